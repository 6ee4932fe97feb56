"""Inputs at the edges, where flashsdpa must do what PyTorch does (issue 22): the same result,
or the same error, under enable() as without it, and from the direct API where it applies."""
import pytest
import torch
import torch.nn.functional as F

import flashsdpa
from conftest import ATOL, DTYPE_IDS, DTYPES, reference_sdpa


def routed(*args, **kw):
    with flashsdpa.enabled():
        return F.scaled_dot_product_attention(*args, **kw)


def qkv(B=1, H=2, L=8, S=8, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (L, S, S))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_a_row_masked_with_finfo_min_attends_uniformly(dtype):
    """Hugging Face fills masks with finfo(dtype).min: a row of nothing else is a row of equal
    scores (PyTorch: the mean of V), not a masked row; finite values past float32's log2-domain
    range saturate instead of overflowing. -inf still hides a key."""
    q, k, v = qkv(dtype=dtype)
    mask = torch.zeros(8, 8, dtype=dtype)
    mask[2, :] = torch.finfo(dtype).min                 # every key of row 2
    mask[3, :5] = torch.finfo(dtype).min                # most keys of row 3
    mask[4, :] = float("-inf")                          # a truly masked row
    mask[4, 0] = 0
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = reference_sdpa(q, k, v, attn_mask=mask)
    tol = 2 * (want.double() - ref).abs().max() + ATOL[dtype] * 2
    for out in (routed(q, k, v, attn_mask=mask),
                flashsdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask)):
        assert (out.double() - ref).abs().max() <= tol
        if dtype != torch.float16:  # (fp16's min, -65504, does not swamp the scores)
            mean_v = v.double().mean(2)
            assert torch.allclose(out[:, :, 2].double(), mean_v,
                                  atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("scale", [1e39, float("inf"), float("nan"), -1e31, 1e38])
def test_scales_the_kernels_cannot_take_run_pytorch(scale):
    """Past |scale| 1e30 the kernels' log2-domain scores would overflow where PyTorch's do not:
    PyTorch runs (NaN where it gives NaN), and explain() says why."""
    q, k, v = qkv()
    want = F.scaled_dot_product_attention(q, k, v, scale=scale)
    for out in (routed(q, k, v, scale=scale),
                flashsdpa.scaled_dot_product_attention(q, k, v, scale=scale)):
        assert torch.equal(out.isnan(), want.isnan())
        torch.testing.assert_close(out, want, equal_nan=True)
    assert "scale" in flashsdpa.explain(q, k, v, scale=scale)


def test_a_large_finite_scale_still_runs_the_kernels():
    q, k, v = qkv()
    q = q * 1e-6
    out = flashsdpa.scaled_dot_product_attention(q, k, v, scale=1e6)
    assert "flashsdpa::flash_attn_fwd" in flashsdpa.explain(q, k, v, scale=1e6)
    torch.testing.assert_close(out, reference_sdpa(q, k, v, scale=1e6).float(), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("batches", [(1, 3, 3), (3, 1, 1), (1, 3, 1), (3, 3, 1)])
def test_batch_broadcast_as_pytorch(batches):
    """query, key and value broadcast over the batch (each has it or 1), through the direct API
    too; gradients reduce over the broadcast."""
    bq, bk, bv = batches
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, 2, 8, 16, generator=g, requires_grad=True) for b in batches)
    want = F.scaled_dot_product_attention(q, k, v)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for fn in (routed, flashsdpa.scaled_dot_product_attention):
        out = fn(q, k, v)
        assert out.shape == want.shape == (3, 2, 8, 16)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        for got, exp in zip(grads, grads_want):
            torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="key batch size"):
        flashsdpa.scaled_dot_product_attention(torch.randn(3, 2, 8, 16), torch.randn(2, 2, 8, 16),
                                               torch.randn(3, 2, 8, 16))


@pytest.mark.parametrize("form", ["3-D", "dropout", "Dv != D"])
def test_mask_with_is_causal_is_rejected_where_pytorch_rejects_it(form):
    """PyTorch's math path rejects attn_mask with is_causal=True; calls it sends there keep that
    error under enable() (flashsdpa would otherwise have taken them)."""
    q, k, v = qkv()
    kw = dict(attn_mask=torch.zeros(8, 8), is_causal=True)
    if form == "3-D":
        q, k, v = q[0], k[0], v[0]
    elif form == "dropout":
        kw["dropout_p"] = 0.5
    else:
        v = v[..., :8]
    with pytest.raises(RuntimeError) as want:
        F.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(RuntimeError) as got:
        routed(q, k, v, **kw)
    assert str(got.value) == str(want.value)


def test_mask_with_is_causal_where_pytorch_accepts_it():
    q, k, v = qkv()
    kw = dict(attn_mask=torch.zeros(8, 8), is_causal=True)
    torch.testing.assert_close(routed(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw))


def test_export_with_a_data_dependent_batch():
    """torch.export of a model whose batch is read from a tensor (an unbacked size): the routing
    reads sizes without guarding on it, so export succeeds as it does without flashsdpa."""

    class Model(torch.nn.Module):
        def forward(self, q, k, v, n):
            b = n.item()
            torch._check(b >= 1)
            torch._check(b <= q.shape[0])
            mask = torch.ones(b, 1, q.shape[2], k.shape[2], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q[:b], k[:b], v[:b], attn_mask=mask)

    q, k, v = qkv(B=3)
    args = (q, k, v, torch.tensor(2))
    want = Model()(*args)
    with flashsdpa.enabled():
        program = torch.export.export(Model(), args)
        torch.testing.assert_close(program.module()(*args), want)


@pytest.mark.parametrize("shapes", [((3, 0, 0, 80), (3, 0, 0, 80)), ((1, 4, 8, 16), (1, 0, 8, 16)),
                                    ((2, 0, 5, 8), (2, 0, 7, 8))])
def test_no_key_heads_with_enable_gqa_as_pytorch(shapes):
    """PyTorch's kernel chooser divides by the key heads: flashsdpa never asks it about calls
    without any (a SIGFPE killed the process). Run in a subprocess, so a crash fails the test."""
    import subprocess
    import sys
    code = (f"import torch, flashsdpa, torch.nn.functional as F\n"
            f"q, k = torch.randn{shapes[0]}, torch.randn{shapes[1]}\n"
            f"def run():\n"
            f"    try: return F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)\n"
            f"    except Exception as e: return type(e).__name__\n"
            f"want = run()\n"
            f"with flashsdpa.enabled(): got = run()\n"
            f"print(flashsdpa.explain(q, k, k, is_causal=True, enable_gqa=True)[:0], end='')\n"
            f"assert type(got) is type(want), (got, want)\n"
            f"assert not isinstance(want, torch.Tensor) or want.shape == got.shape\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_short_query_training_forward_keeps_the_backward_exact():
    """A short-query forward (q_len <= 16) whose backward follows takes the prefill kernels:
    the split-KV decode path's logsumexp is not exact enough for the backward's recomputed P
    once scores reach ~100 (its gradients were 5-14x PyTorch's error). Without gradients the
    decode path still runs."""
    from flashsdpa import _testing
    from conftest import assert_within_rule
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g) * s for n, s in ((4, 3), (256, 3), (256, 1)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    same = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    go = torch.randn(1, 4, 4, 64, generator=g)
    with _testing.counting() as counts:
        out = flashsdpa.scaled_dot_product_attention(*leaves)
        assert counts()["decode_blocks"] == 0
    torch_out = F.scaled_dot_product_attention(*same)
    ref = F.scaled_dot_product_attention(*refs)
    for t, o in ((leaves, out), (same, torch_out), (refs, ref)):
        o.backward(go.to(o.dtype))
    for name, a, b, r in zip("qkv", leaves, same, refs):
        assert_within_rule(a.grad, b.grad, r.grad, torch.float32, f"d{name}")
    with _testing.counting() as counts, torch.no_grad():
        flashsdpa.scaled_dot_product_attention(*leaves)
        assert counts()["decode_blocks"] > 0


def _grads(fn, q, k, v, mask, scale, go):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves, attn_mask=mask, scale=scale).backward(go)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("case", ["a row at -1e9", "huge scores"])
def test_gradients_at_large_logits_as_pytorchs_math_path(case):
    """Calls PyTorch runs on its math path (3-D inputs here) keep their gradients at any logit
    size: the backward takes P from each row's logsumexp kept in two floats (softmax_stats, hi +
    lo), not from the fp32 logsumexp alone, whose rounding (ulp(|lse|)) spreads over every P of
    a row with a large lse, and which lost log(S) whole for a row at one huge constant
    (gradients S times too large; issue 22 item 8)."""
    from conftest import assert_within_rule
    g = torch.Generator().manual_seed(3)
    if case == "a row at -1e9":
        q, k, v = (torch.randn(2, n, 16, generator=g) for n in (8, 24, 24))
        mask, scale = torch.zeros(8, 24), None
        mask[3] = -1e9          # every key: a row of equal scores
        mask[5, :20] = -1e9     # most keys
    else:                       # scores in the thousands
        q, k, v = (torch.randn(2, n, 64, generator=g) * 8 for n in (17, 3, 3))
        mask, scale = None, 2.0
    go = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g)
    want = _grads(F.scaled_dot_product_attention, q, k, v, mask, scale, go)
    ref = _grads(F.scaled_dot_product_attention, q.double(), k.double(), v.double(),
                 None if mask is None else mask.double(), scale, go.double())
    # (rows of one-hot P, as here, have dq and dk that are 0 in exact arithmetic: what is left
    # is the rounding residue of dP - delta, which the fuzzer's cancelling_terms bounds; dv
    # takes P itself and was 500x PyTorch's error)
    names = "qkv" if case == "a row at -1e9" else "v"
    for fn in (routed, flashsdpa.scaled_dot_product_attention):
        for name, ours, w, r in zip("qkv", _grads(fn, q, k, v, mask, scale, go), want, ref):
            if name in names:
                assert_within_rule(ours, w, r, torch.float32, f"d{name}")


def test_backward_without_softmax_stats_is_what_they_fix():
    """The check above can fail: the same backward op given only the logsumexp (as aten's
    autograd formula calls it) is S times off on the row at -1e9; with the forward's
    softmax_stats it gives the fp64 gradients. The stats keep each row's mask shift (its
    largest visible mask value: -1e9 on that row, 0 on the others). A malformed softmax_stats
    is an error naming it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for n in (4, 24, 24))
    mask = torch.zeros(4, 24)
    mask[1] = -1e9
    out, lse, rng, stats = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask)
    assert stats.shape == (1, 1, 4, 3) and stats.dtype == torch.float32
    assert stats[0, 0, :, 2].tolist() == [0.0, -1e9, 0.0, 0.0]
    go = torch.randn(out.shape, generator=g)
    ref = _grads(F.scaled_dot_product_attention, q[0].double(), k[0].double(), v[0].double(),
                 mask.double(), None, go[0].double())[2][None]
    err = {}
    for given in (stats, None):
        dv = torch.ops.flashsdpa.flash_attn_bwd(go, q, k, v, out, lse, rng, mask,
                                                softmax_stats=given)[2]
        err[given is None] = (dv.double() - ref).abs().max().item()
    assert err[False] < 1e-5 < 0.1 < err[True], err
    with pytest.raises(RuntimeError, match="softmax_stats"):
        torch.ops.flashsdpa.flash_attn_bwd(go, q, k, v, out, lse, rng, mask,
                                           softmax_stats=stats[..., :2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [16, 70])  # the split-KV decode path (short queries) and prefill
def test_a_query_of_nan_gives_nan(dtype, lq):
    """A query row holding NaN gives NaN (issue 22 item 2), also when a mask hides every key of
    the row, where PyTorch's fused kernel gives NaN too; the other rows are untouched. A query
    of NaN gives NaN everywhere, what PyTorch's test_cpu_flash_attn_nan_propagation checks."""
    q, k, v = qkv(L=lq, S=24, dtype=dtype, seed=4)
    q[0, 1, 2] = float("nan")
    mask = torch.ones(lq, 24, dtype=torch.bool)
    mask[2] = False
    for kw in ({}, {"attn_mask": mask}):
        want = F.scaled_dot_product_attention(q, k, v, **kw)
        for out in (routed(q, k, v, **kw), flashsdpa.scaled_dot_product_attention(q, k, v, **kw)):
            assert out[0, 1, 2].isnan().all()
            rest = torch.ones(lq, dtype=torch.bool)
            rest[2] = False
            assert not out[0, 0].isnan().any() and not out[0, 1, rest].isnan().any()
            torch.testing.assert_close(out[0, 1, rest], want[0, 1, rest], atol=ATOL[dtype] * 8,
                                       rtol=0.0)
    q.fill_(float("nan"))
    for out in (routed(q, k, v), flashsdpa.scaled_dot_product_attention(q, k, v)):
        assert out.isnan().all()
