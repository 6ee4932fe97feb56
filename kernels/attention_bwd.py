"""Flash-attention backward (FA2) in Triton, no float atomics:

  delta_i = sum_d dO[i,d] * O[i,d]                (computed by the launcher)
  (Q, K, V and dO tiles come through 2-D tensor descriptors, as in the forward.)
  dK/dV kernel, grid (cdiv(Lk, BLOCK_N), B * Hkv): one kv tile resident; loops over the query
      heads of its GQA group and over the q tiles; recomputes P = 2^(s - lse2), applies the
      forward's dropout keep-mask, dV += Pd^T dO, dS = P * (dP - delta) (times 1 - tanh^2
      under softcap), dK += dS^T Q.
  dQ kernel, grid (cdiv(Lq, BLOCK_M), B * Hq): one q tile resident; loops over the kv tiles;
      dQ += dS K.
  Packed (varlen) calls: the same kernels over (1, H, total, D) tensors, axis 1 over
      (sequence, head), each program's rows from cu_seqlens (common.sequence), as the forward.
  DELTA has LSE's layout (the launcher's); SHIFT (MASK_SHIFT) the forward's (M, m) per row,
      2 floats (attention_fwd.py): the float-mask shift and the log2-domain max LSE is then
      relative to.
Every gradient is accumulated in fp32 and written once (dK, dQ scaled by the softmax scale). The
band, softcap, ALiBi and the mask as in the forward (common.py); the sinks' gradient,
-sum_i exp(sink - lse_i) delta_i, is the launcher's (O(Lq) work).
"""
import triton
import triton.language as tl

from .common import (LOG2E, dropout_keep, dropout_row0, kv_bounds, load_block, masked_scores,
                     q_bounds, scaled_scores, sequence, tile_desc)


@triton.jit
def row_shift(shift_base, offs_m, stride_lm, Lq, MASK_SHIFT: tl.constexpr):
    """([BLOCK_M], [BLOCK_M]): the rows' float-mask shift M and the log2-domain max m their LSE
    is relative to, as the forward stored them (MASK_SHIFT), else 0 and 0."""
    if MASK_SHIFT:
        ptrs = shift_base + 2 * offs_m * stride_lm
        return (tl.load(ptrs, mask=offs_m < Lq, other=0.0),
                tl.load(ptrs + 1, mask=offs_m < Lq, other=0.0))
    zero = tl.zeros([offs_m.shape[0]], tl.float32)
    return zero, zero


@triton.jit
def _tile_ds(q, k, v, do, lse2, delta, offs_m, offs_n, Lq, Lk, qk_scale, cap_in, cap_out,
             mask_base, stride_mm, stride_mn, diag_lo, diag_hi, slope2, diag, mshift, mref,
             dropout_p, seed, rng_offset, rng_row0, rng_cols, HAS_MASK: tl.constexpr,
             MASK_BOOL: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
             PRECISION: tl.constexpr, CHECK: tl.constexpr):
    """P (dropped out, for dV) and dS of one (q tile, kv tile) pair, both [BLOCK_M, BLOCK_N].
    CHECK=False for interior tiles (see masked_scores); query rows past Lq, zero-filled by the
    descriptors with lse = delta = 0, then contribute exactly 0 to dK, dV and dQ."""
    s, dcap = scaled_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale,
                            cap_in, cap_out, SOFTCAP)
    s = masked_scores(s, offs_m, offs_n, Lq, Lk, mask_base, stride_mm, stride_mn, diag_lo,
                      diag_hi, slope2, diag, mshift, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI,
                      HAS_ALIBI, CHECK)
    # P = 2^((s - m) - lse2) <= 1 (masked -> 0), lse2 relative to m (row_shift; 0 without).
    # Given an unshifted float mask (aten's autograd keeps only the logsumexp), a row at one huge
    # mask value has scores rounded apart from its logsumexp by far more than 1: capped at 1
    # (such rows' gradients are off, as PyTorch's, rather than inf). NaN stays NaN.
    x = (s - mref[:, None]) - lse2[:, None]
    p = tl.math.exp2(tl.where(x > 0.0, 0.0, x))
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        keep = dropout_keep(seed, rng_offset, rng_row0, offs_m, offs_n, rng_cols, dropout_p)
        pd = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    else:
        pd = p
    ds = p * (dp - delta[:, None]) * dcap
    return pd, ds


@triton.jit
def _dkdv_tile(q_desc, do_desc, start_m, k, v, dk, dv, offs_n, lse_base, delta_base, shift_base,
               stride_lm, Lq, Lk, qk_scale, cap_in, cap_out, mask_base, stride_mm, stride_mn,
               diag_lo, diag_hi, slope2, diag, dropout_p, seed, rng_offset, rng_row0, rng_cols,
               HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_SHIFT: tl.constexpr,
               HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, CHECK: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_block(q_desc, start_m, UPCAST)
    do = load_block(do_desc, start_m, UPCAST)
    lse2 = tl.load(lse_base + offs_m * stride_lm, mask=offs_m < Lq, other=0.0) * LOG2E
    delta = tl.load(delta_base + offs_m * stride_lm, mask=offs_m < Lq, other=0.0)
    mshift, mref = row_shift(shift_base, offs_m, stride_lm, Lq, MASK_SHIFT)
    pd, ds = _tile_ds(q, k, v, do, lse2, delta, offs_m, offs_n, Lq, Lk, qk_scale, cap_in,
                      cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi, slope2, diag,
                      mshift, mref, dropout_p, seed, rng_offset, rng_row0, rng_cols, HAS_MASK,
                      MASK_BOOL, HAS_LO, HAS_HI, SOFTCAP, HAS_ALIBI, DROPOUT, PRECISION, CHECK)
    dv = tl.dot(tl.trans(pd).to(do.dtype), do, dv, input_precision=PRECISION)
    dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, Mask, DO, LSE, DELTA, SHIFT, DK, DV_, Alibi, CuQ, CuK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm, stride_ab, stride_ah,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, Lq, Lk, D, DV, diag_lo, diag_hi, diag,
    qk_scale, cap_in, cap_out, sm_scale, dropout_p, seed, rng_offset,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_SHIFT: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    group = Hq // Hkv
    start_n = pid_n * BLOCK_N
    bt, q0, k0, lq, lk, diag_lo, diag_hi, diag = sequence(CuQ, CuK, b, Lq, Lk, diag_lo, diag_hi,
                                                          diag, VARLEN)
    if start_n >= lk:  # a packed call's surplus tiles (the grid covers the longest sequence)
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_desc = tile_desc(K + bt * stride_kb + hk * stride_kh + k0 * stride_kn, lk, D, stride_kn,
                       BLOCK_N, BLOCK_D)
    v_desc = tile_desc(V + bt * stride_vb + hk * stride_vh + k0 * stride_vn, lk, DV, stride_vn,
                       BLOCK_N, BLOCK_DV)
    k = load_block(k_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_D]
    v = load_block(v_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # the q tiles at the band's edges ([a, b) and [c, hi)) are checked, the interior ones not
    a, b_, c, hi = q_bounds(start_n, lq, lk, diag_lo, diag_hi, HAS_LO, HAS_HI, BLOCK_M, BLOCK_N)
    for g in range(0, group):
        h = hk * group + g
        q_desc = tile_desc(Q + bt * stride_qb + h * stride_qh + q0 * stride_qm, lq, D, stride_qm,
                           BLOCK_M, BLOCK_D)
        do_desc = tile_desc(DO + bt * stride_dob + h * stride_doh + q0 * stride_dom, lq, DV,
                            stride_dom, BLOCK_M, BLOCK_DV)
        mask_base = Mask + bt * stride_mb + h * stride_mh
        row = bt * stride_lb + h * stride_lh + q0 * stride_lm  # LSE, DELTA and SHIFT alike
        rng_row0 = dropout_row0(bt, h, Hq, Lq, q0)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
        n_lo = tl.cdiv(b_ - a, BLOCK_M)  # the edge tiles: [a, b_) then [c, hi)
        for t in range(0, n_lo + tl.cdiv(hi - c, BLOCK_M)):
            start_m = tl.where(t < n_lo, a + t * BLOCK_M, c + (t - n_lo) * BLOCK_M)
            dk, dv = _dkdv_tile(q_desc, do_desc, start_m, k, v, dk, dv, offs_n, LSE + row,
                                DELTA + row, SHIFT + 2 * row, stride_lm, lq, lk, qk_scale,
                                cap_in,
                                cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi,
                                slope2, diag, dropout_p, seed, rng_offset, rng_row0, Lk,
                                HAS_MASK, MASK_BOOL, MASK_SHIFT, HAS_LO, HAS_HI, SOFTCAP,
                                HAS_ALIBI, DROPOUT, UPCAST, PRECISION, True, BLOCK_M)
        for start_m in range(b_, c, BLOCK_M):
            dk, dv = _dkdv_tile(q_desc, do_desc, start_m, k, v, dk, dv, offs_n, LSE + row,
                                DELTA + row, SHIFT + 2 * row, stride_lm, lq, lk, qk_scale,
                                cap_in,
                                cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi,
                                slope2, diag, dropout_p, seed, rng_offset, rng_row0, Lk,
                                HAS_MASK, MASK_BOOL, MASK_SHIFT, HAS_LO, HAS_HI, SOFTCAP,
                                HAS_ALIBI, DROPOUT, UPCAST, PRECISION, False, BLOCK_M)

    n_ok = offs_n[:, None] < lk
    rows_k = k0 + offs_n[:, None]
    tl.store(DK + bt * stride_dkb + hk * stride_dkh + rows_k * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok & (offs_d[None, :] < D))
    tl.store(DV_ + bt * stride_dvb + hk * stride_dvh + rows_k * stride_dvn + offs_dv[None, :],
             dv.to(DV_.dtype.element_ty), mask=n_ok & (offs_dv[None, :] < DV))


@triton.jit
def _dq_tile(q, do, lse2, delta, k_desc, v_desc, start_n, dq, offs_m, Lq, Lk, qk_scale,
             cap_in, cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi, slope2, diag,
             mshift, mref, dropout_p, seed, rng_offset, rng_row0, rng_cols,
             HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_LO: tl.constexpr,
             HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
             DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
             CHECK: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_block(k_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_D]
    v = load_block(v_desc, start_n, UPCAST)                           # [BLOCK_N, BLOCK_DV]
    _, ds = _tile_ds(q, k, v, do, lse2, delta, offs_m, offs_n, Lq, Lk, qk_scale, cap_in,
                     cap_out, mask_base, stride_mm, stride_mn, diag_lo, diag_hi, slope2, diag,
                     mshift, mref, dropout_p, seed, rng_offset, rng_row0, rng_cols, HAS_MASK,
                     MASK_BOOL, HAS_LO, HAS_HI, SOFTCAP, HAS_ALIBI, DROPOUT, PRECISION, CHECK)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, Mask, DO, LSE, DELTA, SHIFT, DQ, Alibi, CuQ, CuK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm, stride_ab, stride_ah,
    stride_dqb, stride_dqh, stride_dqm,
    Hq, Hkv, Lq, Lk, D, DV, diag_lo, diag_hi, diag,
    qk_scale, cap_in, cap_out, sm_scale, dropout_p, seed, rng_offset,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_SHIFT: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hkv)
    start_m = pid_m * BLOCK_M
    bt, q0, k0, lq, lk, diag_lo, diag_hi, diag = sequence(CuQ, CuK, b, Lq, Lk, diag_lo, diag_hi,
                                                          diag, VARLEN)
    if start_m >= lq:  # a packed call's surplus tiles, as in the forward
        return
    rng_row0 = dropout_row0(bt, h, Hq, Lq, q0)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_desc = tile_desc(Q + bt * stride_qb + h * stride_qh + q0 * stride_qm, lq, D, stride_qm,
                       BLOCK_M, BLOCK_D)
    do_desc = tile_desc(DO + bt * stride_dob + h * stride_doh + q0 * stride_dom, lq, DV,
                        stride_dom, BLOCK_M, BLOCK_DV)
    q = load_block(q_desc, start_m, UPCAST)
    do = load_block(do_desc, start_m, UPCAST)
    row = bt * stride_lb + h * stride_lh + q0 * stride_lm  # LSE, DELTA and SHIFT alike
    lse2 = tl.load(LSE + row + offs_m * stride_lm, mask=offs_m < lq, other=0.0) * LOG2E
    delta = tl.load(DELTA + row + offs_m * stride_lm, mask=offs_m < lq, other=0.0)
    mshift, mref = row_shift(SHIFT + 2 * row, offs_m, stride_lm, lq, MASK_SHIFT)
    k_desc = tile_desc(K + bt * stride_kb + hk * stride_kh + k0 * stride_kn, lk, D, stride_kn,
                       BLOCK_N, BLOCK_D)
    v_desc = tile_desc(V + bt * stride_vb + hk * stride_vh + k0 * stride_vn, lk, DV, stride_vn,
                       BLOCK_N, BLOCK_DV)
    mask_base = Mask + bt * stride_mb + h * stride_mh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    a, b_, c, hi = kv_bounds(start_m, lq, lk, diag_lo, diag_hi, HAS_LO, HAS_HI, BLOCK_M,
                             BLOCK_N)  # as the forward
    n_lo = tl.cdiv(b_ - a, BLOCK_N)  # the edge tiles: [a, b_) then [c, hi)
    for t in range(0, n_lo + tl.cdiv(hi - c, BLOCK_N)):
        start_n = tl.where(t < n_lo, a + t * BLOCK_N, c + (t - n_lo) * BLOCK_N)
        dq = _dq_tile(q, do, lse2, delta, k_desc, v_desc, start_n, dq, offs_m, lq, lk,
                      qk_scale, cap_in, cap_out, mask_base, stride_mm, stride_mn, diag_lo,
                      diag_hi, slope2, diag, mshift, mref, dropout_p, seed, rng_offset,
                      rng_row0, Lk, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI, SOFTCAP, HAS_ALIBI,
                      DROPOUT, UPCAST, PRECISION, True, BLOCK_N)
    for start_n in range(b_, c, BLOCK_N):
        dq = _dq_tile(q, do, lse2, delta, k_desc, v_desc, start_n, dq, offs_m, lq, lk,
                      qk_scale, cap_in, cap_out, mask_base, stride_mm, stride_mn, diag_lo,
                      diag_hi, slope2, diag, mshift, mref, dropout_p, seed, rng_offset,
                      rng_row0, Lk, HAS_MASK, MASK_BOOL, HAS_LO, HAS_HI, SOFTCAP, HAS_ALIBI,
                      DROPOUT, UPCAST, PRECISION, False, BLOCK_N)

    tl.store(DQ + bt * stride_dqb + h * stride_dqh + (q0 + offs_m[:, None]) * stride_dqm
             + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < lq) & (offs_d[None, :] < D))
