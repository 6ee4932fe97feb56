// The AVX-512 (F/BW/VL/DQ) trait: a 12x32 fp32 micro-kernel in zmm registers and 16-wide softmax
// rows; everything else (widening loads, Philox, decode kernels, ...) comes from the AVX2 trait,
// compiled here with the AVX-512 flags.
//
// Register blocking: a 12-row x 32-column tile of C lives in 24 zmm accumulators; per step of
// the inner dimension one 32-wide row of the B panel is loaded (2 zmm) and each of the 12 A
// values is broadcast into 2 FMAs: 24 FMAs per 2 loads + 12 broadcasts, 27 of 32 registers.
#pragma once
#include "avx2_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

inline __mmask16 tail_mask16(int n) { return __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 32 words, an e4m3 byte in each one's high half -> the fp16 bits of the values x 2^-8
// (the AVX2 trait's ymm overload's steps).
inline __m512i e4m3_fp16_from_high(__m512i w) {
  const __m512i x = _mm512_and_si512(_mm512_srai_epi16(w, 1), _mm512_set1_epi16(int16_t(0xBFFF)));
  const __m512i t = _mm512_add_epi16(x, _mm512_set1_epi16(0x80));
  // x | (t & 0x4000): vpternlog's truth table for A | (B & C)
  return _mm512_ternarylogic_epi32(x, t, _mm512_set1_epi16(0x4000), 0xF8);
}
// 32 e4m3 bytes -> the fp16 bits of the values x 2^-8, in order.
inline __m512i e4m3_fp16_bits(__m256i b) {
  return e4m3_fp16_from_high(_mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8));
}
// 16 e4m3 bytes -> the values x 2^-8.
inline __m512 e4m3_widen16(__m128i b) {
  return _mm512_cvtph_ps(_mm512_castsi512_si256(e4m3_fp16_bits(_mm256_castsi128_si256(b))));
}
// 32 e4m3 bytes -> dims 0-15 and 16-31: the integer steps once for both halves (the widening is
// most of an e4m3 decode kernel's instructions).
inline void e4m3_widen32(const e4m3_t* p, __m512* lo, __m512* hi) {
  const __m512i h = e4m3_fp16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
inline __m512 load16(const e4m3_t* p) {
  return e4m3_widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// n < 16 elements, the rest zero (masked loads: nothing past the end is touched)
inline __m512 load16_partial(const float* p, int n) {
  return _mm512_maskz_loadu_ps(tail_mask16(n), p);
}
inline __m512 load16_partial(const bf16_t* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(tail_mask16(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16_partial(const e4m3_t* p, int n) {
  return e4m3_widen16(_mm_maskz_loadu_epi8(tail_mask16(n), p));
}
inline __m512 load16_partial(const f16_t* p, int n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask16(n), p));
}
// C chunks of 16 elements from p, widened (e4m3 in pairs: e4m3_widen32).
template <int C, class T>
inline void load16s(const T* p, __m512* x) {
  if constexpr (std::is_same<T, e4m3_t>::value && C % 2 == 0) {
#pragma GCC unroll 4
    for (int c = 0; c < C; c += 2) e4m3_widen32(p + 16 * c, &x[c], &x[c + 1]);
  } else {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) x[c] = load16(p + 16 * c);
  }
}

// The four sums of x0 .. x3 (each folded to 8 lanes, then a hadd tree).
inline __m128 reduce4(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
  const auto fold = [](__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold(x0), fold(x1)), _mm256_hadd_ps(fold(x2), fold(x3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// exp2 of 16 lanes: exp2_poly's polynomial (scalar.h) with AVX-512's rounding and scaling:
// n = rint(x) by vrndscaleps, 2^n applied by vscalefps (which also saturates large n to inf),
// 4 fewer vector ops per 16 lanes than the magic-number steps of exp2_8. NaN flows through (max
// returns its second operand when one is NaN; NLT_UQ keeps unordered lanes).
// kMasked (lanes that may be -inf: masked scores): x is clamped below at -126, so every
// vscalefps result is a normal fp32 (one that underflows, denormal or 0, takes a microcode
// assist on Intel cores: every masked lane of a causal diagonal tile would), and the lanes
// below -126 are zeroed by the mask: exactly 0. Otherwise (the fused GEMM epilogues, whose
// scores are products: no mask's -inf) two vector ops fewer, x not clamped: what underflows
// gives 0 or a denormal, through an assist only for scores 126 below the running max; a -inf
// (from an infinite input) gives NaN, which sends its block to the two-pass softmax (the fused
// sum is not finite).
// The lanes not in `keep` are 0, whatever x holds there (a band tile's columns a row does not
// see: their results are never formed, so they take no assist either).
template <bool kMasked = true, int kDegree = 6>
inline __m512 exp2_16(__m512 x, __mmask16 keep = 0xffff) {
  const __m512 lo = _mm512_set1_ps(-126.0f);
  const __m512 xc = kMasked ? _mm512_max_ps(lo, x) : x;
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  const __m512 p = exp2_horner<kDegree>(
      f, [](float c) { return _mm512_set1_ps(c); },
      [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); });
  if constexpr (kMasked) keep &= _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// The fused exponentials of one row of a micro-tile (kExp, one reference per row): P = 2^x of
// its two vectors (0 on the columns not set in `bits`), their sum added to the row's 16 lanes
// at sv; kDegree: exp2_horner's.
// (Always inlined: a call would pass the tile's registers through memory.)
template <int kDegree = 6>
__attribute__((always_inline)) inline void exp2_row_pair(__m512 x0, __m512 x1, uint32_t bits,
                                                        float* sv, __m512* p0, __m512* p1) {
  *p0 = exp2_16<false, kDegree>(x0, __mmask16(bits));
  *p1 = exp2_16<false, kDegree>(x1, __mmask16(bits >> 16));
  _mm512_storeu_ps(sv, _mm512_add_ps(_mm512_loadu_ps(sv), _mm512_add_ps(*p0, *p1)));
}

// The 12-row x 32-column zmm tile of the fp32 (here) and bf16 (avx512bf16_ops.h) micro-kernels,
// written once: 24 named accumulators c<row><half> (rows 0-9, a, b), a macro applied to every
// row as M(row name, row index), and the store of the first R rows (added to C when accumulating).
#define FLASHSDPA_ZMM_TILE_ACCUMULATORS                                         \
  const __m512 z_ = _mm512_setzero_ps();                                      \
  __m512 c00 = z_, c01 = z_, c10 = z_, c11 = z_, c20 = z_, c21 = z_, c30 = z_, c31 = z_; \
  __m512 c40 = z_, c41 = z_, c50 = z_, c51 = z_, c60 = z_, c61 = z_, c70 = z_, c71 = z_; \
  __m512 c80 = z_, c81 = z_, c90 = z_, c91 = z_, ca0 = z_, ca1 = z_, cb0 = z_, cb1 = z_;
#define FLASHSDPA_ZMM_TILE_EACH_ROW(M)                                          \
  M(0, 0) M(1, 1) M(2, 2) M(3, 3) M(4, 4) M(5, 5) M(6, 6) M(7, 7) M(8, 8) M(9, 9) M(a, 10) \
  M(b, 11)
#define FLASHSDPA_ZMM_TILE_STORE_ROW(i, n) FLASHSDPA_TILE_STORE_ROW(_mm512, 16, i, n)

// The row operations' vector type (row_ops.h) on zmm.
struct VecZ16 {
  FLASHSDPA_X86_VEC_ARITH(_mm512, __m512)
  static constexpr int W = 16, kSums = 2;
  static reg exp2(reg x) { return exp2_16(x); }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  static float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  static reg first_n(reg x, int n, float fill) {
    return _mm512_mask_blend_ps(tail_mask16(n), splat(fill), x);
  }
  static reg keep_from(reg x, int n, float fill) {
    return _mm512_mask_blend_ps(tail_mask16(n), x, splat(fill));
  }
  static reg iota(float s) {
    return _mm512_add_ps(splat(s), _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                                 2, 1, 0));
  }
  template <class T> static reg load_t(const T* p) { return load16(p); }
  template <class T> static reg load_n(const T* p, int n) { return load16_partial(p, n); }
  // fp16 stores round through the AVX2 halves (F16C); bf16 ones by store8's integer rounding
  // on all 16 lanes (round to nearest even, NaN -> qNaN: the same bits; plain AVX-512 has no
  // bf16 conversion)
  static __m256 high_half(reg v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  }
  static __m256i round_bf16(reg v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), hi,
                             _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(r);
  }
  template <class T>
  static void store_t(T* p, reg v) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(p, v);
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16(v));
    } else {
      store8(p, _mm512_castps512_ps256(v));
      store8(p + 8, high_half(v));
    }
  }
  template <class T>
  static void store_n(T* p, reg v, int n) {
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(p, tail_mask16(n), v);
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      _mm256_mask_storeu_epi16(p, tail_mask16(n), round_bf16(v));
    } else if (n <= 8) {
      store8_partial(p, _mm512_castps512_ps256(v), n);
    } else {
      store8(p, _mm512_castps512_ps256(v));
      store8_partial(p + 8, high_half(v), n - 8);
    }
  }
};

struct Avx512Ops : Avx2Ops {
  static constexpr int NR = 32;  // panel width: 2 zmm
  static constexpr int MR = 12;  // 12 x 2 = 24 accumulators
  static constexpr int kBlockQ = 192;
  static constexpr int kBlockQBwd = 96;
  static constexpr int kLightVEvery = GenericOps::kLightVEvery;  // P V: a row in one pass (pv_zmm)
  // (its decode prefetches a block ahead: near ones were slower on Zen 4, in every decode case)
  static constexpr bool kDecodeNearPf = false;
  // (pv_zmm and the bf16 tier's pv_pairs hold the accumulators over a call's keys)
  static constexpr bool kDecodePvWhole = true;
  using Row = RowOps<VecZ16>;  // the row operations and operand formats (row_ops.h)
  FLASHSDPA_TRAIT_CAPS(Avx512Ops, /*scale_in_a=*/true, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/true, /*transposed_s=*/true)
  // its decode kernels keep the dims in their natural order (not the AVX2 trait's chunk order)
  using GenericOps::decode_to_order;
  using GenericOps::decode_to_natural;
  template <class KV>
  static constexpr int decode_key_group(int64_t) { return 4; }  // qk_key_groups<4>, every type

  // C tile of R rows x 32 columns (=|+=) A * panel, 24 named zmm accumulators. With kExp (the
  // fused softmax of gemm_exp; exp2_horner's degree) the tile is stored as 2^(C - mref[row])
  // and each row's two vectors are added to its 16-lane sum at sumv + 16 row; with kExp and
  // kColRef (gemm_exp_cols, transposed scores) as 2^(C - mref[column]), column sums added at
  // sumv[0, 32); `band` (a tile a band's edge crosses): row n's P is 0 on the columns not set
  // in band[n] (bit x: column x; TileBand::bits). kStridedB: the panel's rows are ldb floats
  // apart (B read in place) instead of NR.
  template <bool TransA, int R, int kExp = 0, bool kColRef = false, bool kStridedB = false>
  static inline void micro_tile(int K, const float* a, int lda, const float* panel, float* c,
                                int ldc, bool accumulate, const float* mref = nullptr,
                                float* sumv = nullptr, const uint32_t* band = nullptr,
                                int64_t ldb = NR) {
    static_assert(R >= 1 && R <= 12, "1 to 12 rows");
    const int64_t sb = kStridedB ? ldb : NR;
    FLASHSDPA_ZMM_TILE_ACCUMULATORS
    const int64_t step_i = TransA ? 1 : lda, step_k = TransA ? lda : 1;
    const float* a0 = a;
#define FLASHSDPA_ROW(i, n) FLASHSDPA_TILE_FMA_ROW(_mm512, i, n, _mm512_set1_ps(a0[(n) * step_i]))
#pragma GCC unroll 2
    for (int kk = 0; kk < K; ++kk, a0 += step_k) {
      const __m512 b0 = _mm512_loadu_ps(panel + kk * sb);
      const __m512 b1 = _mm512_loadu_ps(panel + kk * sb + 16);
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_ROW)
    }
#undef FLASHSDPA_ROW
    if constexpr (kExp != 0 && kColRef) {
      // transposed scores: one reference per column (query), column sums at sumv[0, 32)
      const __m512 m0 = _mm512_loadu_ps(mref), m1 = _mm512_loadu_ps(mref + 16);
      __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
#define FLASHSDPA_EXP_ROW(i, n)                                                 \
  if (R > n) {                                                                \
    const uint32_t bits = band ? band[n] : ~0u;                               \
    const __m512 p0 = exp2_16<false, kExp>(_mm512_sub_ps(c##i##0, m0), __mmask16(bits)); \
    const __m512 p1 = exp2_16<false, kExp>(_mm512_sub_ps(c##i##1, m1), __mmask16(bits >> 16)); \
    _mm512_storeu_ps(c + int64_t(n) * ldc, p0);                               \
    _mm512_storeu_ps(c + int64_t(n) * ldc + 16, p1);                          \
    t0 = _mm512_add_ps(t0, p0);                                               \
    t1 = _mm512_add_ps(t1, p1);                                               \
  }
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_EXP_ROW)
#undef FLASHSDPA_EXP_ROW
      _mm512_storeu_ps(sumv, _mm512_add_ps(_mm512_loadu_ps(sumv), t0));
      _mm512_storeu_ps(sumv + 16, _mm512_add_ps(_mm512_loadu_ps(sumv + 16), t1));
    } else if constexpr (kExp != 0) {
#define FLASHSDPA_EXP_ROW(i, n)                                                       \
  if (R > n) {                                                                      \
    const __m512 mr = _mm512_set1_ps(mref[n]);                                      \
    __m512 p0, p1;                                                                  \
    exp2_row_pair<kExp>(_mm512_sub_ps(c##i##0, mr), _mm512_sub_ps(c##i##1, mr),     \
                  band ? band[n] : ~0u, sumv + 16 * (n), &p0, &p1);                 \
    _mm512_storeu_ps(c + int64_t(n) * ldc, p0);                                     \
    _mm512_storeu_ps(c + int64_t(n) * ldc + 16, p1);                                \
  }
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_EXP_ROW)
#undef FLASHSDPA_EXP_ROW
    } else {
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_ZMM_TILE_STORE_ROW)
    }
  }

  FLASHSDPA_TRAIT_GEMM(Avx512Ops)

  // The backward's S and dP tiles of one group of R <= kSdpRows rows in one micro-tile
  // (gemm_sdp_loop, flash_bwd.h fused_rows): S = Q K^T and dP = dO V^T over the same inner
  // steps (D == Dv), 6 x 32 each (Q pre-scaled), then P = 2^(S - m) * inv_l and
  // dS = P (dP - delta) in registers with exp2_band_scaled's and ds_band's operations (0 on the
  // columns not set in band[n]), stored as the fp32 rows the dV, dK (P and dS, read
  // transposed) and dQ GEMMs take as they are: P at pt, dS at ds, ldt floats apart (dst, the
  // bf16 trait's dS^T, is ds here). The same P and dS as the two passes', bit for bit.
  static constexpr int kSdpRows = 6;
  template <int R>
  static inline void micro_tile_sdp(int K, const float* q, int ldq, const float* dO, int lddo,
                                    const float* kt, const float* vt, const uint32_t* band,
                                    float smul, const float* m, const float* inv_l,
                                    const float* delta, float* pt, float* dst, int ldt,
                                    uint16_t* ds16, int64_t ldr) {
    static_assert(R >= 1 && R <= kSdpRows, "1 to 6 rows");
    (void)smul, (void)ds16, (void)ldr;  // (scale folded into Q; no bf16 operand)
    __m512 s[R][2] = {}, d[R][2] = {};  // S and dP accumulators, zeroed
    for (int kk = 0; kk < K; ++kk) {
      const __m512 k0 = _mm512_loadu_ps(kt + kk * NR), k1 = _mm512_loadu_ps(kt + kk * NR + 16);
      const __m512 v0 = _mm512_loadu_ps(vt + kk * NR), v1 = _mm512_loadu_ps(vt + kk * NR + 16);
#pragma GCC unroll 6
      for (int n = 0; n < R; ++n) {
        const __m512 aq = _mm512_set1_ps(q[int64_t(n) * ldq + kk]);
        s[n][0] = _mm512_fmadd_ps(aq, k0, s[n][0]);
        s[n][1] = _mm512_fmadd_ps(aq, k1, s[n][1]);
        const __m512 ad = _mm512_set1_ps(dO[int64_t(n) * lddo + kk]);
        d[n][0] = _mm512_fmadd_ps(ad, v0, d[n][0]);
        d[n][1] = _mm512_fmadd_ps(ad, v1, d[n][1]);
      }
    }
#pragma GCC unroll 6
    for (int n = 0; n < R; ++n) {
      const uint32_t bits = band ? band[n] : ~0u;
      const __m512 mv = _mm512_set1_ps(-m[n]), kv = _mm512_set1_ps(inv_l[n]);
      const __m512 dv = _mm512_set1_ps(delta[n]);
      for (int h = 0; h < 2; ++h) {
        const __mmask16 keep = __mmask16(bits >> (16 * h));
        const __m512 e = exp2_16(_mm512_add_ps(s[n][h], mv), keep);
        const __m512 p = _mm512_mul_ps(e, kv);
        _mm512_storeu_ps(pt + int64_t(n) * ldt + 16 * h, p);
        _mm512_storeu_ps(dst + int64_t(n) * ldt + 16 * h,
                         _mm512_maskz_mul_ps(keep, p, _mm512_sub_ps(d[n][h], dv)));
      }
    }
  }

  // (The fused exponentials computed from the accumulators in place, 3 free registers here;
  // AVX2's 16 registers do it out of line.)
  FLASHSDPA_TRAIT_GEMM_EXP(Avx512Ops)

  // The forward's transposed-score path (flash_fwd.h, run_item_t): S^T = K Q^T, its online
  // softmax down the columns (one per query) of st [nk rows (keys) x ncols (queries), ld
  // floats apart], ncols a multiple of 16. Per column: m' = max(m, column max),
  // alpha = 2^(m - m'), P = 2^(s - m') in place, l = alpha * l + column sum; alpha stored for
  // the caller (acc rows). A column with nothing but -inf keeps m = -inf, P = 0, alpha = 0.
  static void softmax_cols(float* st, int ld, int nk, int ncols, float* m, float* l,
                           float* alpha) {
    const __m512 ninf = _mm512_set1_ps(kNegInf);
    for (int c = 0; c < ncols; c += 16) {
      float* col = st + c;
      __m512 mx0 = ninf, mx1 = ninf;
      int j = 0;
      for (; j + 2 <= nk; j += 2) {
        mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(col + int64_t(j) * ld));
        mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(col + int64_t(j + 1) * ld));
      }
      if (j < nk) mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(col + int64_t(j) * ld));
      const __m512 mold = _mm512_loadu_ps(m + c);
      const __m512 mnew = _mm512_max_ps(mold, _mm512_max_ps(mx0, mx1));
      const __mmask16 empty = _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ);
      const __m512 ref = _mm512_mask_blend_ps(empty, mnew, _mm512_setzero_ps());
      const __m512 a = exp2_16(_mm512_sub_ps(mold, ref));
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      j = 0;
      for (; j + 2 <= nk; j += 2) {
        float* r0 = col + int64_t(j) * ld;
        float* r1 = r0 + ld;
        const __m512 p0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(r0), ref));
        const __m512 p1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(r1), ref));
        _mm512_storeu_ps(r0, p0);
        _mm512_storeu_ps(r1, p1);
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
      }
      if (j < nk) {
        float* r0 = col + int64_t(j) * ld;
        const __m512 p0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(r0), ref));
        _mm512_storeu_ps(r0, p0);
        s0 = _mm512_add_ps(s0, p0);
      }
      _mm512_storeu_ps(m + c, mnew);
      _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), a, _mm512_add_ps(s0, s1)));
      _mm512_storeu_ps(alpha + c, a);
    }
  }

  // C (+)= A B (TransA: A^T B) with B's rows read in place, ldb floats apart (N a multiple of
  // NR).
  template <bool TransA>
  static void gemm_strided_b(int M, int N, int K, const float* a, int lda, const float* b,
                             int64_t ldb, float* c, int ldc, bool accumulate,
                             const RowLimit* lim = nullptr) {
    gemm_strided_b_loop<Avx512Ops, TransA>(M, N, K, a, lda, b, ldb, c, ldc, accumulate, lim);
  }

  // S^T = K Q^T with the exponentials fused, one reference per column (gemm_exp_cols_loop).
  static void gemm_exp_cols(int M, int N, int K, const float* a, int lda, const float* bp,
                            int64_t bstride, float* c, int ldc, const float* mref, float* sumv,
                            const RowLimit* lim = nullptr) {
    gemm_exp_cols_loop<Avx512Ops>(M, N, K, a, lda, bp, bstride, c, ldc, mref, sumv, lim);
  }



  // Decode Q K^T on zmm: 4 keys x R (up to 4) query rows per pass, 4R zmm accumulators over 16
  // dims at a time, each reduced to its dot product by a fold and hadd tree; each chunk of 4 K
  // rows is loaded and widened once for all R rows. (On cores with full-width 512-bit FMA units
  // this is half the FMA instructions of the AVX2 trait's 8-dim qk_4keys, and an e4m3 cache's
  // widening, which costs more than the FMAs it feeds, is done on 16 lanes at once.)
  template <class T, int R>
  static inline void qk_4keys16(const T* const* k4, int D, const float* q, int ldq,
                                float* s, int lds) {
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) a[i][u] = _mm512_setzero_ps();
    // C chunks of 16 dims from d (e4m3: 2, widened together), or one of t < 16 dims
    const auto step = [&](auto chunks, int d, int t) {
      constexpr int C = decltype(chunks)::value;
      __m512 x[4][C];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        if (t == 16) load16s<C>(k4[u] + d, x[u]);
        else x[u][0] = load16_partial(k4[u] + d, t);
      }
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) {
          const float* qi = q + int64_t(i) * ldq + d + 16 * c;
          const __m512 qv = t == 16 ? _mm512_loadu_ps(qi) : _mm512_maskz_loadu_ps(tail_mask16(t), qi);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) a[i][u] = _mm512_fmadd_ps(qv, x[u][c], a[i][u]);
        }
    };
    constexpr int kPair = std::is_same<T, e4m3_t>::value ? 2 : 1;
    int d = 0;
    for (; d + 16 * kPair <= D; d += 16 * kPair) step(std::integral_constant<int, kPair>{}, d, 16);
    for (; d + 16 <= D; d += 16) step(std::integral_constant<int, 1>{}, d, 16);
    if (d < D) step(std::integral_constant<int, 1>{}, d, D - d);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) _mm_storeu_ps(s + int64_t(i) * lds, reduce4(a[i][0], a[i][1], a[i][2], a[i][3]));
  }

  template <class Rows, class T = typename Rows::Elem>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq, int M,
                        float* s, int lds) {
    const int j = qk_key_groups<4>(k, nk, D, M, [&](auto rows, const T* const* k4, int r, int j) {
      qk_4keys16<T, decltype(rows)::value>(k4, D, q + int64_t(r) * ldq, ldq,
                                           s + int64_t(r) * lds + j, lds);
    });
    if (j < nk) GenericOps::decode_qk(k.from(j), nk - j, D, q, ldq, M, s + j, lds);
  }

  // Decode P V with zmm accumulators: R rows x C vectors of 16 dims per pass, so a pass reads
  // 16 C contiguous dims of each V row (one row, C = 8: the whole 128-dim row, read once in
  // order) and each widened V vector feeds R FMAs. With `prefetch` (the first row group), the
  // lines of each key's pf_row.
  template <class Rows, int R, int C, class T = typename Rows::Elem>
  static inline void pv_zmm(const Rows& v, int nk, const float* p, int ldp,
                            float* acc, int ldacc, int d0, bool prefetch) {
    __m512 c[R][C];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < C; ++u) c[r][u] = _mm512_loadu_ps(acc + int64_t(r) * ldacc + d0 + 16 * u);
    prefetch = prefetch && prefetches_at(v, d0);
    auto cur = v.cursor();
    for (int j = 0; j < nk; ++j, cur.next()) {
      const T* vj = cur.row() + d0;
      if (prefetch) prefetch_key(cur, v, d0 * int64_t(sizeof(T)), 16 * C * int(sizeof(T)));
      __m512 x[C];
      load16s<C>(vj, x);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m512 pj = _mm512_set1_ps(p[int64_t(r) * ldp + j]);
#pragma GCC unroll 8
        for (int u = 0; u < C; ++u) c[r][u] = _mm512_fmadd_ps(pj, x[u], c[r][u]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < C; ++u) _mm512_storeu_ps(acc + int64_t(r) * ldacc + d0 + 16 * u, c[r][u]);
  }

  // Dims in passes of 128 (one or two rows), 64 (up to six rows), then 16; the last dims, fewer
  // than 16, on the portable kernel (GenericOps::decode_pv), as in the AVX2 trait.
  template <class Rows, int R>
  static void pv_zmm_group(const Rows& v, int nk, int Dv, const float* p, int ldp,
                           float* acc, int ldacc, bool prefetch) {
    constexpr int C = R <= 2 ? 8 : 4;
    const int d16 = Dv & ~15;
    int d0 = 0;
    for (; d0 + 16 * C <= d16; d0 += 16 * C)
      pv_zmm<Rows, R, C>(v, nk, p, ldp, acc, ldacc, d0, prefetch);
    for (; d0 < d16; d0 += 16) pv_zmm<Rows, R, 1>(v, nk, p, ldp, acc, ldacc, d0, prefetch);
    if (d16 < Dv)
      GenericOps::decode_pv(v.shift(d16), nk, Dv - d16, p, ldp, R, acc + d16, ldacc);
  }

  template <class Rows>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                        float* acc, int ldacc) {
    for (int r = 0; r < M; r += 6) {
      const float* pr = p + int64_t(r) * ldp;
      float* ar = acc + int64_t(r) * ldacc;
      with_rows<6>(M - r < 6 ? M - r : 6, [&](auto rows) {
        pv_zmm_group<Rows, decltype(rows)::value>(v, nk, Dv, pr, ldp, ar, ldacc, r == 0);
      });
    }
  }

};

#if !defined(FLASHSDPA_EMULATE)  // (SIMDe has no AVX512-FP16: the emulated tiers keep fp32 P V)
#pragma GCC push_options
#pragma GCC target("avx512fp16")
// P V over float8_e4m3fn V in fp16 (AVX512-FP16), for bf16 / fp16 queries (plan.cpp). Each byte
// becomes the fp16 of its value x 2^-8 (e4m3_fp16_from_high: exact, NaN bytes NaN), P is rounded
// to fp16, and the products accumulate 32 to a vector in fp16 over runs of kRun keys, each run's
// sums then added into the fp32 accumulators: 32 lanes an FMA and no widening to fp32, where
// Avx512Ops::decode_pv has 16 and two conversions a vector. V's values (x 2^-8) are at most 1.75
// and P at most 1, so a run's sums stay far inside fp16's range, and its rounding (2^-11 of a
// product or a sum) is finer than the bf16 P of the bf16 tiers' decode. AVX512-FP16 is not
// part of the tier's flags: this trait alone is compiled for it, and the plan takes it only
// where the CPU has it.
struct Avx512Fp16PvOps : Avx512Ops {
  FLASHSDPA_TRAIT_CAPS(Avx512Fp16PvOps, /*scale_in_a=*/true, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/false, /*transposed_s=*/false)
  static constexpr int kRun = 16;    // keys summed in fp16 before the fp32 accumulators
  static constexpr int kChunk = 256; // keys whose P is rounded to fp16 at a time

  // 64 bytes (n < 64: the first n, the rest 0) -> fp16 of dims {0-7, 16-23, 32-39, 48-55} (x0)
  // and {8-15, 24-31, 40-47, 56-63} (x1): unpacking 0 below each byte puts it in a word's high
  // half, and keeps the bytes in their 128-bit lanes (add_run puts the dims back in order).
  static inline void widen64(const e4m3_t* p, int n, __m512h* x0, __m512h* x1) {
    const __m512i raw = n >= 64 ? _mm512_loadu_si512(p)
                                : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
    const __m512i z = _mm512_setzero_si512();
    *x0 = _mm512_castsi512_ph(e4m3_fp16_from_high(_mm512_unpacklo_epi8(z, raw)));
    *x1 = _mm512_castsi512_ph(e4m3_fp16_from_high(_mm512_unpackhi_epi8(z, raw)));
  }
  // a[0 .. n) += a run's sums of 64 dims in widen64's order (n < 64: the lanes past n untouched)
  static inline void add_run(float* a, int n, __m512h s0, __m512h s1) {
    const __m512i b0 = _mm512_castph_si512(s0), b1 = _mm512_castph_si512(s1);
    const __m512 lo0 = _mm512_cvtph_ps(_mm512_castsi512_si256(b0));   // dims 0-7, 16-23
    const __m512 hi0 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(b0, 1));  // 32-39, 48-55
    const __m512 lo1 = _mm512_cvtph_ps(_mm512_castsi512_si256(b1));   // 8-15, 24-31
    const __m512 hi1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(b1, 1));  // 40-47, 56-63
    const __m512 d[4] = {
        _mm512_shuffle_f32x4(lo0, lo1, 0x44), _mm512_shuffle_f32x4(lo0, lo1, 0xEE),  // 0-31
        _mm512_shuffle_f32x4(hi0, hi1, 0x44), _mm512_shuffle_f32x4(hi0, hi1, 0xEE)};  // 32-63
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int left = n - 16 * u;
      if (left <= 0) break;
      const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : tail_mask16(left);
      const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(k, a + 16 * u), d[u]);
      _mm512_mask_storeu_ps(a + 16 * u, k, sum);
    }
  }

  // acc[r][d0 .. d0 + n) += sum_j ph[r][j] v_j for R rows, C chunks of 64 dims (n > 64 (C - 1)).
  template <int R, int C, class Rows>
  static inline void pv_pass(const Rows& v, int nk, const _Float16* ph,
                             float* acc, int ldacc, int d0, int n, bool prefetch) {
    prefetch = prefetch && prefetches_at(v, d0);
    auto cur = v.cursor();
    for (int j0 = 0; j0 < nk; j0 += kRun) {
      const int j1 = nk - j0 < kRun ? nk : j0 + kRun;
      __m512h c[R][2 * C];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 2 * C; ++u) c[r][u] = _mm512_setzero_ph();
      for (int j = j0; j < j1; ++j, cur.next()) {
        const e4m3_t* vj = cur.row() + d0;
        if (prefetch) prefetch_key(cur, v, d0, n);
        __m512h x[2 * C];
#pragma GCC unroll 2
        for (int h = 0; h < C; ++h) {
          const int left = n - 64 * h;
          widen64(vj + 64 * h, left < 64 ? left : 64, &x[2 * h], &x[2 * h + 1]);
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m512h pj = _mm512_set1_ph(ph[r * kChunk + j]);
#pragma GCC unroll 4
          for (int u = 0; u < 2 * C; ++u) c[r][u] = _mm512_fmadd_ph(pj, x[u], c[r][u]);
        }
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int h = 0; h < C; ++h)
          add_run(acc + int64_t(r) * ldacc + d0 + 64 * h, n - 64 * h, c[r][2 * h], c[r][2 * h + 1]);
    }
  }

  // Rows in groups of up to 6, keys in chunks of kChunk (P rounded to fp16 first), dims in
  // passes of 128 (up to four rows) or 64, the last one shorter.
  template <class Rows>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp,
                        int M, float* acc, int ldacc) {
    static_assert(std::is_same<typename Rows::Elem, e4m3_t>::value, "float8_e4m3fn V");
    alignas(64) _Float16 ph[6 * kChunk];
    for (int r = 0; r < M; r += 6) {
      const int rows = M - r < 6 ? M - r : 6;
      for (int k0 = 0; k0 < nk; k0 += kChunk) {
        const int kn = nk - k0 < kChunk ? nk - k0 : kChunk;
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < kn; j += 16) {
            const __mmask16 k = kn - j >= 16 ? __mmask16(0xFFFF) : tail_mask16(kn - j);
            const __m512 pv = _mm512_maskz_loadu_ps(k, p + int64_t(r + i) * ldp + k0 + j);
            _mm256_mask_storeu_epi16(ph + i * kChunk + j, k,
                                     _mm256_castph_si256(_mm512_cvtxps_ph(pv)));
          }
        const Rows vk = v.from(k0);
        float* ar = acc + int64_t(r) * ldacc;
        const bool first = r == 0;
        with_rows<6>(rows, [&](auto R) {
          constexpr int kR = decltype(R)::value, C = kR <= 4 ? 2 : 1;
          int d0 = 0;
          for (; d0 + 64 * C <= Dv; d0 += 64 * C)
            pv_pass<kR, C>(vk, kn, ph, ar, ldacc, d0, 64 * C, first);
          for (; d0 < Dv; d0 += 64)
            pv_pass<kR, 1>(vk, kn, ph, ar, ldacc, d0, Dv - d0 < 64 ? Dv - d0 : 64, first);
        });
      }
    }
  }
};
#pragma GCC pop_options

// Over an e4m3 cache with bf16 / fp16 queries, where the plan allows (plan.cpp): P V in fp16.
template <class KV>
struct DecodeOpsOf<Avx512Ops, KV> {
  using type = Avx512Ops;
  using fp16_pv = typename std::conditional<std::is_same<KV, e4m3_t>::value, Avx512Fp16PvOps,
                                            Avx512Ops>::type;
  using exact = type;
};
#endif

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
