"""The Triton (xpu) tier: forward and gradients of every feature against the fp64 reference, the
aten registration and autograd route, the dispatch table.

Where: on a GPU (xpu, or cuda through Triton's NVIDIA backend) when one is present; otherwise
under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, small shapes. The interpreter's
bf16 arithmetic works on raw bits, so under it the kernels widen bf16 dot operands to fp32
(UPCAST) and bf16 results are written in fp32 and rounded by PyTorch; fp16 and fp32 run the
kernels' own dtypes. The error rule is the suite's (tests/conftest.py): within 2x PyTorch's own
same-dtype error plus the shared ATOL. Every buffer the launchers allocate starts as NaN.
"""
import importlib.util
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import (DTYPE_IDS, DTYPES, assert_within_rule, check_forward_backward, make_qkv,
                      reference_sdpa, run_python, torch_sdpa_same_dtype)

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)


def _gpu():
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


GPU = _gpu()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py without a GPU
DEVICE = "cpu" if INTERPRETER else GPU
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="the CPU stand-in for the XPU key runs the kernels in the interpreter")
pytestmark = [pytest.mark.interpreted] if INTERPRETER else []

import flashsdpa  # noqa: E402
from flashsdpa import _C, _gpu as gpu, _triton  # noqa: E402
from flashsdpa._common import decide  # noqa: E402

import test_variants as variant_tests  # noqa: E402  (its cases, reference and check)
import test_varlen as varlen_tests  # noqa: E402  (its packed cases and per-sequence check)
import test_kvcache as kvcache_tests  # noqa: E402  (its caches, reference and checks)
import test_masks as mask_tests  # noqa: E402  (its large-mask-value cases)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from flashsdpa.kernels import common as kernel_common  # noqa: E402


@pytest.fixture(autouse=True)
def poison():
    _triton.POISON = True
    yield
    _triton.POISON = False


def _dev(t):
    return t.to(DEVICE) if t is not None else None


def run_case(q, k, v, dtype, what, backward=True, **kw):
    """flashsdpa's Triton path (on DEVICE) vs fp64 reference vs PyTorch's own same-dtype SDPA
    (on CPU), forward and gradients."""
    return check_forward_backward(q, k, v, dtype, what, backward,
                                  sdpa=_triton.scaled_dot_product_attention, device=DEVICE, **kw)


# (B, Hq, Hkv, L, S, D, Dv, layout, extra kwargs)
CASES = {
    "plain": (1, 2, 2, 37, 45, 24, 24, "contiguous", {}),
    "causal": (2, 2, 2, 45, 45, 32, 32, "contiguous", dict(is_causal=True)),
    "causal_lq_gt_lk": (1, 2, 2, 50, 21, 16, 16, "contiguous", dict(is_causal=True)),
    "causal_lq_lt_lk": (1, 1, 1, 19, 70, 16, 16, "contiguous", dict(is_causal=True)),
    "gqa": (1, 4, 2, 33, 40, 16, 16, "contiguous", {}),
    "gqa_causal_mqa": (1, 4, 1, 40, 40, 16, 16, "contiguous", dict(is_causal=True)),
    "dv_ne_d": (1, 2, 2, 30, 36, 24, 40, "contiguous", {}),
    "odd_head_dim": (1, 2, 2, 20, 27, 7, 5, "contiguous", {}),
    "scale": (1, 2, 2, 33, 33, 16, 16, "contiguous", dict(scale=0.3)),
    "permuted_blhd": (2, 2, 2, 29, 31, 16, 16, "blhd", dict(is_causal=True)),
    "padded_view": (1, 2, 2, 26, 35, 16, 16, "padded", {}),
    "single_row_col": (1, 2, 2, 1, 1, 16, 16, "contiguous", {}),
    # several interior (unchecked) tiles per row of tiles, then ragged checked ones
    "many_tiles": (1, 2, 1, 150, 130, 16, 16, "contiguous", {}),
    "many_tiles_causal": (1, 2, 1, 150, 130, 16, 16, "contiguous", dict(is_causal=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients(case, dtype):
    B, Hq, Hkv, L, S, D, Dv, layout, kw = CASES[case]
    q, k, v = make_qkv(B, Hq, Hkv, L, S, D, Dv, dtype=dtype, layout=layout, seed=3)
    run_case(q, k, v, dtype, case, **kw)


def test_large_head_dim():
    q, k, v = make_qkv(1, 1, 1, 20, 24, 200, 256, dtype=torch.float32, seed=4)
    run_case(q, k, v, torch.float32, "D=200 Dv=256", is_causal=True)


def test_three_d_inputs():
    q, k, v = make_qkv(1, 2, 2, 21, 30, 16, dtype=torch.float16, seed=5)
    mask = torch.randn(2, 21, 30).to(torch.float16)
    run_case(q[0], k[0], v[0], torch.float16, "3-D + 3-D mask", attn_mask=mask)


def test_broadcast_key_batch():
    q, _, _ = make_qkv(3, 2, 2, 17, 19, 16, dtype=torch.float32, seed=6)
    _, k, v = make_qkv(1, 2, 2, 17, 19, 16, dtype=torch.float32, seed=7)
    run_case(q, k, v, torch.float32, "key/value batch 1")


def _mask(kind, B, H, L, S, dtype, seed=11):
    g = torch.Generator().manual_seed(seed)
    shape = {"LS": (L, S), "B1LS": (B, 1, L, S), "1H1S": (1, H, 1, S), "BHLS": (B, H, L, S),
             "1HLS": (1, H, L, S), "B11S": (B, 1, 1, S)}[kind]
    if dtype == torch.bool:
        m = torch.rand(shape, generator=g) > 0.3
        return m
    return (torch.randn(shape, generator=g) * 2).to(dtype)


MASK_FORMS = ["LS", "B1LS", "1H1S", "BHLS", "1HLS", "B11S"]


@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_forms(form, kind):
    dtype = torch.float32
    B, H, L, S = 2, 2, 23, 37
    q, k, v = make_qkv(B, H, H, L, S, 16, dtype=dtype, seed=8)
    mask = _mask(form, B, H, L, S, torch.bool if kind == "bool" else dtype)
    run_case(q, k, v, dtype, f"{kind} mask {form}", attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_mask_with_causal(dtype):
    q, k, v = make_qkv(1, 2, 2, 30, 30, 16, dtype=dtype, seed=9)
    run_case(q, k, v, dtype, "float mask + causal", attn_mask=_mask("B1LS", 1, 2, 30, 30, dtype),
             is_causal=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero(kind):
    B, H, L, S = 1, 2, 20, 33
    q, k, v = make_qkv(B, H, H, L, S, 16, dtype=torch.float32, seed=10)
    keep = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[:, :, 3] = False
    keep[:, :, 17] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out = run_case(q, k, v, torch.float32, f"{kind} fully masked rows", attn_mask=mask)
    assert torch.equal(out[:, :, 3].detach().cpu(), torch.zeros_like(out[:, :, 3].cpu()))


# ---- rows at one large mask value: each row's mask shift (kernels/common.py, mask_row_shift) ---
def _triton_sdpa(q, k, v, attn_mask=None, is_causal=False, window_size=None):
    var = {} if window_size is None else dict(window_left=window_size[0],
                                              window_right=window_size[1])
    return _triton.scaled_dot_product_attention(_dev(q), _dev(k), _dev(v), _dev(attn_mask),
                                                is_causal=is_causal, **var).cpu()


def _triton_lse(q, k, v, mask):
    """The rows' logsumexp from the forward op's lse and mask shift (full_lse)."""
    _, lse, _, shift = torch.ops.flashsdpa.triton_attn_fwd(_dev(q), _dev(k), _dev(v), _dev(mask),
                                                           0.0, False, None)
    assert shift.shape == lse.shape + (2,)
    return _triton.full_lse(lse, shift).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("form", mask_tests.LARGE_MASK_FORMS)
def test_rows_at_one_large_mask_value(form, dtype):
    """test_masks' case on the Triton kernels: rows whose visible keys all carry a -1e9 fill
    attend by their scores (before the shift, scores + mask rounded to multiples of 64 (128 in
    the log2 domain) and such rows attended to the wrong keys); with a float32 mask out and
    every gradient are bit for bit the offset-free call's; fp64 and the suite's rule; the
    logsumexp puts the offset back."""
    mask_tests.check_rows_at_one_large_mask_value(form, dtype, _triton_sdpa, _triton_lse,
                                                  "triton")


def test_sinks_in_shifted_rows():
    """test_masks' sinks in shifted rows on the Triton kernels: a row at -1e9 on every key
    attends to its sink alone (out 0); a row at -3000 + N(0, 1) shares its mass with sinks at
    -2996 and -2997.5 as the formula says (the sinks' gradient from the logsumexp relative to
    the shift); forward, gradients and the sinks' gradient against fp64."""
    mask_tests.check_sink_in_a_shifted_row(
        lambda q, k, v, mask, sinks: _triton.scaled_dot_product_attention(
            _dev(q), _dev(k), _dev(v), _dev(mask), sinks=_dev(sinks)).cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_finfo_min_mask_rows_attend_as_pytorch(dtype):
    """A float mask at finfo.min (of its dtype) stays finite: past +-2.35e38 saturated
    (kernels/common.py MASK_LIMIT, the CPU's kMaskLimit) before the log2(e) factor, which would
    take it to -inf and mask the key. A row whose only key sits there attends to it (out = v, as
    PyTorch), a row at finfo.min on every key attends uniformly. (fuzz_sdpa --triton --case 24:
    rows of 0 where v was due.)"""
    low = torch.finfo(dtype).min
    q, k, v = make_qkv(2, 2, 2, 6, 1, 16, dtype=dtype, seed=41)
    mask = torch.zeros(6, 1, dtype=dtype)
    mask[1] = low
    out = run_case(q, k, v, dtype, "one key at finfo.min", attn_mask=mask)
    torch.testing.assert_close(out[:, :, 1].detach().cpu(), v[:, :, 0])
    q, k, v = make_qkv(1, 2, 2, 9, 20, 16, dtype=dtype, seed=42)
    mask = torch.randn(9, 20, generator=torch.Generator().manual_seed(6)).to(dtype)
    mask[[2, 7]] = low
    run_case(q, k, v, dtype, "rows at finfo.min", attn_mask=mask)


def test_one_key_row_of_unaligned_stride():
    """K / V of a single row whose row stride is not a multiple of 16 bytes (head dim 33, a
    broadcast key batch; 3-D fp16 of head dim 1): the tensor descriptor takes the row stride
    even over one row, so such views are copied with padded rows too (fuzz_sdpa --triton
    --cases 40: 'stride must be 16-byte aligned')."""
    q, _, _ = make_qkv(2, 2, 2, 30, 1, 33, dtype=torch.float32, seed=43)
    _, k, v = make_qkv(1, 1, 1, 30, 1, 33, dtype=torch.float32, seed=44)
    run_case(q, k, v, torch.float32, "one key, D 33, key batch 1", backward=False,
             enable_gqa=True)
    # the backward reads them through descriptors too: with one key P = 1, so dV = the rows'
    # sum of dO (dK, a rounding residue of dP - delta, is checked by the fuzzer's rule)
    leaves = [_dev(t).requires_grad_() for t in (q, k, v)]
    out = _triton.scaled_dot_product_attention(*leaves, enable_gqa=True)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    out.backward(go)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    torch.testing.assert_close(leaves[2].grad.cpu(), go.cpu().sum((0, 1, 2)).view(1, 1, 1, 33),
                               atol=1e-5, rtol=1e-5)
    q, k, v = make_qkv(1, 1, 1, 16, 1, 1, dtype=torch.float16, seed=45)
    run_case(q[0], k[0], v[0], torch.float16, "3-D, one key, D 1", backward=False)


def test_empty_sequences():
    for L, S in ((0, 5), (5, 0)):
        q, k, v = make_qkv(1, 2, 2, L, S, 16, dtype=torch.float32)
        leaves = [_dev(t.detach().clone()).requires_grad_() for t in (q, k, v)]
        out = _triton.scaled_dot_product_attention(*leaves)
        assert out.shape == (1, 2, L, 16) and not torch.isnan(out).any()
        if L == 5:
            assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
        out.sum().backward()
        for t in leaves:
            assert t.grad.shape == t.shape and not torch.isnan(t.grad).any()


def test_launch_from_new_thread():
    """Triton's scratch allocator is per thread (a ContextVar): forward and backward launched
    from a thread that never launched before must still run (a GPU backward always does: autograd
    runs it on its device thread)."""
    q, k, v = make_qkv(1, 2, 2, 33, 40, 16, dtype=torch.float32, seed=21)
    results = {}

    def work():
        try:
            leaves = [_dev(t.detach().clone()).requires_grad_() for t in (q, k, v)]
            out = _triton.scaled_dot_product_attention(*leaves, is_causal=True)
            out.sum().backward()
            results["out"] = out.detach().cpu()
            results["dq"] = leaves[0].grad.cpu()
        except Exception as e:  # surfaced below, in the test's own thread
            results["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in results, results.get("error")
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_sdpa(*ref_leaves, is_causal=True)
    ref.sum().backward()
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_out = F.scaled_dot_product_attention(*same, is_causal=True)
    torch_out.sum().backward()
    assert_within_rule(results["out"], torch_out.detach(), ref.detach(), torch.float32, "out")
    assert_within_rule(results["dq"], same[0].grad, ref_leaves[0].grad, torch.float32, "dq")


# ---- the attention variants (window, bottom-right alignment, softcap, ALiBi, sinks) ---------------
# The cases, the fp64 reference written from ../shared/api-variants-serving.md and the check (out
# and every gradient, the sinks' too, within the suite's rule) are test_variants.py's: the CPU
# kernels and the Triton ones are held to the same formulas.
VARIANT_CASES = list(variant_tests.CASES)


def _variant_kwargs(kw):
    """test_variants' variant keywords -> the ops' (window_left .. sinks), tensors on DEVICE."""
    left, right = kw.get("window", (-1, -1))
    return dict(window_left=left, window_right=right, softcap=kw.get("softcap", 0.0),
                alibi_slopes=_dev(kw.get("alibi")), sinks=_dev(kw.get("sinks")))


def _triton_variants(q, k, v, kw):
    """_triton.scaled_dot_product_attention on DEVICE with test_variants' keywords."""
    return _triton.scaled_dot_product_attention(
        _dev(q), _dev(k), _dev(v), attn_mask=_dev(kw.get("mask")),
        is_causal=kw.get("causal", False), **_variant_kwargs(kw)).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", VARIANT_CASES)
def test_variants_forward_and_gradients(name, dtype):
    q, k, v, kw = variant_tests.make_case(name, dtype)
    variant_tests.check(q, k, v, kw, dtype, f"triton {name}", run=_triton_variants)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq,lk", [(40, 70), (70, 40), (1, 33), (9, 5)])
def test_flash_attn_bottom_right(dtype, lq, lk):
    """flash_attn_func's semantics on the Triton kernels: (B, L, H, D) layout, bottom-right causal
    and window, every variant, the lse (-inf for the rows that see nothing when Lq > Lk)."""
    q, k, v = make_qkv(2, 4, 2, lq, lk, 16, dtype=dtype, seed=31)
    g = torch.Generator().manual_seed(5)
    kw = dict(causal=True, window=(25, -1), softcap=1.2, alibi=torch.rand(4, generator=g),
              sinks=torch.randn(4, generator=g))

    def run(q, k, v, kw):
        out, lse = _triton.flash_attn(*(_dev(t).transpose(1, 2) for t in (q, k, v)), 0.0, None,
                                      kw["causal"], **_variant_kwargs(kw))
        ref_lse = variant_tests.reference(q.detach(), k.detach(), v.detach(), bottom_right=True,
                                          **dict(kw, sinks=kw["sinks"].detach()))[1]
        torch.testing.assert_close(lse.cpu(), ref_lse.float(), atol=1e-5, rtol=1e-5)
        return out.transpose(1, 2).cpu()

    variant_tests.check(q, k, v, kw, dtype, f"triton flash_attn {lq}x{lk}", run=run,
                        bottom_right=True)


def test_rows_that_see_nothing_bottom_right():
    """Lq > Lk, bottom-right causal: the first Lq - Lk rows see no key: out 0, lse -inf, zero
    gradients; with a sink their lse is the sink's score and their out 0."""
    q, k, v = make_qkv(1, 2, 2, 9, 5, 16)
    qb, kb, vb = (_dev(t.transpose(1, 2).contiguous()).requires_grad_() for t in (q, k, v))
    out, lse = _triton.flash_attn(qb, kb, vb, 0.0, None, True)
    assert torch.equal(out[:, :4].cpu(), torch.zeros(1, 4, 2, 16))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    out.sum().backward()
    assert torch.equal(qb.grad[:, :4].cpu(), torch.zeros(1, 4, 2, 16))
    assert not torch.isnan(kb.grad).any() and not torch.isnan(vb.grad).any()
    sinks = _dev(torch.tensor([0.5, -1.0]))
    out, lse = _triton.flash_attn(qb, kb, vb, 0.0, None, True, sinks=sinks)
    torch.testing.assert_close(lse[0, :, :4].cpu(), sinks.cpu().view(2, 1).expand(2, 4))
    assert torch.equal(out[:, :4].cpu(), torch.zeros(1, 4, 2, 16))


@triton.jit
def _band_tiles_kernel(KV, Q, Lq, Lk, diag_lo, diag_hi, HAS_LO: tl.constexpr,
                       HAS_HI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(a, b, c, hi) of kv_bounds for q tile t and of q_bounds for kv tile t (program t)."""
    t = tl.program_id(0)
    if t * BLOCK_M < Lq:
        a, b, c, hi = kernel_common.kv_bounds(t * BLOCK_M, Lq, Lk, diag_lo, diag_hi, HAS_LO,
                                              HAS_HI, BLOCK_M, BLOCK_N)
        tl.store(KV + 4 * t, a)
        tl.store(KV + 4 * t + 1, b)
        tl.store(KV + 4 * t + 2, c)
        tl.store(KV + 4 * t + 3, hi)
    if t * BLOCK_N < Lk:
        a, b, c, hi = kernel_common.q_bounds(t * BLOCK_N, Lq, Lk, diag_lo, diag_hi, HAS_LO,
                                             HAS_HI, BLOCK_M, BLOCK_N)
        tl.store(Q + 4 * t, a)
        tl.store(Q + 4 * t + 1, b)
        tl.store(Q + 4 * t + 2, c)
        tl.store(Q + 4 * t + 3, hi)


def band_tiles(lq, lk, var, BM, BN):
    """The kernels' tile ranges of a call: (kv ranges per q tile, q ranges per kv tile)."""
    kv = torch.zeros(triton.cdiv(lq, BM), 4, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(triton.cdiv(lk, BN), 4, dtype=torch.int32, device=DEVICE)
    _band_tiles_kernel[(max(kv.shape[0], q.shape[0]),)](
        kv, q, lq, lk, var.diag_lo, var.diag_hi, HAS_LO=var.has_lo, HAS_HI=var.has_hi,
        BLOCK_M=BM, BLOCK_N=BN)
    return kv.cpu(), q.cpu()


@triton.jit
def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(Y + offs, kernel_common.tanh(x), mask=offs < N)


def test_tanh_is_the_cpu_fit_and_accurate():
    """The Triton softcap's tanh (kernels/common.py) is the CPU kernels' rational fit (its
    constants those of csrc/cpu/row_ops.h's Softcap), within 8 ulps relative at every size
    from 1e-8 to 12 and exact +-1 beyond; NaN stays NaN. (Its 1 - 2 / (e^2x + 1) before lost
    digits below |x| ~ 1: fuzz_variants --triton --case 143, softcap 30.)"""
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "csrc", "cpu", "row_ops.h")) as f:
        src = f.read()
    for name, ours in (("kP", kernel_common.TANH_P), ("kQ", kernel_common.TANH_Q)):
        cpu = re.search(name + r"\[5\] = \{([^}]*)\}", src).group(1)
        assert [float(c.strip().rstrip("f")) for c in cpu.split(",")] == list(ours), name
    mag = torch.cat([torch.logspace(-8, 0, 400), torch.linspace(1, 12, 400)])
    x = torch.cat([mag, -mag, torch.tensor([30.0, -1e30, float("nan")])]).float()
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 256),)](_dev(x), y_dev := _dev(y), x.numel(), BLOCK=256)
    y = y_dev.cpu()
    ref = torch.tanh(x.double())
    ok = (y.double() - ref).abs() <= 8 * 2.0 ** -24 * ref.abs()
    assert ok[:-1].all(), x[:-1][~ok[:-1]][:5]
    assert y[-1].isnan()


def test_band_tile_ranges_cover_the_band():
    """kernels/common.py's kv_bounds / q_bounds against the visibility rule, element by element:
    the tiles they visit hold every visible (row, key) pair, the interior tiles (run without
    checks) only pairs that are visible and in range, for windows on either side, both
    alignments, Lq above and below Lk, ragged ends."""
    BM, BN = 16, 8
    for lq, lk in ((37, 37), (20, 53), (53, 20), (64, 64), (1, 40)):
        for left, right, bottom in ((-1, -1, False), (-1, 0, False), (-1, 0, True), (7, 0, True),
                                    (12, 3, False), (0, 0, True), (5, -1, False), (30, 30, True)):
            var = _triton.Variants(lq, lk, False, (left, right), bottom)
            kv, q = band_tiles(lq, lk, var, BM, BN)
            i = torch.arange(lq).view(-1, 1)
            j = torch.arange(lk).view(1, -1)
            seen = torch.ones(lq, lk, dtype=torch.bool)
            if var.has_hi:
                seen &= j <= i + var.diag_hi
            if var.has_lo:
                seen &= j >= i + var.diag_lo
            what = f"{lq}x{lk} window ({left}, {right}) bottom_right={bottom}"
            for tiles, tile_rows, tile_cols in ((kv, BM, BN), (q, BN, BM)):
                visited = torch.zeros(lq, lk, dtype=torch.bool)
                for t, (a, b, c, hi) in enumerate(tiles.tolist()):
                    assert a <= b <= c and a % tile_cols == 0, (what, t, a, b, c, hi)
                    assert b % tile_cols == 0 or b >= hi, (what, t, a, b, c, hi)
                    for start in range(a, hi, tile_cols):
                        rows = slice(t * tile_rows, (t + 1) * tile_rows)
                        cols = slice(start, start + tile_cols)
                        if tiles is q:
                            rows, cols = cols, rows
                        visited[rows, cols] = True
                        if b <= start < c:  # interior: every pair in range visible
                            block = seen[rows, cols]  # (rows past Lq sliced off: they add 0)
                            assert block.all() and block.shape[1] == BN, (what, "interior", t,
                                                                          start)
                assert not (seen & ~visited).any(), (what, "a visible pair not visited")


# ---- packed variable-length batches (flash_attn_varlen_func) ---------------------------------
# test_varlen's cases, per-sequence fp64 reference and check: the CPU and Triton kernels are held
# to the same formulas. One launch per kernel covers every sequence (a grid over cu_seqlens).

def _triton_varlen(q, k, v, cu_q, cu_k, kw, return_lse=True, dropout_p=0.0):
    lens_q, lens_k = (c[1:] - c[:-1] for c in (cu_q, cu_k))
    out, lse = _triton.flash_attn_varlen(
        _dev(q), _dev(k), _dev(v), _dev(cu_q), _dev(cu_k), int(lens_q.max()),
        int(lens_k.max()), dropout_p, None, kw.get("causal", False), **_variant_kwargs(kw))
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(varlen_tests.CASES))
def test_varlen_equals_each_sequence(name, dtype, spy):
    """Every sequence (empty ones, ones without keys, GQA, Dv != D, each variant) as the
    reference computes it alone; one forward and one backward launch for the whole batch."""
    q, k, v, cu_q, cu_k, kw = varlen_tests.make_packed(name, dtype)
    varlen_tests.check_packed(q, k, v, cu_q, cu_k, kw, dtype, f"triton varlen {name}",
                              run=_triton_varlen)
    assert spy["forward"] == 1 and spy["backward"] == 1, spy


def test_varlen_dropout_keep_mask_per_sequence():
    """Dropout over a packed batch: sequence s's (row i, key j) draws the keep bit of packed row
    cu_q[s] + i, key j (one stream over (H, total_q, max_seqlen_k) elements, so sequences never
    share bits), the same in the backward; against the reference with those masks."""
    q, k, v, cu_q, cu_k, kw = varlen_tests.make_packed("window-alibi-sinks", torch.float32)
    p = 0.25
    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    torch.manual_seed(7)
    seed, offset = _triton.new_rng_state()
    full = _triton.dropout_keep_mask(seed, offset, 1, q.shape[1], q.shape[0], max(lens), p,
                                     DEVICE).cpu()
    keeps = [full[:, :, int(cu_q[s]):int(cu_q[s + 1]), :n] for s, n in enumerate(lens)]
    assert not torch.equal(keeps[0][..., :3, :3], keeps[1])

    def run(*args, **kw):
        torch.manual_seed(7)  # the launch draws the same (seed, offset)
        return _triton_varlen(*args, dropout_p=p, **kw)

    varlen_tests.check_packed(q, k, v, cu_q, cu_k, kw, torch.float32, "triton varlen dropout",
                              run=run, keeps=keeps, p=p)


@needs_interpreter
def test_varlen_gpu_entry_point(triton_decides, spy):
    """flash_attn_varlen_func on xpu / cuda tensors (_gpu.flash_attn_varlen, the decision taken
    as for them): one launch per kernel; the CPU op's checks, with errors naming the argument;
    a call the Triton kernels decline (float64) is left to the per-sequence loop (None)."""
    q, k, v, cu_q, cu_k, kw = varlen_tests.make_packed("all", torch.float32)

    def run(q, k, v, cu_q, cu_k, kw, return_lse=True):
        return gpu.flash_attn_varlen(q, k, v, cu_q, cu_k, 60, 90, 0.0, None, kw["causal"],
                                     **_variant_kwargs(kw))

    varlen_tests.check_packed(q, k, v, cu_q, cu_k, kw, torch.float32, "gpu varlen", run=run)
    assert spy["forward"] == 1 and spy["backward"] == 1, spy
    assert gpu.flash_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 60, 90, 0.0,
                                 None, True) is None
    bad = [((q, k, v, cu_q.long(), cu_k, 60, 90), "cu_seqlens_q must be a 1-D int32 tensor"),
           ((q, k, v, cu_q, cu_k, 59, 90), r"max_seqlen_q \(59\) must be at least"),
           ((q, k, v, cu_q, torch.tensor([0, 64, 60, 170, 179], dtype=torch.int32), 60, 90),
            "cu_seqlens_k must be non-decreasing"),
           ((q[None], k, v, cu_q, cu_k, 60, 90), "q must be 3-D"),
           ((q, k, v[1:], cu_q, cu_k, 60, 90), "v must have as many rows as k"),
           ((q, k[:, :1].expand(-1, 3, -1), v, cu_q, cu_k, 60, 90), r"key heads \(3\)")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            gpu.flash_attn_varlen(*args, 0.0, None, True)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape .* \(B, H\) = \(4, 4\)"):
        gpu.flash_attn_varlen(q, k, v, cu_q, cu_k, 60, 90, 0.0, None, True,
                              alibi_slopes=torch.rand(3, 4))
    assert spy["forward"] == 1, spy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_varlen_reads_views_of_a_packed_qkv_buffer(dtype):
    """q, k, v as views of one (total, 3, H, D) buffer (rows 3 H D apart) are read in place;
    a NaN-filled spare head between them is never read."""
    lens = [7, 30, 1, 0, 19]
    cu = varlen_tests.cu(lens)
    buf = torch.full((sum(lens), 4, 4, 16), float("nan"), dtype=dtype)
    buf[:, :3] = torch.randn(sum(lens), 3, 4, 16, generator=torch.Generator().manual_seed(9))
    q, k, v = buf[:, 0], buf[:, 1], buf[:, 2]
    assert q.stride(0) == 4 * 4 * 16 and not q.is_contiguous()
    out, lse = _triton_varlen(q, k, v, cu, cu, dict(causal=True))
    want, want_lse = varlen_tests.per_sequence_reference(q, k, v, cu, cu, dict(causal=True))
    base, _ = varlen_tests.per_sequence_reference(q, k, v, cu, cu, dict(causal=True), dtype)
    assert_within_rule(out, base, want, dtype, "packed qkv views")
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2 if dtype != torch.float32
                               else 1e-5, rtol=1e-3)


@needs_interpreter
def test_nested_sdpa_on_the_triton_kernels(triton_decides, spy, monkeypatch):
    """Jagged tensors through F.scaled_dot_product_attention on an xpu device (the CPU standing
    in: _nested.TRITON_DEVICES) take the Triton kernels' packed launch, forward and gradients,
    against the per-sequence fp64 reference; explain() says so."""
    import torch.nn.functional as F
    import test_nested as nested_tests
    from flashsdpa import _nested
    monkeypatch.setattr(_nested, "TRITON_DEVICES", ("xpu", "cpu"))
    q, qs = nested_tests.jagged(nested_tests.LENS_Q, 4, 16, torch.float32, 0, grad=True)
    k, ks = nested_tests.jagged(nested_tests.LENS_Q, 2, 16, torch.float32, 1, grad=True, like=q)
    v, vs = nested_tests.jagged(nested_tests.LENS_Q, 2, 24, torch.float32, 2, grad=True, like=q)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    out = out.transpose(1, 2)
    assert spy["forward"] == 1 and out.is_nested and torch.equal(out.offsets(), q.offsets())
    want = nested_tests.per_sequence(qs, ks, vs, True, torch.float64)
    torch.testing.assert_close(out.values().double(), want, atol=1e-5, rtol=1e-5)
    out.values().square().sum().backward()
    assert spy["backward"] == 1
    leaves = [[t.double().requires_grad_() for t in ts] for ts in (qs, ks, vs)]
    nested_tests.per_sequence(*leaves, True, torch.float64).square().sum().backward()
    for nt, ts in zip((q, k, v), leaves):
        torch.testing.assert_close(nt.grad.values().double(), torch.cat([t.grad for t in ts]),
                                   atol=1e-5, rtol=1e-5)
    assert "flashsdpa::triton_attn_fwd" in flashsdpa.explain(qt, kt, vt, is_causal=True,
                                                             enable_gqa=True)


def test_varlen_op_opcheck():
    """The packed form of flashsdpa::triton_attn_fwd / _bwd (cu_seqlens arguments): opcheck's
    schema, fake-kernel and autograd checks."""
    q, k, v, cu_q, cu_k, kw = varlen_tests.make_packed("all", torch.float32)
    q4, k4, v4 = (_dev(t).unsqueeze(0).transpose(1, 2).requires_grad_() for t in (q, k, v))
    packing = dict(cu_seqlens_q=_dev(cu_q), cu_seqlens_k=_dev(cu_k), max_seqlen_q=60,
                   max_seqlen_k=90)
    var = dict(_variant_kwargs(kw), bottom_right=True, **packing)
    var["sinks"].requires_grad_()
    opcheck_triton_ops(q4, k4, v4, None, var)


def opcheck_triton_ops(q, k, v, mask, var):
    """opcheck of flashsdpa::triton_attn_fwd (causal, lse_neg_inf, the op keywords `var`, sinks
    differentiable) and of triton_attn_bwd on its results."""
    torch.library.opcheck(torch.ops.flashsdpa.triton_attn_fwd, (q, k, v, mask, 0.0, True, None),
                          dict(var, lse_neg_inf=True))
    out, lse, rng, shift = torch.ops.flashsdpa.triton_attn_fwd(q, k, v, mask, 0.0, True, None,
                                                                **var)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, rng,
            mask, 0.0, True, None)
    torch.library.opcheck(torch.ops.flashsdpa.triton_attn_bwd, args,
                          dict(var, sinks=var["sinks"].detach(), mask_shift=shift))


# ---- attention over a KV cache (flash_attn_with_kvcache) -------------------------------------
# test_kvcache's caches, reference and checks: a paged pool holds NaN in its spare blocks and
# rows, which the kernel must never read.

@pytest.fixture
def kv_route(request):
    """Under the interpreter, _gpu's decision taken as for GPU tensors (the CPU stand-in)."""
    if INTERPRETER:
        request.getfixturevalue("triton_decides")


def _kv(q, kc, vc, kn, vn, kw, table=None, seqlens=None, **scales):
    """flash_attn_with_kvcache on the Triton path -> (out, lse) on the CPU: the public function
    on GPU tensors (the op's xpu / cuda kernel, _gpu.flash_attn_with_kvcache), or that kernel
    itself on CPU tensors under the interpreter. The caches are written in place."""
    seq = None if seqlens is None else _dev(torch.tensor(seqlens, dtype=torch.int32))
    left, right = kw.get("window", (-1, -1))
    args = (q, kc, vc, kn, vn, seq, _dev(table))
    opts = dict(causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0),
                alibi_slopes=_dev(kw.get("alibi")), sinks=_dev(kw.get("sinks")), **scales)
    if INTERPRETER:
        out, lse = gpu.flash_attn_with_kvcache(*args, window_left=left, window_right=right,
                                               **opts)
    else:
        out, lse = flashsdpa.flash_attn_with_kvcache(*args, window_size=(left, right),
                                                     return_lse=True, **opts)
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [1, 4, 40])
@pytest.mark.parametrize("block_size", [None, 16, 7], ids=["contiguous", "paged16", "paged7"])
@pytest.mark.parametrize("variant", list(kvcache_tests.VARIANTS))
def test_kvcache_against_reference(kv_route, spy, variant, block_size, lq, dtype):
    """Decode, speculative and chunked-prefill query counts over a contiguous or paged cache
    (blocks smaller than, equal to and not dividing the kernel's key tiles), lq new tokens
    appended first, every variant: the fp64 reference over each sequence's keys."""
    t = kvcache_tests
    q, kc, vc, kn, vn, kw = t.make_cache(dtype, lq, lq, **t.VARIANTS[variant])
    want, want_lse = kvcache_tests.expected(q, kc, vc, kn, vn, kw, torch.float64)
    base, _ = kvcache_tests.expected(q, kc, vc, kn, vn, kw, dtype)
    table = None
    if block_size:
        (kc, table), (vc, _) = (kvcache_tests.paged(c, block_size) for c in (kc, vc))
    q, kc, vc, kn, vn = (_dev(t) for t in (q, kc, vc, kn, vn))
    out, lse = _kv(q, kc, vc, kn, vn, kw, table, kvcache_tests.SEQLENS)
    kvcache_tests.assert_out_lse(out, lse, base, want, want_lse, dtype,
                                 f"triton {variant} {block_size} lq={lq}")
    assert spy["kvcache_forward"] == 1, spy


@pytest.mark.parametrize("combine_tile", [None, 1], ids=["rows-a-program", "one-row-a-program"])
def test_kvcache_splits_combine_to_one(monkeypatch, combine_tile):
    """The split-KV partials (each split's normalised output and lse, combined with the sinks)
    give the single-split result, whatever the split count; the interpreter's default splits a
    150-key cache several ways. The combine kernel with several rows a program (these small
    heads) and with one (its tile at many splits of large heads, forced here)."""
    from flashsdpa.kernels import configs
    if combine_tile:
        monkeypatch.setattr(configs, "COMBINE_TILE", combine_tile)
    assert (configs.combine_config(6, 4, 16)["BLOCK_R"] > 1) == (combine_tile is None)
    q, kc, vc, _, _, kw = kvcache_tests.make_cache(torch.float32, 3, 0, causal=True, sinks=True,
                                                   alibi="BH")
    var = _triton.Variants(0, 0, True, (-1, -1), True, 0.0, _dev(kw["alibi"]), _dev(kw["sinks"]),
                           DEVICE)
    lens = _dev(torch.tensor(kvcache_tests.SEQLENS, dtype=torch.int32))
    run = [_triton.kvcache_forward(_dev(q), _dev(kc), _dev(vc), None, lens, 101, var, splits=n)
           for n in (1, 2, 7, 20)]
    assert _triton._kv_splits(q.device, 2 * 3, 101, 16)[1] > 1 or not INTERPRETER
    # however long the cache, at most MAX_SPLITS (the combine kernel's register tile)
    chunk, n = _triton._kv_splits(q.device, 1, 10 ** 7, 16)
    assert n <= _triton.MAX_SPLITS and n * chunk >= 10 ** 7
    for out, lse in run[1:]:
        torch.testing.assert_close(out.cpu(), run[0][0].cpu(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse.cpu(), run[0][1].cpu(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size", [None, 5])
def test_kvcache_append_writes_exactly_the_new_slots(kv_route, block_size):
    """Bit for bit: the new tokens' rows written, every other byte (the pool's NaN spares
    included) untouched."""
    q, kc, vc, kn, vn, kw = kvcache_tests.make_cache(torch.bfloat16, 4, 6, causal=True)
    table = None
    if block_size:
        (kc, table), (vc, _) = (kvcache_tests.paged(c, block_size) for c in (kc, vc))
    want_k, want_v = (kvcache_tests.appended(c, n, table, block_size)
                      for c, n in ((kc, kn), (vc, vn)))
    kc, vc = _dev(kc), _dev(vc)
    _kv(_dev(q), kc, vc, _dev(kn), _dev(vn), kw, table, kvcache_tests.SEQLENS)
    assert torch.equal(kc.cpu().view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(vc.cpu().view(torch.int16), want_v.view(torch.int16))


def test_kvcache_rows_that_see_nothing(kv_route):
    """A sequence with nothing cached and nothing appended: out 0, lse -inf (or the sink)."""
    q, kc, vc, _, _, _ = kvcache_tests.make_cache(torch.float32, 2, 0)
    out, lse = _kv(_dev(q), _dev(kc), _dev(vc), None, None, {}, seqlens=[3, 0, 9])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    sinks = torch.tensor([0.5, 1.0, -1.0, 2.0])
    out, lse = _kv(_dev(q), _dev(kc), _dev(vc), None, None, dict(sinks=sinks), seqlens=[3, 0, 9])
    assert torch.equal(lse[1], sinks.view(4, 1).expand(4, 2))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("name", ["seqlens beyond", "seqlens int64", "no seqlens", "k without v",
                                  "cache batch", "cache dtype", "block out of range",
                                  "table shape", "k shape"])
def test_kvcache_bad_arguments_name_the_argument(kv_route, name):
    """The CPU op's checks, before anything is written."""
    (q, kc, vc, kn, vn, seq, *table), message = kvcache_tests._bad(name)
    q, kc, vc, kn, vn = (_dev(t) for t in (q, kc, vc, kn, vn))
    before = [kc.clone(), vc.clone()]
    call = gpu.flash_attn_with_kvcache if INTERPRETER else flashsdpa.flash_attn_with_kvcache
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        call(q, kc, vc, kn, vn, _dev(seq), *(_dev(t) for t in table))
    for a, b in zip((kc, vc), before):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@needs_interpreter
def test_kvcache_declined_call_gathers_the_keys(kv_route, spy):
    """A call the Triton kernel declines (head dim 300): each sequence's keys gathered through
    the block table and flash_attn_func over them; the append done first, as always."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 2, 300, generator=g)
    kc, vc = (torch.randn(2, 40, 1, 300, generator=g) for _ in range(2))
    kn, vn = (torch.randn(2, 3, 1, 300, generator=g) for _ in range(2))
    table = torch.randperm(10, generator=g).view(2, 5).to(torch.int32)
    kp, vp = (torch.full((10, 8, 1, 300), float("nan")) for _ in range(2))
    for pool, cache in ((kp, kc), (vp, vc)):
        for i in range(10):
            pool[table.view(-1)[i]] = cache[i // 5, (i % 5) * 8:(i % 5 + 1) * 8]
    seqlens = [10, 25]
    out, lse = gpu.flash_attn_with_kvcache(q, kp, vp, kn, vn, torch.tensor(seqlens,
                                           dtype=torch.int32), table, causal=True)
    assert spy["kvcache_forward"] == 0
    for b, n in enumerate(seqlens):
        keys, vals = torch.cat([kc[b, :n], kn[b]]), torch.cat([vc[b, :n], vn[b]])
        ref, ref_lse = variant_tests.reference(q[b:b + 1].transpose(1, 2),
                                               keys[None].transpose(1, 2),
                                               vals[None].transpose(1, 2), causal=True,
                                               bottom_right=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref.transpose(1, 2), atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_kvcache_op_route_and_compile(kv_route, spy):
    """flashsdpa.flash_attn_with_kvcache reaches the Triton path through the op's xpu / cuda
    kernel (registered at import; here the same function on the CPU key as their stand-in), in
    eager mode and under torch.compile(fullgraph=True), which keeps the in-place append."""
    op = "flashsdpa::flash_attn_with_kvcache"
    for key in ("CUDA", "XPU"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    q, kc, vc, kn, vn, _ = kvcache_tests.make_cache(torch.float32, 1, 1)
    seq = torch.tensor(kvcache_tests.SEQLENS, dtype=torch.int32)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = flashsdpa.flash_attn_with_kvcache(q, ref_k, ref_v, kn, vn, seq, causal=True)
    lib = torch.library.Library("flashsdpa", "IMPL")
    lib.impl("flash_attn_with_kvcache", gpu.flash_attn_with_kvcache, "CPU")
    try:
        torch._dynamo.reset()

        def step(q, kc, vc, kn, vn, seq):
            return flashsdpa.flash_attn_with_kvcache(q, kc, vc, kn, vn, seq, causal=True)

        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
            k2, v2 = kc.clone(), vc.clone()
            out = fn(q, k2, v2, kn, vn, seq)
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
            assert torch.equal(k2, ref_k) and torch.equal(v2, ref_v)
        assert spy["kvcache_forward"] == 2, spy
    finally:
        lib._destroy()
        torch._dynamo.reset()
    flashsdpa.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, seq)
    assert spy["kvcache_forward"] == 2, spy  # the C++ kernel again on the CPU key


# float8_e4m3fn caches
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [1, 40])
@pytest.mark.parametrize("layout", ["contiguous-scalar", "paged16-per-head"])
@pytest.mark.parametrize("variant", ["causal", "alibi-sinks"])
def test_kvcache_e4m3_against_reference(kv_route, variant, layout, lq, dtype):
    """float8 caches (values across each kv head's range, subnormals included) against the fp64
    reference over the dequantised values, the new keys / values as the append quantises them."""
    t = kvcache_tests
    per_head = layout.endswith("per-head")
    q, kc, vc, kn, vn, kw, (ks, vs) = t.make_e4m3_cache(dtype, lq, per_head, **t.VARIANTS[variant])
    kn_q, vn_q = t.dequantize(t.quantize(kn, ks), ks), t.dequantize(t.quantize(vn, vs), vs)
    kc_d, vc_d = t.dequantize(kc, ks), t.dequantize(vc, vs)
    want, want_lse = t.expected(q, kc_d, vc_d, kn_q, vn_q, kw, torch.float64)
    base, _ = t.expected(q, kc_d.to(dtype), vc_d.to(dtype), kn_q.to(dtype), vn_q.to(dtype), kw,
                         dtype)
    table = None
    if layout.startswith("paged"):
        (kc, table), (vc, _) = t.paged(kc, 16), t.paged(vc, 16)
    out, lse = _kv(*(_dev(x) for x in (q, kc, vc, kn, vn)), kw, table, t.SEQLENS,
                   k_scale=_dev(ks.reshape(-1)), v_scale=_dev(vs.reshape(-1)))
    t.assert_out_lse(out, lse, base, want, want_lse, dtype, f"triton e4m3 {variant} {layout}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_kvcache_e4m3_widening_is_exact_for_every_byte(kv_route, dtype):
    """One key whose value row holds all 256 bytes: the output is that row, widened as PyTorch
    converts float8_e4m3fn (the two NaN bytes give NaN) and scaled; and K: each byte's value is
    the lse of a single key (q = 1)."""
    E4M3 = torch.float8_e4m3fn
    v8 = torch.arange(256, dtype=torch.uint8).view(E4M3).view(1, 1, 1, 256)
    k8 = torch.zeros(1, 1, 1, 16, dtype=E4M3)
    q = torch.randn(1, 1, 1, 16).to(dtype)
    for v_scale in (1.0, 0.37):
        out, _ = _kv(_dev(q), _dev(k8), _dev(v8), None, None, {},
                     k_scale=_dev(torch.tensor([2.0])), v_scale=_dev(torch.tensor([v_scale])))
        want = (v8.float() * torch.tensor(v_scale)).to(dtype)
        torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)
    k8 = torch.arange(128, dtype=torch.uint8).view(E4M3).view(128, 1, 1, 1)
    q16 = torch.zeros(128, 1, 1, 16, dtype=dtype)
    q16[..., 0] = 1
    k16 = torch.zeros(128, 1, 1, 16, dtype=E4M3)
    k16[..., 0] = k8[..., 0]
    _, lse = _kv(_dev(q16), _dev(k16), _dev(torch.zeros(128, 1, 1, 4, dtype=E4M3)), None, None,
                 {}, k_scale=_dev(torch.tensor([0.5])), v_scale=_dev(torch.tensor([1.0])))
    want = (k8.float() * 0.5).view(128, 1, 1) / 4.0  # the default scale 1/sqrt(16)
    finite = want.isfinite()
    torch.testing.assert_close(lse[finite], want[finite], atol=1e-30, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # (the interpreter's numpy max)
def test_kvcache_e4m3_nan_in_a_visible_key_gives_nan(kv_route):
    """A NaN byte among a sequence's visible keys reaches that sequence's rows of its kv head
    (through the split combination), as through the dequantised reference; keys beyond
    cache_seqlens are never read."""
    t = kvcache_tests
    q, kc, vc, _, _, _ = t.make_cache(torch.float32, 1, 0)
    kc8, vc8 = t.quantize(kc, torch.tensor(0.05)), t.quantize(vc, torch.tensor(0.05))
    nan = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    kc8[0, 10, 1, 3] = nan  # visible for sequence 0 (37 keys)
    kc8[2, 120, :, :] = nan  # beyond sequence 2's 101 keys
    scale = _dev(torch.tensor([0.05]))
    out, _ = _kv(_dev(q), _dev(kc8), _dev(vc8), None, None, {}, seqlens=t.SEQLENS,
                 k_scale=scale, v_scale=scale)
    group = t.HQ // t.HKV
    assert out[0, :, group:].isnan().all() and not out[0, :, :group].isnan().any()
    assert not out[2].isnan().any()


@pytest.mark.parametrize("block_size", [None, 5])
def test_kvcache_e4m3_append_stores_the_quantised_values(kv_route, block_size):
    """k / v appended to a float8 cache: exactly those slots, round-to-nearest(value / scale)
    saturated to +-448, every other byte untouched."""
    t = kvcache_tests
    q, kc, vc, kn, vn, _, (ks, vs) = t.make_e4m3_cache(torch.bfloat16, 4, per_head=True)
    kn = kn.clone()
    kn[0, 0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])
    table = None
    if block_size:
        (kc, table), (vc, _) = t.paged(kc, block_size), t.paged(vc, block_size)
    u8 = torch.uint8
    want_k = t.appended(kc.view(u8), t.quantize(kn, ks).view(u8), table, block_size)
    want_v = t.appended(vc.view(u8), t.quantize(vn, vs).view(u8), table, block_size)
    kc, vc = _dev(kc), _dev(vc)
    _kv(_dev(q), kc, vc, _dev(kn), _dev(vn), dict(causal=True), table, t.SEQLENS,
        k_scale=_dev(ks), v_scale=_dev(vs))
    assert torch.equal(kc.cpu().view(u8), want_k) and torch.equal(vc.cpu().view(u8), want_v)


# ---- dropout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_reference_with_same_keep_mask(dtype, causal):
    B, H, L, S, p = 1, 2, 29, 35, 0.3
    q, k, v = make_qkv(B, H, H, L, S, 16, dtype=dtype, seed=12)
    torch.manual_seed(2024)
    seed, offset = _triton.new_rng_state()
    keep = _triton.dropout_keep_mask(seed, offset, B, H, L, S, p, DEVICE).cpu()
    torch.manual_seed(2024)  # the call below draws the same (seed, offset)
    leaves = [_dev(t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out = _triton.scaled_dot_product_attention(*leaves, dropout_p=p, is_causal=causal)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_sdpa(*ref_leaves, is_causal=causal, keep=keep, dropout_p=p)
    # PyTorch's own same-dtype error: the same computation with PyTorch ops in this dtype
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_out = reference_sdpa(*same, is_causal=causal, keep=keep, dropout_p=p, dtype=dtype)
    assert_within_rule(out.detach().cpu(), torch_out.detach(), ref.detach(), dtype, "dropout out")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(_dev(grad))
    ref.backward(grad.double())
    torch_out.backward(grad)
    for name, ours, theirs, r in zip(("dq", "dk", "dv"), leaves, same, ref_leaves):
        assert_within_rule(ours.grad.cpu(), theirs.grad, r.grad, dtype, f"dropout {name}")


def test_dropout_reproducible_and_fresh():
    q, k, v = (_dev(t) for t in make_qkv(1, 2, 2, 20, 24, 16, dtype=torch.float32, seed=13))
    torch.manual_seed(5)
    a = _triton.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = _triton.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = _triton.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dropout_keep_rate():
    p = 0.25
    keep = _triton.dropout_keep_mask(99, 0, 2, 2, 64, 64, p, DEVICE).double()
    n = keep.numel()
    rate = keep.mean().item()
    assert abs(rate - (1 - p)) < 4 * ((p * (1 - p)) / n) ** 0.5, rate
    # no structure: rows and heads are not copies of each other
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


# ---- the direct API's checks on the Triton path ---------------------------------------------------
def test_gpu_path_validates_and_declines():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        gpu.sdpa(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="enable_gqa"):
        gpu.sdpa(torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match="attn_mask"):
        gpu.sdpa(q, k, v, attn_mask=torch.ones(3, 8, 8, dtype=torch.bool))
    def triton_reasons(q, k, v):
        return decide(q, k, v, None, 0.0, False, None, False, "direct")["reasons"]["triton"]

    assert "float64" in " ".join(triton_reasons(q.double(), k.double(), v.double()))
    big = torch.randn(1, 1, 4, 300)
    assert any("head dim" in r for r in triton_reasons(big, big, big))
    # the variants are the Triton kernels' too
    reasons = decide(q, k, v, None, 0.0, False, None, False, "direct", window_left=3,
                     window_right=0, bottom_right=True, softcap=1.0,
                     sinks=torch.zeros(2))["reasons"]["triton"]
    assert reasons and not any("window" in r or "softcap" in r for r in reasons), reasons
    # declined calls still give PyTorch's answer
    out = gpu.sdpa(q.double(), k.double(), v.double())
    assert torch.allclose(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double()))


# ---- registration and the autograd route ------------------------------------------------------------
OVERRIDEABLE = ["_scaled_dot_product_fused_attention_overrideable",
                "_scaled_dot_product_fused_attention_overrideable_backward"]


def _xpu_kernels(op):
    dump = torch._C._dispatch_dump(f"aten::{op}")
    return [line for line in dump.splitlines() if line.startswith("XPU:")]


def test_dispatch_table_has_xpu_kernels_only_while_enabled(monkeypatch):
    """With an xpu device (stood in for here) enable() registers the kernels on the XPU key
    and disable() removes them; without one it registers nothing (a Library made and destroyed
    per cycle keeps memory: test_stress.test_toggle_cycles_keep_no_memory)."""
    ops = list(gpu.KERNELS)
    assert flashsdpa.is_enabled() is False
    before = {op: _xpu_kernels(op) for op in ops}
    assert not any("flashsdpa" in line for lines in before.values() for line in lines)
    if not gpu._xpu_present():
        with flashsdpa.enabled():
            assert gpu.is_registered() is False
            assert {op: _xpu_kernels(op) for op in ops} == before
    monkeypatch.setattr(gpu, "_xpu_present", lambda: True)
    flashsdpa.enable()
    try:
        for op in ops:
            lines = _xpu_kernels(op)
            assert lines and "flashsdpa" in lines[0], (op, lines)
    finally:
        flashsdpa.disable()
    assert {op: _xpu_kernels(op) for op in ops} == before


def test_import_needs_no_triton():
    code = ("import sys, torch, flashsdpa; flashsdpa.enable();"
            "q = torch.randn(1, 2, 16, 16); flashsdpa.scaled_dot_product_attention(q, q, q);"
            "flashsdpa.disable(); print('triton' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"



@pytest.fixture
def cpu_standin():
    """The overrideable op pair registered on the CPU key, as enable() registers it on XPU."""
    lib = gpu.register("CPU", OVERRIDEABLE)
    yield
    lib._destroy()


@pytest.fixture
def spy(monkeypatch):
    calls = {"forward": 0, "backward": 0, "kvcache_forward": 0}
    for name in calls:
        real = getattr(_triton, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(_triton, name, wrapped)
    return calls


def _overrideable(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, mask, dropout_p, is_causal, False, scale=scale)[0]


def _check_against_reference(fn, dtype, spy, **kw):
    """fn(q, k, v, mask, **kw) - an aten op or F.sdpa routed to the Triton kernels - checked as
    every other path; the spy proves the kernels ran."""
    q, k, v = make_qkv(2, 4, 2, 21, 26, 16, dtype=dtype, seed=21)

    def sdpa(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        return fn(q, k, v, attn_mask, **kw)

    check_forward_backward(q, k, v, dtype, "registered", sdpa=sdpa,
                           attn_mask=_mask("B1LS", 2, 4, 21, 26, dtype), **kw)
    assert spy["forward"] >= 1 and spy["backward"] >= 1, spy


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_registered_overrideable_eager(cpu_standin, spy, dtype):
    _check_against_reference(_overrideable, dtype, spy, is_causal=True)


@needs_interpreter
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_registered_overrideable_under_compile(cpu_standin, spy, backend):
    """torch.compile traces with PyTorch's meta kernels and autograd formula; the compiled graph
    calls the registered kernels."""
    torch._dynamo.reset()
    fn = torch.compile(_overrideable, backend=backend, fullgraph=True)
    _check_against_reference(fn, torch.float32, spy, is_causal=True)
    torch._dynamo.reset()


@needs_interpreter
def test_registered_overrideable_rows_at_one_large_mask_value(cpu_standin, spy):
    """aten's op pair on a mask with rows at one huge value: the forward shifts each row (such
    rows attend by their scores, within the rule of the offset-free mask) and returns the rows'
    logsumexp; aten's autograd keeps only that, so the backward adds the mask unshifted: P
    capped at 1 in those rows, every gradient finite, the other rows' dQ within the rule. (At
    -999997632 = -1e9 + 37 * 64, log2(e) * M lies 40.6 below its fp32 rounding: scores past
    44 in such a row then round 128 above the row's log2 logsumexp, P = 2^128 = inf uncapped.)"""
    q, k, v = make_qkv(1, 2, 2, 20, 24, 16, dtype=torch.float32, seed=0)
    q = q * 32
    mask = torch.randn(1, 1, 20, 24, generator=torch.Generator().manual_seed(4))
    big = (1, 3, 7, 9, 15)  # (uncapped, row 1 of head 1 overflows)
    mask[..., [1, 3, 9, 15], :] = -999997632.0
    mask[..., 7, :] = -1e9
    shifted = mask_tests._shifted(mask, 20, 24, False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _overrideable(*leaves, mask=mask)
    ref = reference_sdpa(*(t.double().requires_grad_() for t in (q, k, v)), shifted.double())
    assert_within_rule(out.detach(), torch_sdpa_same_dtype(q, k, v, attn_mask=shifted),
                       ref.detach(), torch.float32, "aten forward at -1e9")
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    ref_q = q.double().requires_grad_()
    ref = reference_sdpa(ref_q, k.double(), v.double(), shifted.double())
    ref.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).double())
    same_q = q.clone().requires_grad_()
    torch_sdpa_same_dtype(same_q, k, v, attn_mask=shifted).backward(
        torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    rows = [i for i in range(20) if i not in big]
    assert_within_rule(leaves[0].grad[:, :, rows], same_q.grad[:, :, rows],
                       ref_q.grad[:, :, rows], torch.float32, "aten dq, the other rows")
    assert spy["forward"] == 1 and spy["backward"] == 1, spy


@needs_interpreter
def test_registered_overrideable_dropout_regenerates_mask(cpu_standin):
    q, k, v = make_qkv(1, 2, 2, 20, 24, 16, dtype=torch.float32, seed=22)
    torch.manual_seed(11)
    res = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v, None, 0.4,
                                                                          False, False)
    out, seed, offset = res[0], int(res[6]), int(res[7])
    keep = _triton.dropout_keep_mask(seed, offset, 1, 2, 20, 24, 0.4)
    ref = reference_sdpa(q, k, v, keep=keep, dropout_p=0.4)
    assert (out.double() - ref).abs().max().item() < 1e-5
    # the backward regenerates the same mask from (seed, offset)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out2 = _overrideable(*leaves, dropout_p=0.4)
    assert torch.equal(out2.detach(), out)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_sdpa(*ref_leaves, keep=keep, dropout_p=0.4)
    grad = torch.randn(out.shape)
    out2.backward(grad)
    ref.backward(grad.double())
    for ours, r in zip(leaves, ref_leaves):
        assert (ours.grad.double() - r.grad).abs().max().item() < 1e-5


@pytest.fixture
def routed_cpu_standin(cpu_standin):
    """enable() with the CPU key standing in for XPU: F.scaled_dot_product_attention on CPU
    tensors takes the route xpu tensors take."""
    flashsdpa.enable()
    _C.set_overrideable_route("cpu")
    yield
    _C.set_overrideable_route("")
    flashsdpa.disable()


@pytest.fixture
def triton_decides(routed_cpu_standin, monkeypatch):
    """The GPU entry points (_gpu) decide for the CPU stand-in as they do for xpu tensors, where
    no CPU kernel is in front of the Triton kernels: the Triton backend wherever it may run."""
    def as_on_gpu(*args, **kw):
        d = decide(*args, **kw)
        if d["backend"] == "cpu" and not d["reasons"]["triton"]:
            d["backend"] = "triton"
        return d

    monkeypatch.setattr(gpu, "decide", as_on_gpu)


@needs_interpreter
def test_gpu_entry_points_send_variants_to_triton(triton_decides, spy):
    """The direct API's GPU entry points (flashsdpa.scaled_dot_product_attention and
    flash_attn_func on xpu / cuda tensors: _gpu.sdpa, _gpu.flash_attn) run the variants on the
    Triton kernels, forward and gradients; a call they decline (float64) takes flashsdpa's math
    on PyTorch ops instead. The CPU stands in for the Triton device: the decision is taken as it
    is for xpu tensors, where no CPU kernel is in front of the Triton kernels."""
    q, k, v, kw = variant_tests.make_case("all", torch.float32)

    def run_sdpa(q, k, v, kw):
        return gpu.sdpa(q, k, v, kw.get("mask"), is_causal=kw.get("causal", False),
                        enable_gqa=True, **_variant_kwargs(kw))

    variant_tests.check(q, k, v, kw, torch.float32, "gpu.sdpa", run=run_sdpa)
    assert spy["forward"] == 1 and spy["backward"] == 1, spy

    def run_flash(q, k, v, kw):
        out, _ = gpu.flash_attn(*(t.transpose(1, 2) for t in (q, k, v)), 0.0, None, False,
                                **_variant_kwargs(kw))
        return out.transpose(1, 2)

    variant_tests.check(q, k, v, kw, torch.float32, "gpu.flash_attn", run=run_flash,
                        bottom_right=True)
    assert spy["forward"] == 2 and spy["backward"] == 2, spy
    out = run_sdpa(q.double(), k.double(), v.double(), kw)
    ref, _ = variant_tests.reference(q, k, v, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert spy["forward"] == 2, spy


@needs_interpreter
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(dropout_p=0.0, scale=0.2)],
                         ids=["causal", "scale"])
def test_f_sdpa_routes_to_triton_kernels(routed_cpu_standin, spy, kw):
    def fn(q, k, v, mask, **kw):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw)
    _check_against_reference(fn, torch.float32, spy, **kw)


@needs_interpreter
def test_f_sdpa_route_under_compile(routed_cpu_standin, spy):
    torch._dynamo.reset()

    def fn(q, k, v, mask, **kw):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw)

    _check_against_reference(torch.compile(fn, backend="aot_eager", fullgraph=True),
                             torch.float32, spy, is_causal=True)
    torch._dynamo.reset()


@needs_interpreter
def test_f_sdpa_route_respects_sdpa_kernel_and_declines(routed_cpu_standin, spy):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = make_qkv(1, 2, 2, 12, 12, 16, dtype=torch.float32)
    with sdpa_kernel([SDPBackend.MATH]):
        F.scaled_dot_product_attention(q, k, v)
    assert spy["forward"] == 0
    F.scaled_dot_product_attention(q.double(), k.double(), v.double())  # float64: PyTorch's
    assert spy["forward"] == 0
    F.scaled_dot_product_attention(q, k, v)
    assert spy["forward"] == 1


@pytest.mark.skipif(GPU != "xpu" or INTERPRETER, reason="needs an Intel GPU")
def test_xpu_f_sdpa_runs_triton_kernels(spy):
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, dtype=torch.float16, seed=30)
    with flashsdpa.enabled():
        leaves = [t.to("xpu").requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, dropout_p=0.0)
        out.sum().backward()
    assert spy["forward"] == 1 and spy["backward"] == 1
    ref = reference_sdpa(q, k, v, is_causal=True)
    assert (out.detach().cpu().double() - ref).abs().max().item() < 5e-3


# ---- block configurations ----------------------------------------------------------------------------
@pytest.mark.parametrize("blocks", ["BLOCK_M=16,BLOCK_N=64", "BLOCK_M=64,BLOCK_N=16"])
def test_other_block_shapes(monkeypatch, blocks):
    """The kernels are correct for unequal tiles (causal limits, masks, GQA, ragged edges)."""
    for var in ("FLASHSDPA_TRITON_FWD", "FLASHSDPA_TRITON_BWD_KV", "FLASHSDPA_TRITON_BWD_Q"):
        monkeypatch.setenv(var, blocks)
    q, k, v = make_qkv(1, 4, 2, 70, 53, 16, dtype=torch.float32, seed=40)
    mask = _mask("B1LS", 1, 4, 70, 53, torch.bool)
    run_case(q, k, v, torch.float32, f"{blocks} causal+mask", attn_mask=mask, is_causal=True)


def test_config_override_parsing(monkeypatch):
    from flashsdpa.kernels import configs
    monkeypatch.setenv("FLASHSDPA_TRITON_FWD", "BLOCK_M=256, BLOCK_N=32,num_warps=32,grf_mode=256")
    assert configs.parse_override("FLASHSDPA_TRITON_FWD", "xpu") == (
        dict(BLOCK_M=256, BLOCK_N=32), dict(num_warps=32, grf_mode="256"))
    # grf_mode is an xpu-only option: dropped elsewhere
    assert configs.parse_override("FLASHSDPA_TRITON_FWD", "cuda")[1] == dict(num_warps=32)
    for bad, msg in (("BLOCK_M=48", "power of two"), ("BLOCK_M", "key=value"),
                     ("warps=4", "unknown key"), ("num_warps=x", "integer")):
        monkeypatch.setenv("FLASHSDPA_TRITON_FWD", bad)
        with pytest.raises(ValueError, match="FLASHSDPA_TRITON_FWD.*" + msg):
            configs.parse_override("FLASHSDPA_TRITON_FWD", "xpu")
    monkeypatch.delenv("FLASHSDPA_TRITON_FWD")
    assert configs.parse_override("FLASHSDPA_TRITON_FWD") is None


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_nvidia_targets(arch):
    """Triton's real compiler (not the interpreter) accepts the kernels at the launchers' block
    configurations, down to ptxas: compiled ahead of time, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "triton_aot_check.py")
    res = subprocess.run([sys.executable, script, str(arch)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    # 6 cases (triton_aot_check.CASES), the xpu-shaped forward, the KV-cache kernel's cases
    assert res.stdout.count("compiled") == 8, res.stdout


# ---- the direct API's ops under torch.compile --------------------------------------------------------
def test_triton_ops_opcheck():
    q, k, v = (_dev(t) for t in make_qkv(1, 4, 2, 20, 24, 16, dtype=torch.float32, seed=50))
    mask = _dev(_mask("B1LS", 1, 4, 20, 24, torch.bool))
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.flashsdpa.triton_attn_fwd, (q, k, v, mask, 0.0, True, None))
    out, lse, rng, shift = torch.ops.flashsdpa.triton_attn_fwd(q, k, v, mask, 0.0, True, None)
    assert shift.numel() == 0  # (a bool mask: no shift)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, rng,
            mask, 0.0, True, None)
    torch.library.opcheck(torch.ops.flashsdpa.triton_attn_bwd, args)
    # with every variant (the sinks differentiable), and a float mask with rows at -1e9 (the
    # mask shift: an output of the forward op, an argument of the backward op)
    fmask = _mask("B1LS", 1, 4, 20, 24, torch.float32)
    fmask[..., 3, :] = -1e9
    for m in (mask, _dev(fmask)):
        opcheck_triton_ops(q, k, v, m, dict(window_left=5, window_right=2, bottom_right=True,
                                            softcap=2.0, alibi_slopes=_dev(torch.rand(4)),
                                            sinks=_dev(torch.randn(4)).requires_grad_()))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_direct_api_under_compile(backend):
    """torch.compile(fullgraph=True) keeps each Triton launch as one opaque op (fake kernels for
    tracing); forward and gradients match eager, and dropout draws fresh masks per call."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 4, 2, 21, 26, 16, dtype=torch.float32, seed=51)
    mask = _mask("B1LS", 1, 4, 21, 26, torch.float32)

    def fn(q, k, v, p=0.0):
        return _triton.scaled_dot_product_attention(q, k, v, _dev(mask), dropout_p=p,
                                                    is_causal=True)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    eager_leaves = [_dev(t.detach().clone()).requires_grad_() for t in (q, k, v)]
    comp_leaves = [_dev(t.detach().clone()).requires_grad_() for t in (q, k, v)]
    ref = fn(*eager_leaves)
    out = compiled(*comp_leaves)
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    ref.backward(grad)
    out.backward(grad)
    for a, b in zip(comp_leaves, eager_leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        d1 = compiled(*(_dev(t) for t in (q, k, v)), p=0.5)
        d2 = compiled(*(_dev(t) for t in (q, k, v)), p=0.5)
    assert not torch.equal(d1, d2)
    torch._dynamo.reset()


def test_everything_cpu_works_without_triton():
    """With Triton unimportable: import, enable()/disable(), CPU calls and explain() work; the XPU
    kernels are simply not registered, and the GPU path reports why it declines."""
    out = run_python(
        "import sys; sys.modules['triton'] = None",
        "import torch, flashsdpa",
        "from flashsdpa import _gpu, _common",
        "flashsdpa.enable()",
        "q = torch.randn(1, 2, 16, 16, requires_grad=True)",
        "torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum().backward()",
        "reasons = _common.decide(q, q, q, None, 0.0, False, None, False, 'direct')['reasons']",
        "print(_gpu.is_registered(), 'Triton is not installed' in reasons['triton'])",
        "flashsdpa.explain(q, q, q)",
        "flashsdpa.disable()")
    assert out.strip() == "False True", out
