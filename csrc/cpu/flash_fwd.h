// Blocked flash-attention forward with an online softmax, written once for every tier.
//
// One work item = (b, h, q-block). For a q block Q_blk [bq, D]:
//   m = -inf, l = 0, acc = 0                               (per row; fp32)
//   for each kv block [j0, j0 + bk) the rows can see:
//     S   = Q_blk K_blk^T                                  (gemm, fp32)
//     s   = log2(e) * (scale * S + mask - M); causal cut   (score_row; log2 domain: Q_blk is
//                                                           loaded pre-multiplied by scale*log2e;
//                                                           M: the row's mask_shift)
//     m'  = max(m, rowmax(s)); alpha = 2^(m - m')
//     P   = 2^(s - m'); l = alpha * l + rowsum(P)
//     acc = alpha * acc + dropout(P) V_blk                 (gemm)
//   out = acc / l;  lse = ln(2) * (m + log2(l)) + M
// Rows with nothing to attend to (l == 0) give out = 0 and lse = 0, as PyTorch's kernel does.
// Fused exponentials (traits with fused_exp, when the plan allows them: AttnParams::fused_exp):
// on a block without mask, dropout, softcap or ALiBi, of whole panels, P = 2^(s - m) comes
// straight from the S GEMM's tile stores with m the running max of the earlier blocks, or 0 on
// the first block (no max pass; the exp work overlaps the GEMM); on a block a band's edge (the
// causal diagonal, a window) crosses, the tiles it crosses take the same epilogue with each
// row's lanes masked to the columns it sees, 0 on the others (gemm_exp_loop). A
// row whose block sum passes 2^16 then moves m up by a power of two (P, l, acc rescaled); a sum
// that is inf or NaN, or on the first block below 2^-40 (scores so low that 2^(s - 0) would lose
// digits), sends the block through the two-pass path.
// Transposed scores (Phase::ForwardTransposed, traits with transposed_s; the plan takes it for
// fp32 inputs without mask, dropout, softcap, ALiBi or sinks; run_item_t):
// S^T = K_blk Q_blk^T instead, with the rows of K read in place as the GEMM's A operand and
// Q_blk^T packed once per item as its B panels, so that no K^T (nor, when Dv is a multiple of
// the panel width, V) panels are packed at all; the online softmax runs down the columns (one
// per query: vertical vector ops), fused into the tile stores as above with one reference per
// column, and acc += P V_blk takes P^T as the transposed A operand, V's rows in place. On a
// block a band's edge crosses (causal, windows) S^T's key groups skip the query panels none of
// their keys is seen by (set to 0), P is 0 off the band, and P V's query groups reduce over the
// keys they see.
// (bench/bench_paths.py measures each of these paths against its alternative.)
#pragma once
#include "flash_common.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

template <class Ops, class T>
struct FlashForward {
  static constexpr float kFusedRescale = 65536.0f;  // 2^16: a row's P sum past this moves m up
  static constexpr float kFusedSumMax = 1e30f;      // past this (or inf / NaN): two-pass path
  static constexpr float kFusedSumMin = 0x1p-40f;   // first block: below this, two-pass path
  // One thread's buffers over its scratch (null: sizes only, in total). `transposed`: the
  // buffers of the transposed-score items (Phase::ForwardTransposed) too.
  struct Layout {
    int ldq, lds, ldacc, ldt;
    float *q, *kt, *v, *s, *acc, *m, *l, *shift, *mask, *a16, *sv, *qt, *st, *at, *ct;
    int32_t* mask_slot;
    int64_t total;
    Layout(const AttnParams& p, const Blocks& bl, bool transposed, float* scratch = nullptr) {
      const int64_t bkp = round_up(bl.bk, Ops::NR);
      const int64_t dvp = round_up(p.Dv, Ops::NR);
      const int64_t bqp = round_up(bl.bq, Ops::NR);
      ldq = int(p.D);
      lds = int(bkp);
      ldacc = int(dvp);
      ldt = int(bqp);
      Carve c{scratch};
      q = c.take(int64_t(bl.bq) * p.D);
      kt = c.take(bkp * p.D);
      v = c.take(int64_t(bl.bk) * dvp);
      s = c.take(int64_t(bl.bq) * bkp);
      acc = c.take(int64_t(bl.bq) * dvp);
      m = c.take(bqp);  // per query row: whole panels of them in the transposed path
      l = c.take(bqp);
      shift = c.take(bl.bq);  // per query row: its mask_shift
      mask = c.take(int64_t(bl.bq) * bkp);
      mask_slot = reinterpret_cast<int32_t*>(c.take(bl.bq));  // (MaskTile)
      a16 = c.take(caps<Ops>().prep_a ? int64_t(bl.bq) * bkp : 0);
      sv = c.take(caps<Ops>().fused_exp ? int64_t(bl.bq) * 16 : 0);
      qt = c.take(transposed ? bqp * p.D : 0);
      st = c.take(transposed ? int64_t(bl.bk) * bqp : 0);
      at = c.take(transposed ? bqp : 0);
      ct = c.take(transposed ? bqp : 0);
      total = c.total;
    }
  };
  static int64_t scratch_floats(const AttnParams& p, const Blocks& bl, bool transposed) {
    return Layout(p, bl, transposed).total;
  }

  static int64_t num_items(const AttnParams& p, const Blocks& bl) {
    return p.B * p.Hq * ceil_div(p.Lq, bl.bq);
  }

  // ---- Phase::PackKV: K^T and V panels of every (b, hkv, kv-block), packed once ---------------
  static int64_t pack_items(const AttnParams& p, const Blocks& bl) {
    return kv_batches(p) * p.Hkv * ceil_div(p.Lk, bl.bk);
  }
  static int64_t pack_block_floats(const AttnParams& p, const Blocks& bl) {
    return round_up(bl.bk, Ops::NR) * p.D + int64_t(bl.bk) * round_up(p.Dv, Ops::NR);
  }
  static void run_pack(const AttnParams& p, const Blocks& bl, int64_t item) {
    const KvItem it(p, bl, item);
    const int64_t b = it.b, hk = it.hk, j0 = it.j0;
    const int nk = it.nk;
    float* kt = p.kv_pack + item * pack_block_floats(p, bl);
    StepClock clock(p);
    Ops::Row::pack_bt(k_row<T>(p, b, hk, j0), p.k_sl, int(p.D), nk, kt);
    Ops::Row::pack_b(v_row<T>(p, b, hk, j0), p.v_sl, nk, int(p.Dv), kt + round_up(bl.bk, Ops::NR) * p.D);
    clock.lap(&PathCounters::fwd_pack_ns);
  }

  // A fused block's sum (one per query: a row of S, a column of S^T) can be used: not past
  // kFusedSumMax (false for inf and NaN) and, on the first block (reference 0), not below
  // kFusedSumMin. Otherwise the block takes the two-pass path.
  static bool fused_sum_ok(float sum, bool first) {
    return sum <= kFusedSumMax && (!first || sum >= kFusedSumMin);
  }
  // Adds a fused block's sum to one query's softmax state (m, l, its acc row). Past
  // kFusedRescale the reference moves up by a power of two: acc rescaled here, and the factor
  // returned for the block's P (1: unchanged).
  static float absorb_fused_sum(float sum, float* m, float* l, float* acc_row, int Dv) {
    if (sum <= kFusedRescale) {
      *l += sum;
      return 1.0f;
    }
    const float shift = __builtin_ceilf(__builtin_log2f(sum));
    const float alpha = exp2_poly(-shift);
    Ops::Row::scale_row(acc_row, Dv, alpha);
    *l = (*l + sum) * alpha;
    *m += shift;
    return alpha;
  }

  // The transposed-score item (see the top of the file). Per kv block: fused exponentials
  // against each column's running max (0 on the first block) with the same 2^16 rescale and
  // sum checks as the row path, else the two-pass softmax_cols; padding columns (past nq, zero
  // queries) keep reference 0 and are never read.
  static void run_item_t(const AttnParams& p, const Blocks& bl, int64_t item, float* scratch) {
    if constexpr (caps<Ops>().transposed_s && std::is_same_v<T, float>) {
      const Layout L(p, bl, true, scratch);
      int64_t fused_blocks = 0, band_blocks = 0;
      const QItem pos(p, bl, item);
      const int64_t b = pos.b, h = pos.h, hk = pos.hk, i0 = pos.i0;
      const int nq = pos.nq;
      const int nqc = int(round_up(nq, 16));
      const int D = int(p.D), Dv = int(p.Dv);
      float *qt = L.qt, *st = L.st, *m = L.m, *l = L.l, *alpha = L.at, *acc = L.acc, *vp = L.v;
      StepClock clock(p);  // (as run_item's)
      Ops::Row::pack_bt(q_row<T>(p, b, h, i0), p.q_sl, D, nq, qt);
      Ops::Row::scale_row(qt, int(round_up(nq, Ops::NR) * D), p.scale * kLog2e);
      float* csum = L.ct;
      const int nqp = int(round_up(nq, Ops::NR));
      // padding columns (zero queries) keep reference 0: their P is 1 (0 off the band), never read
      for (int c = 0; c < nqp; ++c) m[c] = c < nq ? kNegInf : 0.0f, l[c] = 0.0f, alpha[c] = 1.0f;
      for (int r = 0; r < nq; ++r) {
        float* a = acc + int64_t(r) * L.ldacc;
        for (int d = 0; d < L.ldacc; ++d) a[d] = 0.0f;
      }
      bool m_fit = false;
      const Visibility vis = Visibility::of(p);
      const int64_t kv_begin = first_kv_block(vis, i0, nq, bl.bk), kv_end = vis.rows_end(i0, nq);
      count_path(p, &PathCounters::fwd_tiles, ceil_div(max64(0, kv_end - kv_begin), bl.bk));
      clock.lap(&PathCounters::fwd_softmax_ns);
      for (int64_t j0 = kv_begin; j0 < kv_end; j0 += bl.bk) {
        const int nk = int(min64(bl.bk, kv_end - j0));
        const float* kr = k_row<T>(p, b, hk, j0);
        // A band's edge crossing the block (causal diagonal, window): S^T's key groups skip the
        // queries none of them is seen by, P V's query groups the keys none of them sees
        const VisTile ct = vis.tile(i0, nq, j0, nk, Ops::MR);
        bool done = false;
        const bool first = j0 == kv_begin;
        if (p.fused_exp && (m_fit || first)) {
          if (first)
            for (int c = 0; c < nq; ++c) m[c] = 0.0f;
          for (int c = 0; c < nqp; ++c) csum[c] = 0.0f;
          Ops::gemm_exp_cols(nk, nq, D, kr, int(p.k_sl), qt, int64_t(D) * Ops::NR, st, L.ldt, m,
                             csum, ct.limit_st());
          clock.lap(&PathCounters::fwd_scores_ns);
          bool finite = true;
          for (int c = 0; c < nq; ++c) finite &= fused_sum_ok(csum[c], first);
          if (finite) {
            bool shifted = false;
            for (int c = 0; c < nq; ++c) {
              alpha[c] = absorb_fused_sum(csum[c], &m[c], &l[c], acc + int64_t(c) * L.ldacc, Dv);
              shifted |= alpha[c] != 1.0f;
            }
            if (shifted) {
              for (int j = 0; j < nk; ++j) {
                float* row = st + int64_t(j) * L.ldt;
                for (int c = 0; c < nqc; ++c) row[c] *= alpha[c];
              }
              for (int c = 0; c < nq; ++c) alpha[c] = 1.0f;
            }
            done = true;
            m_fit = true;
            ++fused_blocks;
            band_blocks += ct.partial();
          } else if (first) {
            for (int c = 0; c < nq; ++c) m[c] = kNegInf;
          }
        }
        if (!done) {
          Ops::template gemm<false>(nk, nq, D, kr, int(p.k_sl), qt, int64_t(D) * Ops::NR, st,
                                    L.ldt, false);
          clock.lap(&PathCounters::fwd_scores_ns);
          if (ct.partial()) {  // -inf off the band (key j0 + j's queries): P = 0 there
            for (int j = 0; j < nk; ++j) {
              float* row = st + int64_t(j) * L.ldt;
              const int64_t cl = vis.first_row(j0 + j) - i0;
              const int64_t ch = vis.last_row_end(j0 + j + 1) - i0;
              for (int c = 0; c < nqc; ++c)
                if (c < cl || c >= ch) row[c] = kNegInf;
            }
          }
          Ops::softmax_cols(st, L.ldt, nk, nqc, m, l, alpha);
          m_fit = true;
          for (int r = 0; r < nq; ++r) {
            if (alpha[r] != 1.0f) Ops::Row::scale_row(acc + int64_t(r) * L.ldacc, Dv, alpha[r]);
            alpha[r] = 1.0f;
            m_fit &= fused_ref_ok<Ops>(m[r]);
          }
        }
        clock.lap(&PathCounters::fwd_softmax_ns);
        if (Dv % Ops::NR == 0) {  // V read in place: no V panels to pack
          Ops::template gemm_strided_b<true>(nq, Dv, nk, st, L.ldt, v_row<T>(p, b, hk, j0), p.v_sl, acc,
                                L.ldacc, true, ct.limit_k());
          clock.lap(&PathCounters::fwd_pv_ns);
          continue;
        }
        Ops::Row::pack_b(v_row<T>(p, b, hk, j0), p.v_sl, nk, Dv, vp);
        clock.lap(&PathCounters::fwd_pack_ns);
        Ops::template gemm<true>(nq, Dv, nk, st, L.ldt, vp, int64_t(nk) * Ops::NR, acc,
                                 L.ldacc, true, ct.limit_k());
        clock.lap(&PathCounters::fwd_pv_ns);
      }
      for (int r = 0; r < nq; ++r)
        finish_row<Ops, T>(p, b, h, i0 + r, m[r], l[r], acc + int64_t(r) * L.ldacc);
      clock.lap(&PathCounters::fwd_softmax_ns);
      count_path(p, &PathCounters::fused_exp_blocks, fused_blocks);
      count_path(p, &PathCounters::fused_exp_band_blocks, band_blocks);
    }
  }

  static void run_item(const AttnParams& p, const Blocks& bl, int64_t item, float* scratch) {
    const Layout L(p, bl, false, scratch);
    int64_t fused_blocks = 0, band_blocks = 0;
    const QItem pos(p, bl, item);
    const int64_t bh = pos.bh, b = pos.b, h = pos.h, hk = pos.hk, i0 = pos.i0;
    const int nq = pos.nq;
    const int Dv = int(p.Dv);

    float *qbuf = L.q, *s = L.s, *acc = L.acc, *m = L.m, *l = L.l, *shift = L.shift;
    const Visibility vis = Visibility::of(p);
    MaskTile mt{L.mask, L.mask_slot, L.lds, shift};
    const float scale_log2 = p.scale * kLog2e;
    const float q_mul = caps<Ops>().scale_in_a ? scale_log2 : 1.0f;  // folded into Q, or
    const float s_mul = caps<Ops>().scale_in_a ? 1.0f : scale_log2;  // applied to the scores
    const bool dropout = p.dropout_p > 0.0f;
    // prep_a traits: the exp pass writes P straight into P V's A operand (online_softmax_row),
    // unless dropout, which works on the fp32 P, follows it
    const bool p_in_a = caps<Ops>().prep_a && !dropout;
    const auto a16_row = [&](int r) {  // row r of P V's bf16 A operand (prep_a traits)
      return reinterpret_cast<uint16_t*>(L.a16 + int64_t(r) * L.lds);
    };

    StepClock clock(p);  // (the steps' time, when counting: PathCounters::fwd_*_ns)
    // Q_blk [nq, D] in fp32
    Ops::Row::load_rows(q_row<T>(p, b, h, i0), p.q_sl, nq, int(p.D), qbuf, L.ldq, q_mul);
    mask_shifts(p, vis, b, h, i0, nq, shift);
    for (int r = 0; r < nq; ++r) {
      start_row(p, h, &m[r], &l[r], shift[r]);
      float* a = acc + int64_t(r) * L.ldacc;
      for (int d = 0; d < L.ldacc; ++d) a[d] = 0.0f;
    }

    // every row's running max can be the fused reference (the fused path may run): from the
    // start with a sink
    const auto refs_ok = [&] {
      for (int r = 0; r < nq; ++r)
        if (!fused_ref_ok<Ops>(m[r])) return false;
      return true;
    };
    bool m_fit = p.sinks != nullptr && refs_ok();
    const int64_t kv_begin = first_kv_block(vis, i0, nq, bl.bk), kv_end = vis.rows_end(i0, nq);
    count_path(p, &PathCounters::fwd_tiles, ceil_div(max64(0, kv_end - kv_begin), bl.bk));
    clock.lap(&PathCounters::fwd_softmax_ns);
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += bl.bk) {
      const int nk = int(min64(bl.bk, kv_end - j0));
      // K_blk^T and V_blk panels: pre-packed by Phase::PackKV, or packed here
      // (pre-packed V panels hold the whole block's rows, nk_full >= nk under the causal cut)
      float* kt = L.kt;
      float* vp = L.v;
      int64_t v_stride = int64_t(nk) * Ops::NR;
      const bool prepacked = p.kv_pack != nullptr;
      if (prepacked) {
        const int64_t kb = p.kv_batch1 ? 0 : b;  // (batch-1 key / value: packed once)
        kt = p.kv_pack + ((kb * p.Hkv + hk) * ceil_div(p.Lk, bl.bk) + j0 / bl.bk) *
                             pack_block_floats(p, bl);
        vp = kt + round_up(bl.bk, Ops::NR) * p.D;
        v_stride = min64(bl.bk, p.Lk - j0) * Ops::NR;
      } else {
        Ops::Row::pack_bt(k_row<T>(p, b, hk, j0), p.k_sl, int(p.D), nk, kt);
      }
      clock.lap(&PathCounters::fwd_pack_ns);
      // S = Q_blk K_blk^T   [nq, nk]. On a tile the causal diagonal crosses, each group of MR
      // rows only computes the columns its last row can see (VisTile).
      const VisTile ct = vis.tile(i0, nq, j0, nk, Ops::MR);
      bool any_row = false;
      if constexpr (caps<Ops>().fused_exp) {
        // Every row has a finite running max: P = 2^(S - m) straight from the GEMM's tile
        // stores (0 on the columns a row does not see), against the max of the earlier blocks
        // rather than this one's.
        // The same online softmax with another reference point: a row whose block sum grows
        // past 2^16 moves its reference up (P, l and acc rescaled as usual); a sum that is not
        // finite (overflow, NaN) sends the block through the two-pass path below. On the first
        // block the reference is 0: a score s > 0 adds 2^s (up to the 1e30 limit, then the
        // rescale brings it back), and a row whose first-block sum stays below 2^-40 (every
        // score under about -40: 2^(s - 0) would sit near the bottom of fp32's range, where
        // digits go) takes the two-pass path too.
        const bool first = j0 == kv_begin && !p.sinks;
        if (p.fused_exp && (m_fit || first) && p.mask_type == MaskType::None && !dropout &&
            p.softcap == 0.0f && !p.alibi && nk % Ops::NR == 0) {
          if (first)
            for (int r = 0; r < nq; ++r) m[r] = 0.0f;
          float* sv = L.sv;
          for (int64_t x = 0; x < int64_t(nq) * 16; ++x) sv[x] = 0.0f;
          // P's polynomial: the degree-3 one where P is rounded to bf16 (prep_a) or the
          // inputs are 16-bit (kExp2DegreeP)
          constexpr int kDeg = caps<Ops>().prep_a ? kExp2DegreeBf16P : kExp2DegreeP<T>;
          Ops::template gemm_exp<kDeg>(nq, nk, int(p.D), qbuf, L.ldq, kt, p.D * Ops::NR, s,
                                       L.lds, m, sv, ct.limit_n(), s_mul, a16_row(0),
                                       2 * int64_t(L.lds));
          clock.lap(&PathCounters::fwd_scores_ns);
          bool finite = true;
          for (int r = 0; r < nq; ++r) {
            float sum = 0.0f;
            for (int x = 0; x < 16; ++x) sum += sv[r * 16 + x];
            sv[r * 16] = sum;
            finite &= fused_sum_ok(sum, first);
          }
          if (finite) {
            for (int r = 0; r < nq; ++r) {
              const float alpha =
                  absorb_fused_sum(sv[r * 16], &m[r], &l[r], acc + int64_t(r) * L.ldacc, Dv);
              if (alpha == 1.0f) continue;
              if constexpr (caps<Ops>().prep_a)
                Ops::Row::scale_row_bf16(a16_row(r), nk, alpha);
              else
                Ops::Row::scale_row(s + int64_t(r) * L.lds, nk, alpha);
            }
            any_row = true;
            m_fit = refs_ok();  // (a rescale moves m up)
            ++fused_blocks;
            band_blocks += ct.partial();
          } else if (first) {
            for (int r = 0; r < nq; ++r) m[r] = kNegInf;
          }
        }
      }
      if (!any_row) {  // the two-pass online softmax
        Ops::template gemm<false>(nq, nk, int(p.D), qbuf, L.ldq, kt, p.D * Ops::NR, s, L.lds,
                                  false, ct.limit_n());
        clock.lap(&PathCounters::fwd_scores_ns);
        const float* mtile = mt.fill(p, b, h, i0, nq, j0, nk);

        for (int r = 0; r < nq; ++r) {
          const int64_t i = i0 + r;
          const int w = ct.width(r);  // columns of this row's group: the rest is never read
          float* srow = s + int64_t(r) * L.lds;
          RowScore rs = row_score(p, b, h, i, j0, s_mul, mt.row(mtile, r));
          rs.lo = ct.first(r), rs.hi = ct.cols(r);
          uint16_t* p16 = p_in_a ? a16_row(r) : nullptr;
          if (!online_softmax_row<Ops>(srow, w, rs, &m[r], &l[r], acc + int64_t(r) * L.ldacc, Dv,
                                       p16))
            continue;
          any_row = true;
          if (dropout) Ops::dropout_row(p, uint64_t(bh), i, j0, w, srow, srow);
        }
        clock.lap(&PathCounters::fwd_softmax_ns);
        if (!any_row) continue;  // the whole tile is masked: skip P V
        m_fit = refs_ok();
      }
      // acc += P V_blk   [nq, Dv]
      clock.lap(&PathCounters::fwd_softmax_ns);  // (the fused path's rescaling)
      if (!prepacked) Ops::Row::pack_b(v_row<T>(p, b, hk, j0), p.v_sl, nk, Dv, vp);
      clock.lap(&PathCounters::fwd_pack_ns);
      int ldp = L.lds;  // (P already in L.a16 when the exp pass wrote it there)
      const float* pa = p_in_a ? L.a16 : Ops::template prep_a<false>(s, L.lds, nq, nk, L.a16, &ldp);
      clock.lap(&PathCounters::fwd_softmax_ns);
      Ops::template gemm<false>(nq, Dv, nk, pa, ldp, vp, v_stride, acc, L.ldacc, true,
                                ct.limit_k());
      clock.lap(&PathCounters::fwd_pv_ns);
    }

    for (int r = 0; r < nq; ++r)
      finish_row<Ops, T>(p, b, h, i0 + r, m[r], l[r], acc + int64_t(r) * L.ldacc, shift[r]);
    clock.lap(&PathCounters::fwd_softmax_ns);
    count_path(p, &PathCounters::fused_exp_blocks, fused_blocks);
    count_path(p, &PathCounters::fused_exp_band_blocks, band_blocks);
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
