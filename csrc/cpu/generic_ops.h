// GenericOps: the micro-kernel trait in plain C++ (no intrinsics). It is the portable tier's
// trait, and the base that faster tiers derive from, overriding what they accelerate.
//
// The blocked algorithms (flash_fwd.h, flash_bwd.h) only talk to a trait through these members:
//
//   NR                   panel width: B operands are packed in panels of NR columns
//   gemm<TransA>         C[M][Np] (= or +=) A[M][K] * B[K][Np], A row-major or transposed,
//                        B panels `bstride` floats apart
//   Row                  the row operations (row_ops.h) on the trait's vector type: score_row,
//                        exp2_row_sum, scale_row, ds_row, store_row, dot_row, and the operand
//                        formats: load_rows (A rows), pack_b / pack_bt (B panels of NR columns)
//   dropout_row          out = x * keep / (1 - p), keep bits from Philox (scalar.h)
//   decode_qk, decode_pv short-query kernels on unpacked K / V rows (flash_decode.h)
#pragma once
#include "../params.h"
#include "row_ops.h"
#include "scalar.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// 4-float vectors from the compiler's generic vector extension (GCC / Clang): SSE2 on x86-64,
// NEON on aarch64, scalar code elsewhere. Not ISA intrinsics: this stays portable C++.
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));

inline vf4 vload(const float* p) {
  vf4 v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf4 v) { memcpy(p, &v, sizeof(v)); }
inline vf4 vsplat(float x) { return vf4{x, x, x, x}; }
inline vf4 vselect(vi4 mask, vf4 a, vf4 b) {  // mask lanes are all-ones or zero
  return (vf4)((mask & (vi4)a) | (~mask & (vi4)b));
}
inline vf4 vmax(vf4 a, vf4 b) { return vselect(a > b, a, b); }
inline vf4 vmin(vf4 a, vf4 b) { return vselect(a < b, a, b); }
inline float hmax(vf4 v) {
  const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
  return a > b ? a : b;
}
inline float hsum(vf4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// exp2 of 4 lanes: exp2_poly (scalar.h), vectorised.
inline vf4 vexp2(vf4 x) {
  const vf4 hi = vsplat(kExp2Max), lo = vsplat(kExp2Min);
  vf4 xc = vselect(x < hi, x, hi);
  xc = vselect(xc > lo, xc, lo);  // also maps NaN to lo
  const vf4 magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vf4 t = xc + magic;
  const vf4 n = t - magic;
  const vf4 f = xc - n;
  const vf4 p = exp2_horner(f, [](float c) { return vsplat(c); },
                            [](vf4 a, vf4 b, vf4 c) { return a * b + c; });
  const vi4 ni = (vi4)t - (vi4)magic;  // the integer n, from the low mantissa bits
  const vf4 scale = (vf4)((ni + 127) << 23);
  return vselect(x != x, x, p * scale);
}

// The row operations' vector type (row_ops.h) on vf4.
struct VecF4 {
  using reg = vf4;
  static constexpr int W = 4, kSums = 1;
  static reg load(const float* p) { return vload(p); }
  static void store(float* p, reg v) { vstore(p, v); }
  static reg splat(float x) { return vsplat(x); }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static reg max(reg a, reg b) { return vmax(a, b); }
  static reg min(reg a, reg b) { return vmin(a, b); }
  static reg exp2(reg x) { return vexp2(x); }
  static float hsum(reg v) { return ::flashsdpa::cpu::FLASHSDPA_TIER_NS::hsum(v); }
  static float hmax(reg v) { return ::flashsdpa::cpu::FLASHSDPA_TIER_NS::hmax(v); }
  static reg first_n(reg x, int n, float fill) {
    return vselect(vi4{0, 1, 2, 3} < vi4{n, n, n, n}, x, vsplat(fill));
  }
  static reg keep_from(reg x, int n, float fill) {
    return vselect(vi4{0, 1, 2, 3} >= vi4{n, n, n, n}, x, vsplat(fill));
  }
  static reg abs(reg x) { return (vf4)((vi4)x & vi4{kMag, kMag, kMag, kMag}); }
  static reg div(reg a, reg b) { return a / b; }
  static reg iota(float s) { return vf4{s, s + 1.0f, s + 2.0f, s + 3.0f}; }
  static constexpr int32_t kMag = 0x7fffffff;  // the bits of a float but its sign
  template <class T>
  static reg load_t(const T* p) {
    return vf4{to_f32(p[0]), to_f32(p[1]), to_f32(p[2]), to_f32(p[3])};
  }
  template <class T>
  static reg load_n(const T* p, int n) {
    vf4 v = vsplat(0.0f);
    for (int i = 0; i < n; ++i) v[i] = to_f32(p[i]);
    return v;
  }
  template <class T>
  static void store_t(T* p, reg v) {
    for (int i = 0; i < W; ++i) p[i] = from_f32<T>(v[i]);
  }
  template <class T>
  static void store_n(T* p, reg v, int n) {
    for (int i = 0; i < n; ++i) p[i] = from_f32<T>(v[i]);
  }
  static constexpr int kTransposeRows = W;
  template <class T>
  static void transpose_rows(const T* src, int64_t ld, int K, int rows, float* out, int ldo) {
    for (int kk = 0; kk < K; ++kk)
      for (int i = 0; i < W; ++i)
        out[int64_t(kk) * ldo + i] = i < rows ? to_f32(src[i * ld + kk]) : 0.0f;
  }
};

// What a trait offers beyond the common interface, and its operand formats. Each trait states
// its own (FLASHSDPA_TRAIT_CAPS in its body): capabilities are never inherited from the trait a
// trait takes its code from, so a fast path written for one operand format cannot switch on
// silently in a derived trait with another (caps<Ops>() refuses to compile otherwise).
struct TraitCaps {
  // scale_in_a: the scores' scale * log2(e) is folded into the fp32 copy of Q (else score_row
  // applies it). prep_a: A operands made from fp32 tiles (P, dS) go through prep_a (a tier with
  // another operand format converts them; fp32 tiers use them in place). inner_pack: elements
  // of the inner dimension per float slot of the A / B operands (bf16 pairs: 2).
  bool scale_in_a, prep_a;
  int inner_pack;
  // fused_exp: gemm_exp, the S GEMM with the softmax's exponentials fused into its tile stores
  // (flash_fwd.h). transposed_s: softmax_cols, gemm_exp_cols and gemm_strided_b (the
  // forward's S^T = K Q^T path for fp32 inputs, flash_fwd.h run_item_t; gemm_strided_b also
  // reads the fp32 backward's operands in place, flash_bwd.h in_place).
  bool fused_exp, transposed_s;
};
#define FLASHSDPA_TRAIT_CAPS(Self, scale_in_a, prep_a, inner_pack, fused_exp, transposed_s) \
  using CapsOwner = Self;                                                                     \
  static constexpr TraitCaps kCaps{scale_in_a, prep_a, inner_pack, fused_exp, transposed_s};
template <class Ops>
constexpr TraitCaps caps() {
  static_assert(std::is_same<typename Ops::CapsOwner, Ops>::value,
                "each trait states its own capabilities (FLASHSDPA_TRAIT_CAPS)");
  return Ops::kCaps;
}

// Whether the backward makes P and dS per S / dP GEMM tile while it is in L1 (flash_bwd.h,
// fused_rows; gemm_rows_then): every trait whose GEMMs run on its micro-tile, so all but the
// tile unit's (AMX: bf16 operands, prep_a, and no fused exponentials).
template <class Ops>
constexpr bool fused_bwd_rows() {
  return caps<Ops>().scale_in_a || caps<Ops>().fused_exp;
}

// Whether the backward's fused tiles make S and dP in one micro-tile, P and dS in registers
// straight into the bf16 operands of the dV, dK and dQ GEMMs (gemm_sdp_loop; flash_bwd.h
// fused_rows): traits with fused_bwd_rows that give a micro_tile_sdp (Ops::kSdpRows rows).
template <class Ops, class = void>
struct HasSdpTile : std::false_type {};
template <class Ops>
struct HasSdpTile<Ops, std::void_t<decltype(Ops::kSdpRows)>> : std::true_type {};
template <class Ops>
constexpr bool bwd_sdp() {
  return fused_bwd_rows<Ops>() && HasSdpTile<Ops>::value;
}

// A band's restriction of a gemm (visibility.h), per group of MR rows: the group of rows
// [i, i + R) needs only the columns of B (on_n) or the inner steps (!on_n) in
// [lo_off + i, hi_off + i + R) (either side only when has_lo / has_hi): before them lies the
// band's left edge, after them its diagonal. Skipped C tiles are left as they are.
struct RowLimit {
  bool has_hi;
  int64_t hi_off;
  bool has_lo;
  int64_t lo_off;
  bool on_n;
};

// Calls Ops::micro_tile<TransA, r> (kExp, not 0: its fused-exponential form with exp2_horner's
// polynomial of that degree, gemm_exp_loop, band or not, with the trait's epilogue arguments
// `ex`) for a run-time row count r in [1, R].
template <class Ops, bool TransA, int R, int kExp = 0, bool kColRef = false, class... Ex>
inline void micro_tile_rows(int r, int K, const float* a, int lda, const float* panel, float* c,
                            int ldc, bool accumulate, Ex... ex) {
  if constexpr (R > 1) {
    if (r != R)
      return micro_tile_rows<Ops, TransA, R - 1, kExp, kColRef>(r, K, a, lda, panel, c, ldc,
                                                               accumulate, ex...);
  }
  if constexpr (kColRef)
    Ops::template micro_tile<TransA, R, kExp, true>(K, a, lda, panel, c, ldc, false, ex...);
  else if constexpr (kExp != 0)
    Ops::template micro_tile<TransA, R, kExp>(K, a, lda, panel, c, ldc, false, ex...);
  else
    Ops::template micro_tile<TransA, R>(K, a, lda, panel, c, ldc, accumulate);
}

// The panel / row-group loops around a trait's micro-tile, shared by every tier:
// C[M][round_up(N, NR)] (= or +=) A * B. A[i][kk] = a[i*lda + kk], or a[kk*lda + i] if TransA.
// B: panels from pack_b / pack_bt with the same N and at least K rows, `bstride` floats apart.
// The micro-tiles of C[M][N] in panel-outer order (a B panel stays in L1 while every row group
// uses it): f(p, i, R, kb, ke) for panel p, rows [i, i + R) (R <= MR), inner steps [kb, ke).
// Under a RowLimit (tiles a band's edge crosses) a group skips the panels (on_n) or the inner
// steps (!on_n) none of its rows sees; groups with nothing to do are skipped.
template <int NR, int MR, class F>
inline void for_each_tile(int M, int N, int K, const RowLimit* lim, F&& f) {
  const int np = int(ceil_div(N, NR));
  for (int p = 0; p < np; ++p) {
    for (int i = 0; i < M; i += MR) {
      const int R = M - i < MR ? M - i : MR;
      int kb = 0, ke = K;
      if (lim) {
        const int64_t hi = lim->has_hi ? lim->hi_off + i + R : int64_t(1) << 62;
        const int64_t lo = lim->has_lo ? lim->lo_off + i : 0;
        if (lim->on_n) {
          if (hi <= int64_t(p) * NR || lo >= int64_t(p + 1) * NR) continue;
        } else {
          ke = int(max64(0, min64(K, hi)));
          kb = int(max64(0, min64(ke, lo)));
          if (kb == ke) continue;
        }
      }
      f(p, i, R, kb, ke);
    }
  }
}

// The columns of one tile (panel p, rows [i, i + R)) its row n sees under a RowLimit on the
// columns (on_n; none: all): [first(n), end(n)) of [0, NR).
template <int NR>
struct TileBand {
  static constexpr int64_t kAll = int64_t(1) << 40;
  int64_t lo, hi;  // row n: [lo + n, hi + n), unclamped
  int R;
  TileBand(const RowLimit* lim, int p, int i, int R_)
      : lo(lim && lim->has_lo ? lim->lo_off + i - int64_t(p) * NR : -kAll),
        hi(lim && lim->has_hi ? lim->hi_off + i + 1 - int64_t(p) * NR : kAll),
        R(R_) {}
  bool all() const { return lo + R - 1 <= 0 && hi >= NR; }  // every row sees the whole tile
  bool none() const { return lo >= NR || hi + R - 1 <= 0; }  // no row sees any of it
  int first(int n) const { return int(max64(0, min64(NR, lo + n))); }
  int end(int n) const { return int(max64(0, min64(NR, hi + n))); }
  // Every row's [first, end) as bits (bit x: column x) for a fused epilogue's band argument
  // (micro_tile); null when every row sees the whole tile.
  const uint32_t* bits(uint32_t* out) const {
    static_assert(NR <= 32, "a row's columns in one word");
    if (all()) return nullptr;
    for (int n = 0; n < R; ++n) {
      const int f = first(n), e = end(n);
      out[n] = e > f ? uint32_t((uint64_t(1) << e) - (uint64_t(1) << f)) : 0u;
    }
    return out;
  }
};

// Zeroes rows [0, R) of an NR-column tile.
template <int NR>
inline void zero_tile(float* c, int ldc, int R) {
  for (int n = 0; n < R; ++n)
    for (int x = 0; x < NR; ++x) c[int64_t(n) * ldc + x] = 0.0f;
}

template <class Ops, bool TransA>
inline void gemm_loop(int M, int N, int K, const float* a, int lda, const float* bp,
                      int64_t bstride, float* c, int ldc, bool accumulate, const RowLimit* lim) {
  constexpr int NR = Ops::NR, MR = Ops::MR, pack = caps<Ops>().inner_pack;
  for_each_tile<NR, MR>(M, N, K, lim, [&](int p, int i, int R, int kb, int ke) {
    const int skip = kb / pack;  // inner steps skipped, in the operands' packed units
    const float* ai = TransA ? a + i + int64_t(skip) * lda : a + int64_t(i) * lda + skip;
    micro_tile_rows<Ops, TransA, MR>(R, ke - skip * pack, ai, lda, bp + p * bstride + skip * NR,
                                     c + p * NR + int64_t(i) * ldc, ldc, accumulate);
  });
}

// The forward's S = Q K^T with the softmax's exponentials fused into the tile stores, for a
// trait with fused_exp: N a multiple of NR, sumv zeroed by the caller. Saves the separate max
// and exp passes over S. (flash_fwd.h: the reference mref is the running max of the earlier
// blocks.) The micro-tile exponentiates its tile in registers (micro_tile<false, R, kDegree>:
// exp2_horner's polynomial of that degree, kExp2DegreeP of the input type), so the exp work
// overlaps the next tile's FMAs, each row's vectors added to sumv + 16 row: a trait with fp32
// operands (scale folded into A) stores 2^(C - mref[row]) over C; one with bf16 operands
// (prep_a) stores 2^(C * mul - mref[row]) rounded to bf16 into p16, the A operand of P V, rows
// ldp16 words apart (ldp16 even: its rows start at fp32 row offsets, as that format's rows
// do). Under a RowLimit `lim` from VisTile::limit_n (a band's edge crosses the block) tiles no
// row of a group sees are skipped as in gemm_loop, and on a crossed tile the columns a row
// does not see are 0 (the fused micro-tile's band bits).
template <class Ops, int kDegree>
inline void gemm_exp_loop(int M, int N, int K, const float* a, int lda, const float* bp,
                          int64_t bstride, float* c, int ldc, const float* mref, float* sumv,
                          const RowLimit* lim, float mul, uint16_t* p16, int64_t ldp16) {
  // the fp32 form takes the scale folded into A (mul unused); the bf16 form applies mul
  static_assert(caps<Ops>().prep_a || caps<Ops>().scale_in_a, "a form of the fused exponentials");
  constexpr int NR = Ops::NR, MR = Ops::MR;
  for_each_tile<NR, MR>(M, N, K, lim, [&](int p, int i, int R, int, int kk) {
    const float* ai = a + int64_t(i) * lda;
    const float* panel = bp + p * bstride;
    uint32_t bits[MR];
    const uint32_t* bb = TileBand<NR>(lim, p, i, R).bits(bits);
    float* sv = sumv + 16 * int64_t(i);
    if constexpr (!caps<Ops>().prep_a)
      micro_tile_rows<Ops, false, MR, kDegree>(R, kk, ai, lda, panel,
                                               c + p * NR + int64_t(i) * ldc, ldc, false,
                                               mref + i, sv, bb);
    else
      micro_tile_rows<Ops, false, MR, kDegree>(R, kk, ai, lda, panel,
                                               reinterpret_cast<float*>(p16 + i * ldp16 + p * NR),
                                               int(ldp16 / 2), false, mref + i, sv, bb, mul);
  });
}

// C[M][round_up(N, NR)] = A * B tile by tile, each tile's rows handed, while the tile is in L1,
// to f(row, r, p, first, end): row r of panel p, [first, end) the columns r sees under `lim`
// (on the columns; none: all). A tile no row of its group sees is set to 0 without a product:
// the gemms that read such a tile by other groups (the backward's dK / dV) read zeros there.
template <class Ops, class F>
inline void gemm_rows_then(int M, int N, int K, const float* a, int lda, const float* bp,
                           int64_t bstride, float* c, int ldc, const RowLimit* lim, F&& f) {
  constexpr int NR = Ops::NR, MR = Ops::MR;
  for_each_tile<NR, MR>(M, N, K, nullptr, [&](int p, int i, int R, int, int kk) {
    float* ci = c + p * NR + int64_t(i) * ldc;
    const TileBand<NR> band(lim, p, i, R);
    if (band.none()) return zero_tile<NR>(ci, ldc, R);
    micro_tile_rows<Ops, false, MR>(R, kk, a + int64_t(i) * lda, lda, bp + p * bstride, ci, ldc,
                                    false);
    for (int n = 0; n < R; ++n) f(ci + int64_t(n) * ldc, i + n, p, band.first(n), band.end(n));
  });
}

// Ops::micro_tile_sdp<r> for a run-time row count r in [1, R].
template <class Ops, int R, class... Args>
inline void sdp_rows(int r, Args... args) {
  if constexpr (R > 1) {
    if (r != R) return sdp_rows<Ops, R - 1>(r, args...);
  }
  Ops::template micro_tile_sdp<R>(args...);
}

// The backward's S and dP GEMMs in one pass for a trait with Ops::micro_tile_sdp (bwd_sdp):
// C-tiles of kSdpRows rows x NR columns in panel-outer order, each giving the A operands of the
// dV, dK and dQ GEMMs in the trait's format (prep_a traits: P^T and dS^T at pt, dst as pair
// rows, dS at ds as bf16 rows, ld floats apart; fp32 traits: P at pt, dS at dst, rows ld
// floats apart, which the GEMMs read as they are, ds unused) with the columns row n does not
// see under `lim` 0; a tile no row of its group sees is stored as zeros without a product. M
// (queries) and N (keys, a multiple of NR) as in gemm_rows_then; q / dO: A rows, kt / vt: the
// K^T / V^T panels, bstride floats apart (K = D = Dv).
template <class Ops>
inline void gemm_sdp_loop(int M, int N, int K, const float* q, int ldq, const float* dO,
                          int lddo, const float* kt, const float* vt, int64_t bstride,
                          const RowLimit* lim, float smul, const float* m, const float* inv_l,
                          const float* delta, float* pt, float* dst, float* ds, int ld) {
  constexpr int NR = Ops::NR, MR = Ops::kSdpRows;
  constexpr bool pairs = caps<Ops>().prep_a;
  static_assert(MR % 2 == 0, "row groups of whole pairs");
  for_each_tile<NR, MR>(M, N, K, nullptr, [&](int p, int i, int R, int, int kk) {
    const TileBand<NR> band(lim, p, i, R);
    uint16_t* dsr = reinterpret_cast<uint16_t*>(ds + int64_t(i) * ld) + p * NR;
    const int64_t off = int64_t(pairs ? i / 2 : i) * ld + p * NR;
    if (band.none()) {  // zeros: NR floats of each (pair) row of pt / dst, NR bf16 of each ds row
      for (int n = 0; n < R; n += pairs ? 2 : 1) {
        const int64_t row = off + (pairs ? n / 2 : n) * int64_t(ld);
        for (int x = 0; x < NR; ++x) pt[row + x] = dst[row + x] = 0.0f;
      }
      for (int n = 0; pairs && n < R; ++n)
        for (int x = 0; x < NR; ++x) dsr[n * 2 * int64_t(ld) + x] = 0;
      return;
    }
    uint32_t bits[MR];
    const uint32_t* bb = band.bits(bits);
    sdp_rows<Ops, MR>(R, kk, q + int64_t(i) * ldq, ldq, dO + int64_t(i) * lddo, lddo,
                      kt + p * bstride, vt + p * bstride, bb, smul, m + i, inv_l + i, delta + i,
                      pt + off, dst + off, ld, dsr, 2 * int64_t(ld));
  });
}
// gemm_exp_loop for the transposed scores S^T = K Q^T (flash_fwd.h, run_item_t): the
// reference and the sums are per column (query): mref[n], sumv[n] for n < round_up(N, NR).
// Under a RowLimit (lim_st: a band's edge crosses the block; rows: keys, on_n: queries) a tile
// its keys see in part takes the fused micro-tile with band bits (0 on the queries a key is not
// seen by), and one they do not see at all is set to 0: P V's query groups read it (they
// reduce over whole key groups).
template <class Ops>
inline void gemm_exp_cols_loop(int M, int N, int K, const float* a, int lda, const float* bp,
                               int64_t bstride, float* c, int ldc, const float* mref,
                               float* sumv, const RowLimit* lim) {
  constexpr int NR = Ops::NR, MR = Ops::MR;
  for_each_tile<NR, MR>(M, N, K, nullptr, [&](int p, int i, int R, int, int kk) {
    float* ci = c + p * NR + int64_t(i) * ldc;
    const uint32_t* band = nullptr;
    uint32_t bits[MR];
    if (lim) {  // (blocks without a band: no TileBand per tile)
      const TileBand<NR> tb(lim, p, i, R);
      if (tb.none()) return zero_tile<NR>(ci, ldc, R);
      band = tb.bits(bits);
    }
    micro_tile_rows<Ops, false, MR, 6, true>(R, kk, a + int64_t(i) * lda, lda,
                                             bp + p * bstride, ci, ldc, false, mref + p * NR,
                                             sumv + p * NR, band);
  });
}

// C[M][N] (= or +=) A B, A[i][kk] = a[i*lda + kk] or, TransA, a[kk*lda + i], with B's rows
// read in place, ldb floats apart (B[kk][n] = b[kk*ldb + n], N a multiple of NR): the
// transposed-score path's P V with V unpacked, the fp32 backward's dV / dK / dQ with dO, Q and
// K unpacked (a trait's micro_tile<TransA, R, 0, false, true>). Under a RowLimit (on the
// inner steps) a group of rows reduces over its steps only, as gemm_loop does.
template <class Ops, bool TransA>
inline void gemm_strided_b_loop(int M, int N, int K, const float* a, int lda, const float* b,
                                int64_t ldb, float* c, int ldc, bool accumulate,
                                const RowLimit* lim) {
  constexpr int NR = Ops::NR, MR = Ops::MR;
  for_each_tile<NR, MR>(M, N, K, lim, [&](int p, int i, int R, int kb, int ke) {
    const float* ai = TransA ? a + i + int64_t(kb) * lda : a + int64_t(i) * lda + kb;
    with_rows<MR>(R, [&](auto rows) {
      Ops::template micro_tile<TransA, decltype(rows)::value, 0, false, true>(
          ke - kb, ai, lda, b + p * NR + int64_t(kb) * ldb, c + p * NR + int64_t(i) * ldc, ldc,
          accumulate, nullptr, nullptr, nullptr, ldb);
    });
  });
}

// A trait's gemm (and, with fused_exp, gemm_exp): the loops above around its own micro-tile.
#define FLASHSDPA_TRAIT_GEMM(Self)                                                           \
  template <bool TransA>                                                                     \
  static void gemm(int M, int N, int K, const float* a, int lda, const float* bp,            \
                   int64_t bstride, float* c, int ldc, bool accumulate,                      \
                   const RowLimit* lim = nullptr) {                                          \
    gemm_loop<Self, TransA>(M, N, K, a, lda, bp, bstride, c, ldc, accumulate, lim);          \
  }
#define FLASHSDPA_TRAIT_GEMM_EXP(Self)                                                       \
  template <int kDegree>                                                                     \
  static void gemm_exp(int M, int N, int K, const float* a, int lda, const float* bp,        \
                       int64_t bstride, float* c, int ldc, const float* mref, float* sumv,   \
                       const RowLimit* lim, float mul, uint16_t* p16, int64_t ldp16) {       \
    gemm_exp_loop<Self, kDegree>(M, N, K, a, lda, bp, bstride, c, ldc, mref, sumv, lim, mul,  \
                                 p16, ldp16);                                                \
  }

// The K or V rows of keys [0, n) as the decode kernels read them (flash_decode.h), in one of
// two forms with one interface, the kernels templated on it:
//   row(j)         key j's row (where the kernel's columns start: `shift`)
//   from(j)        the rows of keys j ..;  shift(d): their columns from d
//   cursor(j)      a walk over keys j, j + 1, ... for the kernels' loops: row(), next(), and,
//                  where prefetches(), pf_row(): the row to prefetch while this key's is read
//                  (the same key of the next block; null where kPfGaps: none), one line per
//                  `every` bytes of the part the kernel reads, with the non-temporal hint
//                  (into L1, a short way ahead) where kNta, else into L2 (a block ahead); a
//                  template parameter, not a field: the kernels' loops read no flag for it
// StridedRows: rows `ld` elements apart (a contiguous cache, a gathered block), pf_row `pf`
// elements on (0: none); its cursor steps a pointer, as the loops over a contiguous cache
// always did (computing each key's row costs the loops registers they do not have to spare).
// TableRows: a table of row pointers (a paged cache's, filled a block at a time, so that the
// kernels cross its pages without leaving their loops), `off` elements into each; its cursor
// is an index into the tables.
template <class T, bool NTA = false>
struct StridedRows {
  using Elem = T;
  static constexpr bool kNta = NTA;
  const T* base;
  int64_t ld, pf;
  int every;
  const T* row(int j) const { return base + j * ld; }
  bool prefetches() const { return pf != 0; }
  struct Cursor {
    static constexpr bool kPfGaps = false;
    const T* r;
    int64_t ld, pf;
    const T* row() const { return r; }
    const T* pf_row() const { return r + pf; }
    void next() { r += ld; }
  };
  Cursor cursor(int j = 0) const { return {row(j), ld, pf}; }
  StridedRows from(int j) const { return {row(j), ld, pf, every}; }
  StridedRows shift(int64_t d) const { return {base + d, ld, pf, every}; }
};
template <class T, bool NTA = false>
struct TableRows {
  using Elem = T;
  static constexpr bool kNta = NTA;
  const T* const* at;
  const T* const* pf;  // null: no prefetches
  int64_t off;
  int every;
  const T* row(int j) const { return at[j] + off; }
  bool prefetches() const { return pf != nullptr; }
  struct Cursor {
    static constexpr bool kPfGaps = true;  // keys past the sequence's
    const T* const* at;
    const T* const* pf;
    int64_t off;
    int j;
    const T* row() const { return at[j] + off; }
    const T* pf_row() const { return pf[j] ? pf[j] + off : nullptr; }
    void next() { ++j; }
  };
  Cursor cursor(int j = 0) const { return {at, pf, off, j}; }
  TableRows from(int j) const { return {at + j, pf ? pf + j : nullptr, off, every}; }
  TableRows shift(int64_t d) const { return {at, pf, off + d, every}; }
};

// The traits the decode path uses over K / V of storage type KV (a tier whose operand format
// does not suit the short-query kernels specialises this to an fp32 trait): `type`;
// `fp16_pv`, the one running P V over float8 V in fp16 where the plan allows it
// (KernelPolicy::fp16_pv; `type` again where a tier has no such kernel); and `exact`, where
// `type`'s float8 widening reads NaN bytes as numbers (`type` again where not): `type` then
// has denormals_kept(), whether an item may take it on this thread (FlashDecode::run_split;
// `exact` the others), and nan_bytes(bytes, n), with which the decode flow finds the blocks
// whose NaN bytes it sets after the kernels (FlashDecode::patch_nan).
template <class Ops, class KV>
struct DecodeOpsOf {
  using type = Ops;
  using fp16_pv = Ops;
  using exact = Ops;
};

struct GenericOps {
  static constexpr int NR = 8;   // panel width: 2 vectors
  static constexpr int MR = 6;   // rows per micro-tile: 6 x 2 = 12 vector accumulators
  FLASHSDPA_TRAIT_CAPS(GenericOps, /*scale_in_a=*/true, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/false, /*transposed_s=*/false)

  // Called by each thread before and after a run of work items (per-thread CPU state, such as
  // the AMX tile configuration).
  static void thread_begin() {}
  static void thread_end() {}
  static constexpr int kBlockQ = 60;     // forward: query rows per block (a multiple of MR)
  static constexpr int kBlockQBwd = 64;  // backward: query rows per block
  // Light decode's V prefetches (flash_decode.h prefetch_every): one per this many bytes of a
  // row, where the trait's P V reads a row in one pass and the hardware streamer fetches the
  // lines between (fewer prefetch instructions let the loads run further ahead); one per line
  // where it does not (Avx2Ops). (This trait leaves prefetching to the hardware.)
  static constexpr int kLightVEvery = 256;
  // Whether the trait's decode prefetches may run near (KernelPolicy::near_pf: one sub-block's
  // bytes ahead, decode_sub_bytes(), with the non-temporal hint, rather than a block ahead into
  // L2; FlashDecode::ahead). This trait does not prefetch.
  static constexpr bool kDecodeNearPf = false;
  // Whether the trait's decode_pv keeps a call's accumulators in registers over all its keys
  // (loaded and stored once a call): then an all-heads item's P V runs per kv head over the
  // whole block, not a sub-block at a time (KernelPolicy::pv_whole, FlashDecode::split). Not
  // here, nor in the AVX2 trait, whose P V loads and stores them every few keys anyway.
  static constexpr bool kDecodePvWhole = false;
  // A float8 cache's K and V as the decode kernels widen them: the values / these (folded into
  // the scales: FlashDecode::kv_factor).
  static constexpr float kE4m3UnitK = kE4m3Unit, kE4m3UnitV = kE4m3Unit;
  using Row = RowOps<VecF4>;  // the row operations and operand formats (row_ops.h)


  // One R x NR tile: C[0..R)[0..NR) (=|+=) sum_kk A[i][kk] * panel[kk][0..NR).
  template <bool TransA, int R>
  static inline void micro_tile(int K, const float* a, int lda, const float* panel, float* c,
                                int ldc, bool accumulate) {
    vf4 acc0[R], acc1[R];
    for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = vsplat(0.0f);
    for (int kk = 0; kk < K; ++kk) {
      const vf4 b0 = vload(panel + int64_t(kk) * NR), b1 = vload(panel + int64_t(kk) * NR + 4);
      for (int i = 0; i < R; ++i) {
        const vf4 av = vsplat(TransA ? a[int64_t(kk) * lda + i] : a[int64_t(i) * lda + kk]);
        acc0[i] += av * b0;
        acc1[i] += av * b1;
      }
    }
    for (int i = 0; i < R; ++i) {
      float* cr = c + int64_t(i) * ldc;
      if (accumulate) {
        acc0[i] += vload(cr);
        acc1[i] += vload(cr + 4);
      }
      vstore(cr, acc0[i]);
      vstore(cr + 4, acc1[i]);
    }
  }

  FLASHSDPA_TRAIT_GEMM(GenericOps)

  // The A operand of gemm<TransA>(M, N, K, ...) from an fp32 tile (row-major, ld floats):
  // fp32 tiers use the tile itself.
  template <bool TransA>
  static const float* prep_a(const float* tile, int ld, int M, int K, float* buf, int* lda) {
    (void)M, (void)K, (void)buf;
    *lda = ld;
    return tile;
  }



  // ---- short-query (decode) kernels: K and V rows read in place, no packing ---------------------
  // The orders of the dims in which the decode kernels over a KV cache take q's rows
  // (decode_to_order: FlashDecode puts q in it once per item) and keep the accumulators
  // (decode_to_natural: FlashDecode puts them back when it writes its partials); the two may
  // differ (Avx512Bf16DecodeOps: q natural, accumulators in unpack order). Natural here.
  template <class KV>
  static void decode_to_order(float*, int) {}
  template <class KV>
  static void decode_to_natural(float*, int) {}
  // The keys decode_qk takes at a time for M query rows over a KV cache (a call over fewer, or
  // the last keys of a call, take a slower path): FlashDecode's sub-blocks are multiples of it.
  template <class KV>
  static constexpr int decode_key_group(int64_t) { return 1; }

  // s[r*lds + j] = sum_d q[r*ldq + d] * K[j][d] for r < M, j < nk. (The SIMD traits also
  // prefetch the rows' pf_row; this one leaves it to the hardware.)
  template <class Rows>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq, int M,
                        float* s, int lds) {
    for (int j = 0; j < nk; ++j)
      for (int r = 0; r < M; ++r)
        s[int64_t(r) * lds + j] = Row::dot_row(q + int64_t(r) * ldq, k.row(j), D);
  }

  // acc[r*ldacc + d] += sum_j p[r*ldp + j] * V[j][d] for r < M, d < Dv.
  template <class Rows>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                        float* acc, int ldacc) {
    for (int j = 0; j < nk; ++j)
      for (int r = 0; r < M; ++r)
        Row::axpy_row(p[int64_t(r) * ldp + j], v.row(j), acc + int64_t(r) * ldacc, Dv);
  }

  // out[c] = x[c] * keep(bh, i, j0 + c) / (1 - p) for c < n (x and out may alias).
  static void dropout_row(const AttnParams& p, uint64_t bh, int64_t i, int64_t j0, int n,
                          const float* x, float* out) {
    const uint32_t thr = dropout_threshold(p.dropout_p);
    const float rscale = 1.0f / (1.0f - p.dropout_p);
    constexpr int kChunk = 64;
    uint8_t keep[kChunk];
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int len = n - c0 < kChunk ? n - c0 : kChunk;
      dropout_keep_row(p.seed, p.offset, bh, i, j0 + c0, len, thr, keep);
      for (int c = 0; c < len; ++c) out[c0 + c] = keep[c] ? x[c0 + c] * rscale : 0.0f;
    }
  }




};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
