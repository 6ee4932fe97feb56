"""The attention variants (sliding window, bottom-right alignment, softcap, ALiBi, sinks), alone
and combined with each other and with masks, dropout, GQA, Lq != Lk, Dv != D and strided views,
forward and every gradient (the sinks' too), on every native and emulated tier, against an fp64
reference written from the formulas of ../shared/api-variants-serving.md. PyTorch has no kernel
for most of them, so "PyTorch's own same-dtype error" of the suite's rule is the same formulas
evaluated in the inputs' dtype."""
import math

import pytest
import torch

import flashsdpa
from flashsdpa import _C, _testing
from conftest import DTYPE_IDS, assert_within_rule, make_qkv, num_threads

_TIER_DTYPES = {t["name"]: t["dtypes"] for t in _C.tiers()}


def assert_kernel_ran(counts, tier, dtype):
    """The CPU kernels computed the last call (its forward tiles were counted: not the math
    fallback), on the fixture's tier where that tier implements the dtype."""
    assert counts()["fwd_tiles"] + counts()["decode_blocks"] > 0, "the kernels did not run"
    name = tier.removeprefix("emu-")
    if str(dtype).removeprefix("torch.") in _TIER_DTYPES[name]:
        assert _testing.last_policy()["tier"] == name


def reference(q, k, v, *, causal=False, window=(-1, -1), bottom_right=False, softcap=0.0,
              alibi=None, sinks=None, mask=None, scale=None, keep=None, dropout_p=0.0,
              dtype=torch.float64):
    """(out, lse) in `dtype` from the formulas; q (B, H, Lq, D), k / v (B, Hkv, Lk, D[v])."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], 1)
        v = v.repeat_interleave(H // v.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    d = Lk - Lq if bottom_right else 0
    i = torch.arange(Lq, dtype=dtype).view(Lq, 1)
    j = torch.arange(Lk, dtype=dtype).view(1, Lk)
    if alibi is not None:
        slopes = alibi.to(dtype).view(-1 if alibi.dim() == 2 else 1, H, 1, 1) \
            if alibi.dim() == 1 else alibi.to(dtype).view(B, H, 1, 1)
        s = s - slopes * (i + d - j).abs()
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(dtype)
    left, right = window
    right = 0 if causal else right
    hide = torch.zeros(Lq, Lk, dtype=torch.bool)
    if right >= 0:
        hide |= j > i + d + right
    if left >= 0:
        hide |= j < i + d - left
    s = s.masked_fill(hide, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype).view(1, H, 1, 1).expand(B, H, Lq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    # P by softmax (from the row max), not exp(s - lse): a row at one huge offset (finfo.min
    # on every key) has a logsumexp that absorbed log(Lk) even in fp64, and P = 1 per key from it
    p = torch.softmax(s, -1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # rows that see nothing: 0
    if sinks is not None:
        p = p[..., :Lk]
    if keep is not None:
        p = p * keep.to(dtype) / (1 - dropout_p)
    return p @ v, lse


# name -> (B, Hq, Hkv, Lq, Lk, D, Dv, kwargs of scaled_dot_product_attention / reference)
CASES = {
    "window-left": (1, 2, 2, 70, 70, 16, 16, dict(window=(9, -1))),
    "window-right": (1, 2, 2, 70, 70, 16, 16, dict(window=(-1, 5))),
    "window-both": (2, 2, 1, 90, 90, 24, 24, dict(window=(20, 3))),
    "window-causal": (1, 3, 3, 300, 300, 16, 16, dict(window=(64, -1), causal=True)),
    "window-long": (1, 2, 2, 620, 620, 32, 32, dict(window=(100, 0))),
    "softcap": (1, 2, 2, 45, 60, 32, 32, dict(softcap=0.7)),
    "softcap-causal": (1, 2, 1, 130, 130, 16, 24, dict(softcap=2.5, causal=True)),
    "alibi": (2, 4, 4, 33, 50, 16, 16, dict(alibi="H")),
    "alibi-batch": (2, 3, 3, 40, 40, 16, 16, dict(alibi="BH", causal=True)),
    "sinks": (1, 4, 2, 37, 45, 16, 16, dict(sinks=True)),
    "sinks-causal": (2, 2, 2, 60, 60, 16, 16, dict(sinks=True, causal=True)),
    "all": (2, 4, 2, 80, 80, 24, 16, dict(window=(30, 2), softcap=1.5, alibi="H", sinks=True)),
    "all-mask": (1, 2, 2, 50, 64, 16, 16, dict(window=(12, 12), softcap=3.0, alibi="BH",
                                               sinks=True, mask="float")),
    "window-boolmask": (1, 2, 2, 66, 66, 16, 16, dict(window=(15, 0), mask="bool")),
}


def make_case(name, dtype, layout="contiguous", seed=0):
    B, Hq, Hkv, Lq, Lk, D, Dv, kw = CASES[name]
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout=layout, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(kw)
    if kw.get("alibi") == "H":
        kw["alibi"] = torch.rand(Hq, generator=g) * 0.5
    elif kw.get("alibi") == "BH":
        kw["alibi"] = torch.rand(B, Hq, generator=g) * 0.5
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(Hq, generator=g) * 2
    if kw.get("mask") == "float":
        kw["mask"] = torch.randn(Lq, Lk, generator=g)
    elif kw.get("mask") == "bool":
        kw["mask"] = torch.rand(Lq, Lk, generator=g) < 0.8
    return q, k, v, kw


def ours_sdpa(q, k, v, kw, **extra):
    """flashsdpa.scaled_dot_product_attention with the reference's keywords (top-left)."""
    return flashsdpa.scaled_dot_product_attention(
        q, k, v, attn_mask=kw.get("mask"), is_causal=kw.get("causal", False),
        enable_gqa=q.shape[1] != k.shape[1], window_size=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
        **extra)


def check(q, k, v, kw, dtype, what, run=ours_sdpa, bottom_right=False, backward=True):
    """Ours (run) vs the fp64 reference within the suite's rule, out and every gradient (q, k,
    v, sinks), the baseline error being the same formulas in `dtype`."""
    sinks = kw.get("sinks")
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    s_leaf = sinks.detach().clone().requires_grad_(backward) if sinks is not None else None
    out = run(*leaves, dict(kw, sinks=s_leaf))
    refs = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    r_sink = sinks.detach().double().requires_grad_(backward) if sinks is not None else None
    ref, _ = reference(*refs, bottom_right=bottom_right, **dict(kw, sinks=r_sink))
    same = [t.detach().clone().float().to(dtype).requires_grad_(backward) for t in (q, k, v)]
    s_same = sinks.detach().clone().requires_grad_(backward) if sinks is not None else None
    base, _ = reference(*same, bottom_right=bottom_right, dtype=dtype, **dict(kw, sinks=s_same))
    assert_within_rule(out, base.detach(), ref.detach(), dtype, f"{what} out")
    if not backward:
        return out
    assert_grads_within_rule(out, ref, base, (leaves, same, refs), dtype, what,
                             (s_leaf, s_same, r_sink) if sinks is not None else None)
    return out


def assert_grads_within_rule(out, ref, base, qkv, dtype, what, sinks=None):
    """Backward from one random gradient through ours (out), the fp64 reference and PyTorch's
    same-dtype computation (base); qkv = (our leaves, PyTorch's, the reference's), sinks the
    same triple or None: every gradient within the error rule."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    out.backward(g)
    ref.backward(g.double())
    base.backward(g)
    for name, a, b, r in zip("qkv", *qkv):
        assert_within_rule(a.grad, b.grad, r.grad, dtype, f"{what} d{name}")
    if sinks is not None:
        a, b, r = sinks
        assert_within_rule(a.grad, b.grad.float(), r.grad, torch.float32, f"{what} dsinks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(CASES))
def test_variants_forward_backward(tier, name, dtype):
    q, k, v, kw = make_case(name, dtype)
    with _testing.counting() as counts:
        check(q, k, v, kw, dtype, f"{tier} {name}")
        assert_kernel_ran(counts, tier, dtype)
        assert counts()["bwd_tiles"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_row(tier, dtype):
    """The tier's softcap directly: cap * tanh(x / cap) within 4 ulp of the fp64 value (relative
    to cap, since it is cap-scaled) over the whole range including the clamp, exactly +-cap beyond
    it and at +-inf (never beyond by more than 2 ulp), odd around 0, NaN stays NaN in its lane, every length remainder."""
    g = torch.Generator().manual_seed(3)
    for cap in (0.5, 30.0, 50.0):
        for n in (1, 7, 16, 33, 100):
            x = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * 12 * cap
            x = x.float()
            y = _testing.softcap_row(x, cap, dtype)
            ref = cap * torch.tanh(x.double() / cap)
            err = ((y.double() - ref).abs() / (cap * 2.0 ** -23)).max().item()
            assert err <= 4, f"{tier}: softcap error {err:.2f} ulp of cap (cap={cap}, n={n})"
            assert torch.equal(_testing.softcap_row(-x, cap, dtype), -y), f"{tier}: not odd"
        edge = torch.tensor([0.0, 1e-30, float("inf"), float("-inf"), 1e30, -1e30, float("nan"),
                             9.5 * cap, 2.0])
        y = _testing.softcap_row(edge, cap, dtype)
        assert y[0].item() == 0.0 and y[1].item() == pytest.approx(1e-30, rel=1e-6), f"{tier}: {y}"
        sat = torch.tensor([cap, -cap, cap, -cap, cap])
        assert ((y[[2, 3, 4, 5, 7]] - sat).abs() <= 2 * cap * 2.0 ** -23).all(), (
            f"{tier}: {y[[2, 3, 4, 5, 7]]} should be +-{cap}")
        bound = cap * (1 + 2.0 ** -22)  # the rational fit may pass cap by 2 ulp, no more
        assert (y.nan_to_num().abs() <= bound).all(), f"{tier}: {y} beyond +-{cap}"
        assert (_testing.softcap_row(x, cap, dtype).abs() <= bound).all(), f"{tier}: beyond {cap}"
        assert torch.isnan(y[6]) and not torch.isnan(y[[0, 1, 2, 3, 4, 5, 7, 8]]).any(), (
            f"{tier}: NaN must stay in its lane: {y}")


@pytest.mark.parametrize("layout", ["blhd", "padded"])
def test_variants_strided_views(tier, layout):
    q, k, v, kw = make_case("all", torch.float32, layout=layout)
    check(q, k, v, kw, torch.float32, f"{tier} all {layout}")


@pytest.mark.parametrize("lq", [1, 3, 16])
@pytest.mark.parametrize("name", ["window-both", "softcap", "alibi", "sinks", "all"])
def test_variants_decode_path(tier, name, lq):
    """Short queries take the split-KV decode path with every variant (forward; its backward is
    the prefill one)."""
    B, Hq, Hkv, _, _, D, Dv, kw = CASES[name]
    q, k, v, kw = make_case(name, torch.float32)
    q = q[:, :, -lq:]
    with _testing.policy(decode=1), _testing.counting() as counts:
        check(q, k, v, kw, torch.float32, f"{tier} {name} lq={lq}")
        assert counts()["decode_blocks"] > 0


@pytest.mark.parametrize("strategy", [0, 1], ids=["two_sweep", "fused"])
def test_variants_backward_strategies_bit_identical(tier, strategy):
    q, k, v, kw = make_case("all", torch.float32)
    grads = {}
    for s in (0, 1):
        with _testing.policy(fused_bwd=s), num_threads(2 - s):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            sinks = kw["sinks"].detach().clone().requires_grad_()
            out = ours_sdpa(*leaves, dict(kw, sinks=sinks))
            out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float32)).view(out.shape))
            grads[s] = [t.grad for t in leaves] + [sinks.grad]
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)


def visible_tiles(lq, lk, bq, bk, window, d=0):
    """(q block, kv block) tiles with at least one visible (row, key): from the formulas."""
    i = torch.arange(lq).view(lq, 1) + d
    j = torch.arange(lk).view(1, lk)
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if window[0] >= 0:
        vis &= j >= i - window[0]
    if window[1] >= 0:
        vis &= j <= i + window[1]
    pad = torch.zeros(-(-lq // bq) * bq, -(-lk // bk) * bk, dtype=torch.bool)
    pad[:lq, :lk] = vis
    return int(pad.view(pad.shape[0] // bq, bq, -1, bk).any(3).any(1).sum())


@pytest.mark.parametrize("window,d", [((256, 0), 0), ((100, 37), 0), ((-1, 0), 0),
                                      ((-1, -1), 0), ((300, 0), 500), ((50, 50), -300)])
def test_window_skips_blocks(window, d):
    """A window's cost is O(L * W): forward and backward compute exactly the score tiles that
    hold a visible (row, key), nothing outside the band (d: bottom-right offset Lk - Lq)."""
    H, lq = 2, 2000
    lk = lq + d
    q, k, v = make_qkv(1, H, H, lq, lk, 32, requires_grad=True)
    with _testing.policy(fwd_bq=64, fwd_bk=64, bwd_bq=64, bwd_bk=64, fused_bwd=1,
                         transposed=0), _testing.counting() as counts:
        out, _ = flashsdpa.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                           window_size=window, return_lse=True)
        pol = _testing.last_policy()  # (blocks rounded to the tier's micro-tile)
        assert counts()["fwd_tiles"] == H * visible_tiles(lq, lk, pol["bq"], pol["bk"], window, d)
        out.sum().backward()
        pol = _testing.last_policy()
        assert counts()["bwd_tiles"] == H * visible_tiles(lq, lk, pol["bq"], pol["bk"], window, d)
    if window == (256, 0):
        assert visible_tiles(lq, lk, 64, 64, window) < visible_tiles(lq, lk, 64, 64, (-1, -1)) / 5


def test_window_skips_blocks_in_decode():
    """Decode over a long cache with a window: the splits cover the band only."""
    q, k, v = make_qkv(1, 8, 2, 1, 8192, 64)
    for window, most in (((1024, 0), 2 * 6), ((-1, -1), 2 * 32)):
        with _testing.policy(decode=1), _testing.counting() as counts:
            out = flashsdpa.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                            window_size=window)
            assert 0 < counts()["decode_blocks"] <= most
        ref, _ = reference(q, k, v, window=window, bottom_right=True)
        torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=1e-5, rtol=1e-4)


def test_rows_that_see_nothing():
    """flash-attn's alignment with Lq > Lk: the first rows see no key: out 0, lse -inf, zero
    gradients; with a sink, lse is the sink's score."""
    q, k, v = make_qkv(1, 2, 2, 9, 5, 16)
    qb, kb, vb = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    out, lse = flashsdpa.flash_attn_func(qb, kb, vb, causal=True, return_lse=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    out.sum().backward()
    assert torch.equal(qb.grad[:, :4], torch.zeros_like(qb.grad[:, :4]))
    sinks = torch.tensor([0.5, -1.0])
    out, lse = flashsdpa.flash_attn_func(qb, kb, vb, causal=True, sinks=sinks, return_lse=True)
    torch.testing.assert_close(lse[0, :, :4], sinks.view(2, 1).expand(2, 4))
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq,lk", [(40, 70), (70, 40), (1, 33)])
def test_flash_attn_func_bottom_right(tier, dtype, lq, lk):
    """flash_attn_func: (B, L, H, D) layout, bottom-right causal / window, GQA from the shapes,
    the lse it returns."""
    q, k, v = make_qkv(2, 4, 2, lq, lk, 16, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    kw = dict(causal=True, window=(25, -1), softcap=1.2, alibi=torch.rand(4, generator=g),
              sinks=torch.randn(4, generator=g))

    def run(q, k, v, kw):
        out, lse = flashsdpa.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=kw["causal"],
            window_size=kw["window"], softcap=kw["softcap"], alibi_slopes=kw["alibi"],
            sinks=kw["sinks"], return_lse=True)
        ref_lse = reference(q.detach(), k.detach(), v.detach(), bottom_right=True,
                            **dict(kw, sinks=kw["sinks"].detach()))[1]
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3 if dtype != torch.float32
                                   else 1e-5, rtol=1e-3)
        return out.transpose(1, 2)

    check(q, k, v, kw, dtype, f"{tier} flash_attn_func {lq}x{lk}", run=run, bottom_right=True)


def test_float64_takes_the_math_fallback():
    q, k, v, kw = make_case("all", torch.float64)
    text = flashsdpa.explain(q, k, v, window_size=kw["window"], softcap=kw["softcap"],
                             alibi_slopes=kw["alibi"].double().float(), sinks=kw["sinks"],
                             enable_gqa=True)
    assert "flashsdpa::variants_math" in text and "dtype torch.float64" in text
    check(q, k, v, kw, torch.float64, "float64 math fallback")


@pytest.mark.parametrize("bad, message", [
    (dict(window_size=(-2, 0)), "window_size must be (left, right)"),
    (dict(window_size=5), "window_size must be a pair"),
    (dict(softcap=-1.0), "softcap must be finite and >= 0"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape (H,) = (2,)"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), "alibi_slopes must be float32"),
    (dict(sinks=torch.ones(2, 2)), "sinks must have shape (H,) = (2,)"),
    (dict(sinks=torch.ones(2, dtype=torch.int32)), "sinks must be float32"),
    (dict(sinks=torch.ones(2, device="meta")), "sinks must be on query's device"),
    (dict(alibi_slopes=torch.ones(2, device="meta")), "alibi_slopes must be on query's device"),
])
def test_bad_variant_arguments_name_the_argument(bad, message):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flashsdpa.scaled_dot_product_attention(q, k, v, **bad)


def test_explain_describes_the_variant_path():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16)
    text = flashsdpa.explain(q, k, v, window_size=(16, 0), softcap=30.0,
                             alibi_slopes=torch.ones(2), sinks=torch.zeros(2))
    for piece in ("sliding window (16, 0)", "softcap 30.0", "ALiBi", "sinks",
                  "kernel: flashsdpa::cpu_forward["):
        assert piece in text, text


def test_dropout_with_variants(tier):
    """Dropout composes with the variants: the kernels' keep-mask (Philox, regenerated in the
    backward) applied to the reference's probabilities (the sink's mass is not dropped)."""
    q, k, v, kw = make_case("all", torch.float32)
    B, H, L, S, p = q.shape[0], q.shape[1], q.shape[2], k.shape[2], 0.3
    rng = []

    def run(q, k, v, kw):
        out, _, state, _ = torch.ops.flashsdpa.flash_attn_fwd(
            q, k, v, None, p, False, window_left=kw["window"][0], window_right=kw["window"][1],
            softcap=kw["softcap"], alibi_slopes=kw["alibi"], sinks=kw["sinks"])
        rng.append(state)
        return out

    torch.manual_seed(11)
    out = run(q, k, v, kw)
    seed, offset = (int(x) for x in rng[0])
    keep = _testing.dropout_keep_mask(seed, offset, B, H, L, S, p)
    assert 0.6 < keep.float().mean().item() < 0.8
    torch.manual_seed(11)
    check(q, k, v, dict(kw, keep=keep, dropout_p=p), torch.float32, f"{tier} dropout",
          run=run)
    assert torch.equal(rng[1], rng[0])


def test_compile_fullgraph_one_node_and_dynamic_shapes():
    """torch.compile(fullgraph=True): the variant call is one graph node; sequence lengths are
    dynamic (one compile for several)."""
    import torch._dynamo.testing
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    sinks = torch.zeros(2, requires_grad=True)

    def f(q, k, v):
        return flashsdpa.scaled_dot_product_attention(q, k, v, window_size=(8, 0), softcap=2.0,
                                                      sinks=sinks)

    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for L in (17, 33, 50):
        q, k, v = make_qkv(1, 2, 2, L, L, 16, requires_grad=True)
        out = cf(q, k, v)
        torch.testing.assert_close(out, f(q, k, v))
        out.sum().backward()
        frames.append(cnt.frame_count)
    # (dynamo may trace the first call twice, restarting to specialise the float softcap)
    assert frames[0] >= 1 and frames[1:] == frames[:1] * 2, frames
    ops = [n.target for n in cnt.graphs[-1].graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.flashsdpa.sdpa.default], ops


def test_opcheck_variant_ops():
    q, k, v = make_qkv(1, 2, 2, 12, 12, 16)
    sinks = torch.randn(2)
    args = (q, k, v, None, 0.0, False)
    kwargs = dict(window_left=3, window_right=0, bottom_right=True, softcap=1.0,
                  alibi_slopes=torch.rand(2), sinks=sinks, lse_neg_inf=True)
    torch.library.opcheck(torch.ops.flashsdpa.flash_attn_fwd.default, args, kwargs)


def test_reference_rows_at_finfo_min_attend_uniformly():
    """The fp64 reference's P comes from softmax (the row max), not exp(s - lse): a row at
    finfo.min on every key attends uniformly, as PyTorch and the kernels do (its logsumexp
    absorbed log(Lk) even in fp64, so exp(s - lse) gave P = 1 per key, Lk times the mean:
    fuzz_variants --case 511 failed the kernels' correct rows against it)."""
    q, k, v = make_qkv(1, 2, 2, 4, 31, 16, dtype=torch.float64)
    mask = torch.zeros(4, 31, dtype=torch.float64)
    mask[2] = torch.finfo(torch.float32).min
    out, _ = reference(q, k, v, mask=mask, alibi=torch.tensor([0.3, 0.1]))
    torch.testing.assert_close(out[:, :, 2], v.mean(2))
