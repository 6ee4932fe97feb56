// Visibility: which keys each query row may attend to, built once from the call. The forward,
// the backward and the decode path ask it for the key range of a block of query rows, the query
// rows that see a block of keys, the visible columns of a row and the per-row-group limits of a
// tile; nothing else in the algorithms knows what causal means.
//
// Row i sees keys [0, end(i)), with
//   end(i) = clamp(i + shift, 0, Lk)   when bounded (causal, top-left aligned as PyTorch's
//                                      is_causal: shift = 1, so row i sees keys j <= i)
//   end(i) = Lk                        otherwise.
// end is non-decreasing in i, which every range below relies on.
#pragma once
#include "../params.h"
#include "generic_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

struct VisTile;

struct Visibility {
  bool bounded;   // some row sees fewer than Lk keys
  int64_t shift;  // end(i) = i + shift (clamped) when bounded
  int64_t Lk;

  static Visibility of(const AttnParams& p) { return Visibility{p.causal, 1, p.Lk}; }

  // Every row sees every key.
  bool all() const { return !bounded; }

  // One past the last key row i sees.
  int64_t end(int64_t i) const { return bounded ? max64(0, min64(Lk, i + shift)) : Lk; }

  // Columns [0, n) of the key block [j0, j0 + nk) that row i sees: n, the rest hidden.
  int row_cols(int64_t i, int64_t j0, int nk) const {
    return int(max64(0, min64(int64_t(nk), end(i) - j0)));
  }

  // One past the last key any of rows [i0, i0 + nq) sees (nq >= 1).
  int64_t rows_end(int64_t i0, int64_t nq) const { return end(i0 + nq - 1); }

  // The first query row that sees key j0 (the rows before it see no key of [j0, Lk)).
  int64_t first_row(int64_t j0) const { return bounded ? max64(0, j0 - shift + 1) : 0; }

  // The view of one tile (VisTile, below).
  VisTile tile(int64_t i0, int nq, int64_t j0, int nk, int group) const;
};

// A (query rows [i0, i0 + nq) x keys [j0, j0 + nk)) tile, its rows handled in groups of `group`
// (the micro-kernel height): a group computes the columns its last row sees, so the work past a
// diagonal shrinks to less than one group-height strip.
struct VisTile {
  Visibility vis;
  bool partial;  // some row of the tile sees fewer than nk of its columns
  int64_t i0, j0;
  int nq, nk, group;
  RowLimit lim_n, lim_k;  // the same rule for the gemms: group [i, i + R) needs
                          // (i0 + i + R - 1 + shift) - j0 columns / inner steps
  const RowLimit* limit_n() const { return partial ? &lim_n : nullptr; }  // S = Q K^T
  const RowLimit* limit_k() const { return partial ? &lim_k : nullptr; }  // O += P V
  // columns the group of row r computes: those its last row sees (0: the group sees nothing)
  int width(int r) const {
    if (!partial) return nk;
    return vis.row_cols(i0 + min64(nq, (r / group + 1) * group) - 1, j0, nk);
  }
  // columns row r itself sees (a prefix of its group's width)
  int cols(int r) const { return vis.row_cols(i0 + r, j0, nk); }
};

inline VisTile Visibility::tile(int64_t i0, int nq, int64_t j0, int nk, int group) const {
  const bool partial = bounded && end(i0) < j0 + nk;
  const int64_t off = i0 - j0 + shift - 1;
  return VisTile{*this, partial, i0, j0, nq, nk, group, RowLimit{off, true}, RowLimit{off, false}};
}

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
