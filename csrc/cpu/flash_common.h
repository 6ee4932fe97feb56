// Pieces shared by the blocked forward and backward: block sizes, work-item numbering, element
// addressing, mask rows and the score / probability rows. Templated on a micro-kernel trait
// (generic_ops.h) and compiled once per tier inside that tier's namespace.
#pragma once
#include "../params.h"
#include "generic_ops.h"
#include "scalar.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// ---- block sizes ---------------------------------------------------------------------------------
struct Blocks {
  int bq;  // query rows per block
  int bk;  // key columns per block (a multiple of the trait's NR)
};

// The per-thread working set (K^T and V panels of one kv block plus the score tile) should stay
// in L2: bk = kL2PanelBytes / (4 * (D + Dv)), clamped, rounded to the panel width (a V panel of
// 256 rows x 16 floats still fits L1). The backward holds more tiles (P, dP, dS, mask) and the
// q-side panels, so it takes shorter q blocks. bk depends on the shape only (it sets the order
// of the online softmax). The q blocking never changes a result - ops.cpp may pick one q block
// per head by thread count (bq_override) - because every forward q block starts at a multiple
// of MR, so the causal row groups (CausalTile), and with them each row's columns, are the same.
template <class Ops>
Blocks choose_blocks(const AttnParams& p, Phase phase) {
  static_assert(Ops::kBlockQ % Ops::MR == 0, "forward q blocks must hold whole row groups");
  constexpr int64_t kL2PanelBytes = 256 * 1024;
  constexpr int64_t kMinBk = 64, kMaxBk = 256, kMaxBkBwd = 256;
  const bool fwd = phase == Phase::Forward || phase == Phase::PackKV;
  const int64_t bq_max = fwd ? Ops::kBlockQ : Ops::kBlockQBwd;
  Blocks bl;
  int64_t bq = p.Lq >= bq_max ? bq_max : round_up(max64(p.Lq, 1), Ops::MR);
  int64_t bk = kL2PanelBytes / (4 * (p.D + p.Dv));
  bk = max64(kMinBk, min64(fwd ? kMaxBk : kMaxBkBwd, bk));
  bk = min64(bk, round_up(max64(p.Lk, 1), Ops::NR));
  bk = round_up(bk, Ops::NR);
  if (p.bq_override > 0) bq = round_up(p.bq_override, Ops::MR);
  if (p.bk_override > 0) bk = round_up(p.bk_override, Ops::NR);
  bl.bq = int(bq);
  bl.bk = int(bk);
  return bl;
}

// Under a causal mask a q block's work grows with its index (a kv block's shrinks). The compute
// phases hand their items out one at a time in index order (ops.cpp, run_planned_phase), so
// each head's blocks are numbered costliest first: the last items handed out, which set how long
// the other threads wait at the end, are the cheapest (longest-processing-time first).
// Interleaved A/B against the earlier 0, n-1, 1, n-2, ... order, causal fp32 forward suite: +0.5%;
// causal fp32 forward + backward (this order and one-at-a-time items vs both the old ways):
// within 1.7% either way per shape, geomean 1.000.
inline int64_t costliest_q_block(int64_t t, int64_t n) { return n - 1 - t; }

// ---- addressing ----------------------------------------------------------------------------------
template <class T> inline const T* q_row(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + i * p.q_sl;
}
template <class T> inline const T* k_row(const AttnParams& p, int64_t b, int64_t hk, int64_t j) {
  return static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh + j * p.k_sl;
}
template <class T> inline const T* v_row(const AttnParams& p, int64_t b, int64_t hk, int64_t j) {
  return static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh + j * p.v_sl;
}
template <class T> inline T* o_row(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + i * p.o_sl;
}
template <class T> inline const T* o_crow(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(p.out) + b * p.o_sb + h * p.o_sh + i * p.o_sl;
}
template <class T> inline const T* do_row(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + i * p.do_sl;
}
inline float* lse_ptr(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return p.lse + b * p.lse_sb + h * p.lse_sh + i * p.lse_sl;
}
inline float* delta_ptr(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return p.delta + (b * p.Hq + h) * p.Lq + i;
}

// ---- masks ---------------------------------------------------------------------------------------
// dst[c] = log2(e) * mask[b, h, i, j0 + c] for c < n; bool masks give 0 (attend) or -inf.
inline void mask_row_log2(const AttnParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, int n,
                          float* dst) {
  const int64_t base = b * p.m_sb + h * p.m_sh + i * p.m_sl + j0 * p.m_sk;
  const int64_t sk = p.m_sk;
  switch (p.mask_type) {
    case MaskType::Bool: {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base;
      for (int c = 0; c < n; ++c) dst[c] = m[c * sk] ? 0.0f : kNegInf;
      break;
    }
    case MaskType::F32: {
      const float* m = static_cast<const float*>(p.mask) + base;
      for (int c = 0; c < n; ++c) dst[c] = m[c * sk] * kLog2e;
      break;
    }
    case MaskType::BF16: {
      const uint16_t* m = static_cast<const uint16_t*>(p.mask) + base;
      for (int c = 0; c < n; ++c) dst[c] = bf16_to_f32(m[c * sk]) * kLog2e;
      break;
    }
    case MaskType::F16: {
      const uint16_t* m = static_cast<const uint16_t*>(p.mask) + base;
      for (int c = 0; c < n; ++c) dst[c] = f16_to_f32(m[c * sk]) * kLog2e;
      break;
    }
    case MaskType::None:
      for (int c = 0; c < n; ++c) dst[c] = 0.0f;
      break;
  }
}

// Mask rows of one (q block x kv block) tile. When the mask does not vary along the query
// dimension (m_sl == 0, e.g. a key-padding mask) one converted row serves every query row.
struct MaskTile {
  float* buf;  // scratch: one row of bk floats, or bq rows when the mask varies by row
  int ld;
  bool per_row;

  const float* fill(const AttnParams& p, int64_t b, int64_t h, int64_t i0, int nq, int64_t j0,
                    int nk) {
    if (p.mask_type == MaskType::None) return nullptr;
    per_row = p.m_sl != 0;
    const int rows = per_row ? nq : 1;
    for (int r = 0; r < rows; ++r) mask_row_log2(p, b, h, i0 + r, j0, nk, buf + int64_t(r) * ld);
    return buf;
  }
  const float* row(const float* tile, int r) const {
    return tile ? tile + (per_row ? int64_t(r) * ld : 0) : nullptr;
  }
};

// Columns of kv block [j0, j0 + nk) that query row i may attend to under the causal rule.
inline int causal_valid(const AttnParams& p, int64_t i, int64_t j0, int nk) {
  if (!p.causal) return nk;
  const int64_t v = i + 1 - j0;
  return int(v < 0 ? 0 : (v > nk ? nk : v));
}

// A (q block x kv block) tile under the causal rule. When the diagonal crosses it, rows are
// handled in groups of `group` (the micro-kernel height): a group needs the columns its last row
// sees, so work above the diagonal shrinks to less than one group-height strip.
struct CausalTile {
  bool diagonal;  // some row of the tile sees fewer than nk columns
  int64_t i0, j0;
  int nq, nk, group;
  RowLimit lim_n, lim_k;  // the same rule for the gemms: group [i, i+R) needs i0 - j0 + i + R
  CausalTile(const AttnParams& p, int64_t i0_, int nq_, int64_t j0_, int nk_, int group_)
      : diagonal(p.causal && j0_ + nk_ > i0_ + 1), i0(i0_), j0(j0_), nq(nq_), nk(nk_),
        group(group_), lim_n{i0_ - j0_, true}, lim_k{i0_ - j0_, false} {}
  const RowLimit* limit_n() const { return diagonal ? &lim_n : nullptr; }  // S = Q K^T
  const RowLimit* limit_k() const { return diagonal ? &lim_k : nullptr; }  // O += P V
  // rows in the group that starts at (or contains) row r
  int rows(int r) const { return int(min64(group, nq - (r / group) * group)); }
  // columns the group of row r needs: up to the last row's diagonal (0: the group sees nothing)
  int width(int r) const {
    if (!diagonal) return nk;
    const int64_t last = i0 + min64(nq, (r / group + 1) * group) - 1;
    return int(max64(0, min64(nk, last + 1 - j0)));
  }
};

// One row of the online softmax over a block of scores (srow, log2 domain, w columns computed):
//   s += mask; causal cut at `valid`; m' = max(m, rowmax); alpha = 2^(m - m');
//   P = 2^(s - m') in place; l = alpha * l + rowsum(P); acc *= alpha.
// Returns false when nothing in the row is visible yet (P set to 0, m / l / acc untouched).
// (mul: the scale the scores still need, 1 when Q came pre-scaled; P is defined up to the next
// multiple of 8 past w, as the vector tiers' score_row / exp2_row_sum leave it.)
template <class Ops>
inline bool online_softmax_row(float* srow, int w, float mul, const float* madd, int valid,
                               float* m, float* l, float* acc_row, int Dv) {
  const float mx = Ops::score_row(srow, w, mul, madd, valid);
  const float m_new = mx > *m ? mx : *m;
  if (m_new == kNegInf) {
    for (int c = 0; c < int(round_up(w, 8)); ++c) srow[c] = 0.0f;
    return false;
  }
  const float alpha = exp2_poly(*m - m_new);  // m = -inf -> 0
  const float rowsum = Ops::exp2_row_sum(srow, w, m_new);
  *l = *l * alpha + rowsum;
  *m = m_new;
  if (alpha != 1.0f) Ops::scale_row(acc_row, Dv, alpha);
  return true;
}

// out = acc / l, lse = ln(2) * (m + log2(l)); rows with nothing to attend to (l == 0, or
// Lk == 0) give out = 0 and lse = 0, as PyTorch's fused kernel does.
template <class Ops, class T>
inline void finish_row(const AttnParams& p, int64_t b, int64_t h, int64_t i, float m, float l,
                       const float* acc_row) {
  const bool empty = l == 0.0f;
  *lse_ptr(p, b, h, i) = empty ? 0.0f : (m + __builtin_log2f(l)) * kLn2;
  Ops::store_row(acc_row, int(p.Dv), empty ? 0.0f : 1.0f / l, o_row<T>(p, b, h, i));
}

// Last key column + 1 that any row of [i0, i0 + nq) can see.
inline int64_t kv_end_for_rows(const AttnParams& p, int64_t i0, int nq) {
  return p.causal ? min64(p.Lk, i0 + nq) : p.Lk;
}

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
