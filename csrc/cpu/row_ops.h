// The row operations of the softmax, the backward and the loads / stores, written once over a
// small vector type V; each trait names its own (Ops::Row = RowOps<its vector type>):
// VecF4 (generic_ops.h: the compiler's generic 4-float vectors), VecY8 (avx2_ops.h: ymm),
// VecZ16 (avx512_ops.h: zmm). V provides
//   reg, W (lanes), kSums (independent sums the exp pass keeps: more need more registers)
//   load / store (float, unaligned), splat, add, sub, mul, fma(a, b, c) = a * b + c, max, min
//   (max(a, x) / min(a, x) return x where x is NaN), exp2 (exp2_poly's polynomial, scalar.h),
//   hsum, hmax
//   first_n(x, n, fill): lanes from n on replaced by fill (0 <= n < W); keep_from(x, n, fill):
//   lanes before n replaced by fill (0 < n < W)
//   abs, div, iota(s) (lanes s, s + 1, ..., s + W - 1)
//   load_t<T> / load_n<T>(p, n): W (or the first n, the rest 0) elements of T widened to fp32
//   store_t<T> / store_n<T>(p, v, n): W (or the first n) lanes rounded to T
//   kTransposeRows, transpose_rows<T>(src, ld, K, rows, out, ldo): out[kk*ldo + i] =
//     src[i*ld + kk] for i < kTransposeRows (0 for i >= rows), kk < K
// Operand formats: load_rows, pack_b and pack_bt give the fp32 formats of the GEMMs (A rows; B
// panels of 2 W columns, [K][2W] each); a trait with another format (avx512bf16_ops.h) gives its
// Row its own.
// Rows of scores are padded: a row buffer holds whole vectors past its n columns, and what
// score_row leaves there (-inf) exp2_row_sum turns into 0.
#pragma once
#include "scalar.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// What score_row applies to one row of a block of scores s (log2 domain: log2(e) * scale * q.k
// once `mul` is applied), in the order of the semantics (params.h): the softcap, the ALiBi bias,
// the additive mask (all in the log2 domain); then the columns outside [lo, hi) are hidden.
struct RowScore {
  float mul = 1.0f;         // scale still to apply (1: folded into Q)
  float cap = 0.0f;         // softcap * log2(e) (0: none): s = cap * tanh(s / cap)
  float slope = 0.0f;       // ALiBi slope * log2(e) (0: none): s -= slope * |center - j|
  float center = 0.0f;      // ALiBi: the block column at distance 0 (i + diag - j0)
  const float* madd = nullptr;  // mask row, added
  int lo = 0, hi = 0;       // the visible columns
  float* dcap = nullptr;    // backward: d(capped)/d(s) = 1 - tanh^2 per column (0 where hidden)
  bool plain() const { return cap == 0.0f && slope == 0.0f && lo == 0; }
};

template <class V>
struct RowOps {
  using reg = typename V::reg;
  static constexpr int W = V::W;

  // s[j] = the row's score (RowScore) for the visible columns, -inf for the others, from 0 up to
  // the end of the vector holding column n - 1. Returns the max (-inf when nothing is visible).
  static float score_row(float* s, int n, const RowScore& r) {
    if (r.plain()) return score_row_plain(s, n, r.mul, r.madd, r.hi);
    const reg ninf = V::splat(kNegInf), zero = V::splat(0.0f), one = V::splat(1.0f);
    const Softcap cap(r.cap);
    int j = r.lo / W * W;
    for (int c = 0; c < j; c += W) {
      V::store(s + c, ninf);
      if (r.dcap) V::store(r.dcap + c, zero);
    }
    reg mx = ninf;
    for (; j < r.hi; j += W) {
      reg x = V::load(s + j);
      if (r.mul != 1.0f) x = V::mul(x, V::splat(r.mul));
      reg d = one;
      if (r.cap != 0.0f) {
        x = cap.apply(x);
        if (r.dcap) d = cap.derivative(x);
      }
      if (r.slope != 0.0f)
        x = V::sub(x, V::mul(V::splat(r.slope), V::abs(V::sub(V::iota(float(j)),
                                                              V::splat(r.center)))));
      if (r.madd) x = V::add(x, V::load(r.madd + j));
      if (j < r.lo) x = V::keep_from(x, r.lo - j, kNegInf), d = V::keep_from(d, r.lo - j, 0.0f);
      if (j + W > r.hi) x = V::first_n(x, r.hi - j, kNegInf), d = V::first_n(d, r.hi - j, 0.0f);
      V::store(s + j, x);
      if (r.dcap) V::store(r.dcap + j, d);
      mx = V::max(mx, x);
    }
    for (; j < n; j += W) {
      V::store(s + j, ninf);
      if (r.dcap) V::store(r.dcap + j, zero);
    }
    return V::hmax(mx);
  }

  // x -> cap * tanh(x / cap) per lane, and its derivative. tanh(y) = y P(y^2) / Q(y^2) for
  // |y| <= kTanhYMax (fit_tanh.py, whose output these constants are; beyond, tanh(y) is +-1 in
  // fp32), so cap * tanh(x / cap) = x P(u) / Q(u) with u = x^2 / cap^2 and x clamped to
  // +-kTanhYMax * cap. NaN stays NaN (the clamp's max / min return x for it).
  struct Softcap {
    static constexpr float kTanhYMax = 9.0f;
    static constexpr float kP[5] = {1.0f, 0.13381094f, 0.0034956688f, 2.0610403e-05f,
                                    1.33564715e-08f};
    static constexpr float kQ[5] = {1.0f, 0.4671441f, 0.02587729f, 0.00032857666f,
                                    7.777304e-07f};
    reg hi, lo, inv_cap, inv_cap2;
    explicit Softcap(float cap)
        : hi(V::splat(kTanhYMax * cap)), lo(V::splat(-kTanhYMax * cap)),
          inv_cap(V::splat(cap != 0.0f ? 1.0f / cap : 0.0f)),
          inv_cap2(V::splat(cap != 0.0f ? 1.0f / (cap * cap) : 0.0f)) {}
    reg apply(reg x) const {
      x = V::min(hi, V::max(lo, x));
      const reg u = V::mul(V::mul(x, x), inv_cap2);
      reg p = V::splat(kP[4]), q = V::splat(kQ[4]);
      for (int c = 3; c >= 0; --c) {
        p = V::fma(p, u, V::splat(kP[c]));
        q = V::fma(q, u, V::splat(kQ[c]));
      }
      return V::div(V::mul(x, p), q);
    }
    // d(cap tanh(x / cap)) / dx = 1 - tanh^2, from the capped value c: 1 - (c / cap)^2
    reg derivative(reg capped) const {
      const reg t = V::mul(capped, inv_cap);
      return V::sub(V::splat(1.0f), V::mul(t, t));
    }
  };

  // Test hook: x[j] = cap * tanh(x[j] / cap) for j < n (x padded to whole vectors).
  static void softcap_row(float* x, int n, float cap) {
    const Softcap sc(cap);
    for (int j = 0; j < n; j += W) V::store(x + j, sc.apply(V::load(x + j)));
  }

  // score_row without softcap, ALiBi or a lower bound: s[j] = s[j] * mul + madd[j] for
  // j < valid. Without mask and scale it only reads the row.
  static float score_row_plain(float* s, int n, float mul, const float* madd, int valid) {
    if (mul != 1.0f) scale_row(s, valid, mul);
    const reg ninf = V::splat(kNegInf);
    reg mx = ninf;
    int j = 0;
    if (madd) {
      for (; j + W <= valid; j += W) {
        const reg x = V::add(V::load(s + j), V::load(madd + j));
        V::store(s + j, x);
        mx = V::max(mx, x);
      }
    } else {
      mx = max_chains<W>(s, j, valid, mx, [](const float* x) { return V::load(x); },
                         [](reg a, reg b) { return V::max(a, b); });
    }
    if (j < valid) {  // the vector holding column `valid`
      reg x = V::load(s + j);
      if (madd) x = V::add(x, V::load(madd + j));
      x = V::first_n(x, valid - j, kNegInf);
      V::store(s + j, x);
      mx = V::max(mx, x);
      j += W;
    }
    for (; j < n; j += W) V::store(s + j, ninf);
    return V::hmax(mx);
  }

  // s[j] = exp2(s[j] - m) over the vectors covering n columns (padding lanes hold -inf -> 0);
  // returns the sum. m must be finite.
  static float exp2_row_sum(float* s, int n, float m) {
    const reg mv = V::splat(m);
    reg sum0 = V::splat(0.0f), sum1 = sum0;
    int j = 0;
    if constexpr (V::kSums == 2) {
      for (; j + 2 * W <= n; j += 2 * W) {
        const reg e0 = V::exp2(V::sub(V::load(s + j), mv));
        const reg e1 = V::exp2(V::sub(V::load(s + j + W), mv));
        V::store(s + j, e0);
        V::store(s + j + W, e1);
        sum0 = V::add(sum0, e0);
        sum1 = V::add(sum1, e1);
      }
    }
    for (; j < n; j += W) {
      const reg e = V::exp2(V::sub(V::load(s + j), mv));
      V::store(s + j, e);
      sum0 = V::add(sum0, e);
    }
    return V::hsum(V::kSums == 2 ? V::add(sum0, sum1) : sum0);
  }

  // The vector of columns [j, j + W): x on the columns in [lo, hi), `fill` on the others.
  static reg in_band(reg x, int j, int lo, int hi, float fill) {
    if (j < lo) x = V::keep_from(x, lo - j < W ? lo - j : W, fill);
    if (j + W > hi) x = V::first_n(x, hi > j ? hi - j : 0, fill);
    return x;
  }

  // The backward's P on a tile's row: s[j] = exp2(s[j] * smul - m) * mul for j in [lo, hi), 0
  // for the other columns of the vectors covering n. (tile_ds's fused rows, flash_bwd.h; smul:
  // the scores' scale where the trait does not fold it into A, else 1, exact.) The columns off
  // the band hold whatever the tile left there: they are set to 0 after the exponential, not
  // fed to it as -inf, which a scale of 0 turns into NaN (-inf * 0) and a negative one into +inf.
  static void exp2_band_scaled(float* s, int n, float smul, float m, float mul, int lo, int hi) {
    const reg sv = V::splat(smul), mv = V::splat(-m), kv = V::splat(mul);
    for (int j = 0; j < n; j += W) {
      const reg e = V::mul(V::exp2(V::fma(V::load(s + j), sv, mv)), kv);
      V::store(s + j, in_band(e, j, lo, hi, 0.0f));
    }
  }

  // The backward's dS on a tile's row: ds[j] = p[j] * (ds[j] - delta) for j in [lo, hi), 0 for
  // the other columns of the vectors covering n (ds holds dP on entry).
  static void ds_band(const float* p, float* ds, int n, float delta, int lo, int hi) {
    const reg dv = V::splat(delta);
    for (int j = 0; j < n; j += W) {
      const reg x = V::mul(V::load(p + j), V::sub(V::load(ds + j), dv));
      V::store(ds + j, in_band(x, j, lo, hi, 0.0f));
    }
  }

  // x[j] *= a for j < n.
  static void scale_row(float* x, int n, float a) {
    const reg av = V::splat(a);
    int j = 0;
    for (; j + W <= n; j += W) V::store(x + j, V::mul(V::load(x + j), av));
    if (j < n) V::store_n(x + j, V::mul(V::load_n(x + j, n - j), av), n - j);
  }

  // dS = P * (dP - delta): ds[j] = p[j] * (ds[j] - delta) for j < n (ds holds dP on entry),
  // times dcap[j] (the softcap's derivative) when given.
  static void ds_row(const float* p, float* ds, int n, float delta, const float* dcap) {
    const reg dv = V::splat(delta);
    int j = 0;
    for (; j + W <= n; j += W) {
      reg x = V::mul(V::load(p + j), V::sub(V::load(ds + j), dv));
      if (dcap) x = V::mul(x, V::load(dcap + j));
      V::store(ds + j, x);
    }
    if (j < n) {
      reg x = V::mul(V::load_n(p + j, n - j), V::sub(V::load_n(ds + j, n - j), dv));
      if (dcap) x = V::mul(x, V::load_n(dcap + j, n - j));
      V::store_n(ds + j, x, n - j);
    }
  }

  // dst[j] = round(src[j] * mul) for j < n.
  template <class T>
  static void store_row(const float* src, int n, float mul, T* dst) {
    const reg mv = V::splat(mul);
    int j = 0;
    for (; j + W <= n; j += W) V::store_t(dst + j, V::mul(V::load(src + j), mv));
    if (j < n) V::store_n(dst + j, V::mul(V::load_n(src + j, n - j), mv), n - j);
  }

  // sum_j a[j] * b[j], widened to fp32.
  template <class A, class B>
  static float dot_row(const A* a, const B* b, int n) {
    reg acc = V::splat(0.0f);
    int j = 0;
    for (; j + W <= n; j += W) acc = V::fma(V::load_t(a + j), V::load_t(b + j), acc);
    if (j < n) acc = V::fma(V::load_n(a + j, n - j), V::load_n(b + j, n - j), acc);
    return V::hsum(acc);
  }

  // y[j] += a * x[j] for j < n, x widened to fp32.
  template <class T>
  static void axpy_row(float a, const T* x, float* y, int n) {
    const reg av = V::splat(a);
    int j = 0;
    for (; j + W <= n; j += W) V::store(y + j, V::fma(av, V::load_t(x + j), V::load(y + j)));
    if (j < n) V::store_n(y + j, V::fma(av, V::load_n(x + j, n - j), V::load_n(y + j, n - j)), n - j);
  }

  // B panels: panel p holds columns [p*NR, p*NR + NR) as [K][NR], NR = 2 W, columns >= N zero.
  // pack_b: B[kk][n] = src[kk*ld + n], the source rows run along K (e.g. V for O += P V).
  template <class T>
  static void pack_b(const T* src, int64_t ld, int K, int N, float* dst) {
    constexpr int NR = 2 * W;
    for (int p = 0; p < int(ceil_div(N, NR)); ++p) {
      const int n0 = p * NR, w = int(min64(NR, N - n0));
      float* panel = dst + int64_t(p) * K * NR;
      const T* s = src + n0;
      if (w == NR) {
        for (int kk = 0; kk < K; ++kk, s += ld) {
          V::store(panel + kk * NR, V::load_t(s));
          V::store(panel + kk * NR + W, V::load_t(s + W));
        }
      } else {
        const int w0 = w < W ? w : W, w1 = w - w0;
        for (int kk = 0; kk < K; ++kk, s += ld) {
          V::store(panel + kk * NR, w0 == W ? V::load_t(s) : V::load_n(s, w0));
          V::store(panel + kk * NR + W, w1 > 0 ? V::load_n(s + W, w1) : V::splat(0.0f));
        }
      }
    }
  }

  // pack_bt: B[kk][n] = src[n*ld + kk], the source rows run along N (K^T from the rows of K),
  // kTransposeRows rows at a time.
  template <class T>
  static void pack_bt(const T* src, int64_t ld, int K, int N, float* dst) {
    constexpr int NR = 2 * W, G = V::kTransposeRows;
    for (int p = 0; p < int(ceil_div(N, NR)); ++p) {
      float* panel = dst + int64_t(p) * K * NR;
      for (int g = 0; g < NR / G; ++g) {
        const int n0 = p * NR + g * G;
        V::transpose_rows(src + int64_t(n0) * ld, ld, K, int(max64(0, min64(G, N - n0))),
                          panel + g * G, NR);
      }
    }
  }

  // dst[i*ldd + c] = mul * src[i*ld + c] for i < rows, c < cols (fp32 rows: an A operand).
  template <class T>
  static void load_rows(const T* src, int64_t ld, int rows, int cols, float* dst, int ldd,
                        float mul) {
    const reg mv = V::splat(mul);
    for (int i = 0; i < rows; ++i) {
      const T* s = src + i * ld;
      float* d = dst + int64_t(i) * ldd;
      int c = 0;
      for (; c + W <= cols; c += W) V::store(d + c, V::mul(V::load_t(s + c), mv));
      if (c < cols) V::store_n(d + c, V::mul(V::load_n(s + c, cols - c), mv), cols - c);
    }
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
