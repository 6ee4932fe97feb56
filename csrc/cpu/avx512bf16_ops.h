// The AVX512-BF16 trait (bf16 inputs only): every GEMM of the forward and backward runs on
// vdpbf16ps, which multiplies bf16 pairs and accumulates in fp32, twice the multiply-adds per
// instruction of an fp32 FMA. Softmax, statistics and accumulators stay fp32. The decode path
// (Avx512Bf16DecodeOps below) runs Q . K and P V on vdpbf16ps straight from the K / V rows.
//
// Operand formats (the algorithm only sees float* buffers; this trait decides what is in them):
//   A rows  bf16, row-major, pairs along the inner dimension adjacent, each row at the byte
//           offset of an fp32 row of the same ld (load_rows; prep_a<false> for P and dS)
//   A^T     for gemm<true>: pair (kk, kk+1) of column m adjacent, "rows" of pairs ld apart
//           (prep_a<true>, the P^T / dS^T of the dV / dK products)
//   B       panels of 32 columns as [K/2][32][2] bf16 (VNNI-2), K padded to even with zeros
// The scores' scale is applied in fp32 by score_row (scale_in_a is false): folding it into bf16 Q
// would round Q a second time.
//
// Micro-kernel: 12 rows x 32 columns in 24 zmm accumulators; per pair of inner steps 2 B loads
// + 12 broadcast pairs feed 24 vdpbf16ps.
#pragma once
#include <type_traits>

#include "avx512_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

inline uint16_t* bf16_words(float* p) { return reinterpret_cast<uint16_t*>(p); }
inline const uint16_t* bf16_words(const float* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const uint16_t* bf16_words(const bf16_t* p) { return reinterpret_cast<const uint16_t*>(p); }

template <class T>
inline uint16_t to_bf16_bits(T v) {
  return f32_to_bf16(to_f32(v));
}
template <>
inline uint16_t to_bf16_bits<bf16_t>(bf16_t v) {
  return v.x;
}

// 16 fp32 -> 16 bf16 (round to nearest even, NaN stays NaN)
inline __m256i cvt16_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

struct Avx512Bf16Ops : Avx512Ops {
  static constexpr int NR = 32;
  static constexpr int MR = 12;
  // Avx512Ops' transposed scores take fp32 operands: off here. The fused exponentials take
  // this trait's form (gemm_exp_loop: P in bf16 into P V's operand).
  FLASHSDPA_TRAIT_CAPS(Avx512Bf16Ops, /*scale_in_a=*/false, /*prep_a=*/true,
                       /*inner_pack=*/2, /*fused_exp=*/true, /*transposed_s=*/false)

  // Pair (a, b) -> one 32-bit word: a in the low half.
  static inline __m512i interleave_lo(__m512i a, __m512i b) {  // columns 0..15
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    return _mm512_permutex2var_epi16(a, idx, b);
  }
  static inline __m512i interleave_hi(__m512i a, __m512i b) {  // columns 16..31
    const __m512i idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25,
                                         56, 24, 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18,
                                         49, 17, 48, 16);
    return _mm512_permutex2var_epi16(a, idx, b);
  }

  // The row operations on zmm, with this trait's operand formats.
  struct Row : RowOps<VecZ16> {
    // A rows in bf16 (mul is 1: scale_in_a is false); an odd row length gets a zero pair partner.
    template <class T>
    static void load_rows(const T* src, int64_t ld, int rows, int cols, float* dst, int ldd,
                          float mul) {
      (void)mul;
      for (int i = 0; i < rows; ++i) {
        const T* s = src + i * ld;
        uint16_t* d = bf16_words(dst + int64_t(i) * ldd);
        for (int c = 0; c < cols; ++c) d[c] = to_bf16_bits(s[c]);
        if (cols & 1) d[cols] = 0;
      }
    }

    // The two-pass forward's exp pass straight into the A operand of P V (online_softmax_row;
    // the fused exponentials do theirs in micro_tile): P = 2^(s * mul - m) for the first n
    // columns, 0 for the other lanes of the vectors covering n (the padding score_row left at
    // -inf), rounded to bf16 into dst, a row of prep_a<false>'s format, instead of back into s;
    // returns the unrounded P's sum.
    static float exp2_row_sum_bf16(const float* s, int n, float mul, float m, uint16_t* dst) {
      const __m512 mv = _mm512_set1_ps(-m), kv = _mm512_set1_ps(mul);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __mmask16 keep = j + 16 > n ? tail_mask16(n - j) : __mmask16(0xffff);
        const __m512 e = exp2_16<true, kExp2DegreeBf16P>(
            _mm512_fmadd_ps(_mm512_loadu_ps(s + j), kv, mv), keep);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), cvt16_bf16(e));
        sum = _mm512_add_ps(sum, e);
      }
      return _mm512_reduce_add_ps(sum);
    }

    // dst[j] *= a for j < n (n a multiple of 16; a a power of two: exact but for underflow).
    static void scale_row_bf16(uint16_t* dst, int n, float a) {
      const __m512 av = _mm512_set1_ps(a);
      for (int j = 0; j < n; j += 16) {
        __m256i* d = reinterpret_cast<__m256i*>(dst + j);
        const __m512 x = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(d)), 16));
        _mm256_storeu_si256(d, cvt16_bf16(_mm512_mul_ps(x, av)));
      }
    }

    // B[kk][n] = src[kk*ld + n] as VNNI-2 panels: word (kp, n) = (B[2kp][n], B[2kp+1][n]).
    template <class T>
    static void pack_b(const T* src, int64_t ld, int K, int N, float* dst) {
      const int np = int(ceil_div(N, NR)), kp_n = (K + 1) / 2;
      for (int p = 0; p < np; ++p) {
        const int n0 = p * NR, w = int(min64(NR, N - n0));
        uint16_t* panel = bf16_words(dst + int64_t(p) * K * NR);
        for (int kp = 0; kp < kp_n; ++kp) {
          const T* r0 = src + (2 * kp) * ld + n0;
          const bool has_r1 = 2 * kp + 1 < K;
          uint16_t* out = panel + kp * 2 * NR;
          if constexpr (sizeof(T) == 2 && !std::is_same<T, f16_t>::value) {  // bf16: no conversion
            const __mmask32 m = w == 32 ? __mmask32(~0u) : __mmask32((1u << w) - 1u);
            const __m512i a = _mm512_maskz_loadu_epi16(m, r0);
            const __m512i b = has_r1 ? _mm512_maskz_loadu_epi16(m, r0 + ld) : _mm512_setzero_si512();
            _mm512_store_si512(out, interleave_lo(a, b));
            _mm512_store_si512(out + 32, interleave_hi(a, b));
          } else {
            for (int n = 0; n < NR; ++n) {
              out[2 * n] = n < w ? to_bf16_bits(r0[n]) : 0;
              out[2 * n + 1] = (n < w && has_r1) ? to_bf16_bits(r0[ld + n]) : 0;
            }
          }
        }
      }
    }

    // B[kk][n] = src[n*ld + kk] (K^T from the rows of K): word (kp, n) is the pair
    // (K[n][2kp], K[n][2kp+1]), adjacent in K's row, so this is a 32-bit transpose.
    template <class T>
    static void pack_bt(const T* src, int64_t ld, int K, int N, float* dst) {
      const int np = int(ceil_div(N, NR)), kp_n = (K + 1) / 2;
      for (int p = 0; p < np; ++p) {
        uint32_t* panel = reinterpret_cast<uint32_t*>(dst + int64_t(p) * K * NR);
        for (int g = 0; g < NR / 8; ++g) {
          const int n0 = p * NR + g * 8;
          const int rows = int(max64(0, min64(8, N - n0)));
          uint32_t* out = panel + g * 8;
          int kp = 0;
          if constexpr (sizeof(T) == 2 && !std::is_same<T, f16_t>::value) {
            for (; rows > 0 && kp + 8 <= K / 2; kp += 8) {  // 8 pairs of 8 rows at a time
              __m256 r[8];
              for (int i = 0; i < 8; ++i)
                r[i] = i < rows ? _mm256_loadu_ps(reinterpret_cast<const float*>(
                                      src + (n0 + i) * ld + 2 * kp))
                                : _mm256_setzero_ps();
              transpose8(r);
              for (int i = 0; i < 8; ++i)
                _mm256_store_ps(reinterpret_cast<float*>(out + (kp + i) * NR), r[i]);
            }
          }
          for (; kp < kp_n; ++kp) {
            for (int i = 0; i < 8; ++i) {
              uint32_t word = 0;
              if (i < rows) {
                const T* row = src + (n0 + i) * ld;
                const uint32_t lo = to_bf16_bits(row[2 * kp]);
                const uint32_t hi = 2 * kp + 1 < K ? to_bf16_bits(row[2 * kp + 1]) : 0u;
                word = lo | (hi << 16);
              }
              out[kp * NR + i] = word;
            }
          }
        }
      }
    }
  };

  // fp32 tile -> A operand. TransA = false: rows of pairs along K (as load_rows).
  // TransA = true: pair (kk, kk+1) of column m adjacent: "row" kp = (tile row 2kp, 2kp+1).
  template <bool TransA>
  static const float* prep_a(const float* tile, int ld, int M, int K, float* buf, int* lda) {
    *lda = ld;
    if (!TransA) {
      for (int i = 0; i < M; ++i) {
        const float* t = tile + int64_t(i) * ld;
        uint16_t* d = bf16_words(buf + int64_t(i) * ld);
        int c = 0;
        for (; c + 32 <= K; c += 32)
          _mm512_storeu_si512(d + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t + c + 16),
                                                                 _mm512_loadu_ps(t + c)));
        for (; c + 16 <= K; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), cvt16_bf16(_mm512_loadu_ps(t + c)));
        if (c < K) {
          const __mmask16 m = tail_mask16(K - c);
          _mm256_mask_storeu_epi16(d + c, m, cvt16_bf16(_mm512_maskz_loadu_ps(m, t + c)));
        }
        if (K & 1) d[K] = 0;
      }
    } else {
      for (int kp = 0; kp < (K + 1) / 2; ++kp) {
        const float* t0 = tile + int64_t(2 * kp) * ld;
        const bool has_t1 = 2 * kp + 1 < K;
        uint16_t* d = bf16_words(buf + int64_t(kp) * ld);
        int m = 0;
        for (; has_t1 && m + 32 <= M; m += 32) {  // whole pairs of 32-column rows
          const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t0 + m + 16),
                                                        _mm512_loadu_ps(t0 + m));
          const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t0 + ld + m + 16),
                                                        _mm512_loadu_ps(t0 + ld + m));
          _mm512_storeu_si512(d + 2 * m, interleave_lo(a, b));
          _mm512_storeu_si512(d + 2 * m + 32, interleave_hi(a, b));
        }
        for (; m < M; m += 32) {
          const int w = M - m < 32 ? M - m : 32;
          const __mmask16 m0 = w >= 16 ? __mmask16(0xFFFF) : tail_mask16(w);
          const __mmask16 m1 = w > 16 ? tail_mask16(w - 16) : __mmask16(0);
          const __m512i a = _mm512_inserti64x4(
              _mm512_castsi256_si512(cvt16_bf16(_mm512_maskz_loadu_ps(m0, t0 + m))),
              cvt16_bf16(_mm512_maskz_loadu_ps(m1, t0 + m + 16)), 1);
          const __m512i b =
              has_t1 ? _mm512_inserti64x4(
                           _mm512_castsi256_si512(cvt16_bf16(_mm512_maskz_loadu_ps(m0, t0 + ld + m))),
                           cvt16_bf16(_mm512_maskz_loadu_ps(m1, t0 + ld + m + 16)), 1)
                     : _mm512_setzero_si512();
          // words m .. m+w: 2w bf16, the first 32 from interleave_lo, the rest from _hi
          const __mmask32 lo = w >= 16 ? __mmask32(~0u) : __mmask32((1ull << (2 * w)) - 1u);
          const __mmask32 hi = w > 16 ? __mmask32((1ull << (2 * (w - 16))) - 1u) : __mmask32(0);
          _mm512_mask_storeu_epi16(d + 2 * m, lo, interleave_lo(a, b));
          if (hi) _mm512_mask_storeu_epi16(d + 2 * m + 32, hi, interleave_hi(a, b));
        }
      }
    }
    return buf;
  }

  // C tile of R rows x 32 columns (=|+=) A * panel, over ceil(K / 2) pair steps. With kExp (the
  // fused softmax of gemm_exp) the tile is P = 2^(C * mul - mref[row]) in bf16, rounded from the
  // accumulators in registers, stored as rows of this trait's A format (P V's operand: row n's
  // 32 words at the byte offset of c + n * ldc), each row's unrounded P added to its 16-lane sum
  // at sumv + 16 row; `band` as in Avx512Ops::micro_tile (0 on the columns not set in band[n]).
  template <bool TransA, int R, int kExp = 0>
  static inline void micro_tile(int K, const float* a, int lda, const float* panel, float* c,
                                int ldc, bool accumulate, const float* mref = nullptr,
                                float* sumv = nullptr, const uint32_t* band = nullptr,
                                float mul = 1.0f) {
    static_assert(R >= 1 && R <= 12, "1 to 12 rows");
    static_assert(kExp == 0 || kExp == kExp2DegreeBf16P, "P rounded to bf16: the degree-3 one");
    FLASHSDPA_ZMM_TILE_ACCUMULATORS
    const uint32_t* A = reinterpret_cast<const uint32_t*>(a);  // pairs
    const int64_t step_i = TransA ? 1 : lda, step_k = TransA ? lda : 1;  // in pairs
    const uint16_t* B = bf16_words(panel);
    const int kp_n = (K + 1) / 2;
#define FLASHSDPA_ROW(i, n)                                                             \
  if (R > n) {                                                                         \
    const __m512bh av = (__m512bh)_mm512_set1_epi32(int(A[kp * step_k + (n) * step_i])); \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, av, b0);                                       \
    c##i##1 = _mm512_dpbf16_ps(c##i##1, av, b1);                                       \
  }
#pragma GCC unroll 2
    for (int kp = 0; kp < kp_n; ++kp) {
      const __m512bh b0 = (__m512bh)_mm512_load_si512(B + kp * 2 * NR);
      const __m512bh b1 = (__m512bh)_mm512_load_si512(B + kp * 2 * NR + 32);
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_ROW)
    }
#undef FLASHSDPA_ROW
    if constexpr (kExp != 0) {
      const __m512 kv = _mm512_set1_ps(mul);
#define FLASHSDPA_EXP_ROW(i, n)                                                        \
  if (R > n) {                                                                       \
    const __m512 mr = _mm512_set1_ps(-mref[n]);                                      \
    __m512 p0, p1;                                                                   \
    exp2_row_pair<kExp>(_mm512_fmadd_ps(c##i##0, kv, mr), _mm512_fmadd_ps(c##i##1, kv, mr), \
                        band ? band[n] : ~0u, sumv + 16 * (n), &p0, &p1);                    \
    _mm512_storeu_si512(c + int64_t(n) * ldc, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)); \
  }
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_EXP_ROW)
#undef FLASHSDPA_EXP_ROW
    } else {
      FLASHSDPA_ZMM_TILE_EACH_ROW(FLASHSDPA_ZMM_TILE_STORE_ROW)
    }
  }

  FLASHSDPA_TRAIT_GEMM(Avx512Bf16Ops)

  // The backward's S and dP tiles of one group of R <= kSdpRows rows in one micro-tile
  // (gemm_sdp_loop, flash_bwd.h fused_rows): S = Q K^T and dP = dO V^T over the same inner
  // steps (D == Dv), 6 x 32 each, then P = 2^(S * smul - m) * inv_l and dS = P (dP - delta) in
  // registers (0 on the columns not set in band[n]), rounded to bf16 straight into the three A
  // operands the dV, dK and dQ GEMMs read: P^T and dS^T as prep_a<true>'s pairs of rows (the
  // group's rows n, n + 1 one pair row of pt / dst, ldt floats apart; a last odd row pairs
  // with 0) and dS as prep_a<false>'s rows (ds, ldr words apart). The fp32 tiles are never
  // stored. P's exponent is the forward's bf16 one (kExp2DegreeBf16P, unclamped as in the
  // fused epilogues: the scores are products), whose 7.5e-5 relative error sits 50x below the
  // bf16 rounding that P and dS take next (and the epilogue, unlike the two passes', is on
  // the tile's critical path).
  static constexpr int kSdpRows = 6;
  template <int R>
  static inline void micro_tile_sdp(int K, const float* q, int ldq, const float* dO, int lddo,
                                    const float* kt, const float* vt, const uint32_t* band,
                                    float smul, const float* m, const float* inv_l,
                                    const float* delta, float* pt, float* dst, int ldt,
                                    uint16_t* ds, int64_t ldr) {
    static_assert(R >= 1 && R <= kSdpRows, "1 to 6 rows");
    __m512 s[R][2] = {}, d[R][2] = {};  // S and dP accumulators, zeroed
    const uint32_t* A = reinterpret_cast<const uint32_t*>(q);
    const uint32_t* G = reinterpret_cast<const uint32_t*>(dO);
    const uint16_t* BK = bf16_words(kt);
    const uint16_t* BV = bf16_words(vt);
    const int kp_n = (K + 1) / 2;
    for (int kp = 0; kp < kp_n; ++kp) {
      const __m512bh k0 = (__m512bh)_mm512_load_si512(BK + kp * 2 * NR);
      const __m512bh k1 = (__m512bh)_mm512_load_si512(BK + kp * 2 * NR + 32);
      const __m512bh v0 = (__m512bh)_mm512_load_si512(BV + kp * 2 * NR);
      const __m512bh v1 = (__m512bh)_mm512_load_si512(BV + kp * 2 * NR + 32);
#pragma GCC unroll 6
      for (int n = 0; n < R; ++n) {
        const __m512bh aq = (__m512bh)_mm512_set1_epi32(int(A[int64_t(n) * ldq + kp]));
        s[n][0] = _mm512_dpbf16_ps(s[n][0], aq, k0);
        s[n][1] = _mm512_dpbf16_ps(s[n][1], aq, k1);
        const __m512bh ad = (__m512bh)_mm512_set1_epi32(int(G[int64_t(n) * lddo + kp]));
        d[n][0] = _mm512_dpbf16_ps(d[n][0], ad, v0);
        d[n][1] = _mm512_dpbf16_ps(d[n][1], ad, v1);
      }
    }
    const __m512 sv = _mm512_set1_ps(smul);
    __m512i p16[R], ds16[R];
#pragma GCC unroll 6
    for (int n = 0; n < R; ++n) {
      const uint32_t bits = band ? band[n] : ~0u;
      const __m512 mv = _mm512_set1_ps(-m[n]), kv = _mm512_set1_ps(inv_l[n]);
      const __m512 dv = _mm512_set1_ps(delta[n]);
      __m512 pr[2], dr[2];
      for (int h = 0; h < 2; ++h) {
        const __mmask16 keep = __mmask16(bits >> (16 * h));
        const __m512 e = exp2_16<false, kExp2DegreeBf16P>(_mm512_fmadd_ps(s[n][h], sv, mv), keep);
        pr[h] = _mm512_mul_ps(e, kv);
        dr[h] = _mm512_maskz_mul_ps(keep, pr[h], _mm512_sub_ps(d[n][h], dv));
      }
      p16[n] = (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]);
      ds16[n] = (__m512i)_mm512_cvtne2ps_pbh(dr[1], dr[0]);
      _mm512_storeu_si512(ds + n * ldr, ds16[n]);
    }
#pragma GCC unroll 3
    for (int n = 0; n < R; n += 2) {
      const __m512i z = _mm512_setzero_si512();
      const __m512i pb = n + 1 < R ? p16[n + 1] : z, db = n + 1 < R ? ds16[n + 1] : z;
      float* tp = pt + int64_t(n / 2) * ldt;
      float* td = dst + int64_t(n / 2) * ldt;
      _mm512_storeu_si512(tp, interleave_lo(p16[n], pb));
      _mm512_storeu_si512(tp + 16, interleave_hi(p16[n], pb));
      _mm512_storeu_si512(td, interleave_lo(ds16[n], db));
      _mm512_storeu_si512(td + 16, interleave_hi(ds16[n], db));
    }
  }

  // S GEMM with the exponentials fused (gemm_exp_loop, generic_ops.h: micro_tile<false, R,
  // true> puts P in bf16 into the A operand of P V).
  FLASHSDPA_TRAIT_GEMM_EXP(Avx512Bf16Ops)
};

// The decode path of this tier: Q . K on vdpbf16ps (bf16 Q rows, unscaled; K rows read in place
// as bf16 pairs along the head dim), P V on vdpbf16ps with P rounded to bf16 (V rows unpacked
// into key pairs in registers).
struct Avx512Bf16DecodeOps : Avx512Ops {
  FLASHSDPA_TRAIT_CAPS(Avx512Bf16DecodeOps, /*scale_in_a=*/false, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/false, /*transposed_s=*/false)

  using Row = Avx512Bf16Ops::Row;  // bf16 Q rows

  // Four keys x two query rows: 8 zmm accumulators over 32-wide chunks of the head dim; each
  // accumulator is folded to 8 lanes and four of them summed by a hadd tree.
  template <bool kTwo>
  static inline void qk_4keys_bf16(const uint16_t* const* k4, int D, const uint16_t* q0,
                                   const uint16_t* q1, float* s0, float* s1) {
    const uint16_t *k0 = k4[0], *k1 = k4[1], *k2 = k4[2], *k3 = k4[3];
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    const auto step = [&](__m512i v0, __m512i v1, __m512i v2, __m512i v3, __m512i qa,
                          __m512i qb) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)qa, (__m512bh)v0);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)qa, (__m512bh)v1);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)qa, (__m512bh)v2);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)qa, (__m512bh)v3);
      if (kTwo) {
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)qb, (__m512bh)v0);
        b1 = _mm512_dpbf16_ps(b1, (__m512bh)qb, (__m512bh)v1);
        b2 = _mm512_dpbf16_ps(b2, (__m512bh)qb, (__m512bh)v2);
        b3 = _mm512_dpbf16_ps(b3, (__m512bh)qb, (__m512bh)v3);
      }
    };
    int d = 0;
    for (; d + 32 <= D; d += 32)
      step(_mm512_loadu_si512(k0 + d), _mm512_loadu_si512(k1 + d),
           _mm512_loadu_si512(k2 + d), _mm512_loadu_si512(k3 + d),
           _mm512_loadu_si512(q0 + d), kTwo ? _mm512_loadu_si512(q1 + d) : _mm512_setzero_si512());
    if (d < D) {  // masked: missing elements (and half pairs) read as 0
      const __mmask32 m = __mmask32((1ull << (D - d)) - 1u);
      step(_mm512_maskz_loadu_epi16(m, k0 + d), _mm512_maskz_loadu_epi16(m, k1 + d),
           _mm512_maskz_loadu_epi16(m, k2 + d), _mm512_maskz_loadu_epi16(m, k3 + d),
           _mm512_maskz_loadu_epi16(m, q0 + d),
           kTwo ? _mm512_maskz_loadu_epi16(m, q1 + d) : _mm512_setzero_si512());
    }
    _mm_storeu_ps(s0, reduce4(a0, a1, a2, a3));
    if (kTwo) _mm_storeu_ps(s1, reduce4(b0, b1, b2, b3));
  }

  template <class Rows, class T = typename Rows::Elem>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq, int M,
                        float* s, int lds) {
    int j = 0;
    if constexpr (std::is_same<T, bf16_t>::value) {
      const bool pf = k.prefetches();
      auto c = k.cursor();
      for (; j + 4 <= nk; j += 4) {
        const uint16_t* kw[4];
        for (int u = 0; u < 4; ++u, c.next()) {
          kw[u] = bf16_words(c.row());
          if (pf) prefetch_key(c, k, 0, 2 * D);
        }
        int r = 0;
        for (; r + 2 <= M; r += 2)
          qk_4keys_bf16<true>(kw, D, bf16_words(q + int64_t(r) * ldq),
                              bf16_words(q + int64_t(r + 1) * ldq), s + int64_t(r) * lds + j,
                              s + int64_t(r + 1) * lds + j);
        if (r < M)
          qk_4keys_bf16<false>(kw, D, bf16_words(q + int64_t(r) * ldq), nullptr,
                               s + int64_t(r) * lds + j, nullptr);
      }
    }
    for (; j < nk; ++j) {  // the last keys (and other dtypes, which this tier never runs)
      const T* kj = k.row(j);
      for (int r = 0; r < M; ++r) {
        const uint16_t* qr = bf16_words(q + int64_t(r) * ldq);
        float sum = 0.0f;
        for (int d = 0; d < D; ++d) sum += bf16_to_f32(qr[d]) * to_f32(kj[d]);
        s[int64_t(r) * lds + j] = sum;
      }
    }
  }

  // ---- P V on vdpbf16ps -------------------------------------------------------------------
  // acc[r] += sum_j p[r][j] V[j], two keys per instruction: P rounded to bf16 (as the prefill
  // path's P V GEMM does), V rows read in place. Unpacking rows j and j+1 makes 32-bit words
  // (V[j][d], V[j+1][d]); against the broadcast pair (p[r][j], p[r][j+1]) one vdpbf16ps adds
  // both keys' terms for 16 dims. Per pair of keys and 32 dims: 2 loads and 2 unpacks shared by
  // all R rows, then 2 vdpbf16ps per row (the widening path: 4 widened loads + 8 FMAs per row).
  // Unpacking works within 128-bit lanes, so a chunk's accumulators hold its 32 dims in unpack
  // order - lo lane k is dim 8 (k / 4) + k % 4, hi lane k that + 4. The split's accumulator rows
  // (FlashDecode::split: zeroed, scaled by the softmax, added to by every P V call) keep that
  // order, 32 dims at a time over [0, Dv & ~31), for the whole item; decode_to_natural puts them
  // back once at its end (permuting them on each call's load and store instead cost more than
  // the products where calls are a few keys each: the sub-blocks of a (.., L, Hkv, D) cache
  // without pv_whole).
  // Q's rows stay in natural order (decode_to_order: none).
  template <class KV>
  static void decode_to_natural(float* x, int n) {
    if constexpr (std::is_same<KV, bf16_t>::value || std::is_same<KV, e4m3_t>::value) {
      // natural dims 0..15 and 16..31 from (lo, hi) (index bit 4 selects hi)
      const __m512i o0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i o1 =
          _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      for (int d = 0; d + 32 <= n; d += 32) {
        const __m512 lo = _mm512_loadu_ps(x + d), hi = _mm512_loadu_ps(x + d + 16);
        _mm512_storeu_ps(x + d, _mm512_permutex2var_ps(lo, o0, hi));
        _mm512_storeu_ps(x + d + 16, _mm512_permutex2var_ps(lo, o1, hi));
      }
    }
  }

  // R rows x C chunks of 32 dims from d0; pw[r * ldpw + jp] = bf16 pair (p[r][2jp], p[r][2jp+1]).
  // With `prefetch`, each row's lines its row source names (pf_row), as the widening path does.
  // The accumulators of R rows x C chunks from d0 (in unpack order) to registers and back. These
  // helpers and pair_step / pair_dots take the accumulators as arrays: always inlined, so that
  // they stay in registers (out of line they go through memory on every key pair).
  template <int R, int C>
  __attribute__((always_inline)) static inline void load_pair_acc(
      const float* acc, int ldacc, int d0, __m512 (*lo)[C], __m512 (*hi)[C]) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const float* a = acc + int64_t(r) * ldacc + d0 + 32 * c;
        lo[r][c] = _mm512_loadu_ps(a);
        hi[r][c] = _mm512_loadu_ps(a + 16);
      }
  }
  template <int R, int C>
  __attribute__((always_inline)) static inline void store_pair_acc(
      float* acc, int ldacc, int d0, __m512 (*lo)[C], __m512 (*hi)[C]) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        float* a = acc + int64_t(r) * ldacc + d0 + 32 * c;
        _mm512_storeu_ps(a, lo[r][c]);
        _mm512_storeu_ps(a + 16, hi[r][c]);
      }
  }
  // One pair of keys: x[c] / y[c] the bf16 words of the two V rows' chunk c; pwj[r * ldpw] the
  // bf16 pair of row r's P.
  template <int R, int C>
  __attribute__((always_inline)) static inline void pair_step(const __m512i* x, const __m512i* y,
                                                             const uint32_t* pwj, int ldpw,
                                                             __m512 (*lo)[C], __m512 (*hi)[C]) {
    __m512i ul[C], uh[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      ul[c] = _mm512_unpacklo_epi16(x[c], y[c]);
      uh[c] = _mm512_unpackhi_epi16(x[c], y[c]);
    }
    pair_dots<R, C>(ul, uh, pwj, ldpw, lo, hi);
  }
  // The pair's words already in unpack order (ul[c] / uh[c]: what pair_step's unpacks give).
  template <int R, int C>
  __attribute__((always_inline)) static inline void pair_dots(const __m512i* ul,
                                                             const __m512i* uh,
                                                             const uint32_t* pwj, int ldpw,
                                                             __m512 (*lo)[C], __m512 (*hi)[C]) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pwj[int64_t(r) * ldpw]));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], w, (__m512bh)ul[c]);
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], w, (__m512bh)uh[c]);
      }
    }
  }

  template <int R, int C, class Rows>
  static inline void pv_pairs(const Rows& v, int nk, const uint32_t* pw,
                              int ldpw, float* acc, int ldacc, int d0, bool prefetch) {
    __m512 lo[R][C], hi[R][C];
    load_pair_acc<R, C>(acc, ldacc, d0, lo, hi);
    prefetch = prefetch && prefetches_at(v, d0);
    const int np = (nk + 1) / 2;
    const int64_t at = 2 * int64_t(d0);  // (bytes)
    auto c = v.cursor();
    const auto take = [&] {  // the cursor's row from d0, prefetching as asked; then the next key
      const uint16_t* r = bf16_words(c.row()) + d0;
      if (prefetch) prefetch_key(c, v, at, 64 * C);
      c.next();
      return r;
    };
    // (one loop body, no step function: called twice, GCC kept it out of line, with the
    // accumulators in memory)
    for (int jp = 0; jp < np; ++jp) {
      const uint16_t* va = take();
      const uint16_t* vb = 2 * jp + 1 < nk ? take() : nullptr;  // the last key: pair (V, 0)
      __m512i x[C], y[C];
#pragma GCC unroll 4
      for (int u = 0; u < C; ++u) {
        x[u] = _mm512_loadu_si512(va + 32 * u);
        y[u] = vb ? _mm512_loadu_si512(vb + 32 * u) : _mm512_setzero_si512();
      }
      pair_step<R, C>(x, y, pw + jp, ldpw, lo, hi);
    }
    store_pair_acc<R, C>(acc, ldacc, d0, lo, hi);
  }

  // Rows in groups of up to 6; per group the dims in chunks of 128 (one or two rows: 8 or 16
  // accumulators) or 64 (more rows: up to 24), then 32; dims past the last whole 32 take the
  // widening path on the fp32 P.
  template <int R, class Rows>
  static void pv_group(const Rows& v, int nk, int Dv, const uint32_t* pw,
                       int ldpw, float* acc, int ldacc, bool prefetch) {
    constexpr int C = R <= 2 ? 4 : 2;
    const int d32 = Dv & ~31;
    int d0 = 0;
    for (; d0 + 32 * C <= d32; d0 += 32 * C)
      pv_pairs<R, C>(v, nk, pw, ldpw, acc, ldacc, d0, prefetch);
    for (; d0 < d32; d0 += 32) pv_pairs<R, 1>(v, nk, pw, ldpw, acc, ldacc, d0, prefetch);
  }

  static constexpr int kPvKeys = 256;  // keys per pass (the P pairs of 6 rows on the stack)

  // P V over pairs of keys, kPvKeys keys per pass: P rows to bf16 pairs, then per group of up
  // to 6 rows group(rows, V rows of the pass, keys, pw, ldpw, acc rows, prefetch) for the dims
  // in whole 32s; the last dims, fewer than 32, widened against the fp32 P.
  template <class Rows, class Group>
  static void decode_pv_pairs(const Rows& v, int nk, int Dv, const float* p, int ldp,
                              int M, float* acc, int ldacc, Group&& group) {
    const int d32 = Dv & ~31;
    constexpr int ldpw = kPvKeys / 2 + 8;
    alignas(64) uint32_t pw[6 * ldpw];
    for (int j0 = 0; j0 < nk; j0 += kPvKeys) {
      const int n = nk - j0 < kPvKeys ? nk - j0 : kPvKeys;
      for (int r = 0; r < M; r += 6) {
        const int R = M - r < 6 ? M - r : 6;
        for (int i = 0; i < R; ++i) {  // P rows -> bf16, an odd count padded with a 0
          const float* pr = p + int64_t(r + i) * ldp + j0;
          uint16_t* d = reinterpret_cast<uint16_t*>(pw + i * ldpw);
          for (int j = 0; j < n; j += 16) {
            const int t = n - j < 16 ? n - j : 16;
            const __m512 x = _mm512_maskz_loadu_ps(__mmask16((1u << t) - 1u), pr + j);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j), cvt16_bf16(x));
          }
        }
        with_rows<6>(R, [&](auto rows) {
          group(rows, v.from(j0), n, pw, ldpw, acc + int64_t(r) * ldacc, r == 0);
        });
      }
      if (d32 < Dv)  // the last dims, fewer than 32: V widened, P in fp32
        Avx512Ops::decode_pv(v.from(j0).shift(d32), n, Dv - d32, p + j0, ldp, M, acc + d32,
                             ldacc);
    }
  }

  template <class Rows, class T = typename Rows::Elem>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                        float* acc, int ldacc) {
    if constexpr (!std::is_same<T, bf16_t>::value) {  // other dtypes never run on this tier
      Avx512Ops::decode_pv(v, nk, Dv, p, ldp, M, acc, ldacc);
    } else {
      decode_pv_pairs(v, nk, Dv, p, ldp, M, acc, ldacc,
                      [&](auto rows, const Rows& vj, int n, const uint32_t* pw, int ldpw,
                          float* ar, bool first) {
                        pv_group<decltype(rows)::value>(vj, n, Dv, pw, ldpw, ar, ldacc, first);
                      });
    }
  }
};

// ---- float8_e4m3fn K / V on vdpbf16ps ------------------------------------------------------
// Widening e4m3 to fp32 costs more vector work than the FMAs it feeds; here bytes become bf16
// (exact: e4m3 has 3 mantissa bits, and every e4m3 value / kE4m3Unit is a bf16 normal, which
// vdpbf16ps does not flush) by two 128-entry byte tables, vpermi2b on the magnitude giving the
// high and the low byte, the sign OR-ed back: NaN bytes give NaN, subnormals are exact. A
// vpermb first orders 64 bytes so that unpacking the two byte vectors gives dims 0-31 and
// 32-63 in order. Then Q . K and P V run as the bf16 cache's kernels do, Q and P in bf16.
// AVX512_VBMI is not part of this tier's flags (a CPU with AVX512-BF16 but not VBMI, Cooper
// Lake, would run its code): these functions alone are compiled for it, and selected_isa keeps
// e4m3 calls off this tier where the CPU lacks it. The emulated build needs no target (SIMDe).
// P V takes V in key pairs: there vpermi2b gathers the bytes of two keys' 64 dims (key a's
// byte d at index d, key b's at 64 + d) into pair[t] (t = 0, 1: dims 32t to 32t + 31) so that
// the tables and unpacks give the words pair_step's unpacks would: in each 128-bit lane L,
// byte j < 8 is dim 32t + 8L + j / 2 of key j % 2, byte 8 + j the same 4 dims on.
struct E4m3Tables {
  alignas(64) uint8_t hi[128], lo[128], perm[64], pair[2][64];
  E4m3Tables() {
    for (int m = 0; m < 128; ++m) {
      const uint32_t bits = f32_bits(to_f32(e4m3_t{uint8_t(m)})) >> 16;  // exact (or NaN)
      hi[m] = uint8_t(bits >> 8), lo[m] = uint8_t(bits);
    }
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 8; ++i) perm[16 * k + i] = uint8_t(8 * k + i), perm[16 * k + 8 + i] = uint8_t(32 + 8 * k + i);
    for (int t = 0; t < 2; ++t)
      for (int L = 0; L < 4; ++L)
        for (int j = 0; j < 16; ++j)
          pair[t][16 * L + j] = uint8_t(64 * (j % 2) + 32 * t + 8 * L + 4 * (j / 8) + j % 8 / 2);
  }
  static const E4m3Tables& get() {
    static const E4m3Tables t;
    return t;
  }
};

#if !defined(FLASHSDPA_EMULATE)
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
#endif
struct Avx512Bf16E4m3Ops : Avx512Bf16DecodeOps {
  FLASHSDPA_TRAIT_CAPS(Avx512Bf16E4m3Ops, /*scale_in_a=*/false, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/false, /*transposed_s=*/false)

  struct Lut {
    __m512i hi0, hi1, lo0, lo1, perm, pair0, pair1;
    Lut() {
      const E4m3Tables& t = E4m3Tables::get();
      hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
      lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
      perm = _mm512_load_si512(t.perm);
      pair0 = _mm512_load_si512(t.pair[0]), pair1 = _mm512_load_si512(t.pair[1]);
    }
    static inline __m512i load(const e4m3_t* p, int n) {  // n < 64: the first n, the rest 0
      return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
    }
    // 64 bytes in table order (b) -> the bf16 words of bytes 0-7 of each 128-bit lane (*out0)
    // and of bytes 8-15 (*out1)
    inline void words(__m512i b, __m512i* out0, __m512i* out1) const {
      __m512i h = _mm512_permutex2var_epi8(hi0, b, hi1);
      const __m512i l = _mm512_permutex2var_epi8(lo0, b, lo1);
      h = _mm512_ternarylogic_epi32(h, b, _mm512_set1_epi8(char(0x80)), 0xF8);  // h | (b & 0x80)
      *out0 = _mm512_unpacklo_epi8(l, h);
      *out1 = _mm512_unpackhi_epi8(l, h);
    }
    // 64 bytes (n < 64: the first n, the rest read as 0) -> bf16 dims 0-31 and 32-63
    inline void widen(const e4m3_t* p, int n, __m512i* out0, __m512i* out1) const {
      words(_mm512_permutexvar_epi8(perm, load(p, n)), out0, out1);
    }
    // 64 dims (n of them) of keys a and b (null: zeros) -> pair_step's unpacked words of dims
    // 0-31 (*ul0, *uh0) and, n > 32, 32-63 (*ul1, *uh1): 12 vector ops, where widening both
    // keys and unpacking takes 18
    inline void widen_pair(const e4m3_t* a, const e4m3_t* b, int n, __m512i* ul0, __m512i* uh0,
                           __m512i* ul1, __m512i* uh1) const {
      const __m512i ra = load(a, n), rb = b ? load(b, n) : _mm512_setzero_si512();
      words(_mm512_permutex2var_epi8(ra, pair0, rb), ul0, uh0);
      if (n > 32) words(_mm512_permutex2var_epi8(ra, pair1, rb), ul1, uh1);
    }
  };

  // s[r][j .. j+3] for 4 keys x R rows (bf16 Q words), 64 dims per step, 4R accumulators.
  template <int R>
  static inline void qk_4keys(const Lut& t, const e4m3_t* const* k4, int D, const float* q,
                              int ldq, float* s, int lds) {
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) a[i][u] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 64) {
      const int n = D - d < 64 ? D - d : 64;
      __m512i k[4][2];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) t.widen(k4[u] + d, n, &k[u][0], &k[u][1]);
      const __mmask32 m0 = n >= 32 ? ~0u : (1u << n) - 1u;
      const __mmask32 m1 = n >= 64 ? ~0u : (n > 32 ? (1u << (n - 32)) - 1u : 0u);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const uint16_t* qi = bf16_words(q + int64_t(i) * ldq) + d;
        const __m512i q0 = _mm512_maskz_loadu_epi16(m0, qi), q1 = _mm512_maskz_loadu_epi16(m1, qi + 32);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          a[i][u] = _mm512_dpbf16_ps(a[i][u], (__m512bh)q0, (__m512bh)k[u][0]);
          a[i][u] = _mm512_dpbf16_ps(a[i][u], (__m512bh)q1, (__m512bh)k[u][1]);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) _mm_storeu_ps(s + int64_t(i) * lds, reduce4(a[i][0], a[i][1], a[i][2], a[i][3]));
  }

  template <class Rows>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq,
                        int M, float* s, int lds) {
    const Lut t;
    const int j = qk_key_groups<4>(k, nk, D, M, [&](auto rows, const e4m3_t* const* k4, int r,
                                                    int j) {
      qk_4keys<decltype(rows)::value>(t, k4, D, q + int64_t(r) * ldq, ldq,
                                      s + int64_t(r) * lds + j, lds);
    });
    if (j < nk)  // the last keys, one by one against the bf16 Q words
      Avx512Bf16DecodeOps::decode_qk(k.from(j), nk - j, D, q, ldq, M, s + j, lds);
  }

  // P V as pv_pairs (bf16 P pairs against unpacked (V[j], V[j+1]) words), each pair's words
  // made straight from its two rows' bytes (widen_pair), 64 dims at a time: R rows x C chunks of
  // 32 dims from d0 (C = 1: the chunk's 32 bytes only).
  template <int R, int C, class Rows>
  static inline void pv_pairs(const Lut& t, const Rows& v, int nk,
                              const uint32_t* pw, int ldpw, float* acc, int ldacc, int d0,
                              bool prefetch) {
    __m512 lo[R][C], hi[R][C];
    load_pair_acc<R, C>(acc, ldacc, d0, lo, hi);
    prefetch = prefetch && prefetches_at(v, d0);
    const int np = (nk + 1) / 2;
    auto c = v.cursor();
    const auto take = [&] {  // the cursor's row from d0, prefetching as asked; then the next key
      const e4m3_t* r = c.row() + d0;
      if (prefetch) prefetch_key(c, v, d0, 32 * C);
      c.next();
      return r;
    };
    for (int jp = 0; jp < np; ++jp) {
      const e4m3_t* va = take();
      const e4m3_t* vb = 2 * jp + 1 < nk ? take() : nullptr;  // the last key: pair (V, 0)
      __m512i ul[C + 1], uh[C + 1];  // (C = 1: one spare)
#pragma GCC unroll 2
      for (int c = 0; c < C; c += 2)
        t.widen_pair(va + 32 * c, vb ? vb + 32 * c : nullptr, C == 1 ? 32 : 64, &ul[c], &uh[c],
                     &ul[c + 1], &uh[c + 1]);
      pair_dots<R, C>(ul, uh, pw + jp, ldpw, lo, hi);
    }
    store_pair_acc<R, C>(acc, ldacc, d0, lo, hi);
  }

  template <class Rows>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp,
                        int M, float* acc, int ldacc) {
    const Lut t;
    decode_pv_pairs(v, nk, Dv, p, ldp, M, acc, ldacc, [&](auto rows, const Rows& vj,
                                                          int n, const uint32_t* pw, int ldpw,
                                                          float* ar, bool first) {
      constexpr int kR = decltype(rows)::value;
      constexpr int C = kR <= 2 ? 4 : 2;
      const int d32 = Dv & ~31;
      int d0 = 0;
      for (; d0 + 32 * C <= d32; d0 += 32 * C)
        pv_pairs<kR, C>(t, vj, n, pw, ldpw, ar, ldacc, d0, first);
      for (; d0 < d32; d0 += 32) pv_pairs<kR, 1>(t, vj, n, pw, ldpw, ar, ldacc, d0, first);
    });
  }
};
#if !defined(FLASHSDPA_EMULATE)
#pragma GCC pop_options
#endif

// bf16 K / V: the bf16 dot-product kernels; e4m3: the table-widening ones above.
template <class KV>
struct DecodeOpsOf<Avx512Bf16Ops, KV> {
  using type = typename std::conditional<std::is_same<KV, e4m3_t>::value, Avx512Bf16E4m3Ops,
                                         Avx512Bf16DecodeOps>::type;
  using fp16_pv = type;
  using exact = type;
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
