// Pieces shared by the blocked forward and backward: block sizes, work-item numbering, element
// addressing, mask rows and the score / probability rows. Templated on a micro-kernel trait
// (generic_ops.h) and compiled once per tier inside that tier's namespace.
#pragma once
#include "../params.h"
#include "generic_ops.h"
#include "scalar.h"
#include "visibility.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// ---- block sizes ---------------------------------------------------------------------------------
// The call's blocks (AttnParams::bq / bk, chosen by the plan, csrc/plan.cpp).
struct Blocks {
  int bq;  // query rows per block (a multiple of the trait's MR)
  int bk;  // key columns per block (a multiple of the trait's NR)
  explicit Blocks(const AttnParams& p) : bq(p.bq), bk(p.bk) {}
};

// Under a bounded Visibility a q block's work grows with its index (a kv block's shrinks). The
// compute phases hand their items out one at a time in index order (driver.cpp, run_phase), so
// each head's blocks are numbered costliest first: the last items handed out, which set how long
// the other threads wait at the end, are the cheapest (longest-processing-time first).
inline int64_t costliest_q_block(int64_t t, int64_t n) { return n - 1 - t; }

// The work items over query blocks, (b, h, q block), and over key blocks, (b, hkv, kv block):
// where item `item` sits. Query blocks of a head come costliest first under a bounded
// Visibility (costliest_q_block); key blocks in order (the first have the most rows under them).
struct QItem {
  int64_t bh, b, h, hk, i0;
  int nq;
  QItem(const AttnParams& p, const Blocks& bl, int64_t item) {
    const int64_t n_qb = ceil_div(p.Lq, bl.bq);
    bh = item / n_qb;
    const int64_t t = item % n_qb;
    const int64_t qb = Visibility::of(p).hi_bounded ? costliest_q_block(t, n_qb) : t;
    b = bh / p.Hq, h = bh % p.Hq, hk = h / (p.Hq / p.Hkv), i0 = qb * bl.bq;
    nq = int(min64(bl.bq, p.Lq - i0));
  }
};
// The batches key / value hold: 1 where every query batch reads the same ones
// (AttnParams::kv_batch1), whose per-(batch, kv head) items (packing, dK / dV) then run once.
inline int64_t kv_batches(const AttnParams& p) { return p.kv_batch1 ? 1 : p.B; }
struct KvItem {
  int64_t b, hk, j0;
  int nk;
  KvItem(const AttnParams& p, const Blocks& bl, int64_t item) {
    const int64_t n_kb = ceil_div(p.Lk, bl.bk);
    const int64_t bhk = item / n_kb;
    b = bhk / p.Hkv, hk = bhk % p.Hkv, j0 = (item % n_kb) * bl.bk;
    nk = int(min64(bl.bk, p.Lk - j0));
  }
};

// A thread's scratch carved into float buffers, each 64-byte aligned, in order. With a null base
// only the total is counted: the phase plan sizes the scratch that way, with the same code.
struct Carve {
  float* base;
  int64_t total = 0;
  float* take(int64_t n) {
    float* at = base ? base + total : nullptr;
    total += round_up(n, 16);
    return at;
  }
};

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
inline float* stats_ptr(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return p.stats + b * p.st_sb + h * p.st_sh + i * p.st_sl;
}
// Row i's normaliser for the backward: P = 2^(s - m) * inv_l with s relative to the row's mask
// shift, from the forward's stats when kept (params.h: m = hi, inv_l = 2^-lo, shift), else from
// the logsumexp (inv_l 1, shift 0).
struct RowNorm {
  float m, inv_l, shift;
};
inline RowNorm row_norm(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  if (p.stats) {
    const float* st = stats_ptr(p, b, h, i);
    return {st[AttnParams::kStatHi], exp2_poly(-st[AttnParams::kStatLo]),
            st[AttnParams::kStatShift]};
  }
  return {*lse_ptr(p, b, h, i) * kLog2e, 1.0f, 0.0f};
}
inline float* delta_ptr(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return p.delta + (b * p.Hq + h) * p.Lq + i;
}

// ---- masks ---------------------------------------------------------------------------------------
// A float mask value in the log2 domain. Finite values stay finite: PyTorch adds the mask in the
// natural domain, where finfo.min (Hugging Face's fill value) is finite, so a row of nothing but
// such values attends uniformly there; times log2(e) it would overflow to -inf (a masked row).
// They saturate at +-kMaskLimit instead (+inf too); -inf and NaN pass unchanged.
constexpr float kMaskLimit = 2.35e38f;  // * log2(e) stays below FLT_MAX
inline float mask_log2(float m) {  // (selects, no branches: the loops over it vectorise)
  const float hi = m > kMaskLimit ? kMaskLimit : m;
  const float lo = hi < -kMaskLimit ? -kMaskLimit : hi;
  return (m == kNegInf ? kNegInf : lo) * kLog2e;
}

// f(ld) with ld(c) the float mask's value (as float) at key offset c from offset base: one
// loader per type and stride (1: contiguous, which the loops over it vectorise); nothing for
// bool masks or none.
template <class F>
inline void with_float_mask(const AttnParams& p, int64_t base, F&& f) {
  const int64_t sk = p.m_sk;
  const auto pick = [&](const auto* m, auto widen) {
    if (sk == 1)
      f([=](int64_t c) { return widen(m[c]); });
    else
      f([=](int64_t c) { return widen(m[c * sk]); });
  };
  switch (p.mask_type) {
    case MaskType::F32:
      pick(static_cast<const float*>(p.mask) + base, [](float v) { return v; });
      break;
    case MaskType::BF16:
      pick(static_cast<const uint16_t*>(p.mask) + base, [](uint16_t v) { return bf16_to_f32(v); });
      break;
    case MaskType::F16:
      pick(static_cast<const uint16_t*>(p.mask) + base, [](uint16_t v) { return f16_to_f32(v); });
      break;
    case MaskType::Bool:
    case MaskType::None:
      break;
  }
}

// A float mask enters each row relative to its shift M, the largest mask value among the keys
// [j0, j1) the row sees: scores + (mask - M). Softmax does not change under a per-row
// constant, and mask - M is exact for values near M, so a row masked on every key by one large
// finite value (a -1e9 fill) keeps its scores' digits, where scores + mask would round them to
// multiples of ulp(1e9) = 64 and attend to the wrong keys. The logsumexp adds M back; the
// stats keep it (params.h) for the backward. Only |M| in [kShiftMin, kShiftLimit] shifts.
// Below, scores + mask loses no more than the scores' own rounding, while mask - M would round
// values far below a small M that still weigh something: such rows keep the plain sum's bits.
// Beyond, or not finite, no shift either, so a row masked by finfo.min alone still attends
// uniformly, as in PyTorch (and in fp64, whose ulp there is 2^75).
constexpr float kShiftMin = 0x1p10f, kShiftLimit = 0x1p40f;
inline float shift_of_max(float mx) {
  const float a = __builtin_fabsf(mx);
  return a >= kShiftMin && a <= kShiftLimit ? mx : 0.0f;
}
// The largest of a float mask's values [j0, j1) of row (b, h, i) (-inf: none; NaN passed over),
// in 16 independent lanes (vector max; one chain of maxes would be bound by its latency).
// (Out of line, as mask_row_log2: inlined into the kernels' loops, GCC leaves these scalar.)
__attribute__((noinline)) inline float mask_max(const AttnParams& p, int64_t b, int64_t h,
                                                int64_t i, int64_t j0, int64_t j1) {
  float lane[16];
  for (int u = 0; u < 16; ++u) lane[u] = kNegInf;
  const int64_t n = j1 - j0;
  with_float_mask(p, b * p.m_sb + h * p.m_sh + i * p.m_sl + j0 * p.m_sk, [&](auto ld) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
      for (int u = 0; u < 16; ++u) {
        const float v = ld(c + u);
        lane[u] = v > lane[u] ? v : lane[u];
      }
    for (; c < n; ++c) {
      const float v = ld(c);
      lane[0] = v > lane[0] ? v : lane[0];
    }
  });
  float mx = kNegInf;
  for (int u = 0; u < 16; ++u) mx = lane[u] > mx ? lane[u] : mx;
  return mx;
}
inline float mask_shift(const AttnParams& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                        int64_t j1) {
  return shift_of_max(mask_max(p, b, h, i, j0, j1));
}
// shift[r] = mask_shift of row i0 + r over the keys it sees, r < nq. Rows of a mask that does not
// vary along the queries (m_sl == 0) whose key ranges only grow at the end (no window's left
// edge) take one running max (the same values: max is exact in any order).
inline void mask_shifts(const AttnParams& p, const Visibility& vis, int64_t b, int64_t h,
                        int64_t i0, int nq, float* shift) {
  if (p.mask_type == MaskType::None || p.mask_type == MaskType::Bool) {
    for (int r = 0; r < nq; ++r) shift[r] = 0.0f;
  } else if (p.m_sl == 0 && !vis.lo_bounded) {
    float mx = kNegInf;
    int64_t seen = 0;
    for (int r = 0; r < nq; ++r) {
      const int64_t end = vis.end(i0 + r);
      const float more = mask_max(p, b, h, i0, seen, end);
      mx = more > mx ? more : mx;
      seen = end > seen ? end : seen;
      shift[r] = shift_of_max(mx);
    }
  } else {
    for (int r = 0; r < nq; ++r)
      shift[r] = mask_shift(p, b, h, i0 + r, vis.begin(i0 + r), vis.end(i0 + r));
  }
}

// dst[c] = log2(e) * (mask[b, h, i, j0 + c] - shift) for c < n (mask_log2; the row's shift,
// mask_shift's); bool masks give 0 (attend) or -inf.
// (Out of line: inlined into the kernels' loops GCC left it scalar, 4 cycles a value; here it
// vectorises.)
__attribute__((noinline)) inline void mask_row_log2(const AttnParams& p, int64_t b, int64_t h,
                                                    int64_t i, int64_t j0, int n, float* dst,
                                                    float shift = 0.0f) {
  const int64_t base = b * p.m_sb + h * p.m_sh + i * p.m_sl + j0 * p.m_sk;
  if (p.mask_type == MaskType::Bool) {
    const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base;
    for (int c = 0; c < n; ++c) dst[c] = m[c * p.m_sk] ? 0.0f : kNegInf;
  } else if (p.mask_type == MaskType::None) {
    for (int c = 0; c < n; ++c) dst[c] = 0.0f;
  } else {
    with_float_mask(p, base, [&](auto ld) {
      for (int c = 0; c < n; ++c) dst[c] = mask_log2(ld(c) - shift);
    });
  }
}

// Mask rows of one (q block x kv block) tile, each row relative to its shift (shift[r * ld_shift]
// for row r; null: none). When the mask does not vary along the query dimension (m_sl == 0, e.g.
// a key-padding mask) a converted row serves every next row of the same shift (a key-padding
// mask's shifts rise at most a few times down a block: the running max of mask_shifts).
struct MaskTile {
  float* buf;      // scratch: bq rows of bk floats
  int32_t* slot;   // scratch: per row of the tile, the row of buf it reads
  int ld;
  const float* shift = nullptr;
  int64_t ld_shift = 1;

  float row_shift(int r) const { return shift ? shift[r * ld_shift] : 0.0f; }
  const float* fill(const AttnParams& p, int64_t b, int64_t h, int64_t i0, int nq, int64_t j0,
                    int nk) {
    if (p.mask_type == MaskType::None) return nullptr;
    for (int r = 0; r < nq; ++r) {
      if (r > 0 && p.m_sl == 0 && row_shift(r) == row_shift(r - 1)) {
        slot[r] = slot[r - 1];
        continue;
      }
      slot[r] = r;
      mask_row_log2(p, b, h, i0 + r, j0, nk, buf + int64_t(r) * ld, row_shift(r));
    }
    return buf;
  }
  const float* row(const float* tile, int r) const {
    return tile ? tile + int64_t(slot[r]) * ld : nullptr;
  }
};

// The score variants of the call for row i of head (b, h), over the key block from j0 (without
// its visible columns, which the caller sets: ct.first / ct.cols or the Visibility's).
inline RowScore row_score(const AttnParams& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                          float mul, const float* madd) {
  RowScore r;
  r.mul = mul;
  r.cap = p.softcap * kLog2e;
  if (p.alibi) {
    r.slope = p.alibi[b * p.alibi_sb + h * p.alibi_sh] * kLog2e;
    r.center = float(i + p.diag - j0);
  }
  r.madd = madd;
  return r;
}

// The sink's score, log2 domain, in a row of shift `shift` (mask_shift).
inline float sink_log2(const AttnParams& p, int64_t h, float shift) {
  return (p.sinks[h] - shift) * kLog2e;
}
// A row's softmax state before its first key: nothing (m = -inf, l = 0), or with a sink its
// score (m = sink_log2, l = 2^0 = 1): the sink's mass is in l from the start and its value, 0,
// adds nothing to acc.
inline void start_row(const AttnParams& p, int64_t h, float* m, float* l, float shift = 0.0f) {
  *m = p.sinks ? sink_log2(p, h, shift) : kNegInf;
  *l = p.sinks ? 1.0f : 0.0f;
}

// A bf16 trait's exponential pass applies the scores' scale itself: fma(s, mul, -m), the
// product unrounded, against a max m that was rounded. A score equal to the max then gives
// 2^(the product's rounding error), up to 2^(ulp(m) / 2): at most 2^0.5 while |m| < 2^24, inf or
// 0 far above (scores of 1e30). Rows past this take the scale in a pass of their own, and the
// fused exponentials do not take them as a reference.
constexpr float kFmaRefMax = 0x1p24f;

// Whether a row's running max can be the reference of the fused exponentials: finite, and
// below kFmaRefMax where the trait applies the scale in the exp pass (not scale_in_a).
template <class Ops>
inline bool fused_ref_ok(float m) {
  return __builtin_fabsf(m) < (caps<Ops>().scale_in_a ? -kNegInf : kFmaRefMax);
}

// One row of the online softmax over a block of scores (srow, log2 domain, w columns computed):
//   s = the row's score (RowScore); m' = max(m, rowmax); alpha = 2^(m - m');
//   P = 2^(s - m') in place; l = alpha * l + rowsum(P); acc *= alpha.
// Returns false when nothing in the row is visible yet (P set to 0, m / l / acc untouched).
// (P is defined up to the next multiple of 8 past w, as score_row / exp2_row_sum leave it.)
// p16 (traits with prep_a only): P goes rounded to bf16 into p16, a row of the A operand of
// P V, instead of into srow (defined up to the next multiple of 16 past w), which saves the
// prep_a pass; and on a plain row whose scale score_row would apply (mul > 0: the row max
// commutes with it, exactly in fp32) the exp pass applies it instead of a pass of its own,
// unless the max is past kFmaRefMax.
template <class Ops>
inline bool online_softmax_row(float* srow, int w, const RowScore& rs, float* m, float* l,
                               float* acc_row, int Dv, uint16_t* p16 = nullptr) {
  RowScore r = rs;
  float mul = 1.0f;  // the scale left to the exp pass
  if (p16 && rs.plain() && !rs.madd && rs.mul > 0.0f) mul = rs.mul, r.mul = 1.0f;
  float mx = Ops::Row::score_row(srow, w, r) * mul;
  if (mul != 1.0f && !fused_ref_ok<Ops>(mx)) {  // (and a row that sees nothing)
    Ops::Row::scale_row(srow, w, mul);
    mul = 1.0f;
  }
  const float m_new = mx > *m ? mx : *m;
  if (m_new == kNegInf) {
    for (int c = 0; c < int(round_up(w, 8)); ++c) srow[c] = 0.0f;
    if (p16)
      for (int c = 0; c < int(round_up(w, 16)); ++c) p16[c] = 0;
    return false;
  }
  const float alpha = exp2_poly(*m - m_new);  // m = -inf -> 0
  float rowsum;
  if constexpr (caps<Ops>().prep_a)
    rowsum = p16 ? Ops::Row::exp2_row_sum_bf16(srow, w, mul, m_new, p16)
                 : Ops::Row::exp2_row_sum(srow, w, m_new);
  else
    rowsum = Ops::Row::exp2_row_sum(srow, w, m_new);
  *l = *l * alpha + rowsum;
  *m = m_new;
  if (alpha != 1.0f) Ops::Row::scale_row(acc_row, Dv, alpha);
  return true;
}

template <class T>
inline bool q_row_has_nan(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  const T* q = q_row<T>(p, b, h, i);
  for (int64_t d = 0; d < p.D; ++d)
    if (__builtin_isnan(to_f32(q[d]))) return true;
  return false;
}

// out = acc / l, lse = ln(2) * (m + log2(l)) + shift (the row's mask_shift), and when kept the
// stats: m + log2(l) as hi + lo (TwoSum: exact), and the shift; rows with nothing to attend to
// (l == 0, or Lk == 0) give out = 0, lse = p.lse_empty (0 as PyTorch's fused kernel, or -inf)
// and stats (-inf, 0, shift). A row left
// empty because its query holds NaN (its scores are NaN, which the row max passes over) is NaN,
// as PyTorch gives it, not 0: a NaN hidden as 0 hides a diverging run. (Checked only for empty
// rows: any other row with a NaN score has l = NaN already.)
template <class Ops, class T>
inline void finish_row(const AttnParams& p, int64_t b, int64_t h, int64_t i, float m, float l,
                       const float* acc_row, float shift = 0.0f) {
  if (l == 0.0f && p.Lk > 0 && q_row_has_nan<T>(p, b, h, i)) l = m = kNaN;
  const bool empty = l == 0.0f;
  const float lg = __builtin_log2f(l);
  *lse_ptr(p, b, h, i) = empty ? p.lse_empty : (m + lg) * kLn2 + shift;
  if (p.stats) {
    float* st = stats_ptr(p, b, h, i);
    const float hi = m + lg, lg_part = hi - m;
    st[AttnParams::kStatHi] = empty ? kNegInf : hi;
    st[AttnParams::kStatLo] = empty ? 0.0f : (m - (hi - lg_part)) + (lg - lg_part);
    st[AttnParams::kStatShift] = shift;
  }
  Ops::Row::store_row(acc_row, int(p.Dv), empty ? 0.0f : 1.0f / l, o_row<T>(p, b, h, i));
}

// The first key block (of the bk grid) a call's rows [i0, i0 + nq) need: the grid, not the band,
// sets where blocks start, so the blocks (and the order of every sum) do not depend on the q
// blocking.
inline int64_t first_kv_block(const Visibility& vis, int64_t i0, int64_t nq, int bk) {
  return vis.rows_begin(i0, nq) / bk * bk;
}

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
