"""Nested (jagged) tensors given to torch.nn.functional.scaled_dot_product_attention under
enable(): the varlen kernel runs (counted) instead of PyTorch's per-sequence math path, forward
and gradients against the fp64 per-sequence reference; the calls it cannot take (masks, causal
over different query / key lengths, sdpa_kernel without flash, disabled) reach PyTorch's own."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashsdpa
from flashsdpa import _testing
from conftest import DTYPE_IDS, assert_within_rule
from test_variants import reference

H, HKV, D, DV = 4, 2, 16, 24
LENS_Q = [9, 1, 33, 4]
LENS_K = [12, 3, 33, 7]


def jagged(lens, heads, dim, dtype, seed, grad=False, like=None):
    """(B, j, heads, dim) jagged NestedTensor (models transpose it to (B, heads, j, dim)) and its
    sequences; with `like`, over like's offsets (as q, k, v cut from one packed batch are)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, heads, dim, generator=g).to(dtype) for n in lens]
    if like is None:
        nt = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=grad)
    else:
        nt = torch.nested.nested_tensor_from_jagged(torch.cat(seqs), like.offsets())
        nt.requires_grad_(grad)
    return nt, seqs


def per_sequence(qs, ks, vs, causal, dtype):
    outs = []
    for q, k, v in zip(qs, ks, vs):
        o, _ = reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         causal=causal, dtype=dtype)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["self-causal", "cross", "gqa"])
def test_nested_sdpa_runs_the_varlen_kernel(case, dtype):
    lens_k = LENS_Q if case == "self-causal" else LENS_K
    hkv = HKV if case == "gqa" else H
    q, qs = jagged(LENS_Q, H, D, dtype, 0, grad=True)
    k, ks = jagged(lens_k, hkv, D, dtype, 1, grad=True, like=q if lens_k == LENS_Q else None)
    v, vs = jagged(lens_k, hkv, DV, dtype, 2, grad=True, like=k)
    causal = case == "self-causal"
    with flashsdpa.enabled(), _testing.counting() as counts:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=case == "gqa").transpose(1, 2)
        assert counts()["fwd_tiles"] > 0, "the varlen kernel did not run"
        assert out.is_nested and out.size(0) == len(LENS_Q)
        assert torch.equal(out.offsets(), q.offsets())
        g = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        (out.values() * g).sum().backward()
        assert counts()["bwd_tiles"] > 0
    want = per_sequence(qs, ks, vs, causal, torch.float64)
    base = per_sequence(qs, ks, vs, causal, dtype)
    assert_within_rule(out.values(), base, want, dtype, f"nested {case}")
    # gradients: the fp64 reference's, through autograd over the same sequences
    leaves = [[t.double().requires_grad_() for t in ts] for ts in (qs, ks, vs)]
    ref = per_sequence(*leaves, causal, torch.float64)
    ref.backward(g.double())
    for name, nt, ts in zip("qkv", (q, k, v), leaves):
        want_g = torch.cat([t.grad for t in ts])
        err = (nt.grad.values().double() - want_g).abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 8e-2
        assert err <= tol * max(1.0, want_g.abs().max().item()), f"d{name} {case}: {err}"


def test_nested_sdpa_falls_back_where_the_kernel_does_not_apply():
    """Causal with different query / key lengths (PyTorch would align it top-left, which its
    jagged path then rejects on CPU), the math backend forced, and a disabled library: PyTorch's
    own path, its results and its errors."""
    q, _ = jagged(LENS_Q, H, D, torch.float32, 0)
    k, _ = jagged(LENS_K, H, D, torch.float32, 1)
    v, _ = jagged(LENS_K, H, DV, torch.float32, 2, like=k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    want = F.scaled_dot_product_attention(qt, kt, vt)
    with flashsdpa.enabled(), _testing.counting() as counts:
        with pytest.raises(RuntimeError, match="No viable backend"):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        with sdpa_kernel(SDPBackend.MATH):
            got = F.scaled_dot_product_attention(qt, kt, vt)
        assert counts()["fwd_tiles"] == 0
        torch.testing.assert_close(got.values(), want.values())
        flashsdpa.disable()
        F.scaled_dot_product_attention(qt, kt, vt)
        assert counts()["fwd_tiles"] == 0
        assert "PyTorch's jagged-layout SDPA" in flashsdpa.explain(qt, kt, vt)
        flashsdpa.enable()
        assert "flashsdpa's varlen kernel" in flashsdpa.explain(qt, kt, vt)
        assert "PyTorch's jagged" in flashsdpa.explain(qt, kt, vt, is_causal=True)
        got = F.scaled_dot_product_attention(qt, kt, vt)
        assert counts()["fwd_tiles"] > 0
    torch.testing.assert_close(got.values(), want.values(), atol=1e-5, rtol=1e-5)


def test_nested_sdpa_under_compile():
    """torch.compile(fullgraph=True) over a jagged self-attention: one graph, the varlen kernel
    runs, the result is the eager one."""
    import torch._dynamo
    torch._dynamo.reset()
    q, _ = jagged(LENS_Q, H, D, torch.float32, 0)
    k, _ = jagged(LENS_Q, H, D, torch.float32, 1, like=q)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with flashsdpa.enabled():
        want = attend(qt, kt, kt)
        compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
        with _testing.counting() as counts:
            got = compiled(qt, kt, kt)
            assert counts()["fwd_tiles"] > 0
    torch._dynamo.reset()
    torch.testing.assert_close(got.values(), want.values(), atol=0, rtol=0)


def test_nested_sdpa_while_another_thread_toggles_enable():
    """Calls from several threads while another toggles enable(): each is PyTorch's answer or
    the varlen kernel's (equal within fp32 rounding), never an error."""
    import threading
    q, _ = jagged(LENS_Q, H, D, torch.float32, 0)
    k, _ = jagged(LENS_K, H, D, torch.float32, 1)
    v, _ = jagged(LENS_K, H, DV, torch.float32, 2, like=k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    want = F.scaled_dot_product_attention(qt, kt, vt).values()
    errors, stop = [], threading.Event()

    def call():
        try:
            for _ in range(30):
                got = F.scaled_dot_product_attention(qt, kt, vt).values()
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        except Exception as e:  # reported below
            errors.append(e)

    def toggle():
        while not stop.is_set():
            flashsdpa.enable()
            flashsdpa.disable()

    was = flashsdpa.is_enabled()
    toggler = threading.Thread(target=toggle)
    workers = [threading.Thread(target=call) for _ in range(3)]
    toggler.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    toggler.join()
    (flashsdpa.enable if was else flashsdpa.disable)()
    assert not errors, errors[0]
