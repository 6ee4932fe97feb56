"""Attention masks in every form PyTorch accepts, read in place, and fully masked rows."""
import pytest
import torch

import flashsdpa
from conftest import DTYPE_IDS, DTYPES, check_forward_backward, make_qkv

B, H, L, S, D = 2, 3, 41, 67, 32


def _bool(shape, g, p_keep=0.7):
    return torch.rand(shape, generator=g) < p_keep


def _float(shape, g, dtype=torch.float32):
    m = torch.randn(shape, generator=g)
    m = m.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
    return m.to(dtype)


# name -> builder(generator, query dtype)
MASKS = {
    "bool_LS": lambda g, dt: _bool((L, S), g),
    "float_LS": lambda g, dt: _float((L, S), g),
    "bool_B11S_keypad": lambda g, dt: _bool((B, 1, 1, S), g),
    "float_1HLS": lambda g, dt: _float((1, H, L, S), g),
    "bool_BHLS": lambda g, dt: _bool((B, H, L, S), g),
    "float_B1LS": lambda g, dt: _float((B, 1, L, S), g),
    "bool_11LS": lambda g, dt: _bool((1, 1, L, S), g),
    "float_L1_rowbias": lambda g, dt: torch.randn((L, 1), generator=g),
    "float_1S": lambda g, dt: _float((1, S), g),
    "float_HLS_3d": lambda g, dt: _float((H, L, S), g),
    "qdtype_LS": lambda g, dt: _float((L, S), g, dt),
    "float_transposed_storage": lambda g, dt: _float((S, L), g).t(),
    "bool_expanded_view": lambda g, dt: _bool((1, 1, 1, S), g).expand(B, H, L, S),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_mask_forms(tier, mask_name, causal, dtype):
    g = torch.Generator().manual_seed(hash(mask_name) % 1000)
    q, k, v = make_qkv(B, H, H, L, S, D, dtype=dtype)
    mask = MASKS[mask_name](g, dtype)
    # Guarantee every row keeps at least its first key, so PyTorch's math fallback (used for some
    # forms) does not produce NaN rows that would blur the comparison; fully masked rows have
    # their own test below.
    if mask.dtype == torch.bool:
        mask = mask.clone()
        mask[..., 0] = True
    else:
        mask = mask.clone()
        mask[..., 0] = 0.0
    check_forward_backward(q, k, v, dtype, f"{tier} {mask_name}", attn_mask=mask,
                           is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", ["bool", "float", "causal_and_mask"])
def test_fully_masked_rows(tier, kind, dtype):
    """Rows with nothing to attend to give 0 (PyTorch's fused CPU kernel does the same) and
    zero gradient, never NaN."""
    q, k, v = make_qkv(1, 2, 2, 40, 70, 16, dtype=dtype, requires_grad=True)
    dead = [0, 7, 39]
    causal = False
    if kind == "bool":
        mask = torch.ones(40, 70, dtype=torch.bool)
        mask[dead] = False
    elif kind == "float":
        mask = torch.zeros(40, 70)
        mask[dead] = float("-inf")
    else:  # causal lets row i see keys <= i; the mask hides exactly those keys for dead rows
        causal = True
        mask = torch.ones(40, 70, dtype=torch.bool)
        for i in dead:
            mask[i, : i + 1] = False
    out = flashsdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    alive = [i for i in range(40) if i not in dead]
    assert not torch.isnan(out).any()
    out.backward(torch.ones_like(out))
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert not torch.isnan(t.grad).any(), f"{name} has NaN"
    assert torch.equal(q.grad[:, :, dead], torch.zeros_like(q.grad[:, :, dead]))
    if not causal:  # the rows that do attend are still right
        check_forward_backward(q.detach()[:, :, alive], k.detach(), v.detach(), dtype,
                               f"{tier} alive rows", attn_mask=mask[alive], backward=False)


def test_all_masked_lse_is_zero(tier):
    """The LSE of a fully masked row is 0 (PyTorch's convention, so its backward sees P = 0)."""
    q, k, v = make_qkv(1, 1, 1, 4, 6, 8)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    out, lse, _, _ = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.zeros_like(lse))


def test_key_padding_equals_truncation(tier):
    """A (B, 1, 1, S) key-padding mask hiding the tail equals attention over the kept keys."""
    q, k, v = make_qkv(4, 8, 8, 256, 256, 16)
    mask = torch.zeros(4, 1, 1, 256, dtype=torch.bool)
    mask[..., :200] = True
    out = flashsdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = flashsdpa.scaled_dot_product_attention(q[..., :], k[:, :, :200], v[:, :, :200])
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
