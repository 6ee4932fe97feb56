// Visibility: which keys each query row may attend to, built once from the call. The forward,
// the backward and the decode path ask it for the key range of a block of query rows, the query
// rows that see a block of keys, the visible columns of a row and the per-row-group limits of a
// tile; nothing else in the algorithms knows what causal or a window means.
//
// Row i sees keys [begin(i), end(i)), a band:
//   end(i)   = clamp(i + hi, 0, Lk)   when bounded above (causal, or a window's right side:
//                                     hi = diag + right + 1, right = 0 under causal)
//   begin(i) = clamp(i + lo, 0, Lk)   when bounded below (a window's left side:
//                                     lo = diag - left)
// with diag = 0 for PyTorch's top-left alignment and Lk - Lq for flash-attn's bottom-right one.
// begin and end are non-decreasing in i, which every range below relies on.
#pragma once
#include "../params.h"
#include "generic_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

struct VisTile;

struct Visibility {
  bool hi_bounded, lo_bounded;
  int64_t hi, lo;  // end(i) = i + hi, begin(i) = i + lo (clamped), when bounded
  int64_t Lq, Lk;

  static Visibility of(const AttnParams& p) {
    const int64_t right = p.causal ? 0 : p.win_right;
    return Visibility{right >= 0, p.win_left >= 0, p.diag + right + 1, p.diag - p.win_left,
                      p.Lq, p.Lk};
  }

  // Every row sees every key.
  bool all() const { return !hi_bounded && !lo_bounded; }

  // The keys row i sees: [begin(i), end(i)) (empty when begin >= end).
  int64_t end(int64_t i) const { return hi_bounded ? max64(0, min64(Lk, i + hi)) : Lk; }
  int64_t begin(int64_t i) const { return lo_bounded ? max64(0, min64(Lk, i + lo)) : 0; }

  // The columns of key block [j0, j0 + nk) that row i sees: [first, last) of the block.
  int row_first(int64_t i, int64_t j0, int nk) const {
    return int(max64(0, min64(int64_t(nk), begin(i) - j0)));
  }
  int row_cols(int64_t i, int64_t j0, int nk) const {
    return int(max64(0, min64(int64_t(nk), end(i) - j0)));
  }

  // The keys any of rows [i0, i0 + nq) sees: [rows_begin, rows_end) (nq >= 1).
  int64_t rows_begin(int64_t i0, int64_t nq) const { (void)nq; return begin(i0); }
  int64_t rows_end(int64_t i0, int64_t nq) const { return end(i0 + nq - 1); }

  // The query rows that see a key of [j0, j1): [first_row(j0), last_row_end(j1)).
  int64_t first_row(int64_t j0) const { return hi_bounded ? max64(0, j0 - hi + 1) : 0; }
  int64_t last_row_end(int64_t j1) const { return lo_bounded ? max64(0, min64(Lq, j1 - lo)) : Lq; }

  // The view of one tile (VisTile, below).
  VisTile tile(int64_t i0, int nq, int64_t j0, int nk, int group) const;
};

// A (query rows [i0, i0 + nq) x keys [j0, j0 + nk)) tile, its rows handled in groups of `group`
// (the micro-kernel height): a group computes the columns between its first row's first and its
// last row's last, so the work outside the band shrinks to less than one group-height strip on
// each side.
struct VisTile {
  Visibility vis;
  bool cut_hi, cut_lo;  // some row of the tile sees fewer columns at the end / at the start
  int64_t i0, j0;
  int nq, nk, group;
  RowLimit lim_n, lim_k;  // the same rule for the gemms: group [i, i + R) needs columns (inner
                          // steps) [i0 + i + lo - j0, i0 + i + R - 1 + hi - j0)
  RowLimit lim_t;  // and for the products over the tile's transpose (rows: keys, inner
                   // steps: queries): keys [k, k + R) need the queries
                   // [j0 + k - hi + 1 - i0, j0 + k + R - lo - i0)
  RowLimit lim_st;  // the same on the columns: S^T = K Q^T (rows: keys, columns: queries)
  bool partial() const { return cut_hi || cut_lo; }
  const RowLimit* limit_n() const { return partial() ? &lim_n : nullptr; }  // S = Q K^T
  const RowLimit* limit_k() const { return partial() ? &lim_k : nullptr; }  // O += P V
  const RowLimit* limit_t() const { return partial() ? &lim_t : nullptr; }  // dV += P^T dO
  const RowLimit* limit_st() const { return partial() ? &lim_st : nullptr; }  // S^T = K Q^T
  // The columns the group of row r computes: [group_first, width) (width 0: nothing)
  int width(int r) const {
    if (!cut_hi) return nk;
    return vis.row_cols(i0 + min64(nq, (r / group + 1) * group) - 1, j0, nk);
  }
  int group_first(int r) const {
    return cut_lo ? vis.row_first(i0 + (r / group) * group, j0, nk) : 0;
  }
  // The columns row r itself sees: [first(r), cols(r)), within its group's
  int first(int r) const { return vis.row_first(i0 + r, j0, nk); }
  int cols(int r) const { return vis.row_cols(i0 + r, j0, nk); }
};

inline VisTile Visibility::tile(int64_t i0, int nq, int64_t j0, int nk, int group) const {
  const bool cut_hi = hi_bounded && end(i0) < j0 + nk;
  const bool cut_lo = lo_bounded && begin(i0 + nq - 1) > j0;
  const RowLimit lim{cut_hi, i0 - j0 + hi - 1, cut_lo, i0 - j0 + lo, true};
  RowLimit lim_k = lim;
  lim_k.on_n = false;
  // key j is seen by the queries i with j - hi < i <= j - lo: the band's upper edge bounds the
  // queries from below, its lower edge from above
  const RowLimit lim_t{cut_lo, j0 - i0 - lo, cut_hi, j0 - i0 - hi + 1, false};
  RowLimit lim_st = lim_t;
  lim_st.on_n = true;
  return VisTile{*this, cut_hi, cut_lo, i0, j0, nq, nk, group, lim, lim_k, lim_t, lim_st};
}

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
