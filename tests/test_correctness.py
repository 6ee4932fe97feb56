"""Forward and gradients against the fp64 reference, for every runnable tier: odd shapes, every
dtype, causal, GQA, Lq != Lk, Dv != D, strided / permuted / NaN-padded layouts, scale."""
import pytest
import torch
import torch.nn.functional as F

import flashsdpa
from flashsdpa import _testing
from conftest import DTYPE_IDS, DTYPES, check_forward_backward, make_qkv, num_threads

# (B, Hq, Hkv, L, S, D, Dv)
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 3, 3, 17, 17, 59, 59),
    (1, 2, 2, 97, 97, 80, 80),
    (1, 1, 1, 1025, 1025, 8, 8),
    (1, 2, 2, 17, 1025, 128, 128),
    (1, 1, 1, 130, 130, 256, 256),
    (1, 2, 2, 97, 33, 64, 64),
]


def _id(shape):
    return "B{}H{}/{}L{}S{}D{}Dv{}".format(*shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_shapes(tier, shape, causal, dtype):
    B, Hq, Hkv, L, S, D, Dv = shape
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, Dv, dtype=dtype)
    check_forward_backward(q, k, v, dtype, f"{tier} {_id(shape)}", is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("dims", [(40, 40), (64, 32)], ids=lambda d: f"D{d[0]}Dv{d[1]}")
@pytest.mark.parametrize("layout", ["blhd", "padded"])
def test_layouts(tier, layout, dims, dtype):
    """(B, L, H, D) buffers viewed as (B, H, L, D), and views into NaN-filled buffers (any
    out-of-bounds read turns into NaN). Head dims of whole 32-wide panels: the kernels read
    rows in place (the transposed forward's K / V, the fp32 backward's dO / Q / K)."""
    D, Dv = dims
    q, k, v = make_qkv(2, 4, 4, 45, 70, D, Dv, dtype=dtype, layout=layout)
    check_forward_backward(q, k, v, dtype, f"{tier} {layout}", is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_head_dims_differ(tier, dtype):
    q, k, v = make_qkv(2, 2, 2, 33, 50, 48, Dv=24, dtype=dtype)
    check_forward_backward(q, k, v, dtype, f"{tier} Dv!=D", is_causal=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (6, 3)], ids=lambda h: f"{h[0]}/{h[1]}")
def test_gqa(tier, heads, causal, dtype):
    q, k, v = make_qkv(2, heads[0], heads[1], 37, 53, 32, dtype=dtype)
    check_forward_backward(q, k, v, dtype, f"{tier} gqa", is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_scale_and_large_scores(tier, dtype):
    """A custom scale, and scores in the hundreds (the online softmax must not overflow)."""
    q, k, v = make_qkv(1, 2, 2, 70, 90, 64, dtype=dtype)
    check_forward_backward(q, k, v, dtype, f"{tier} scale", scale=0.37)
    q_big = (q.float() * 12).to(dtype)
    check_forward_backward(q_big, k, v, dtype, f"{tier} large scores", is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_scores(tier, causal, dtype):
    """Query rows scaled to 1e5, 1e10 and 1e30 (one head each; fp16 cannot hold them): scores
    far past 2^24, where fp32 spaces them more than 1 apart, and the softmax is one-hot. Where
    a tier applies the scale in its exponential pass (bf16 operands: fma(s, scale, -m))
    against a max it rounded, the row's max must still give 2^0, not 2^(the product's rounding
    error): 2^(+-1e22) is inf or 0. Forward only: at these magnitudes every kernel's gradients
    are rounding noise (PyTorch's own dK is off by 1e23)."""
    q, k, v = make_qkv(1, 3, 3, 40, 300, 64, dtype=torch.float32, seed=5)
    q = q.clone()
    for h, big in enumerate((1e5, 1e10, 1e30)):
        q[0, h, 7] *= big
    check_forward_backward(q.to(dtype), k.to(dtype), v.to(dtype), dtype, f"{tier} huge scores",
                           is_causal=causal, backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("growth", [4.0, 40.0, 400.0], ids=["rescale", "large", "overflow"])
def test_scores_grow_along_the_keys(tier, growth, dtype):
    """Each kv block's scores far above the last's: the fp32 AVX2 / AVX-512 forward computes a
    block's exponentials against the running max of the earlier blocks, then rescales a row
    whose block sum passes 2^16 (every later block here) or redoes the block in two passes when
    the sum overflows (growth 400: scores in the thousands)."""
    q, k, v = make_qkv(1, 2, 2, 40, 1100, 64, dtype=dtype, seed=int(growth))
    k = k.clone()
    for j in range(1, 5):  # kv blocks of 256 keys at D = 64
        k[:, :, 256 * j:256 * (j + 1)] *= 1 + growth * j / 4
    check_forward_backward(q, k, v, dtype, f"{tier} growing scores x{growth}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_first_block_score_offsets(tier, dtype):
    """Heads whose scores all sit far below or above 0: the fp32 forward takes the first kv
    block's exponentials against 0 and must fall back to two passes where the block sum falls
    below 2^-40 (scores near -100: 2^s zero or subnormal; near -60: tiny but normal) or
    overflows (near +90), and rescale in between (+60). One offset per head, so that each work
    item meets one case."""
    offsets = torch.tensor([-100.0, -60.0, -20.0, 0.0, 20.0, 60.0, 90.0])
    q, k, v = make_qkv(1, len(offsets), len(offsets), 42, 556, 64, dtype=torch.float32, seed=11)
    q, k = q.clone(), k.clone()
    q[..., 0] = offsets[:, None] * 8.0  # score offset = q0 * k0 * 64 ** -0.5 with k0 = 1
    k[..., 0] = 1.0
    check_forward_backward(q.to(dtype), k.to(dtype), v.to(dtype), dtype,
                           f"{tier} first-block score offsets")


def test_nan_key_in_a_later_block(tier):
    """A NaN in a later kv block reaches exactly the rows that see it, as in PyTorch."""
    q, k, v = make_qkv(1, 2, 2, 30, 700, 32)
    k = k.clone()
    k[0, 1, 600, 3] = float("nan")
    out = flashsdpa.scaled_dot_product_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out.isnan(), ref.isnan()) and bool(out[0, 1].isnan().all())
    torch.testing.assert_close(out[0, 0], ref[0, 0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_3d_inputs(tier, dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 29, 16, generator=g).to(dtype)
    k = torch.randn(3, 41, 16, generator=g).to(dtype)
    v = torch.randn(3, 41, 16, generator=g).to(dtype)
    mask = torch.randn(3, 29, 41, generator=g)
    check_forward_backward(q, k, v, dtype, f"{tier} 3-D", attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["short", "causal-gqa-packed", "cancelling"])
def test_batch_broadcast_kv(tier, dtype, case):
    """key/value with batch 1 broadcast against a query batch: the kernel reads them at batch
    stride 0 (packed once where the forward packs) and sums their gradients over the batch in
    fp32 (one rounding, where per-batch gradients rounded to a 16-bit dtype and then summed
    can cancel past the rule: the fuzzer's case 12015548), in the two-sweep backward even when
    the single pass is forced; the gradients have key's and value's own shapes."""
    g = torch.Generator().manual_seed(4)
    if case == "cancelling":  # the fuzzer's cases: one key, dV the sum of the rows' dO
        import fuzz_sdpa
        seed = {torch.float32: 12015548, torch.bfloat16: 12015548, torch.float16: 14014012}
        c = fuzz_sdpa.draw(seed[dtype])
        assert c["k"].shape[0] == 1 < c["q"].shape[0] and c["grad"], fuzz_sdpa.describe(c)
        q, k, v, kw = c["q"], c["k"], c["v"], dict(attn_mask=c["attn_mask"], scale=c["scale"])
        assert fuzz_sdpa.check(c) == "", fuzz_sdpa.describe(c)  # (its own dtype)
    elif case == "short":
        q = torch.randn(3, 2, 20, 16, generator=g)
        k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
        kw = {}
    else:  # several q blocks over two kv blocks: the forward packs K / V panels once
        q = torch.randn(2, 4, 600, 32, generator=g)
        k, v = torch.randn(1, 2, 600, 32, generator=g), torch.randn(1, 2, 600, 24, generator=g)
        kw = dict(is_causal=True, enable_gqa=True)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with _testing.policy(fused_bwd=1):
        check_forward_backward(q, k, v, dtype, f"{tier} kv batch broadcast {case}", **kw)
        assert not _testing.last_policy()["fused_bwd"]
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flashsdpa.scaled_dot_product_attention(*leaves, **kw)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert [tuple(x.shape) for x in grads] == [tuple(t.shape) for t in (q, k, v)]


@pytest.mark.parametrize("L,S", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(tier, L, S):
    q, k, v = make_qkv(1, 2, 2, L, S, 8, requires_grad=True)
    out = flashsdpa.scaled_dot_product_attention(q, k, v)
    assert out.shape == (1, 2, L, 8)
    assert torch.equal(out, torch.zeros_like(out)), "no keys: output must be 0"
    out.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t)), "no keys/queries: zero gradients"


def test_zero_heads_as_pytorch():
    """No query and no key / value heads: an empty output and empty gradients, as PyTorch gives
    (routed, direct and explained), not an error."""
    q, k = (torch.randn(2, 0, 10, 64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 0, 10, 32, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v)
    with flashsdpa.enabled():
        routed = F.scaled_dot_product_attention(q, k, v)
    direct = flashsdpa.scaled_dot_product_attention(q, k, v)
    for out in (routed, direct):
        assert out.shape == want.shape == (2, 0, 10, 32)
        out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    assert "flashsdpa" in flashsdpa.explain(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 300), (1, 3, 3, 300, 300)],
                         ids=lambda s: "B{}H{}/{}L{}S{}".format(*s))
def test_bit_identical_across_runs_and_threads(tier, shape, causal, dtype):
    """Each output row / gradient element is computed by one thread in an order fixed by the
    shape: results must not depend on the run, the thread count or which thread runs which work
    item, forward and backward.
    (The second shape gets one q block per head on 1 thread and the tier's q blocks on 2: the
    blocking the thread count picks must not change results either.)"""
    q, k, v = make_qkv(*shape, 64, dtype=dtype)

    def run(threads):
        with num_threads(threads):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = flashsdpa.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                         enable_gqa=True)
            out.backward(torch.ones_like(out))
            return [out.detach()] + [t.grad for t in leaves]

    # (3 threads on this 2-core machine: the compute phases hand out items one at a time, so
    # which thread runs which item changes from run to run)
    a, b, c, d = run(2), run(2), run(1), run(3)
    for x, y, z, w, name in zip(a, b, c, d, ("out", "dq", "dk", "dv")):
        assert torch.equal(x, y), f"{name} differs between two identical runs"
        assert torch.equal(x, z), f"{name} differs between 1 and 2 threads"
        assert torch.equal(x, w), f"{name} differs between 1 and 3 threads"


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "ranges"])
@pytest.mark.parametrize("total,threads", [(1, 1), (1, 4), (5, 2), (7, 3), (64, 2), (1000, 7)])
def test_item_queue_hands_out_every_item_once(total, threads, in_order):
    """run_phase's ItemQueue: drained by all its threads at once (one of them slowed), every
    item goes to exactly one thread, and on ranges each thread takes its own range's items in
    order before any other (a decode thread's splits follow one another in memory)."""
    n = min(threads, total)  # (a queue has no more threads than items)
    delays = [0] * n
    delays[-1] = 200  # microseconds after each item
    got = _testing.item_queue_drain(total, threads, in_order, delays)
    assert len(got) == n
    assert sorted(i for items in got for i in items) == list(range(total))
    if not in_order:
        for t, items in enumerate(got):
            own = range(total * t // n, total * (t + 1) // n)
            taken = [i for i in items if i in own]
            assert taken == list(own)[:len(taken)], f"thread {t} took its range out of order"
            assert items[:len(taken)] == taken, f"thread {t} took another's item first"


def test_item_queue_ranges_order():
    """On ranges a thread's own items come from the front; then it takes the back of the range
    with the most left (the busiest thread's last items), until none is left for anyone."""
    seq = _testing.item_queue_sequence(10, 2, False, [0] * 6 + [1] + [0] * 5)
    assert seq == [0, 1, 2, 3, 4, 9, 5, 8, 7, 6, -1, -1]
    # ranges [0, 3) [3, 6) [6, 9): thread 2 takes 6, 7, 8, then 2 (the back of [0, 3): of two
    # ranges with 3 left, the first thread's); thread 0 its 0; thread 2 then 5 (the back of
    # [3, 6), now the longest); thread 1 its 3, 4, then 1, the last
    seq = _testing.item_queue_sequence(9, 3, False, [2, 2, 2, 2, 0, 2, 1, 1, 1, 0])
    assert seq == [6, 7, 8, 2, 0, 5, 3, 4, 1, -1]
    assert _testing.item_queue_sequence(3, 2, True, [1, 1, 0, 0]) == [0, 1, 2, -1]


def test_item_queue_a_slowed_thread_does_fewer_items():
    """Items go to the threads that are free: one thread sleeping after each item does only a
    few of its range's 20 (the case that ranges without stealing lost: every decode call waited
    for the slowest thread's last split)."""
    for in_order in (True, False):
        got = _testing.item_queue_drain(40, 2, in_order, [0, 20000])
        assert len(got[1]) <= 10, (in_order, [len(g) for g in got])


def test_tiers_agree():
    """Every runnable tier against the portable anchor (within fp32 rounding)."""
    from conftest import RUNNABLE_TIERS
    from flashsdpa._isa import cap
    q, k, v = make_qkv(2, 4, 2, 77, 130, 72)
    results = {}
    for t in RUNNABLE_TIERS:
        with cap(t):
            results[t] = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
    for t, out in results.items():
        torch.testing.assert_close(out, results["portable"], atol=2e-6, rtol=1e-5,
                                   msg=lambda m: f"tier {t} vs portable: {m}")


@pytest.fixture(params=["never", "always"])
def kv_prepack(request):
    """Forces the forward's K/V pre-pack phase off or on (the plan picks one by shape), on the
    prefill path (short queries would take the decode path, which packs nothing)."""
    with _testing.policy(prepack=int(request.param == "always"), decode=0):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape,causal", [
    ((2, 4, 2, 300, 300, 40, 40), True),    # causal cut inside pre-packed blocks, GQA
    ((1, 2, 2, 5, 700, 24, 33), False),     # one q block, several kv blocks, Dv != D
    ((1, 3, 3, 257, 129, 64, 64), True),    # Lq > Lk
    ((1, 4, 2, 600, 520, 32, 32), True),    # several q blocks per head (zigzag) reuse a head
], ids=["causal-gqa", "short-q", "long-q", "q-blocks"])
def test_kv_prepack_paths(tier, kv_prepack, shape, causal, dtype):
    B, Hq, Hkv, L, S, D, Dv = shape
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, Dv, dtype=dtype)
    mask = torch.randn(L, S)
    check_forward_backward(q, k, v, dtype, f"{tier} prepack={kv_prepack}", is_causal=causal,
                           attn_mask=mask, backward=False)
    assert _testing.last_policy()["prepack"] == (kv_prepack == "always")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_packing_does_not_change_results(tier, causal):
    """Packing K / V per q block or once by the PackKV phase gives bit-identical outputs, on 1
    and 2 threads."""
    q, k, v = make_qkv(2, 6, 3, 700, 650, 40, 24)
    outs = {}
    for mode in ("never", "always"):
        with _testing.policy(prepack=int(mode == "always")):
            for threads in (1, 2):
                with num_threads(threads):
                    outs[mode, threads] = flashsdpa.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, enable_gqa=True)
    ref = outs["never", 1]
    for key, out in outs.items():
        assert torch.equal(out, ref), f"{tier}: {key} differs from per-block packing"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exp2_row_sum(tier, dtype):
    """The tier's softmax exponent directly: within 2 ulp of 2^x over the whole range the
    softmax feeds it (x = s - m <= 0), -inf and far-below-range inputs give exactly 0, NaN
    stays NaN, every length remainder, and the returned sum matches the written values."""
    g = torch.Generator().manual_seed(7)
    m = 0.75
    for n in (1, 7, 8, 15, 16, 17, 37, 64):
        s = m - torch.rand(n, generator=g, dtype=torch.float64) * 40.0
        s[: n // 3] = torch.round(s[: n // 3] * 2) / 2  # integers and halves (rounding ties)
        s = s.float()
        y, total = _testing.exp2_row_sum(s, m, dtype)
        ref = torch.exp2((s - m).double())  # the kernel subtracts in fp32 too
        rel = ((y.double() - ref).abs() / ref).max().item()
        assert rel <= 2 * 2.0 ** -23, f"{tier}: exp2 relative error {rel:.3g} (n={n})"
        assert abs(total - y.double().sum().item()) <= 1e-5 * max(1.0, total), (
            f"{tier}: sum {total} vs {y.double().sum().item()} (n={n})")
    # the far tail: masked (-inf) and very negative scores give 0; tiny results denormal or 0
    s = torch.tensor([0.0, float("-inf"), -1.0e4, -160.0, -151.5, -130.25, -126.0, -100.5, 3.0])
    y, total = _testing.exp2_row_sum(s, 0.0, dtype)
    ref = torch.exp2(s.double())
    assert torch.equal(y[1:5], torch.zeros(4)), f"{tier}: {y[1:5]} should be exactly 0"
    assert (y[5:7].double() - ref[5:7]).abs().max().item() <= 2.0 ** -126, f"{tier}: {y[5:7]}"
    for i in (0, 7, 8):
        assert abs(y[i].item() / ref[i].item() - 1) <= 2 * 2.0 ** -23, f"{tier}: {y[i]} at {s[i]}"
    y, total = _testing.exp2_row_sum(torch.tensor([0.0, float("nan"), -1.0] + [-2.0] * 16), 0.0, dtype)
    assert torch.isnan(y[1]) and not torch.isnan(y[0]) and not torch.isnan(y[2:]).any(), (
        f"{tier}: NaN must stay in its lane: {y}")


def test_exp2_bf16_p(tier):
    """The exponent P V's bf16 operand is made with, on the tiers whose P V takes P in bf16
    (avx512_bf16, amx: the degree-3 polynomial of scalar.h, kExp2DegreeBf16P): each weight
    within bf16's rounding (2^-8 relative) plus 1e-4 of 2^x, the sum of the unrounded weights
    within 1e-4 relative (a polynomial of degree 2, 1.7e-3 off, fails it), -inf and far-below-
    range scores give 0, NaN stays in its lane. Tiers whose P stays fp32 have none."""
    ran = flashsdpa.cpu_isa(torch.bfloat16)
    got = _testing.exp2_row_sum(torch.zeros(1), 0.0, "bfloat16", bf16_p=True)
    assert (got is not None) == (ran in ("avx512_bf16", "amx")), f"{tier} runs bf16 on {ran}"
    if got is None:
        return
    g = torch.Generator().manual_seed(11)
    m = 0.75
    for n in (1, 7, 15, 16, 17, 64, 100, 256):
        s = (m - torch.rand(n, generator=g, dtype=torch.float64) * 30.0).float()
        p, total = _testing.exp2_row_sum(s, m, "bfloat16", bf16_p=True)
        ref = torch.exp2((s - m).double())
        rel = ((p.double() - ref).abs() / ref).max().item()
        assert rel <= 2.0 ** -8 + 1e-4, f"{tier}: bf16 P relative error {rel:.3g} (n={n})"
        assert abs(total - ref.sum().item()) <= 1e-4 * ref.sum().item(), (
            f"{tier}: unrounded sum {total} vs {ref.sum().item()} (n={n})")
    s = torch.tensor([0.0, float("-inf"), -1.0e4, -160.0, float("nan"), -1.0] + [-2.0] * 14)
    p, _ = _testing.exp2_row_sum(s, 0.0, "bfloat16", bf16_p=True)
    assert torch.equal(p[1:4].float(), torch.zeros(3)), f"{tier}: {p[1:4]} should be exactly 0"
    assert torch.isnan(p[4]) and not torch.isnan(p[:4]).any() and not torch.isnan(p[5:]).any(), (
        f"{tier}: NaN must stay in its lane: {p}")
