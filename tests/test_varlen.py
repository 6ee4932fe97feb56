"""Packed variable-length batches (flashsdpa.flash_attn_varlen_func): every sequence equals the
fp64 reference of the formulas computed on that sequence alone (bottom-right alignment, the
variants, GQA, Dv != D, empty sequences and sequences with no keys), forward and every gradient,
on every native and emulated tier; one kernel call whose results do not depend on the thread
count; dropout streams per sequence; the ops' checks, fake kernels and compile behaviour."""
import pytest
import torch

import flashsdpa
from flashsdpa import _testing
from conftest import DTYPE_IDS, assert_within_rule, num_threads
from test_variants import assert_grads_within_rule, assert_kernel_ran, reference

# name -> (query lengths, key lengths, Hq, Hkv, D, Dv, options)
CASES = {
    "self-causal": ([37, 1, 0, 120, 64], None, 2, 2, 16, 16, dict(causal=True)),
    "cross-softcap": ([5, 40, 0, 17, 3], [30, 12, 9, 0, 1], 2, 1, 16, 16, dict(softcap=1.5)),
    "window-alibi-sinks": ([70, 3, 150], None, 3, 3, 24, 24,
                           dict(window=(20, 4), alibi="BH", sinks=True)),
    "all": ([60, 33, 1, 0], [64, 90, 20, 5], 4, 2, 24, 16,
            dict(causal=True, window=(25, -1), softcap=2.0, alibi="H", sinks=True)),
    # every sequence short: the split-KV decode path, per sequence
    "decode": ([1, 3, 16, 2], [300, 40, 1000, 7], 4, 1, 32, 32,
               dict(causal=True, window=(200, 0), alibi="BH", sinks=True)),
}


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def make_packed(name, dtype, seed=0):
    lens_q, lens_k, Hq, Hkv, D, Dv, kw = CASES[name]
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), Hkv, Dv, generator=g).to(dtype)
    kw = dict(kw)
    if kw.get("alibi") == "H":
        kw["alibi"] = torch.rand(Hq, generator=g) * 0.5
    elif kw.get("alibi") == "BH":
        kw["alibi"] = torch.rand(len(lens_q), Hq, generator=g) * 0.5
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(Hq, generator=g) * 2
    return q, k, v, cu(lens_q), cu(lens_k), kw


def ours(q, k, v, cu_q, cu_k, kw, **extra):
    lens_q, lens_k = (c[1:] - c[:-1] for c in (cu_q, cu_k))
    return flashsdpa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
        causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
        **extra)


def per_sequence_reference(q, k, v, cu_q, cu_k, kw, dtype=torch.float64, keeps=None, p=0.0):
    """(out (total_q, H, Dv), lse (H, total_q)): reference() on each sequence alone."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        kw_s = dict(kw)
        if kw.get("alibi") is not None and kw["alibi"].dim() == 2:
            kw_s["alibi"] = kw["alibi"][s]
        if keeps is not None:
            kw_s.update(keep=keeps[s], dropout_p=p)
        o, lse = reference(*(t[x:y].transpose(0, 1).unsqueeze(0)
                             for t, x, y in ((q, a, b), (k, c, d), (v, c, d))),
                           bottom_right=True, dtype=dtype, **kw_s)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check_packed(q, k, v, cu_q, cu_k, kw, dtype, what, run=ours, keeps=None, p=0.0):
    """Ours vs the per-sequence fp64 reference within the suite's rule: out, lse (-inf where a
    row sees nothing and has no sink) and the gradients of q, k, v and sinks."""
    sinks = kw.get("sinks")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s_leaf = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out, lse = run(*leaves, cu_q, cu_k, dict(kw, sinks=s_leaf), return_lse=True)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_sink = sinks.detach().double().requires_grad_() if sinks is not None else None
    ref, ref_lse = per_sequence_reference(*refs, cu_q, cu_k, dict(kw, sinks=r_sink),
                                          keeps=keeps, p=p)
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s_same = sinks.detach().clone().requires_grad_() if sinks is not None else None
    base, _ = per_sequence_reference(*same, cu_q, cu_k, dict(kw, sinks=s_same), dtype=dtype,
                                     keeps=keeps, p=p)
    assert_within_rule(out, base.detach(), ref.detach(), dtype, f"{what} out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse -inf rows differ"
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].detach(), atol=2e-2 if
                               dtype != torch.float32 else 1e-5, rtol=1e-3)
    assert_grads_within_rule(out, ref, base, (leaves, same, refs), dtype, what,
                             (s_leaf, s_same, r_sink) if sinks is not None else None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_equals_each_sequence(tier, name, dtype):
    q, k, v, cu_q, cu_k, kw = make_packed(name, dtype)
    with _testing.counting() as counts:
        out = check_packed(q, k, v, cu_q, cu_k, kw, dtype, f"{tier} {name}")
        assert_kernel_ran(counts, tier, dtype)
        assert counts()["bwd_tiles"] > 0
        # a forward whose backward follows takes the prefill kernels (plan.h, for_backward)
        assert counts()["decode_blocks"] == 0
    if name == "decode":  # without gradients, the short sequences take the decode path
        with _testing.counting() as counts, torch.no_grad():
            fast = ours(q, k, v, cu_q, cu_k, kw)
            assert counts()["decode_blocks"] > 0
        torch.testing.assert_close(fast, out.detach(), atol=1e-5 if dtype == torch.float32
                                   else 2e-2, rtol=1e-3)


def test_varlen_rows_of_empty_sequences():
    """A sequence with queries but no keys: out 0, lse the sink's score (or -inf), no gradient;
    one with keys but no queries: zero dk / dv."""
    q, k, v, cu_q, cu_k, kw = make_packed("cross-softcap", torch.float32)
    for sinks in (None, torch.tensor([0.25, -1.0])):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = flashsdpa.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, 40, 30, sinks=sinks,
                                                    return_lse=True)
        rows = slice(int(cu_q[3]), int(cu_q[4]))  # 17 queries, no keys
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        want = torch.full_like(lse[:, rows], float("-inf")) if sinks is None else \
            sinks.view(2, 1).expand_as(lse[:, rows])
        assert torch.equal(lse[:, rows], want)
        out.sum().backward()
        assert torch.equal(qq.grad[rows], torch.zeros_like(qq.grad[rows]))
        keys = slice(int(cu_k[2]), int(cu_k[3]))  # 9 keys, no queries
        assert torch.equal(kk.grad[keys], torch.zeros_like(kk.grad[keys]))
        assert torch.equal(vv.grad[keys], torch.zeros_like(vv.grad[keys]))


def test_varlen_independent_of_thread_count():
    q, k, v, cu_q, cu_k, kw = make_packed("all", torch.bfloat16)
    results = []
    for threads in (1, 2):
        with num_threads(threads):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            sinks = kw["sinks"].clone().requires_grad_()
            out = ours(*leaves, cu_q, cu_k, dict(kw, sinks=sinks))
            out.float().square().sum().backward()
            results.append([out, *(t.grad for t in leaves), sinks.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_varlen_dropout_per_sequence_streams(tier):
    """Dropout: sequence s draws its keep-mask from its own Philox stream (offset + s), the same
    in the backward; against the reference with those masks."""
    q, k, v, cu_q, cu_k, kw = make_packed("window-alibi-sinks", torch.float32)
    p = 0.25
    state = []

    def run(q, k, v, cu_q, cu_k, kw, return_lse):
        out, lse, rng, _ = torch.ops.flashsdpa.flash_attn_varlen_fwd(
            q, k, v, cu_q, cu_k, 150, 150, p, window_left=kw["window"][0],
            window_right=kw["window"][1], alibi_slopes=kw["alibi"], sinks=kw["sinks"])
        state.append(rng)
        return out, lse

    torch.manual_seed(5)
    run(q, k, v, cu_q, cu_k, kw, True)
    seed, offset = (int(x) for x in state[0])
    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    keeps = [_testing.dropout_keep_mask(seed, offset + s, 1, q.shape[1], n, n, p)
             for s, n in enumerate(lens)]
    assert not torch.equal(keeps[0][..., :3, :3], keeps[1]), "sequences share a keep-mask"
    torch.manual_seed(5)
    check_packed(q, k, v, cu_q, cu_k, kw, torch.float32, f"{tier} dropout", run=run,
                 keeps=keeps, p=p)


def test_varlen_float64_takes_flash_attn_func_per_sequence():
    q, k, v, cu_q, cu_k, kw = make_packed("all", torch.float64)
    with _testing.counting() as counts:
        check_packed(q, k, v, cu_q, cu_k, kw, torch.float64, "float64")
        assert counts()["fwd_tiles"] == 0


@pytest.mark.parametrize("change, message", [
    (dict(cu_q=cu([5, 40, 0, 17, 3]).long()), "cu_seqlens_q must be a 1-D int32 tensor"),
    (dict(cu_k=torch.tensor([0, 30, 42, 41, 51, 52], dtype=torch.int32)),
     "cu_seqlens_k must be non-decreasing, but cu_seqlens_k[3] = 41 < cu_seqlens_k[2] = 42"),
    (dict(cu_q=torch.tensor([1, 5, 45, 45, 62, 65], dtype=torch.int32)),
     "cu_seqlens_q[0] must be 0"),
    (dict(cu_q=cu([5, 40, 0, 17, 2])), "cu_seqlens_q[-1] must be the number of rows of q (65)"),
    (dict(cu_k=cu([30, 12, 9, 1])), "cu_seqlens_k must have as many entries as cu_seqlens_q"),
    (dict(max_q=39), "max_seqlen_q (39) must be at least the longest sequence in cu_seqlens_q"),
    (dict(q=lambda q: q.unsqueeze(0)), "q must be 3-D (total_tokens, heads, head_dim)"),
    (dict(v=lambda v: v[1:]), "v must have as many rows as k"),
    (dict(alibi=torch.rand(4, 2)), "alibi_slopes must have shape (H,) = (2,) or (B, H) = (5, 2)"),
    (dict(window=(-3, 0)), "window_size must be (left, right)"),
])
def test_varlen_bad_arguments_name_the_argument(change, message):
    q, k, v, cu_q, cu_k, _ = make_packed("cross-softcap", torch.float32)
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=40, max_k=30, alibi=None,
                window=(-1, -1))
    for key, val in change.items():
        args[key] = val(args[key]) if callable(val) else val
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        flashsdpa.flash_attn_varlen_func(args["q"], args["k"], args["v"], args["cu_q"],
                                         args["cu_k"], args["max_q"], args["max_k"],
                                         alibi_slopes=args["alibi"], window_size=args["window"])


def test_varlen_opcheck():
    q, k, v, cu_q, cu_k, kw = make_packed("all", torch.float32)
    kwargs = dict(causal=True, window_left=25, window_right=-1, softcap=2.0,
                  alibi_slopes=kw["alibi"], sinks=kw["sinks"])
    torch.library.opcheck(torch.ops.flashsdpa.flash_attn_varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, 60, 90), kwargs)


def test_varlen_compile_fullgraph_one_node():
    import torch._dynamo.testing
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    sinks = torch.zeros(2, requires_grad=True)

    def f(q, k, v, cu_q, cu_k):
        return flashsdpa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True,
                                                window_size=(8, 0), sinks=sinks)

    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for lens in ([17, 5], [33, 1, 9], [50, 20, 3, 4]):
        c = cu(lens)
        q, k, v = (torch.randn(sum(lens), 2, 16, requires_grad=True) for _ in range(3))
        out = cf(q, k, v, c, c)
        torch.testing.assert_close(out, f(q, k, v, c, c))
        out.sum().backward()
        frames.append(cnt.frame_count)
    assert frames[0] >= 1 and frames[1:] == frames[:1] * 2, frames
    ops = [n.target for n in cnt.graphs[-1].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashsdpa.flash_attn_varlen_fwd.default in ops, ops


def test_varlen_prepacks_the_segments_it_pays_for(tier):
    """The pre-pack phase runs in a varlen call (for the sequences whose kv blocks several q
    blocks read: the long one here), and changes no bit of the result."""
    from test_paths import profiled_events
    lens = [300, 20, 9]
    c = cu(lens)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), 2, 32, generator=g) for _ in range(3))

    def run():
        return flashsdpa.flash_attn_varlen_func(q, k, v, c, c, 300, 300, causal=True)

    with _testing.policy(fwd_bq=64):
        names = profiled_events(run)
        packed = run()
        assert _testing.last_policy()["prepack"]
    assert any(n.startswith("flashsdpa::cpu_pack_kv") for n in names), names
    with _testing.policy(fwd_bq=64, prepack=0):
        assert not any(n.startswith("flashsdpa::cpu_pack_kv") for n in profiled_events(run))
        assert torch.equal(run(), packed)
