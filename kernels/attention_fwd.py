"""Flash-attention forward (FA2) in Triton.

Grid: (cdiv(Lq, BLOCK_M), B * Hq), the tile index on axis 0; a packed (varlen) call's grid is
(cdiv(max_seqlen_q, BLOCK_M), num_sequences * Hq), each program finding its sequence's rows in
cu_seqlens (common.sequence), no padding. One Q tile stays resident; the kv blocks stream
through an online softmax in the log2 domain (running max m, running sum l, fp32 accumulator,
`acc = tl.dot(p, v, acc)`); the natural-log LSE is stored for the backward. The dot operands
come through 2-D tensor descriptors (one per (sequence, head) slice; out-of-range rows and
columns read as 0, so ragged lengths need no padding and a sequence never reads its
neighbour's rows). Each row sees a band of keys (common.py:
causal, windows, either alignment): kv tiles outside a q tile's band are never visited. GQA maps
query head h to kv head h // (Hq // Hkv). Masks are read through their (possibly zero) strides.
The variants (softcap, ALiBi, sinks) follow ../shared/api-variants-serving.md: a sink starts
each row's softmax state at (m, l) = (sink, 1). Interior tiles run without the bound and band
checks (a middle loop), only the tiles at the band's edges pay for them. Rows with nothing to
attend to give 0 (and LSE lse_empty). A float mask (MASK_SHIFT) enters each row relative to its
shift M (common.mask_row_shift, found by a pass over the row's visible mask values first), and
the row's state goes out in two parts: SHIFT [.., 2] = (M, m), m the final running max (log2
domain), and LSE = ln(l), so that lse = LSE + ln(2) m + M and the backward's P = 2^((s - m) -
log2(l)) loses nothing to the size of m (finfo.min fills: m near -3.4e38).
"""
import triton
import triton.language as tl

from .common import (LOG2E, dropout_keep, dropout_row0, kv_bounds, load_block, mask_row_shift,
                     masked_scores, scaled_scores, sequence, tile_desc)


@triton.jit
def _fwd_tile(q, k_desc, v_desc, start_n, m_i, l_i, acc, offs_m, Lq, Lk, qk_scale, cap_in,
              cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi, slope2, diag, mshift,
              dropout_p, seed, rng_offset, rng_row0, rng_cols,
              HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_LO: tl.constexpr,
              HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              CHECK: tl.constexpr, BLOCK_N: tl.constexpr):
    """One kv tile of the online softmax: returns the updated (m, l, acc)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_block(k_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_D]
    s, _ = scaled_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, cap_in,
                         cap_out, SOFTCAP)
    s = masked_scores(s, offs_m, offs_n, Lq, Lk, mask_base, stride_mm, stride_mn, diag_lo,
                      diag_hi, slope2, diag, mshift, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI,
                      HAS_ALIBI, CHECK)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: P = 0
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        keep = dropout_keep(seed, rng_offset, rng_row0, offs_m, offs_n, rng_cols, dropout_p)
        p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
    v = load_block(v_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_DV]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Mask, O, LSE, SHIFT, Alibi, Sinks, CuQ, CuK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm, stride_ab, stride_ah,
    Hq, Hkv, Lq, Lk, D, DV, diag_lo, diag_hi, diag,
    qk_scale, cap_in, cap_out, lse_empty, dropout_p, seed, rng_offset,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_SHIFT: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hkv)
    start_m = pid_m * BLOCK_M
    # a packed call's grid covers its longest sequence: the shorter ones' surplus tiles stop here
    bt, q0, k0, lq, lk, diag_lo, diag_hi, diag = sequence(CuQ, CuK, b, Lq, Lk, diag_lo, diag_hi,
                                                          diag, VARLEN)
    if start_m >= lq:
        return
    rng_row0 = dropout_row0(bt, h, Hq, Lq, q0)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_desc = tile_desc(Q + bt * stride_qb + h * stride_qh + q0 * stride_qm, lq, D, stride_qm,
                       BLOCK_M, BLOCK_D)
    k_desc = tile_desc(K + bt * stride_kb + hk * stride_kh + k0 * stride_kn, lk, D, stride_kn,
                       BLOCK_N, BLOCK_D)
    v_desc = tile_desc(V + bt * stride_vb + hk * stride_vh + k0 * stride_vn, lk, DV, stride_vn,
                       BLOCK_N, BLOCK_DV)
    mask_base = Mask + bt * stride_mb + h * stride_mh
    q = load_block(q_desc, start_m, UPCAST)

    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    # the band's edge tiles are checked ([a, b) and [c, hi)), the interior ones are not
    a, b_, c, hi = kv_bounds(start_m, lq, lk, diag_lo, diag_hi, HAS_LO, HAS_HI, BLOCK_M, BLOCK_N)
    mshift = tl.zeros([BLOCK_M], tl.float32)
    if MASK_SHIFT:
        mshift = mask_row_shift(mask_base, stride_mm, stride_mn, offs_m, lq, lk, a, hi, diag_lo,
                                diag_hi, HAS_LO, HAS_HI, BLOCK_N)
    if HAS_SINKS:  # the sink as a key of score `sink` and no value: (m, l) = (sink, 1)
        m_i = (tl.load(Sinks + h) - mshift) * LOG2E  # (in the row's shift)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    n_lo = tl.cdiv(b_ - a, BLOCK_N)  # the edge tiles: [a, b_) then [c, hi)
    for t in range(0, n_lo + tl.cdiv(hi - c, BLOCK_N)):
        start_n = tl.where(t < n_lo, a + t * BLOCK_N, c + (t - n_lo) * BLOCK_N)
        m_i, l_i, acc = _fwd_tile(q, k_desc, v_desc, start_n, m_i, l_i, acc, offs_m, lq, lk,
                                  qk_scale, cap_in, cap_out, mask_base, stride_mm, stride_mn,
                                  diag_lo, diag_hi, slope2, diag, mshift, dropout_p, seed,
                                  rng_offset, rng_row0, Lk, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI,
                                  SOFTCAP, HAS_ALIBI, DROPOUT, UPCAST, PRECISION, True, BLOCK_N)
    for start_n in range(b_, c, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(q, k_desc, v_desc, start_n, m_i, l_i, acc, offs_m, lq, lk,
                                  qk_scale, cap_in, cap_out, mask_base, stride_mm, stride_mn,
                                  diag_lo, diag_hi, slope2, diag, mshift, dropout_p, seed,
                                  rng_offset, rng_row0, Lk, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI,
                                  SOFTCAP, HAS_ALIBI, DROPOUT, UPCAST, PRECISION, False, BLOCK_N)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    m_ref = tl.where(empty, 0.0, m_i)
    if MASK_SHIFT:  # the log2-domain max goes to SHIFT, LSE keeps ln(l)
        m_i = tl.zeros([BLOCK_M], tl.float32)
    lse = tl.where(empty, lse_empty,
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = (O + bt * stride_ob + h * stride_oh + q0 * stride_om + offs_m[:, None] * stride_om
              + offs_dv[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < lq) & (offs_dv[None, :] < DV))
    row = bt * stride_lb + h * stride_lh + (q0 + offs_m) * stride_lm  # SHIFT: 2 floats a row
    tl.store(LSE + row, lse, mask=offs_m < lq)
    if MASK_SHIFT:
        tl.store(SHIFT + 2 * row, mshift, mask=offs_m < lq)
        tl.store(SHIFT + 2 * row + 1, m_ref, mask=offs_m < lq)


@triton.jit
def dropout_mask_kernel(Keep, Lq, Lk, dropout_p, seed, rng_offset,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keep-mask the attention kernels apply, written out as uint8 [B*H, Lq, Lk] (tests and
    debugging only: O(L * S))."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    for start_n in range(0, Lk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, rng_offset, bh * Lq, offs_m, offs_n, Lk, dropout_p)
        ptrs = Keep + (bh * Lq + offs_m[:, None]).to(tl.int64) * Lk + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
