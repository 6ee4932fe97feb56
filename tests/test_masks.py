"""Attention masks in every form PyTorch accepts, read in place, and fully masked rows."""
import math

import pytest
import torch

import flashsdpa
from flashsdpa import _testing
from conftest import (DTYPE_IDS, DTYPES, assert_within_rule, check_forward_backward, make_qkv,
                      reference_sdpa, torch_sdpa_same_dtype)
from test_variants import reference  # (fp64, with sinks)

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


# ---- rows at one large mask value (the row shift) ------------------------------------------------
def _visible(L, S, causal, left=-1):
    """Row i sees keys j <= i (causal), and j >= i - left (a window's left side, left >= 0)."""
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    vis = torch.ones(L, S, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if left >= 0:
        vis &= j >= i - left
    return vis


def _shifted(mask, L, S, causal, left=-1):
    """mask minus each row's largest visible value where that is of magnitude 2^10 to 2^40 (the
    kernels' rule; float32, full (.., L, S)): the same softmax, without the offset."""
    full = mask.float().expand(*mask.shape[:-2], L, S)
    vis = _visible(L, S, causal, left)
    row_max = full.masked_fill(~vis, float("-inf")).amax(-1, keepdim=True)
    shift = torch.where((row_max.abs() >= 2**10) & (row_max.abs() <= 2**40), row_max, 0.0)
    return full - shift


def _grads_of(fn, q, k, v, mask, causal, go, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, attn_mask=mask, is_causal=causal, **kw)
    out.backward(go)
    return [out.detach()] + [t.grad for t in leaves]


LARGE_MASK_FORMS = ["rows_LS", "keypad_left_causal", "keypad_window", "qdtype_BHLS"]


def check_rows_at_one_large_mask_value(form, dtype, sdpa, lse_of, what):
    """test_rows_at_one_large_mask_value's case `form` on sdpa(q, k, v, attn_mask=, is_causal=,
    window_size=(left, 0) where the form has a window) -> out; lse_of(q, k, v, mask) -> the
    rows' logsumexp. (Also test_triton's, on the Triton kernels.)"""
    g = torch.Generator().manual_seed(7)
    B_, H_, L_, S_ = 2, 2, 37, 53
    q, k, v = make_qkv(B_, H_, H_, L_, S_, 32, dtype=dtype)
    q = (q.float() * 4).to(dtype)  # scores spread by tens: far more than ulp(1e9) / 64 apart
    causal = form == "keypad_left_causal"
    left = 6 if form == "keypad_window" else -1  # window (6, 0): rows 26-29 see padding only
    big = -1e9
    if form == "rows_LS":
        mask = torch.randn(L_, S_, generator=g)
        mask[[0, 5, L_ - 1]] = big
        mask[9] = big + 64 * torch.randint(0, 4, (S_,), generator=g).float()  # a few ulps apart
        mask[12, :40] = big  # a mixed row: max 0-ish, unchanged
    elif form == "keypad_left_causal":  # left padding: rows i < 6 of batch 0 see padding only
        mask = torch.zeros(B_, 1, 1, S_)
        mask[0, ..., :6] = big
    elif form == "keypad_window":
        mask = torch.zeros(B_, 1, 1, S_)
        mask[..., 20:30] = big
    else:
        fill = big if dtype != torch.float16 else -6e4
        mask = torch.randn(B_, H_, L_, S_, generator=g)
        mask[:, :, 3] = fill
        mask = mask.to(dtype)
    shifted = _shifted(mask, L_, S_, causal or left >= 0, left)  # (window (left, 0): j <= i)
    go = torch.randn(B_, H_, L_, 32, generator=g).to(dtype)
    window = dict(window_size=(left, 0)) if left >= 0 else {}
    ours = _grads_of(sdpa, q, k, v, mask, causal, go, **window)
    if mask.dtype == torch.float32:
        same = _grads_of(sdpa, q, k, v, shifted, causal, go, **window)
        for name, a, b in zip(("out", "dq", "dk", "dv"), ours, same):
            assert torch.equal(a, b), f"{what} {form} {name}: not the offset-free call's bits"
    if left >= 0:  # the band, for PyTorch and the reference, in the mask
        shifted = shifted.masked_fill(~_visible(L_, S_, True, left), float("-inf"))
    ref = _grads_of(reference_sdpa, q.double(), k.double(), v.double(), shifted.double(), causal,
                    go.double())
    torch_same = _grads_of(torch_sdpa_same_dtype, q, k, v, shifted.to(q.dtype), causal, go)
    for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, torch_same, ref):
        assert_within_rule(a, t, r, dtype, f"{what} {form} {name}")
    # the logsumexp puts the offset back: -1e9 + the row's own logsumexp (to ulp(1e9))
    if form == "rows_LS":
        lse = lse_of(q, k, v, mask)
        s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32) + mask.double()
        torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=64, rtol=0)
        torch.testing.assert_close(lse[..., 1:5].double(), torch.logsumexp(s, -1)[..., 1:5],
                                   atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("form", LARGE_MASK_FORMS)
def test_rows_at_one_large_mask_value(tier, form, dtype):
    """A row whose visible keys all carry one large finite mask value (a -1e9 fill; also values
    a few ulps apart) attends by its scores, as softmax does at any offset and fp64 gives: the
    kernels add the mask relative to the row's largest visible value. Before, scores + 1e9
    rounded to multiples of 64 and such rows attended to the wrong keys (fuzz_sdpa --case
    14031898: error 17.1). With a float32 mask, out and every gradient are bit for bit those of
    the call whose mask has the offset taken out (mask - row max); any mask, within the rule
    of the fp64 reference (PyTorch's own error taken on the offset-free mask)."""
    check_rows_at_one_large_mask_value(
        form, dtype, flashsdpa.scaled_dot_product_attention,
        lambda q, k, v, mask: torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask)[1], tier)


def test_decode_splits_at_different_offsets(tier):
    """The split-KV decode path shifts each split's rows by the largest mask value the split
    sees, and the merge moves them to the row's: a row at -1e6 with its last keys at -1e6 + 2
    (weights e^-2 apart across splits) and a row at -1e9 everywhere, against the fp64
    reference."""
    q, k, v = make_qkv(1, 2, 2, 2, 3000, 32)
    q = q * 4
    mask = torch.full((2, 3000), -1e6)
    mask[0, 2500:] = -1e6 + 2
    mask[1] = -1e9
    with _testing.policy(decode=1):
        out, lse = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask)[:2]
        assert _testing.last_policy()["decode"]
    shifted = _shifted(mask, 2, 3000, False)
    ref = reference_sdpa(q, k, v, attn_mask=shifted.double())
    torch_same = torch_sdpa_same_dtype(q, k, v, attn_mask=shifted)
    assert_within_rule(out, torch_same, ref, torch.float32, f"{tier} decode out")
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    want = torch.logsumexp(s + mask.double(), -1)
    torch.testing.assert_close(lse[..., 0].double(), want[..., 0], atol=0.0625, rtol=0)  # ulp(1e6)
    torch.testing.assert_close(lse[..., 1].double(), want[..., 1], atol=64, rtol=0)


def check_sink_in_a_shifted_row(fwd):
    """test_sink_in_a_shifted_row's case on fwd(q, k, v, mask, sinks) -> out (differentiable in
    q, k, v and sinks). (Also test_triton's, on the Triton kernels.)"""
    q, k, v = make_qkv(1, 2, 2, 6, 40, 16)
    sinks = torch.tensor([-2996.0, -2997.5])
    g = torch.Generator().manual_seed(2)
    mask = torch.randn(6, 40, generator=g)
    mask[1] = -1e9
    mask[2] = -3000.0 + torch.randn(40, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fwd(*leaves[:3], mask, leaves[3])
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = reference(*ref_leaves[:3], sinks=ref_leaves[3], mask=mask)
    p_sink = (ref_leaves[3].view(2, 1) - ref_lse[0]).exp()[:, 2]
    assert 0.1 < p_sink.min() and p_sink.max() < 0.9  # the sink competes
    assert out[0, :, 1].abs().max() < 1e-30
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(go)
    ref.backward(go.double())
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sink_in_a_shifted_row(tier):
    """A sink's score moves with its row's shift: a row at -1e9 on every key attends to its sink
    alone (out 0, the keys e^-1e9 behind); a row at -3000 + N(0, 1) shares its mass with sinks
    at -2996 and -2997.5 as the formula says (scores + 3000 rounded to ulp(4328) = 4.9e-4 in the
    log2 domain would miss the bound); forward, gradients and the sinks' gradient against fp64."""
    check_sink_in_a_shifted_row(
        lambda q, k, v, mask, sinks: torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask,
                                                                        sinks=sinks)[0])


def test_decode_sink_in_shifted_splits(tier):
    """The decode merge starts each row from its sink at the row's merged shift: rows at -1e9
    (the sink alone), at -3000 + N(0, 1) with sinks near them (shared mass), and one whose
    last split alone sits 2^11 above the rest (the other splits weigh nothing), over splits of
    3000 keys, forward only, against fp64."""
    q, k, v = make_qkv(1, 2, 2, 4, 3000, 16)
    sinks = torch.tensor([-2991.0, -2992.5])  # (3000 keys near -3000 sum to about e^9 there)
    g = torch.Generator().manual_seed(5)
    mask = torch.randn(4, 3000, generator=g)
    mask[1] = -1e9
    mask[2] = -3000.0 + torch.randn(3000, generator=g)
    mask[3] = -4096.0 + torch.randn(3000, generator=g)
    mask[3, 2600:] += 2048.0
    with _testing.policy(decode=1):
        out, lse = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask, sinks=sinks)[:2]
        assert _testing.last_policy()["decode"]
    ref, ref_lse = reference(q, k, v, sinks=sinks, mask=mask)
    p_sink = (sinks.double().view(2, 1) - ref_lse[0]).exp()[:, 2]
    assert 0.05 < p_sink.min() and p_sink.max() < 0.95  # the sink competes
    assert out[0, :, 1].abs().max() < 1e-30
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=64, rtol=0)
    torch.testing.assert_close(lse[..., 2:].double(), ref_lse[..., 2:], atol=1e-3,
                               rtol=0)  # (ulp(4096) / 2)
