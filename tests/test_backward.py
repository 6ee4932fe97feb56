"""Backward strategies: the single-pass (fused) and the two-sweep backward compute the same tiles
in the same order, so their gradients are bit-identical; ops.cpp may pick either by thread count
without making results depend on it. Both are also checked against the fp64 reference."""
import pytest
import torch

import flashsdpa
from flashsdpa import _testing
from conftest import DTYPE_IDS, check_forward_backward, make_qkv, num_threads

CASES = {
    # name: (B, Hq, Hkv, L, S, D, Dv, kwargs)
    "plain": (2, 2, 2, 150, 150, 32, 32, {}),
    "causal-gqa": (1, 6, 2, 133, 133, 48, 48, {"is_causal": True}),
    "causal-L>S": (1, 2, 2, 200, 70, 16, 16, {"is_causal": True}),
    "causal-L<S": (1, 2, 1, 70, 300, 24, 40, {"is_causal": True}),
    "mask": (2, 3, 3, 65, 97, 40, 40, {"attn_mask": "float"}),
    "keypad-dropout": (2, 2, 2, 90, 90, 32, 32, {"attn_mask": "keypad", "dropout_p": 0.2}),
}


def _kwargs(case, L, S, B):
    kw = dict(case)
    g = torch.Generator().manual_seed(11)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(L, S, generator=g)
    elif kw.get("attn_mask") == "keypad":
        m = torch.rand(B, 1, 1, S, generator=g) < 0.8
        m[..., 0] = True
        kw["attn_mask"] = m
    return kw


@pytest.fixture
def restore_strategy():
    with _testing.policy():
        yield


def _grads(q, k, v, kw, strategy, threads=2):
    with _testing.policy(fused_bwd=int(strategy == "fused")), num_threads(threads):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        out = flashsdpa.scaled_dot_product_attention(*leaves, enable_gqa=True, **kw)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape)
                     .to(out.dtype))
        assert _testing.last_policy()["fused_bwd"] == (strategy == "fused")
        return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(CASES))
def test_strategies_bit_identical(tier, restore_strategy, name, dtype):
    B, Hq, Hkv, L, S, D, Dv, case = CASES[name]
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, Dv, dtype=dtype)
    kw = _kwargs(case, L, S, B)
    fused = _grads(q, k, v, kw, "fused")
    two = _grads(q, k, v, kw, "two_sweep", threads=1)
    for g_name, a, b in zip(("dq", "dk", "dv"), fused, two):
        assert torch.equal(a, b), f"{g_name}: fused and two-sweep backward differ"


@pytest.mark.parametrize("strategy", ["fused", "two_sweep"])
@pytest.mark.parametrize("name", ["causal-gqa", "mask", "causal-L<S"])
def test_strategies_against_reference(tier, restore_strategy, strategy, name):
    B, Hq, Hkv, L, S, D, Dv, case = CASES[name]
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, Dv, dtype=torch.bfloat16)
    with _testing.policy(fused_bwd=int(strategy == "fused")):
        check_forward_backward(q, k, v, torch.bfloat16, f"{tier} {strategy} {name}",
                               **_kwargs(case, L, S, B))


def test_gradients_come_back_in_their_inputs_layout():
    """dq / dk / dv take their input's layout where that is dense: contiguous leaves get them as
    .grad without a copy (no aten::copy_ in the backward), (B, H, L, D) views of (B, L, H, D)
    projections get that buffer back; inputs that are not dense (sliced from one packed qkv)
    get PyTorch's layout, (B, H, L, D) on a (B, L, H, D) buffer. Every layout: the reference's
    gradients."""
    B, H, L, D = 2, 3, 40, 16
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(B, H, L, D, generator=g)

    def grads(q, k, v, leaves):
        with flashsdpa.enabled():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, leaves, grad_out)

    def reference(q, k, v):
        q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad_out.double())

    # contiguous leaves: .grad in place, no copy
    q, k, v = (torch.randn(B, H, L, D, generator=g, requires_grad=True) for _ in range(3))
    with flashsdpa.enabled(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad_out)
    assert "aten::copy_" not in {e.name for e in prof.events()}
    for t, want in zip((q, k, v), reference(q, k, v)):
        assert t.grad.stride() == t.stride()
        torch.testing.assert_close(t.grad.double(), want, atol=1e-5, rtol=1e-5)
    # views of (B, L, H, D) projections: their gradients on such a buffer
    x = [torch.randn(B, L, H, D, generator=g, requires_grad=True) for _ in range(3)]
    views = [t.transpose(1, 2) for t in x]
    for d, want in zip(grads(*views, views), reference(*views)):
        assert d.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(d.double(), want, atol=1e-5, rtol=1e-5)
    # packed qkv (not dense): PyTorch's layout
    qkv = torch.randn(B, L, 3, H, D, generator=g, requires_grad=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    for d, want in zip(grads(q, k, v, (q, k, v)), reference(q, k, v)):
        assert d.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(d.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_delta_phase(tier, restore_strategy, sinks):
    """delta = rowsum(dO * O): the single-pass items compute their own heads' rows (no
    cpu_bwd_delta phase) unless the sinks' gradient needs the delta phase's per-item parts; the
    two-sweep strategy always runs the phase. Both give the same gradients, bit for bit (the
    fp64 reference checks them throughout the suite)."""
    q, k, v = make_qkv(1, 4, 2, 70, 70, 32, dtype=torch.float32)
    kw = {"is_causal": True}
    if sinks:
        kw["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(5))
    grads, ran = {}, {}
    for strategy in ("fused", "two_sweep"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            grads[strategy] = _grads(q, k, v, kw, strategy)
        ran[strategy] = any(e.name.startswith("flashsdpa::cpu_bwd_delta[") for e in prof.events())
    assert ran == {"fused": sinks, "two_sweep": True}
    for g_name, a, b in zip(("dq", "dk", "dv"), grads["fused"], grads["two_sweep"]):
        assert torch.equal(a, b), f"{g_name}: fused and two-sweep backward differ"
