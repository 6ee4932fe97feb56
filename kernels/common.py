"""Triton helpers shared by the forward and backward attention kernels.

Scores are kept in the log2 domain: s = log2(e) * (scale * q.k + mask), so the softmax uses exp2.
Masks are read through their (broadcast, possibly zero) strides, never expanded in memory.
The dropout keep-mask comes from Triton's counter-based RNG (Philox) keyed by (seed, element
index), so the backward regenerates it exactly.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores and LSE move to the log2 domain
# A row's float-mask shift M (mask_row_shift) is its largest visible mask value when
# SHIFT_MIN <= |M| <= SHIFT_LIMIT, else 0: the CPU kernels' rule (csrc/cpu/flash_common.h,
# kShiftMin / kShiftLimit). Next to a -1e9 fill fp32 holds multiples of 64, so scores + mask would
# round together; mask - M is exact near M and softmax does not change under a per-row constant.
SHIFT_MIN = tl.constexpr(1024.0)
SHIFT_LIMIT = tl.constexpr(1099511627776.0)  # 2^40: finfo.min fills stay unshifted, as in PyTorch
# Float-mask values past +-MASK_LIMIT saturate there (csrc/cpu/flash_common.h, kMaskLimit): times
# log2(e) a finfo.min fill would overflow to -inf, masking a key PyTorch attends (a row whose keys
# all sit at finfo.min attends uniformly there); -inf and NaN pass unchanged.
MASK_LIMIT = tl.constexpr(2.35e38)


@triton.jit
def tile_desc(base, rows, cols, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A 2-D tensor descriptor over one (batch, head) slice [rows, cols] with unit column stride
    (the launcher guarantees a 16-byte aligned base and row stride). Loads outside [rows, cols]
    read as 0, which handles ragged sequence lengths and head dims below the block width."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[stride_r, 1],
                                     block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def load_block(desc, row, UPCAST: tl.constexpr):
    """Rows [row, row + BLOCK_R) of a descriptor; widened to fp32 when UPCAST (bf16 under the
    interpreter, whose bf16 arithmetic works on raw bits)."""
    tile = desc.load([row, 0])
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


# ---- the program's sequence: a batch entry, or one sequence of a packed (varlen) call --------

@triton.jit
def sequence(CuQ, CuK, b, Lq, Lk, diag_lo, diag_hi, diag, VARLEN: tl.constexpr):
    """(bt, q0, k0, lq, lk, diag_lo, diag_hi, diag) of batch entry / sequence b: its index into
    the tensors' batch dim, its first query and key rows, its lengths and its band.

    Batched calls: entry b, rows from 0, the call's Lq / Lk and band. Packed calls (VARLEN; the
    tensors (1, H, total, D)): sequence b holds rows cu_q[b]:cu_q[b+1] and cu_k[b]:cu_k[b+1];
    the launcher's band is relative to each sequence's bottom-right diagonal lk - lq, added
    here."""
    if VARLEN:
        q0 = tl.load(CuQ + b).to(tl.int64)
        k0 = tl.load(CuK + b).to(tl.int64)
        lq = (tl.load(CuQ + b + 1) - q0).to(tl.int32)
        lk = (tl.load(CuK + b + 1) - k0).to(tl.int32)
        bt = 0
        shift = lk - lq
        diag_lo += shift
        diag_hi += shift
        diag += shift
    else:
        q0 = 0
        k0 = 0
        lq = Lq
        lk = Lk
        bt = b
    return bt, q0, k0, lq, lk, diag_lo, diag_hi, diag


@triton.jit
def dropout_row0(bt, h, Hq, Lq, q0):
    """dropout_keep's row0 of head h of a sequence: (bt * Hq + h) * Lq + q0. Packed calls pass Lq
    = total_q and, as dropout_keep's Lk, max_seqlen_k: (row, key) -> index stays unique across
    the sequences."""
    return (bt * Hq + h).to(tl.int64) * Lq + q0


# ---- visibility: which keys each query row sees (the CPU kernels' Visibility, csrc/cpu/) ----------
# Row i sees the band of keys j with  i + diag_lo <= j  (HAS_LO: a window's left side) and
# j <= i + diag_hi  (HAS_HI: causal, or a window's right side), diag_lo = diag - left and
# diag_hi = diag + right (right = 0 under causal), diag = 0 for PyTorch's top-left alignment and
# Lk - Lq for flash-attn's bottom-right one (launcher: band()). Both edges are non-decreasing in i.
# Every tile range below derives from `visible` and these two edges.

@triton.jit
def visible(offs_m, offs_n, diag_lo, diag_hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: row offs_m sees key offs_n (key range checks are the caller's)."""
    ok = (offs_n[None, :] >= 0) & (offs_m[:, None] >= 0)  # all true, the same [M, N] shape
    if HAS_HI:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag_hi)
    if HAS_LO:
        ok = ok & (offs_n[None, :] >= offs_m[:, None] + diag_lo)
    return ok


@triton.jit
def attended(offs_m, offs_n, Lq, Lk, diag_lo, diag_hi, HAS_LO: tl.constexpr,
             HAS_HI: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: row offs_m (< Lq) sees key offs_n (< Lk): the checked tiles' rule."""
    return (offs_n[None, :] < Lk) & (offs_m[:, None] < Lq) & visible(offs_m, offs_n, diag_lo,
                                                                      diag_hi, HAS_LO, HAS_HI)


@triton.jit
def _tile_ranges(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Three loop bounds over tiles of BLOCK from the tile holding `lo` to `hi`: [a, b) and
    [c, hi) checked, [b, c) interior; full_lo / full_hi the first / last-plus-one element of the
    interior (b, c rounded inward to whole tiles)."""
    a = tl.maximum(lo, 0) // BLOCK * BLOCK
    b = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, a), tl.maximum(hi, a))
    c = tl.minimum(tl.maximum(full_hi // BLOCK * BLOCK, b), tl.maximum(hi, b))
    return a, b, c


@triton.jit
def kv_bounds(start_m, Lq, Lk, diag_lo, diag_hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the q tile starting at row start_m: (a, b, c, hi): the kv tiles to visit run from a to
    hi (the keys its rows see); those in [b, c) are interior - every key in range and visible to
    every row, so masked_scores may skip its checks -, those in [a, b) and [c, hi) are checked."""
    last = tl.minimum(start_m + BLOCK_M, Lq) - 1
    lo = 0
    full_lo = 0
    hi = Lk
    full_hi = Lk
    if HAS_LO:
        lo = start_m + diag_lo
        full_lo = last + diag_lo
    if HAS_HI:
        hi = tl.minimum(Lk, last + diag_hi + 1)
        full_hi = tl.minimum(Lk, start_m + diag_hi + 1)
    a, b, c = _tile_ranges(lo, full_lo, full_hi, hi, BLOCK_N)
    return a, b, c, hi


@triton.jit
def q_bounds(start_n, Lq, Lk, diag_lo, diag_hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the kv tile starting at key start_n: (a, b, c, hi): the q tiles with a row that sees
    one of its keys run from a to hi; those in [b, c) see all of them and need no check (query
    rows past Lq there contribute 0: their dO is zero-filled); the rest are checked, all of them
    when the kv tile is ragged."""
    last = tl.minimum(start_n + BLOCK_N, Lk) - 1
    lo = 0
    full_lo = 0
    hi = Lq
    full_hi = Lq + BLOCK_M  # the last, partial q tile too
    if HAS_HI:
        lo = start_n - diag_hi
        full_lo = start_n + BLOCK_N - 1 - diag_hi
    if HAS_LO:
        hi = tl.minimum(Lq, last - diag_lo + 1)
        full_hi = tl.minimum(Lq, start_n - diag_lo + 1)
    if start_n + BLOCK_N > Lk:  # keys past Lk read as 0: checked
        full_lo = hi
    a, b, c = _tile_ranges(lo, full_lo, full_hi, hi, BLOCK_M)
    return a, b, c, hi


# ---- scores: scale or softcap, ALiBi, the mask, the band --------------------------------------

# tanh(y) = y P(y^2) / Q(y^2) for |y| <= TANH_Y_MAX, +-1 in fp32 beyond: csrc/cpu/fit_tanh.py's
# fit, the CPU kernels' constants (row_ops.h, Softcap::kP / kQ; test_triton checks they agree).
TANH_Y_MAX = tl.constexpr(9.0)
TANH_P = (1.0, 0.13381094, 0.0034956688, 2.0610403e-05, 1.33564715e-08)
TANH_Q = (1.0, 0.4671441, 0.02587729, 0.00032857666, 7.777304e-07)
_P1, _P2, _P3, _P4 = (tl.constexpr(c) for c in TANH_P[1:])
_Q1, _Q2, _Q3, _Q4 = (tl.constexpr(c) for c in TANH_Q[1:])


@triton.jit
def tanh(x):
    """tanh in fp32 by the CPU kernels' rational fit (no libdevice call: the same code on every
    backend and the interpreter): relative error a few ulps at every |x|, where 1 - 2 / (e^2x + 1)
    lost digits to cancellation below |x| ~ 1 (softcap 30 over scores of a few: 3e-6 relative).
    NaN stays NaN."""
    y = tl.where(x > TANH_Y_MAX, TANH_Y_MAX, tl.where(x < -TANH_Y_MAX, -TANH_Y_MAX, x))
    u = y * y
    p = (((_P4 * u + _P3) * u + _P2) * u + _P1) * u + 1.0
    q = (((_Q4 * u + _Q3) * u + _Q2) * u + _Q1) * u + 1.0
    return y * p / q


@triton.jit
def scaled_scores(s, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """q.k products -> log2-domain scores: s * scale * log2(e), or with softcap (SOFTCAP)
    cap * tanh(s * scale / cap) * log2(e) (cap_in = scale / cap, cap_out = cap * log2(e)).
    Returns (scores, d score / d(scale * s)): 1 - tanh^2 under softcap, else a tile of ones
    (which the compiler folds away)."""
    if SOFTCAP:
        t = tanh(s * cap_in)
        scores = t * cap_out
        slope = 1.0 - t * t
    else:
        scores = s * qk_scale
        slope = tl.full(s.shape, 1.0, tl.float32)
    return scores, slope


@triton.jit
def mask_row_shift(mask_ptr, stride_mm, stride_mn, offs_m, Lq, Lk, lo, hi, diag_lo, diag_hi,
                   HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M]: each row's float-mask shift (SHIFT_MIN above) from its largest mask value over
    the keys it sees in [lo, hi) (NaN passed over; rows past Lq and rows that see nothing: 0)."""
    mx = tl.full([offs_m.shape[0]], float("-inf"), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ok = attended(offs_m, offs_n, Lq, Lk, diag_lo, diag_hi, HAS_LO, HAS_HI)
        mval = tl.load(mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                       mask=ok, other=float("-inf")).to(tl.float32)
        mval = tl.where(ok & (mval == mval), mval, float("-inf"))
        mx = tl.maximum(mx, tl.max(mval, 1))
    size = tl.abs(mx)
    return tl.where((size >= SHIFT_MIN) & (size <= SHIFT_LIMIT), mx, 0.0)


@triton.jit
def masked_scores(s, offs_m, offs_n, Lq, Lk, mask_ptr, stride_mm, stride_mn, diag_lo, diag_hi,
                  slope2, diag, mshift, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                  HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  CHECK: tl.constexpr):
    """log2-domain scores (scaled_scores) of a [BLOCK_M, BLOCK_N] tile with ALiBi (HAS_ALIBI:
    - slope * |i + diag - j|, slope2 = slope * log2(e)) and the user mask added, a float mask
    relative to each row's shift (mshift [BLOCK_M], mask_row_shift; zeros add it as it is); -inf
    where a key is not attended (outside the sequence, masked out, or outside the band).

    CHECK=False is the fast path for interior tiles: the caller guarantees that every key of the
    tile is inside the sequence and visible to every row, so only ALiBi and a user mask apply
    (the mask read with the rows bounded)."""
    if HAS_ALIBI:
        dist = (offs_m[:, None] + diag - offs_n[None, :]).to(tl.float32)
        s = s - slope2 * tl.abs(dist)
    if CHECK:
        valid = attended(offs_m, offs_n, Lq, Lk, diag_lo, diag_hi, HAS_LO, HAS_HI)
    if HAS_MASK:
        ptrs = mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        if CHECK:
            mval = tl.load(ptrs, mask=valid, other=0)
        else:
            mval = tl.load(ptrs, mask=offs_m[:, None] < Lq, other=0)
        if MASK_BOOL:
            s = tl.where(mval != 0, s, float("-inf"))
        else:
            mv = mval.to(tl.float32) - mshift[:, None]
            lim = tl.where(mv > MASK_LIMIT, MASK_LIMIT, tl.where(mv < -MASK_LIMIT, -MASK_LIMIT, mv))
            s = s + tl.where(mv == float("-inf"), mv, lim) * LOG2E
    if CHECK:
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def dropout_keep(seed, offset, row0, offs_m, offs_n, Lk, dropout_p):
    """Keep bits of a tile: element (row0 + i, key j) -> Philox(seed, offset + (row0 + i)*Lk + j),
    row0 the tile's first row among the call's B * H * Lq (dropout_row0)."""
    idx = (row0 + offs_m[:, None]).to(tl.int64) * Lk + offs_n[None, :] + offset
    return tl.rand(seed, idx) >= dropout_p
