"""Fused dropout: the keep-mask comes from Philox(seed, offset, b*H+h, i, j), seeded from
PyTorch's CPU generator; the backward regenerates it. Checked against a reference that applies
the very same keep-mask (exposed by flashsdpa._testing.dropout_keep_mask)."""
import pytest
import torch

import flashsdpa
from flashsdpa import _testing
from conftest import (DTYPE_IDS, DTYPES, assert_within_rule, make_qkv, num_threads,
                      reference_sdpa)


def _keep_for(rng_state, B, H, L, S, p):
    seed, offset = (int(x) for x in rng_state)
    return _testing.dropout_keep_mask(seed, offset, B, H, L, S, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_reference_with_same_mask(tier, causal, dtype):
    B, Hq, Hkv, L, S, D, p = 2, 4, 2, 45, 77, 32, 0.3
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, dtype=dtype, requires_grad=True)
    mask = torch.randn(1, Hq, L, S)
    out, lse, rng, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask, p, causal)
    keep = _keep_for(rng, B, Hq, L, S, p)
    assert 0.6 < keep.float().mean().item() < 0.8

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    out.backward(grad)

    # fp64 reference and "PyTorch in the same dtype", both with the same keep-mask
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_sdpa(*ref_leaves, attn_mask=mask, is_causal=causal, keep=keep, dropout_p=p)
    ref.backward(grad.double())
    same_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    same = reference_sdpa(*same_leaves, attn_mask=mask, is_causal=causal, keep=keep,
                          dropout_p=p, dtype=dtype)
    same.backward(grad)

    assert_within_rule(out, same, ref, dtype, f"{tier} dropout out")
    for name, ours, theirs, r in zip(("dq", "dk", "dv"), (q, k, v), same_leaves, ref_leaves):
        assert_within_rule(ours.grad, theirs.grad, r.grad, dtype, f"{tier} dropout {name}")


def test_dropout_reproducible_with_manual_seed(tier):
    q, k, v = make_qkv(2, 3, 3, 60, 60, 16)

    def run(seed, threads=2):
        torch.manual_seed(seed)
        with num_threads(threads):
            return flashsdpa.scaled_dot_product_attention(q, k, v, dropout_p=0.2)

    a, b, c, other = run(7), run(7), run(7, threads=1), run(8)
    assert torch.equal(a, b), "same seed must give bit-identical output"
    assert torch.equal(a, c), "thread count must not change the output"
    assert not torch.equal(a, other), "a different seed must give a different keep-mask"


def test_dropout_draws_fresh_masks():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8)
    torch.manual_seed(0)
    _, _, r1, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, None, 0.5, False)
    _, _, r2, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, None, 0.5, False)
    assert not torch.equal(r1, r2), "consecutive calls must use different seeds"
    _, _, r0, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, None, 0.0, False)
    assert torch.equal(r0, torch.zeros_like(r0)), "no dropout: rng_state is zeros"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_statistics(p):
    """The keep fraction of 1M draws is within 5 sigma of 1 - p, and columns 0..3 (one Philox
    call) are not correlated with their neighbours."""
    n_b, n_h, L, S = 2, 4, 256, 512
    keep = _testing.dropout_keep_mask(1234, 0, n_b, n_h, L, S, p).double()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    for lag in (1, 4):
        corr = torch.corrcoef(torch.stack([keep[..., :-lag].flatten(), keep[..., lag:].flatten()]))
        assert abs(corr[0, 1].item()) < 0.01


def test_dropout_mean_converges_to_no_dropout(tier):
    """E[dropout(P) V] = P V: the mean over many seeds approaches the dropout-free output."""
    q, k, v = make_qkv(1, 2, 2, 8, 32, 8)
    exact = flashsdpa.scaled_dot_product_attention(q, k, v)
    n = 400
    acc = torch.zeros_like(exact)
    for s in range(n):
        torch.manual_seed(s)
        acc += flashsdpa.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    err = (acc / n - exact).abs().max().item()
    assert err < 0.1, f"mean of {n} dropout runs is {err} away from the exact output"
    assert err > 0, "dropout had no effect"


def test_dropout_training_step_gradients_match_finite_difference(tier):
    """Gradient of sum(out * w) with a fixed keep-mask, against fp64 autograd on the same mask."""
    q, k, v = make_qkv(1, 1, 1, 12, 20, 8, requires_grad=True)
    out, _, rng, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, None, 0.4, False)
    keep = _keep_for(rng, 1, 1, 12, 20, 0.4)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * w).sum().backward()
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (reference_sdpa(*r, keep=keep, dropout_p=0.4) * w.double()).sum().backward()
    for ours, ref in zip((q, k, v), r):
        torch.testing.assert_close(ours.grad.double(), ref.grad, atol=2e-5, rtol=1e-4)
