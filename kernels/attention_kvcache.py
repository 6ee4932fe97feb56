"""Split-KV attention over a KV cache in Triton (flash_attn_with_kvcache on xpu / cuda tensors).

Grid: (splits, B * Hkv, cdiv(group * Lq, BLOCK_M)). A program takes rows of one kv head's query
group - its Hq / Hkv heads x Lq queries, head-major, so that decode's few rows share every K / V
load - and one split of its sequence's keys (`chunk` keys, a multiple of BLOCK_N), and writes
that split's normalised partial output and natural-log lse; attn_kvcache_combine_kernel then
combines each row's splits and its sink - flash-decoding, two launches per call. Keys are read
through the block table when PAGED (any block size: each key row's address from its own
block), as float8_e4m3fn bytes widened in registers when FP8 (integer bit manipulation, no fp8
instruction needed: the same code on every backend) and scaled by one scalar or one value per
kv head. The queries are the last Lq of the
sequence's keys (bottom-right alignment), their band and the variants as in the other kernels
(common.py). Every program writes its rows, an empty split as (0, -inf).
"""
import triton
import triton.language as tl

from .common import LOG2E, masked_scores, scaled_scores


@triton.jit
def e4m3_to_f32(byte):
    """float8_e4m3fn bytes (uint8) -> fp32, exactly as PyTorch converts them: normal values
    2^(e-7) * (1 + m/8) become the fp32 of exponent field e + 120 and mantissa m << 20;
    exponent 0 gives m * 2^-9; the two NaN bytes (0x7F, 0xFF) give NaN."""
    bits = byte.to(tl.uint32)
    mag = bits & 0x7F
    sign = (bits & 0x80) << 24
    normal = ((mag << 20) + (120 << 23)) | sign
    value = normal.to(tl.float32, bitcast=True)
    sub = (mag & 7).to(tl.float32) * 0.001953125
    value = tl.where(mag < 8, tl.where(sign != 0, -sub, sub), value)
    return tl.where(mag == 0x7F, float("nan"), value)


@triton.jit
def _cache_rows(BlockTable, b, offs_n, n_ok, stride_p, stride_t, page,
                PAGED: tl.constexpr):
    """Element offsets of the key rows offs_n of sequence b (its block b of a contiguous cache,
    or through its block table row when PAGED; rows past n_ok are never looked up)."""
    if PAGED:
        blk = tl.load(BlockTable + offs_n // page, mask=n_ok, other=0).to(tl.int64)
        return blk * stride_p + (offs_n % page).to(tl.int64) * stride_t
    else:
        return b.to(tl.int64) * stride_p + offs_n.to(tl.int64) * stride_t


@triton.jit
def _load_cache(ptrs, ok, scale, FP8: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr):
    """A K or V tile of the cache in the dot's dtype: float8 bytes widened and scaled (then
    rounded to q's dtype, as the CPU path's dequantised values), bf16 widened under UPCAST."""
    tile = tl.load(ptrs, mask=ok, other=0)
    if FP8:
        tile = e4m3_to_f32(tile) * scale
        if not UPCAST:
            tile = tile.to(DTYPE)
    elif UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def attn_kvcache_kernel(
    Q, Kc, Vc, BlockTable, SeqLens, OutP, LseP, Alibi, KScale, VScale,
    stride_qb, stride_qm, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_om, stride_os,
    stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah,
    Hq, Hkv, Lq, D, DV, page, chunk, band_lo, band_hi,
    qk_scale, cap_in, cap_out,
    PAGED: tl.constexpr, FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    split = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    group = Hq // Hkv
    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < group * Lq
    i = offs_r % Lq                    # the row's query
    h = hk * group + offs_r // Lq      # and its head
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    lk = tl.load(SeqLens + b)
    diag = lk - Lq                     # bottom-right: query i is key position i + lk - Lq
    diag_lo = diag + band_lo           # the band relative to that diagonal (Variants for lq = lk)
    diag_hi = diag + band_hi

    q = tl.load(Q + b * stride_qb + i[:, None] * stride_qm + h[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:  # one slope per row: the rows span the group's heads
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah, mask=row_ok,
                         other=0.0)[:, None] * LOG2E
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(KScale + hk * SCALE_PER_HEAD)
        v_scale = tl.load(VScale + hk * SCALE_PER_HEAD)

    # this split's keys that some row sees: [lo, hi), lo BLOCK_N-aligned like the split's start
    lo = split * chunk
    hi = tl.minimum(lo + chunk, lk)
    if HAS_HI:
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, i, 0), 0) + diag_hi + 1)
    if HAS_LO:
        first = tl.maximum(tl.min(tl.where(row_ok, i, Lq), 0) + diag_lo, 0)
        lo = tl.maximum(lo, first // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = BlockTable + b * stride_tb
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k_rows = _cache_rows(table, b, offs_n, n_ok, stride_kp, stride_kt, page, PAGED)
        v_rows = _cache_rows(table, b, offs_n, n_ok, stride_vp, stride_vt, page, PAGED)
        k = _load_cache(Kc + hk * stride_kh + k_rows[:, None] + offs_d[None, :],
                        n_ok[:, None] & (offs_d[None, :] < D), k_scale, FP8, UPCAST,
                        Q.dtype.element_ty)
        s, _ = scaled_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale,
                             cap_in, cap_out, SOFTCAP)
        s = masked_scores(s, i, offs_n, Lq, hi, Q, 0, 0, diag_lo, diag_hi, slope2, diag, 0.0,
                          False, False, HAS_LO, HAS_HI, HAS_ALIBI, True)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_cache(Vc + hk * stride_vh + v_rows[:, None] + offs_dv[None, :],
                        n_ok[:, None] & (offs_dv[None, :] < DV), v_scale, FP8, UPCAST,
                        Q.dtype.element_ty)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    rows = b * stride_ob + h * stride_oh + i * stride_om + split * stride_os
    tl.store(OutP + rows[:, None] + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LseP + b * stride_lb + h * stride_lh + i * stride_lm + split, lse, mask=row_ok)


@triton.jit
def attn_kvcache_combine_kernel(
    OutP, LseP, Sinks, Out, Lse,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    Hq, Lq, S, DV, ROWS,
    HAS_SINKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The splits of BLOCK_R query rows combined (each program the next BLOCK_R of the ROWS
    (b, h, i) rows of the contiguous (B, Hq, Lq, S[, DV]) partials): lse = log(sum_s e^lse_s
    (+ e^sink)), out = sum_s e^(lse_s - lse) out_s, written in q's dtype at Out[b, i, h] and
    Lse[b, h, i]; a row with nothing (no key, no sink) gets out 0, lse -inf. One launch instead
    of a chain of PyTorch ops: decode's whole call is a few microseconds of reading."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    b = rows // (Hq * Lq)
    h = (rows // Lq) % Hq
    i = rows % Lq
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = row_ok[:, None] & (offs_s[None, :] < S)
    lse_s = tl.load(LseP + rows[:, None] * S + offs_s[None, :], mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 1)
    if HAS_SINKS:
        sink = tl.load(Sinks + h, mask=row_ok, other=float("-inf"))
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe[:, None])
    total = tl.sum(w, 1)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    parts = tl.load(OutP + (rows[:, None, None] * S + offs_s[None, :, None]) * DV
                    + offs_dv[None, None, :],
                    mask=s_ok[:, :, None] & (offs_dv[None, None, :] < DV), other=0.0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(w[:, :, None] * parts, 1) / total_safe[:, None]
    dst = b * stride_ob + i * stride_om + h * stride_oh
    tl.store(Out + dst[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b * stride_lb + h * stride_lh + i,
             tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe)), mask=row_ok)
