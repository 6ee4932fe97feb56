// Blocked flash-attention backward (FA2), written once for every tier.
//
// With s = log2(e) * (scale * Q K^T + mask - M) and each row's log2-domain logsumexp from the
// forward as m + log2(1 / inv_l) (row_norm: its stats hi + lo and mask shift M, or
// log2(e) * lse and M = 0):
//   P    = 2^(s - m) * inv_l                  recomputed per tile, never stored
//   Pd   = P * Z / (1 - p)                    Z: the forward's dropout keep bits (Philox)
//   dV  += Pd^T dO
//   dPd  = dO V^T;  dP = dPd * Z / (1 - p)
//   dS   = P * (dP - delta),  delta_i = sum_d dO[i,d] * O[i,d]
//   dQ  += scale * dS K;      dK += scale * dS^T Q
// Phases, each a parallel loop over independent items so that no two threads ever add into
// the same gradient row (deterministic at any thread count, no atomics):
//   BwdDelta: delta for every (b, h, row)
//   BwdDkDv:  item (b, hkv, kv-block); loops over the group's query heads and all q blocks
//   BwdDq:    item (b, h, q-block); loops over the kv blocks
// or the single pass (run_fused below), whose items compute their own rows' delta as well
// (bwd_fused_owns_delta: BwdDelta runs first only with sinks).
// All accumulation is fp32 in per-thread scratch, converted to the gradient dtype once.
// With counting on, each item's steps are timed (StepClock: PathCounters::bwd_*_ns): operand
// copies and panels (pack), S and P (s), dP and dS (dp), the dK / dV GEMMs (dkdv), the dQ GEMM
// (dq), and delta, the accumulators zeroed and the gradients stored (rows).
#pragma once
#include "flash_common.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

template <class Ops, class T>
struct FlashBackward {
  // One thread's buffers over its scratch (null: sizes only, in total).
  struct Layout {
    int ldq, lddo, lds, ldd, lddv;
    float *q, *qp, *dO, *dop, *kt, *vt, *kp, *s, *pd, *dp, *dk, *dv, *dq, *mask, *a16, *dcap, *rn;
    int32_t* mask_slot;
    int64_t total;
    Layout(const AttnParams& p, const Blocks& bl, float* scratch = nullptr) {
      const int64_t bkp = round_up(bl.bk, Ops::NR);
      const int64_t dp_ = round_up(p.D, Ops::NR);
      const int64_t dvp = round_up(p.Dv, Ops::NR);
      ldq = int(p.D);
      lddo = int(p.Dv);
      lds = int(bkp);
      ldd = int(dp_);
      lddv = int(dvp);
      Carve c{scratch};
      const int64_t copy = in_place(p) ? 0 : 1;  // the copies in_place reads where they lie
      q = c.take(int64_t(bl.bq) * p.D);     // Q_blk rows (A operand)
      qp = c.take(copy * bl.bq * dp_);      // Q_blk panels (B operand of dK += dS^T Q)
      dO = c.take(copy * bl.bq * p.Dv);     // dO_blk rows (A operand of dP = dO V^T)
      dop = c.take(copy * bl.bq * dvp);     // dO_blk panels (B operand of dV += Pd^T dO)
      kt = c.take(bkp * p.D);               // K_blk^T panels (S = Q K^T)
      vt = c.take(bkp * p.Dv);              // V_blk^T panels (dP = dO V^T)
      kp = c.take(copy * bl.bk * dp_);      // K_blk panels (dQ += dS K)
      s = c.take(int64_t(bl.bq) * bkp);     // P (bf16 sdp tiles: P^T's pairs)
      pd = c.take(int64_t(bl.bq) * bkp);    // dropped-out P (dropout; bf16 sdp tiles: dS^T's)
      dp = c.take(int64_t(bl.bq) * bkp);    // dP, then dS (bf16 sdp tiles: dS's bf16 rows)
      dk = c.take(int64_t(bl.bk) * dp_);    // dK accumulator
      dv = c.take(int64_t(bl.bk) * dvp);    // dV accumulator
      dq = c.take(int64_t(bl.bq) * dp_);    // dQ accumulator
      mask = c.take(int64_t(bl.bq) * bkp);
      mask_slot = reinterpret_cast<int32_t*>(c.take(bl.bq));  // (MaskTile)
      a16 = c.take(caps<Ops>().prep_a ? int64_t(bl.bq) * bkp : 0);
      dcap = c.take(p.softcap != 0.0f ? int64_t(bl.bq) * bkp : 0);  // softcap's derivative
      rn = c.take(3 * int64_t(bl.bq));      // per row: m, inv_l, delta (fused_rows)
      total = c.total;
    }
  };
  static int64_t scratch_floats(const AttnParams& p, const Blocks& bl) {
    return Layout(p, bl).total;
  }

  // ---- phase BwdDelta: delta = rowsum(dO * O) ---------------------------------------------------
  static int64_t delta_items(const AttnParams& p, const Blocks& bl) {
    return p.B * p.Hq * ceil_div(p.Lq, bl.bq);
  }
  // delta of rows [i0, i0 + n) of head h; returns the sinks' dS summed over them (0 without).
  static float delta_rows(const AttnParams& p, int64_t b, int64_t h, int64_t i0, int64_t n) {
    float dsink = 0.0f;
    for (int64_t i = i0; i < i0 + n; ++i) {
      const float delta = Ops::Row::dot_row(do_row<T>(p, b, h, i), o_crow<T>(p, b, h, i),
                                            int(p.Dv));
      *delta_ptr(p, b, h, i) = delta;
      // the sink's dS: P_sink * (0 - delta), its value being 0
      if (p.sinks) {
        const RowNorm n = row_norm(p, b, h, i);
        dsink -= exp2_poly(sink_log2(p, h, n.shift) - n.m) * n.inv_l * delta;
      }
    }
    return dsink;
  }
  static void run_delta(const AttnParams& p, const Blocks& bl, int64_t item) {
    StepClock clock(p);
    const QItem it(p, bl, item);
    const float dsink = delta_rows(p, it.b, it.h, it.i0, it.nq);
    if (p.sinks) p.dsink_part[item] = dsink;
    clock.lap(&PathCounters::bwd_rows_ns);
  }

  // fp32 inputs on a trait whose GEMMs read B in place (gemm_strided_b), head dims of whole
  // panels: dO (A of dP, B of dV), Q (B of dK) and K (B of dQ) are read where they lie, so only
  // the scaled copy of Q and the K^T / V^T panels are made (a row's numbers are the same either
  // way: the copies are exact). Otherwise load_q_side / load_kv_side make them all.
  static bool in_place(const AttnParams& p) {
    if constexpr (caps<Ops>().transposed_s && std::is_same_v<T, float>)
      return p.D % Ops::NR == 0 && p.Dv % Ops::NR == 0;
    return false;
  }
  // dO_blk's rows as an A operand: in place, or the copy load_q_side made.
  static const float* do_a(const AttnParams& p, const Layout& L, int64_t b, int64_t h,
                           int64_t i0, int* ld) {
    if (in_place(p)) {
      *ld = int(p.do_sl);
      return reinterpret_cast<const float*>(do_row<T>(p, b, h, i0));
    }
    *ld = L.lddo;
    return L.dO;
  }

  // One (q block x kv block) tile: recompute P (in s), Pd (in pd, dropout only), dP and dS (in dp).
  // Needs the q side (load_q_side) and the K^T, V^T panels (load_kv_side) loaded. Returns false
  // when every row of the tile is masked (nothing to add). On a tile a band's edge crosses, rows
  // only compute their group's columns (VisTile) and the columns outside them are 0 (the dK / dV
  // gemms read P and dS by column). A softcap multiplies dS by its derivative (L.dcap).
  struct Tile {
    const float* pd;  // the P that multiplies dO for dV (dropped out, or P itself)
    const float* ds;  // dS
    // or, from gemm_sdp_loop (p.fused_sdp), the A operands themselves, ld L.lds: P^T and dS^T
    // (of the dV, dK GEMMs) and dS (of dQ); null otherwise
    const float *pt_a = nullptr, *dst_a = nullptr, *ds_a = nullptr;
  };
  static bool tile_ds(const AttnParams& p, const Layout& L, int64_t b, int64_t h,
                      int64_t i0, int nq, int64_t j0, int nk, Tile* tile, StepClock& clock) {
    float *s = L.s, *pd = L.pd, *dp = L.dp;
    // (each row's mask shift: the forward's, in its stats; without them none, as row_norm)
    MaskTile mt{L.mask, L.mask_slot, L.lds,
                p.stats ? stats_ptr(p, b, h, i0) + AttnParams::kStatShift : nullptr, p.st_sl};
    const bool dropout = p.dropout_p > 0.0f;
    const uint64_t bh = uint64_t(b * p.Hq + h);
    const VisTile ct = Visibility::of(p).tile(i0, nq, j0, nk, Ops::MR);
    count_path(p, &PathCounters::bwd_tiles, 1);
    tile->pd = dropout ? pd : s;
    tile->ds = dp;
    if (fused_rows(p, L, b, h, i0, nq, nk, ct, tile, clock)) return true;

    // S = Q_blk K_blk^T, then P = 2^(s - m) * inv_l
    Ops::template gemm<false>(nq, nk, int(p.D), L.q, L.ldq, L.kt, p.D * Ops::NR, s,
                              L.lds, false, ct.limit_n());
    const float* mtile = mt.fill(p, b, h, i0, nq, j0, nk);
    bool any = false;
    for (int r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const int w = ct.width(r);
      float* srow = s + int64_t(r) * L.lds;
      RowScore rs = row_score(p, b, h, i, j0, caps<Ops>().scale_in_a ? 1.0f : p.scale * kLog2e,
                              mt.row(mtile, r));
      rs.lo = ct.first(r), rs.hi = ct.cols(r);
      if (p.softcap != 0.0f) rs.dcap = L.dcap + int64_t(r) * L.lds;
      const float mx = Ops::Row::score_row(srow, w, rs);
      if (mx == kNegInf) {
        for (int c = 0; c < w; ++c) srow[c] = 0.0f;
      } else {
        any = true;
        // P = 2^(s - m) * inv_l <= 1. Without stats, a row whose scores all sit at one huge
        // constant (a finfo.min mask on every key) has an fp32 logsumexp that absorbed log(l)
        // and, back in the log2 domain, can land below the scores by far more than 1: no P
        // above 1 (such rows get gradients up to l times too large, as with PyTorch's fused
        // kernel, not overflow). With stats m is hi, within half an ulp of the exact lse, and
        // no clamp: moving it to the row max would cost the very ulp the stats keep.
        const RowNorm n = row_norm(p, b, h, i);
        Ops::Row::exp2_row_sum(srow, w, p.stats || n.m >= mx ? n.m : mx);
        if (n.inv_l != 1.0f) Ops::Row::scale_row(srow, w, n.inv_l);
      }
      for (int c = w; c < nk; ++c) srow[c] = 0.0f;
      if (dropout) Ops::dropout_row(p, bh, i, j0, nk, srow, pd + int64_t(r) * L.lds);
    }
    clock.lap(&PathCounters::bwd_s_ns);
    if (!any) return false;

    // dP = dO_blk V_blk^T; dS = P * (dP * Z / (1-p) - delta), in place of dP
    int lddo;
    const float* dO = do_a(p, L, b, h, i0, &lddo);
    Ops::template gemm<false>(nq, nk, int(p.Dv), dO, lddo, L.vt, p.Dv * Ops::NR, dp, L.lds,
                              false, ct.limit_n());
    for (int r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const int w = ct.width(r);
      const int f = int(min64(ct.group_first(r), w));  // dP's columns: [f, w)
      float* srow = s + int64_t(r) * L.lds;
      float* dprow = dp + int64_t(r) * L.lds;
      if (dropout) Ops::dropout_row(p, bh, i, j0, w, dprow, dprow);
      const float* dcap = p.softcap != 0.0f ? L.dcap + int64_t(r) * L.lds + f : nullptr;
      Ops::Row::ds_row(srow + f, dprow + f, w - f, *delta_ptr(p, b, h, i), dcap);
      for (int c = 0; c < f; ++c) dprow[c] = 0.0f;
      for (int c = w; c < nk; ++c) dprow[c] = 0.0f;
    }
    clock.lap(&PathCounters::bwd_dp_ns);
    return true;
  }

  // tile_ds for traits whose GEMMs run on their micro-tiles (fused_bwd_rows), when the policy
  // allows it (p.fused_rows), on tiles of whole panels whose scores are the scaled products
  // alone (no mask, dropout, softcap or ALiBi; a band only cuts them) and whose rows all have
  // the forward's stats, fit to be the reference (fused_ref_ok; a row that sees nothing takes
  // tile_ds's own path): P = 2^(s - m) * inv_l and dS = P * (dP - delta) are made from each
  // S / dP GEMM tile while it is in L1 (gemm_rows_then, 0 off the band) instead of by passes
  // over the rows. With p.fused_sdp on a trait with bwd_sdp (and D == Dv), S and dP run in one
  // pass whose tiles make P and dS in registers and store them as the dV, dK and dQ GEMMs'
  // operands (gemm_sdp_loop; on the bf16 trait rounded into its bf16 formats, without the
  // three prep_a passes, P's exponent there its bf16 one; on fp32 ones the two passes' P and
  // dS bit for bit, without their tiles' store and reload); the step's time counts under s.
  // Returns whether it ran.
  static bool fused_rows(const AttnParams& p, const Layout& L, int64_t b, int64_t h,
                         int64_t i0, int nq, int nk, const VisTile& ct, Tile* tile,
                         StepClock& clock) {
    if constexpr (!fused_bwd_rows<Ops>()) {
      return false;
    } else {
      if (!p.fused_rows || !p.stats || p.mask_type != MaskType::None || p.dropout_p > 0.0f ||
          p.softcap != 0.0f || p.alibi || nk % Ops::NR != 0)
        return false;
      float *m = L.rn, *inv_l = m + nq, *delta = inv_l + nq;
      for (int r = 0; r < nq; ++r) {
        const RowNorm n = row_norm(p, b, h, i0 + r);
        if (!fused_ref_ok<Ops>(n.m)) return false;
        m[r] = n.m, inv_l[r] = n.inv_l, delta[r] = *delta_ptr(p, b, h, i0 + r);
      }
      count_path(p, &PathCounters::bwd_fused_tiles, 1);
      constexpr int NR = Ops::NR;
      const float smul = caps<Ops>().scale_in_a ? 1.0f : p.scale * kLog2e;
      int lddo;
      const float* dO = do_a(p, L, b, h, i0, &lddo);
      if constexpr (bwd_sdp<Ops>()) {
        if (p.fused_sdp && p.D == p.Dv) {
          count_path(p, &PathCounters::bwd_sdp_tiles, 1);
          // prep_a traits: P^T in s, dS^T in pd, dS in dp (the fp32 tiles are never made);
          // fp32 ones: P in s, dS in dp, each GEMM's operand as it is
          float* dst = caps<Ops>().prep_a ? L.pd : L.dp;
          gemm_sdp_loop<Ops>(nq, nk, int(p.D), L.q, L.ldq, dO, lddo, L.kt, L.vt, p.D * NR,
                             ct.limit_n(), smul, m, inv_l, delta, L.s, dst, L.dp, L.lds);
          tile->pt_a = L.s, tile->dst_a = dst, tile->ds_a = L.dp;
          clock.lap(&PathCounters::bwd_s_ns);
          return true;
        }
      }
      gemm_rows_then<Ops>(
          nq, nk, int(p.D), L.q, L.ldq, L.kt, p.D * NR, L.s, L.lds, ct.limit_n(),
          [&](float* row, int r, int, int first, int end) {
            Ops::Row::exp2_band_scaled(row, NR, smul, m[r], inv_l[r], first, end);
          });
      clock.lap(&PathCounters::bwd_s_ns);
      gemm_rows_then<Ops>(
          nq, nk, int(p.Dv), dO, lddo, L.vt, p.Dv * NR, L.dp, L.lds, ct.limit_n(),
          [&](float* row, int r, int panel, int first, int end) {
            Ops::Row::ds_band(L.s + int64_t(r) * L.lds + panel * NR, row, NR, delta[r], first,
                              end);
          });
      clock.lap(&PathCounters::bwd_dp_ns);
      return true;
    }
  }

  // Loads the q-side operands of rows [i0, i0 + nq) of head h. The A copy of Q is pre-multiplied
  // by scale*log2(e) (scores in the log2 domain); the Q panels for dK stay unscaled. In place
  // (in_place), only the A copy of Q.
  static void load_q_side(const AttnParams& p, const Layout& L, int64_t b,
                          int64_t h, int64_t i0, int nq, bool panels) {
    Ops::Row::load_rows(q_row<T>(p, b, h, i0), p.q_sl, nq, int(p.D), L.q, L.ldq,
                   caps<Ops>().scale_in_a ? p.scale * kLog2e : 1.0f);
    if (in_place(p)) return;
    Ops::Row::load_rows(do_row<T>(p, b, h, i0), p.do_sl, nq, int(p.Dv), L.dO, L.lddo, 1.0f);
    if (panels) {
      Ops::Row::pack_b(q_row<T>(p, b, h, i0), p.q_sl, nq, int(p.D), L.qp);
      Ops::Row::pack_b(do_row<T>(p, b, h, i0), p.do_sl, nq, int(p.Dv), L.dop);
    }
  }

  // Packs the kv-side operands of keys [j0, j0 + nk): K^T and V^T panels (S, dP), and K panels
  // (dQ += dS K) when with_k and not in place.
  static void load_kv_side(const AttnParams& p, const Layout& L, int64_t b,
                           int64_t hk, int64_t j0, int nk, bool with_k) {
    Ops::Row::pack_bt(k_row<T>(p, b, hk, j0), p.k_sl, int(p.D), nk, L.kt);
    Ops::Row::pack_bt(v_row<T>(p, b, hk, j0), p.v_sl, int(p.Dv), nk, L.vt);
    if (with_k && !in_place(p))
      Ops::Row::pack_b(k_row<T>(p, b, hk, j0), p.k_sl, nk, int(p.D), L.kp);
  }

  // The q blocks with a row that sees a key of [j0, j0 + nk): [first, end) (first on the q
  // block grid). Every q block of every query head of the group in there, in this order, in
  // both strategies.
  static int64_t first_q_block_row(const AttnParams& p, const Blocks& bl, int64_t j0) {
    return Visibility::of(p).first_row(j0) / bl.bq * bl.bq;
  }
  static int64_t q_rows_end(const AttnParams& p, int64_t j0, int nk) {
    return Visibility::of(p).last_row_end(j0 + nk);
  }

  // C += A B (TransA: A^T B), B of K rows: the rows at `rows`, ld elements apart, read in place
  // (in_place), or the panels load_q_side / load_kv_side packed from them.
  template <bool TransA>
  static void gemm_b(const AttnParams& p, int M, int N, int K, const float* a, int lda,
                     const T* rows, int64_t ld, const float* panels, float* c, int ldc,
                     const RowLimit* lim) {
    if constexpr (caps<Ops>().transposed_s) {
      if (in_place(p))
        return Ops::template gemm_strided_b<TransA>(
            M, N, K, a, lda, reinterpret_cast<const float*>(rows), ld, c, ldc, true, lim);
    }
    Ops::template gemm<TransA>(M, N, K, a, lda, panels, int64_t(K) * Ops::NR, c, ldc, true, lim);
  }

  // dV += Pd^T dO_blk;  dK += dS^T Q_blk   (A transposed: A[j][i] = tile[i][j]). On a tile a
  // band's edge crosses, each group of keys only reduces over the queries that see one of them
  // (VisTile::limit_t): P and dS are 0 on the others.
  static void add_dkdv(const AttnParams& p, const Layout& L, int64_t b, int64_t h, int64_t i0,
                       int nq, int64_t j0, int nk, const Tile& tile, float* dk, float* dv,
                       StepClock& clock) {
    const VisTile ct = Visibility::of(p).tile(i0, nq, j0, nk, Ops::MR);
    int lda = L.lds;
    const float* a =
        tile.pt_a ? tile.pt_a : Ops::template prep_a<true>(tile.pd, L.lds, nk, nq, L.a16, &lda);
    gemm_b<true>(p, nk, int(p.Dv), nq, a, lda, do_row<T>(p, b, h, i0), p.do_sl, L.dop, dv,
                 L.lddv, ct.limit_t());
    a = tile.dst_a ? tile.dst_a
                   : Ops::template prep_a<true>(tile.ds, L.lds, nk, nq, L.a16, &lda);
    gemm_b<true>(p, nk, int(p.D), nq, a, lda, q_row<T>(p, b, h, i0), p.q_sl, L.qp, dk, L.ldd,
                 ct.limit_t());
    clock.lap(&PathCounters::bwd_dkdv_ns);
  }

  // dQ_blk += dS K_blk, into rows of an fp32 accumulator (ld = L.ldd). The two strategies make
  // exactly these calls in exactly this kv order for every q block, so dq is bit-identical.
  static void add_dq(const AttnParams& p, const Layout& L, int64_t b, int64_t hk, int64_t i0,
                     int nq, int64_t j0, int nk, const Tile& tile, float* dq,
                     StepClock& clock) {
    const VisTile ct = Visibility::of(p).tile(i0, nq, j0, nk, Ops::MR);
    int lda = L.lds;
    const float* a =
        tile.ds_a ? tile.ds_a : Ops::template prep_a<false>(tile.ds, L.lds, nq, nk, L.a16, &lda);
    gemm_b<false>(p, nq, int(p.D), nk, a, lda, k_row<T>(p, b, hk, j0), p.k_sl, L.kp, dq, L.ldd,
                  ct.limit_k());
    clock.lap(&PathCounters::bwd_dq_ns);
  }

  static void store_dkdv(const AttnParams& p, const Layout& L, int64_t b, int64_t hk, int64_t j0,
                         int nk, const float* dk, const float* dv) {
    T* dkp = static_cast<T*>(p.dk) + b * p.dk_sb + hk * p.dk_sh;
    T* dvp = static_cast<T*>(p.dv) + b * p.dv_sb + hk * p.dv_sh;
    for (int c = 0; c < nk; ++c) {
      Ops::Row::store_row(dk + int64_t(c) * L.ldd, int(p.D), p.scale, dkp + (j0 + c) * p.dk_sl);
      Ops::Row::store_row(dv + int64_t(c) * L.lddv, int(p.Dv), 1.0f, dvp + (j0 + c) * p.dv_sl);
    }
  }

  static void store_dq(const AttnParams& p, const Layout& L, int64_t b, int64_t h, int64_t i0,
                       int nq, const float* dq) {
    T* dqp = static_cast<T*>(p.dq) + b * p.dq_sb + h * p.dq_sh;
    for (int r = 0; r < nq; ++r)
      Ops::Row::store_row(dq + int64_t(r) * L.ldd, int(p.D), p.scale, dqp + (i0 + r) * p.dq_sl);
  }

  // ---- two-sweep strategy, phase BwdDkDv: item (b, hkv, kv-block) ------------------------------
  // (batch-1 key / value, p.kv_batch1: item (hkv, kv-block), its sums over every batch)
  static int64_t dkdv_items(const AttnParams& p, const Blocks& bl) {
    return kv_batches(p) * p.Hkv * ceil_div(p.Lk, bl.bk);
  }
  static void run_dkdv(const AttnParams& p, const Blocks& bl, int64_t item, float* scratch) {
    StepClock clock(p);
    const Layout L(p, bl, scratch);
    const KvItem it(p, bl, item);
    const int64_t b = it.b, hk = it.hk, j0 = it.j0, group = p.Hq / p.Hkv;
    const int nk = it.nk;
    float* dk = L.dk;
    float* dv = L.dv;
    for (int64_t x = 0; x < int64_t(nk) * L.ldd; ++x) dk[x] = 0.0f;
    for (int64_t x = 0; x < int64_t(nk) * L.lddv; ++x) dv[x] = 0.0f;
    clock.lap(&PathCounters::bwd_rows_ns);

    load_kv_side(p, L, b, hk, j0, nk, /*with_k=*/false);
    clock.lap(&PathCounters::bwd_pack_ns);
    const int64_t qbatch_end = p.kv_batch1 ? p.B : b + 1;  // the query batches reading these keys
    for (int64_t qbatch = p.kv_batch1 ? 0 : b; qbatch < qbatch_end; ++qbatch) {
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i0 = first_q_block_row(p, bl, j0); i0 < q_rows_end(p, j0, nk);
             i0 += bl.bq) {
          const int nq = int(min64(bl.bq, p.Lq - i0));
          load_q_side(p, L, qbatch, h, i0, nq, /*panels=*/true);
          clock.lap(&PathCounters::bwd_pack_ns);
          Tile tile;
          if (tile_ds(p, L, qbatch, h, i0, nq, j0, nk, &tile, clock))
            add_dkdv(p, L, qbatch, h, i0, nq, j0, nk, tile, dk, dv, clock);
        }
      }
    }
    store_dkdv(p, L, b, hk, j0, nk, dk, dv);
    clock.lap(&PathCounters::bwd_rows_ns);
  }

  // ---- two-sweep strategy, phase BwdDq: item (b, h, q-block) -----------------------------------
  static int64_t dq_items(const AttnParams& p, const Blocks& bl) {
    return p.B * p.Hq * ceil_div(p.Lq, bl.bq);
  }
  static void run_dq(const AttnParams& p, const Blocks& bl, int64_t item, float* scratch) {
    StepClock clock(p);
    const Layout L(p, bl, scratch);
    const QItem it(p, bl, item);
    const int64_t b = it.b, h = it.h, hk = it.hk, i0 = it.i0;
    const int nq = it.nq;
    const Visibility vis = Visibility::of(p);
    float* dq = L.dq;
    for (int64_t x = 0; x < int64_t(nq) * L.ldd; ++x) dq[x] = 0.0f;
    clock.lap(&PathCounters::bwd_rows_ns);

    load_q_side(p, L, b, h, i0, nq, /*panels=*/false);
    clock.lap(&PathCounters::bwd_pack_ns);
    for (int64_t j0 = first_kv_block(vis, i0, nq, bl.bk); j0 < vis.rows_end(i0, nq);
         j0 += bl.bk) {
      const int nk = int(min64(bl.bk, p.Lk - j0));
      load_kv_side(p, L, b, hk, j0, nk, /*with_k=*/true);
      clock.lap(&PathCounters::bwd_pack_ns);
      Tile tile;
      if (tile_ds(p, L, b, h, i0, nq, j0, nk, &tile, clock))
        add_dq(p, L, b, hk, i0, nq, j0, nk, tile, dq, clock);
    }
    store_dq(p, L, b, h, i0, nq, dq);
    clock.lap(&PathCounters::bwd_rows_ns);
  }

  // ---- single-pass strategy, phase BwdFused: item (b, hkv) --------------------------------------
  // FA2 proper: 5 gemms per tile instead of 7. Loops the kv blocks in order; dq of every query
  // head of the group accumulates in p.dq_acc (fp32, [B, Hq, Lq, ldd]) in the same kv order as
  // run_dq, so both strategies give bit-identical gradients. Needs B * Hkv items to keep every
  // thread busy, which is why the plan (plan.cpp) picks it by thread count.
  static int64_t fused_items(const AttnParams& p) { return p.B * p.Hkv; }
  static int64_t dq_acc_floats(const AttnParams& p, const Blocks& bl) {
    return p.B * p.Hq * p.Lq * int64_t(Layout(p, bl).ldd);
  }
  static void run_fused(const AttnParams& p, const Blocks& bl, int64_t item, float* scratch) {
    StepClock clock(p);
    const Layout L(p, bl, scratch);
    const int64_t b = item / p.Hkv, hk = item % p.Hkv;
    const int64_t group = p.Hq / p.Hkv;
    const int64_t head_rows = p.Lq * L.ldd;
    float* dq_heads = p.dq_acc + (b * p.Hq + hk * group) * head_rows;  // the group's dq rows
    for (int64_t x = 0; x < group * head_rows; ++x) dq_heads[x] = 0.0f;
    if (bwd_fused_owns_delta(p))
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) delta_rows(p, b, h, 0, p.Lq);
    float* dk = L.dk;
    float* dv = L.dv;

    for (int64_t j0 = 0; j0 < p.Lk; j0 += bl.bk) {
      const int nk = int(min64(bl.bk, p.Lk - j0));
      for (int64_t x = 0; x < int64_t(nk) * L.ldd; ++x) dk[x] = 0.0f;
      for (int64_t x = 0; x < int64_t(nk) * L.lddv; ++x) dv[x] = 0.0f;
      clock.lap(&PathCounters::bwd_rows_ns);
      load_kv_side(p, L, b, hk, j0, nk, /*with_k=*/true);
      clock.lap(&PathCounters::bwd_pack_ns);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        float* dq_h = dq_heads + (h - hk * group) * head_rows;
        for (int64_t i0 = first_q_block_row(p, bl, j0); i0 < q_rows_end(p, j0, nk); i0 += bl.bq) {
          const int nq = int(min64(bl.bq, p.Lq - i0));
          load_q_side(p, L, b, h, i0, nq, /*panels=*/true);
          clock.lap(&PathCounters::bwd_pack_ns);
          Tile tile;
          if (!tile_ds(p, L, b, h, i0, nq, j0, nk, &tile, clock)) continue;
          add_dkdv(p, L, b, h, i0, nq, j0, nk, tile, dk, dv, clock);
          add_dq(p, L, b, hk, i0, nq, j0, nk, tile, dq_h + i0 * L.ldd, clock);
        }
      }
      store_dkdv(p, L, b, hk, j0, nk, dk, dv);
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
      store_dq(p, L, b, h, 0, int(p.Lq), dq_heads + (h - hk * group) * head_rows);
    clock.lap(&PathCounters::bwd_rows_ns);
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
