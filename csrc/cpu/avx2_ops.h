// The AVX2 / FMA / F16C trait: the 6x16 micro-kernel, vector exp2, bf16 / fp16 widening, Philox
// on 8 lanes, the decode kernels. Included by csrc/cpu/tiers/avx2.cpp, and by the AVX-512 tiers,
// which derive from it and reuse what they do not replace (each copy compiled inside its own
// tier namespace with its own flags).
//
// Register blocking (the 6x16 BLIS/Haswell shape): a 6-row x 16-column fp32 tile of C lives in
// 12 ymm accumulators; per step of the inner dimension one 16-wide row of the packed B panel is
// loaded (2 ymm) and each of the 6 A values is broadcast (1 ymm) into 2 FMAs: 12 FMAs per
// 2 loads + 6 broadcasts, enough independent chains to cover FMA latency x 2 pipes.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "generic_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// ---- loads / stores with widening and rounding ---------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {  // bf16 -> fp32: the 16 bits become the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 words, an e4m3 byte in each one's high half -> the fp16 bits of the values x 2^-8 (see
// e4m3_t): an arithmetic shift right by 1 puts the magnitude in the fp16 position and copies
// the sign into bit 14, which the AND clears; the NaN magnitude (0x3F80 there) is the only one
// that carries into bit 14 when 0x80 is added, and OR-ing that bit back makes the exponent all
// ones. (The AVX-512 tiers' zmm overload: 32 words.)
inline __m256i e4m3_fp16_from_high(__m256i w) {
  const __m256i x = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(int16_t(0xBFFF)));
  const __m256i t = _mm256_and_si256(_mm256_add_epi16(x, _mm256_set1_epi16(0x80)),
                                     _mm256_set1_epi16(0x4000));
  return _mm256_or_si256(x, t);
}
// 8 e4m3 bytes -> the values x 2^-8 (the low 8 words of the above).
inline __m256 load8(const e4m3_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), b);
  return _mm256_cvtph_ps(
      _mm256_castsi256_si128(e4m3_fp16_from_high(_mm256_castsi128_si256(w))));
}

// 16 elements -> two vectors of 8 (the AVX-512 tiers' load16 gives one of 16). e4m3: the bytes
// widened 16 at a time, then two fp16 conversions: 13 uops where two load8 take 18.
template <class T>
inline void load8x2(const T* p, __m256* lo, __m256* hi) {
  *lo = load8(p), *hi = load8(p + 8);
}
inline void load8x2(const e4m3_t* p, __m256* lo, __m256* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i h = e4m3_fp16_from_high(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// A 16-element chunk of a K / V row as the decode kernels read it (Chunk16<T>): load() gives two
// fp32 vectors of the chunk in T's chunk order. bf16 (kPaired): one 256-bit load; the even
// elements from the 32-bit words' low halves shifted up, the odd ones from their high halves
// with the low bits cleared, 3 uops for 16 elements where load8 twice takes 6 (2 of them on
// the shuffle pipe). Other types: elements 0-7 and 8-15 (load8x2).
// The decode path keeps q's rows and the accumulators in that order (Avx2Ops::decode_to_order:
// to_order, and add_natural back). kPScale: what P V multiplies its weights by (pv_keys), the
// unit a chunk's widening leaves out of V where it is not folded into the scales. kPvRows: the
// query rows P V takes at a time (pv_rows), by what widening a chunk costs: where it costs
// little (fp32: none; bf16: 2 uops), pairs, whose 8 weights, 4 accumulators and V chunk stay in
// 14 of the 16 registers; where it costs more (fp16, float8), groups of up to 6, which widen
// each V chunk once for more rows though their weights spill (each FMA then reads one from the
// stack).
template <class T>
struct Chunk16 {
  using Elem = T;
  static constexpr bool kPaired = false;
  static constexpr float kPScale = 1.0f;
  static constexpr int kPvRows = std::is_same<T, float>::value ? 2 : 6;
  static inline void load(const T* p, __m256* lo, __m256* hi) { load8x2(p, lo, hi); }
  static inline void add_natural(float* acc, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), lo));
    _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_loadu_ps(acc + 8), hi));
  }
};
template <>
struct Chunk16<bf16_t> {
  using Elem = bf16_t;
  static constexpr bool kPaired = true;
  static constexpr float kPScale = 1.0f;
  static constexpr int kPvRows = 2;
  static inline void load(const bf16_t* p, __m256* even, __m256* odd) {
    const __m256 x = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(x), 16));
    *odd = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u))));
  }
  // x[0 .. 16) -> out: the even elements, then the odd ones
  static inline void to_order(const float* x, float* out) {
    for (int i = 0; i < 8; ++i) out[i] = x[2 * i], out[8 + i] = x[2 * i + 1];
  }
  static inline void add_natural(float* acc, __m256 even, __m256 odd) {
    // per 128-bit lane: unpacklo = elements 0-3 | 8-11, unpackhi = 4-7 | 12-15
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    Chunk16<float>::add_natural(acc, _mm256_permute2f128_ps(lo, hi, 0x20),
                                _mm256_permute2f128_ps(lo, hi, 0x31));
  }
};

// float8_e4m3fn without F16C's conversion, for Avx2E4m3Ops's decode kernels: 8 bytes -> the
// values x 2^-120 (exact). Each byte sign-extended to 32 bits and shifted up 20 puts its sign in
// bit 31 (copies in 27-30, which the AND clears) and its 7 bits of magnitude in an fp32's low 4
// exponent and top 3 mantissa bits: 4 uops for 8 values, where the fp16 path (load8x2) takes
// 13 for 16 and a slower conversion. e4m3's subnormals become fp32 denormals, which FMAs take
// at full speed on AMD cores but a multiply (restoring the unit here) does not: the 2^120 goes
// into q (K) and into P's weights (V, kPScale) instead. What it reads differently from
// PyTorch: the NaN bytes (0x7F, 0xFF), as +-1.875 x 2^-112, and under MXCSR.DAZ the
// subnormals, as 0 (the decode flow: FlashDecode::patch_nan, ::run_split).
inline __m256 e4m3_widen8_bits(const e4m3_t* p) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(int(0x87F00000u))));
}
struct E4m3Chunk16 : Chunk16<e4m3_t> {
  static constexpr float kPScale = 0x1p120f;
  static inline void load(const e4m3_t* p, __m256* lo, __m256* hi) {
    *lo = e4m3_widen8_bits(p), *hi = e4m3_widen8_bits(p + 8);
  }
};

// n < 8 elements, the rest of the vector zero.
template <class T>
inline __m256 load8_partial(const T* p, int n) {
  alignas(32) T tmp[8] = {};
  for (int i = 0; i < n; ++i) tmp[i] = p[i];
  return load8(tmp);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16_t* p, __m256 v) {
  // round to nearest even: u + 0x7FFF + ((u >> 16) & 1), then keep the high half; NaN -> qNaN
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  r = _mm256_blendv_epi8(r, qnan, is_nan);
  // pack the 8 low halves: packus works per 128-bit lane, so fix the order with a permute
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(f16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
template <class T>
inline void store8_partial(T* p, __m256 v, int n) {
  alignas(32) T tmp[8];
  store8(tmp, v);
  for (int i = 0; i < n; ++i) p[i] = tmp[i];
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes j of [j0, j0 + 8) with j >= limit.
inline __m256 lanes_at_or_after(int j0, int limit) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(limit - 1)));
}

// exp2 of 8 lanes: exp2_poly (scalar.h) with FMA. Rounding by the magic-number trick: adding
// 1.5 * 2^23 + 127 leaves n + 127 in the low mantissa bits of t (n + 127 in [0, 254]), so
// t << 23 is already the bit pattern of 2^n. Operand order keeps NaN flowing through min/max
// (they return the second operand when one is NaN), so NaN in gives NaN out without a blend.
template <int kDegree = 6>
inline __m256 exp2_8(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f + 127.0f);
  __m256 xc = _mm256_min_ps(_mm256_set1_ps(kExp2Max), x);
  xc = _mm256_max_ps(_mm256_set1_ps(kExp2Min), xc);
  const __m256 t = _mm256_add_ps(xc, magic);
  const __m256 f = _mm256_sub_ps(xc, _mm256_sub_ps(t, magic));  // f = xc - n
  const __m256 p = exp2_horner<kDegree>(
      f, [](float c) { return _mm256_set1_ps(c); },
      [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); });
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

// 8x8 fp32 transpose of rows r[0..8) in place.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// out[kk*ldo + i] = src[i*ld + kk] for i < 8 (0 for i >= rows), kk < K: 8 x 8 blocks through
// transpose8, then the last columns one at a time (out 32-byte aligned; ldo a multiple of 8).
template <class T>
inline void transpose_rows8(const T* src, int64_t ld, int K, int rows, float* out, int ldo) {
  if (rows == 0) {
    for (int kk = 0; kk < K; ++kk) _mm256_store_ps(out + int64_t(kk) * ldo, _mm256_setzero_ps());
    return;
  }
  int kk = 0;
  for (; kk + 8 <= K; kk += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = i < rows ? load8(src + i * ld + kk) : _mm256_setzero_ps();
    transpose8(r);
    for (int i = 0; i < 8; ++i) _mm256_store_ps(out + int64_t(kk + i) * ldo, r[i]);
  }
  for (; kk < K; ++kk) {
    alignas(32) float col[8];
    for (int i = 0; i < 8; ++i) col[i] = i < rows ? to_f32(src[i * ld + kk]) : 0.0f;
    _mm256_store_ps(out + int64_t(kk) * ldo, _mm256_load_ps(col));
  }
}

// ---- Philox4x32-10 on 8 counters at once (the same bits as philox4x32_10 in scalar.h) ----------
// hi/lo 32-bit halves of a * b for 8 unsigned lanes: _mm256_mul_epu32 multiplies the even lanes,
// so the odd lanes go through a 32-bit shift.
inline void mulhilo8(__m256i a, __m256i b, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, b);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Philox words for counters (c0 + lane, c1, c2, c3): w[k] holds word k of each lane.
inline void philox8(__m256i c0, uint32_t c1_, uint32_t c2_, uint32_t c3_, uint32_t k0_,
                    uint32_t k1_, __m256i w[4]) {
  const __m256i m0 = _mm256_set1_epi32(int(0xD2511F53u)), m1 = _mm256_set1_epi32(int(0xCD9E8D57u));
  __m256i c1 = _mm256_set1_epi32(int(c1_)), c2 = _mm256_set1_epi32(int(c2_));
  __m256i c3 = _mm256_set1_epi32(int(c3_));
  uint32_t k0 = k0_, k1 = k1_;
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, m0, &hi0, &lo0);
    mulhilo8(c2, m1, &hi1, &lo1);
    const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(int(k0)));
    const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(int(k1)));
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  w[0] = c0, w[1] = c1, w[2] = c2, w[3] = c3;
}

// One inner step of row n of an R-row micro-tile (accumulators c<i>0, c<i>1; b0, b1 the panel's
// row): A[n], broadcast as AV, into two FMAs. P is the intrinsics' prefix.
#define FLASHSDPA_TILE_FMA_ROW(P, i, n, AV)        \
  if (R > n) {                                    \
    const auto av = AV;                           \
    c##i##0 = P##_fmadd_ps(av, b0, c##i##0);      \
    c##i##1 = P##_fmadd_ps(av, b1, c##i##1);      \
  }

// Row n (accumulators c<i>0, c<i>1: two registers of H lanes) of an R-row micro-tile stored to
// C (ldc floats apart), added to it when accumulating; P is the intrinsics' prefix.
#define FLASHSDPA_TILE_STORE_ROW(P, H, i, n)                  \
  if (R > n) {                                               \
    float* cr = c + int64_t(n) * ldc;                        \
    if (accumulate) {                                        \
      c##i##0 = P##_add_ps(c##i##0, P##_loadu_ps(cr));       \
      c##i##1 = P##_add_ps(c##i##1, P##_loadu_ps(cr + H));   \
    }                                                        \
    P##_storeu_ps(cr, c##i##0);                              \
    P##_storeu_ps(cr + H, c##i##1);                          \
  }

// The arithmetic of a row-operation vector type (row_ops.h) on an x86 register type: `P` is the
// intrinsics' prefix (_mm256, _mm512), the rest of each name is shared.
#define FLASHSDPA_X86_VEC_ARITH(P, REG)                                              \
  using reg = REG;                                                                 \
  static reg load(const float* p) { return P##_loadu_ps(p); }                      \
  static void store(float* p, reg v) { P##_storeu_ps(p, v); }                      \
  static reg splat(float x) { return P##_set1_ps(x); }                             \
  static reg add(reg a, reg b) { return P##_add_ps(a, b); }                        \
  static reg sub(reg a, reg b) { return P##_sub_ps(a, b); }                        \
  static reg mul(reg a, reg b) { return P##_mul_ps(a, b); }                        \
  static reg fma(reg a, reg b, reg c) { return P##_fmadd_ps(a, b, c); }            \
  static reg max(reg a, reg b) { return P##_max_ps(a, b); }                        \
  static reg min(reg a, reg b) { return P##_min_ps(a, b); }                        \
  static reg div(reg a, reg b) { return P##_div_ps(a, b); }                        \
  static reg abs(reg x) { return P##_andnot_ps(P##_set1_ps(-0.0f), x); }           \
  static constexpr int kTransposeRows = 8;                                         \
  template <class T>                                                               \
  static void transpose_rows(const T* src, int64_t ld, int K, int rows, float* out, \
                             int ldo) {                                            \
    transpose_rows8(src, ld, K, rows, out, ldo);                                   \
  }

// The row operations' vector type (row_ops.h) on ymm.
struct VecY8 {
  FLASHSDPA_X86_VEC_ARITH(_mm256, __m256)
  static constexpr int W = 8, kSums = 1;  // a second sum costs registers the exp pass needs
  static reg exp2(reg x) { return exp2_8(x); }
  static float hsum(reg v) { return hsum8(v); }
  static float hmax(reg v) { return hmax8(v); }
  static reg first_n(reg x, int n, float fill) {
    return _mm256_blendv_ps(x, splat(fill), lanes_at_or_after(0, n));
  }
  static reg keep_from(reg x, int n, float fill) {
    return _mm256_blendv_ps(splat(fill), x, lanes_at_or_after(0, n));
  }
  static reg iota(float s) {
    return _mm256_add_ps(splat(s), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
  }
  template <class T> static reg load_t(const T* p) { return load8(p); }
  template <class T> static reg load_n(const T* p, int n) { return load8_partial(p, n); }
  template <class T> static void store_t(T* p, reg v) { store8(p, v); }
  template <class T> static void store_n(T* p, reg v, int n) { store8_partial(p, v, n); }
};

struct Avx2Ops : GenericOps {
  static constexpr int NR = 16;  // panel width: 2 ymm
  static constexpr int MR = 6;   // 6 x 2 = 12 accumulators
  static constexpr int kBlockQ = 192;
  static constexpr int kBlockQBwd = 96;
  // One V prefetch per line in light decode too: P V (decode_pv) reads a group of rows at a
  // time, a 16-dim chunk of each in turn, which the streamer behind a prefetch of each row's
  // first line does not follow.
  static constexpr int kLightVEvery = 64;
  // Near decode prefetches (GenericOps::kDecodeNearPf; their case: bench_paths near_pf).
  static constexpr bool kDecodeNearPf = true;
  FLASHSDPA_TRAIT_CAPS(Avx2Ops, /*scale_in_a=*/true, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/true, /*transposed_s=*/false)

  using Row = RowOps<VecY8>;  // the row operations and operand formats (row_ops.h)

  // C tile of R rows x 16 columns (=|+=) A * panel. The 12 accumulators are named variables:
  // GCC does not keep an array of __m256 in registers across an unrolled loop (it spills it).
  // With kExp (gemm_exp: exp2_horner's degree) the tile is stored as 2^(C - mref[row]) and each
  // row's two vectors are added to its sum at sumv + 16 row; with a `band`, 0 on the columns not
  // set in band[row].
  template <bool TransA, int R, int kExp = 0>
  static inline void micro_tile(int K, const float* a, int lda, const float* panel, float* c,
                                int ldc, bool accumulate, const float* mref = nullptr,
                                float* sumv = nullptr, const uint32_t* band = nullptr) {
    static_assert(R >= 1 && R <= 6, "1 to 6 rows");
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    // A[i][kk]: row i of A, or column i when A is stored transposed
    const int64_t step_i = TransA ? 1 : lda, step_k = TransA ? lda : 1;
    const float* a0 = a;
#define FLASHSDPA_ROW(i) \
  FLASHSDPA_TILE_FMA_ROW(_mm256, i, i, _mm256_broadcast_ss(a0 + (i) * step_i))
#pragma GCC unroll 4
    for (int kk = 0; kk < K; ++kk, a0 += step_k) {
      const __m256 b0 = _mm256_load_ps(panel + kk * NR);
      const __m256 b1 = _mm256_load_ps(panel + kk * NR + 8);
      FLASHSDPA_ROW(0) FLASHSDPA_ROW(1) FLASHSDPA_ROW(2)
      FLASHSDPA_ROW(3) FLASHSDPA_ROW(4) FLASHSDPA_ROW(5)
    }
#undef FLASHSDPA_ROW
#define FLASHSDPA_STORE(i) FLASHSDPA_TILE_STORE_ROW(_mm256, 8, i, i)
    FLASHSDPA_STORE(0) FLASHSDPA_STORE(1) FLASHSDPA_STORE(2)
    FLASHSDPA_STORE(3) FLASHSDPA_STORE(4) FLASHSDPA_STORE(5)
#undef FLASHSDPA_STORE
    if constexpr (kExp != 0) exp_tile<kExp>(c, ldc, R, mref, sumv, band);
  }

  // The fused exponentials of a stored R x 16 tile (still in L1): out of line, so that the
  // polynomial's constants do not take registers from the accumulators of the FMA loop (16 ymm
  // registers: computing them from the accumulators in place spills them).
  template <int kDegree>
  static __attribute__((noinline)) void exp_tile(float* c, int ldc, int R, const float* mref,
                                                 float* sumv, const uint32_t* band) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int i = 0; i < R; ++i) {
      float* ci = c + int64_t(i) * ldc;
      const __m256 mr = _mm256_set1_ps(mref[i]);
      __m256 p0 = exp2_8<kDegree>(_mm256_sub_ps(_mm256_loadu_ps(ci), mr));
      __m256 p1 = exp2_8<kDegree>(_mm256_sub_ps(_mm256_loadu_ps(ci + 8), mr));
      if (band) {  // lanes whose bit is clear: 0 (exp2_8 is finite or NaN there; the and drops it)
        const auto keep = [&](int bits) {
          const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits), lane_bit);
          return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane_bit));
        };
        p0 = _mm256_and_ps(p0, keep(int(band[i] & 0xff)));
        p1 = _mm256_and_ps(p1, keep(int((band[i] >> 8) & 0xff)));
      }
      _mm256_storeu_ps(ci, p0);
      _mm256_storeu_ps(ci + 8, p1);
      float* sv = sumv + 16 * i;
      _mm256_storeu_ps(sv, _mm256_add_ps(_mm256_loadu_ps(sv), _mm256_add_ps(p0, p1)));
    }
  }

  FLASHSDPA_TRAIT_GEMM(Avx2Ops)

  // S GEMM with the exponentials fused into the tile stores (gemm_exp_loop, generic_ops.h).
  FLASHSDPA_TRAIT_GEMM_EXP(Avx2Ops)



  // ---- short-query (decode) kernels ---------------------------------------------------------
  // Both read K / V rows in place a few keys at a time, the group's rows together 16 dims at a
  // time, each chunk widened in T's chunk order (Chunk16): the block's rows stream in one
  // after another, which the hardware prefetchers follow (P V once read one 16-dim column of
  // the whole block per pass, which they do not).

  // s[i][j .. j + 4) = q_i . k_u for four keys x R query rows (R <= 2): the dims in 16-element
  // chunks in C's order (q's rows in that order over [0, D & ~15), natural after it), the last
  // D % 16 in 8-element steps. One row keeps a chunk's two halves in separate accumulators, so
  // that 8 FMA chains hide the FMA latency with one row as with two; a hadd tree turns each
  // row's accumulators into its 4 dot products.
  template <class C, int R, class T = typename C::Elem>
  static inline void qk_4keys(const T* const* k4, int D, const float* q, int ldq, float* s,
                              int lds) {
    constexpr int H = R == 1 ? 2 : 1;  // accumulators per (row, key)
    __m256 a[R][4][H];
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) a[i][u][h] = _mm256_setzero_ps();
    const int D16 = D & ~15;
    int d = 0;
    for (; d < D16; d += 16) {
      __m256 q0[R], q1[R];
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i)
        q0[i] = _mm256_loadu_ps(q + int64_t(i) * ldq + d),
        q1[i] = _mm256_loadu_ps(q + int64_t(i) * ldq + d + 8);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        __m256 x0, x1;
        C::load(k4[u] + d, &x0, &x1);
#pragma GCC unroll 2
        for (int i = 0; i < R; ++i) {
          a[i][u][0] = _mm256_fmadd_ps(q0[i], x0, a[i][u][0]);
          a[i][u][H - 1] = _mm256_fmadd_ps(q1[i], x1, a[i][u][H - 1]);
        }
      }
    }
    for (; d < D; d += 8) {
      const int t = D - d < 8 ? D - d : 8;
      __m256 qv[R];
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i) {
        const float* qi = q + int64_t(i) * ldq + d;
        qv[i] = t == 8 ? _mm256_loadu_ps(qi) : load8_partial(qi, t);
      }
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 x = t == 8 ? load8(k4[u] + d) : load8_partial(k4[u] + d, t);
#pragma GCC unroll 2
        for (int i = 0; i < R; ++i) a[i][u][0] = _mm256_fmadd_ps(qv[i], x, a[i][u][0]);
      }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) {
      __m256 r[4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
        r[u] = H == 2 ? _mm256_add_ps(a[i][u][0], a[i][u][H - 1]) : a[i][u][0];
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
      _mm_storeu_ps(s + int64_t(i) * lds,
                    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }

  // The lines of the cursor's pf_row to prefetch: bytes [at, at + bytes) of the row, one line
  // per rows.every: with the non-temporal hint where Rows::kNta (into L1, read a sub-block
  // later), else into L2 (read a block later).
  template <class Cursor, class Rows>
  static inline void prefetch_key(const Cursor& c, const Rows& rows, int64_t at, int bytes) {
    const auto* t = c.pf_row();
    if (Cursor::kPfGaps && !t) return;
    const char* r = reinterpret_cast<const char*>(t) + at;
    for (int b = 0; b < bytes; b += rows.every)
      _mm_prefetch(r + b, Rows::kNta ? _MM_HINT_NTA : _MM_HINT_T1);
  }
  // Whether a pass over the rows' dims from d0 prefetches: passes starting on the `every`
  // grid do (their part of each row, prefetch_key), so each line is prefetched once.
  template <class Rows>
  static inline bool prefetches_at(const Rows& v, int d0) {
    using T = typename Rows::Elem;
    return v.prefetches() && (int64_t(d0) * int64_t(sizeof(T))) % v.every == 0;
  }

  // The decode Q.K loop of every trait: keys in fours (each K row's lines prefetched), query
  // rows in groups of up to kR, f(rows, k4, r, j) computing s[r .. r + rows)[j .. j + 4) from
  // the K rows k4[0 .. 4) of keys j .. j + 3; returns the keys done (the rest, fewer than 4, are
  // the caller's).
  template <int kR, class Rows, class F>
  static int qk_key_groups(const Rows& k, int nk, int D, int M, F&& f) {
    using T = typename Rows::Elem;
    int j = 0;
    const bool pf = k.prefetches();
    auto c = k.cursor();
    for (; j + 4 <= nk; j += 4) {
      const T* k4[4];
      for (int u = 0; u < 4; ++u, c.next()) {
        k4[u] = c.row();
        if (pf) prefetch_key(c, k, 0, D * int(sizeof(T)));
      }
      for (int r = 0; r < M; r += kR)
        with_rows<kR>(M - r < kR ? M - r : kR, [&](auto rows) { f(rows, k4, r, j); });
    }
    return j;
  }

  // s[i][0 .. 2) = q_i . k0, q_i . k1 for R <= 4 query rows: 2R accumulators, each K chunk
  // loaded and widened once for the R rows, q read from the cache as the FMAs' operand.
  template <class C, int R, class T = typename C::Elem>
  static inline void qk_2keys(const T* k0, const T* k1, int D, const float* q, int ldq, float* s,
                              int lds) {
    __m256 a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    const int D16 = D & ~15;
    int d = 0;
    for (; d < D16; d += 16) {
      __m256 x0, x1, y0, y1;
      C::load(k0 + d, &x0, &x1);
      C::load(k1 + d, &y0, &y1);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256 qa = _mm256_loadu_ps(q + int64_t(i) * ldq + d);
        const __m256 qb = _mm256_loadu_ps(q + int64_t(i) * ldq + d + 8);
        a[i][0] = _mm256_fmadd_ps(qa, x0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(qa, y0, a[i][1]);
        a[i][0] = _mm256_fmadd_ps(qb, x1, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(qb, y1, a[i][1]);
      }
    }
    for (; d < D; d += 8) {
      const int t = D - d < 8 ? D - d : 8;
      const __m256 x = t == 8 ? load8(k0 + d) : load8_partial(k0 + d, t);
      const __m256 y = t == 8 ? load8(k1 + d) : load8_partial(k1 + d, t);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const float* qi = q + int64_t(i) * ldq + d;
        const __m256 qv = t == 8 ? _mm256_loadu_ps(qi) : load8_partial(qi, t);
        a[i][0] = _mm256_fmadd_ps(qv, x, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(qv, y, a[i][1]);
      }
    }
    // hadd trees: per 128-bit lane the partial sums (row 0 k0, row 0 k1, row 1 k0, row 1 k1),
    // then rows 2 and 3
    const auto pair_sums = [](const __m256* r0, const __m256* r1) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(r0[0], r0[1]), _mm256_hadd_ps(r1[0], r1[1]));
      return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    };
    alignas(16) float r[8];
    _mm_store_ps(r, pair_sums(a[0], a[1]));
    _mm_store_ps(r + 4, pair_sums(a[2], a[3]));
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      s[int64_t(i) * lds] = r[2 * i], s[int64_t(i) * lds + 1] = r[2 * i + 1];
  }

  // decode_qk over more than two query rows: rows in groups of up to 4, each group's pass over
  // the keys in pairs (qk_2keys, R a compile-time count inside the pass: no row loop or row
  // dispatch per pair); an odd last key paired with itself. Each K chunk is widened once a
  // group; the first pass prefetches, the later groups' passes read the rows from cache.
  template <class C, class Rows, class T = typename Rows::Elem>
  static void qk_pairs(const Rows& k, int nk, int D, const float* q, int ldq, int M, float* s,
                       int lds) {
    const int bytes = D * int(sizeof(T));
    for (int r = 0; r < M; r += 4)
      with_rows<4>(M - r < 4 ? M - r : 4, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        const bool pf = r == 0 && k.prefetches();
        const float* qr = q + int64_t(r) * ldq;
        float* sr = s + int64_t(r) * lds;
        auto c = k.cursor();
        const auto next_row = [&] {
          const T* row = c.row();
          if (pf) prefetch_key(c, k, 0, bytes);
          c.next();
          return row;
        };
        int j = 0;
        for (; j + 2 <= nk; j += 2) {
          const T* k0 = next_row();
          qk_2keys<C, R>(k0, next_row(), D, qr, ldq, sr + j, lds);
        }
        if (j < nk) {  // (its second sums dropped)
          float t[4 * 2];
          const T* k0 = next_row();
          qk_2keys<C, R>(k0, k0, D, qr, ldq, t, 2);
          for (int i = 0; i < R; ++i) sr[int64_t(i) * lds + j] = t[2 * i];
        }
      });
  }

  // decode_qk over q's rows as given, in C's chunk order. Up to two rows: four keys at a time,
  // q's rows in registers (qk_4keys). More: two keys at a time for four rows (qk_pairs), each K
  // chunk widened once for four rows (a float8 cache too: widening its keys once into fp32 rows
  // on the stack for qk_4keys' pairs of rows ran 10% slower).
  template <class C, class Rows, class T = typename Rows::Elem>
  static void qk_rows(const Rows& k, int nk, int D, const float* q, int ldq, int M, float* s,
                      int lds) {
    if (M > 2) return qk_pairs<C>(k, nk, D, q, ldq, M, s, lds);
    const int j = qk_key_groups<2>(k, nk, D, M, [&](auto rows, const T* const* k4, int r, int j) {
      qk_4keys<C, decltype(rows)::value>(k4, D, q + int64_t(r) * ldq, ldq,
                                         s + int64_t(r) * lds + j, lds);
    });
    // the last keys, fewer than 4 (q is in C's order, which only C's kernels read)
    if (j < nk) qk_pairs<C>(k.from(j), nk - j, D, q, ldq, M, s + j, lds);
  }

  // The dims' order (GenericOps::decode_to_order): KV's chunk order over [0, n & ~15) (Chunk16:
  // bf16's even elements before its odd ones), natural after.
  template <class KV>
  static void decode_to_order(float* x, int n) {
    using C = Chunk16<KV>;
    if constexpr (C::kPaired)
      for (int d = 0; d + 16 <= n; d += 16) {
        alignas(32) float t[16];
        C::to_order(x + d, t);
        std::memcpy(x + d, t, sizeof(t));
      }
  }
  template <class KV>
  static void decode_to_natural(float* x, int n) {
    using C = Chunk16<KV>;
    if constexpr (C::kPaired)
      for (int d = 0; d + 16 <= n; d += 16) {
        alignas(32) float t[16] = {};
        C::add_natural(t, _mm256_loadu_ps(x + d), _mm256_loadu_ps(x + d + 8));
        std::memcpy(x + d, t, sizeof(t));
      }
  }

  // qk_rows' key groups: pairs (qk_pairs) for more than two rows, fours otherwise
  template <class KV>
  static constexpr int decode_key_group(int64_t M) { return M > 2 ? 2 : 4; }

  // s[r][j] = q_r . k_j, q's rows in the decode order (decode_to_order).
  template <class Rows, class T = typename Rows::Elem>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq, int M,
                        float* s, int lds) {
    qk_rows<Chunk16<T>>(k, nk, D, q, ldq, M, s, lds);
  }
  template <class Rows, class T = typename Rows::Elem>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                        float* acc, int ldacc) {
    pv_rows<Chunk16<T>>(v, nk, Dv, p, ldp, M, acc, ldacc);
  }

  // acc[i][0, D16) (in C's chunk order) += sum_{u < G} p[i][u] v_u for R rows and G keys, a
  // 16-dim chunk at a time: 2R accumulators, each V chunk loaded and widened once for the R
  // rows. The R x G weights are broadcast once, for all the chunks.
  template <class C, int R, int G, class T>
  static inline void pv_keys(const T* const* vg, int D16, const float* p, int ldp, float* acc,
                             int ldacc) {
    __m256 pb[R][G];
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < G; ++u) {
        pb[i][u] = _mm256_broadcast_ss(p + int64_t(i) * ldp + u);
        if constexpr (C::kPScale != 1.0f)
          pb[i][u] = _mm256_mul_ps(pb[i][u], _mm256_set1_ps(C::kPScale));
      }
    for (int d = 0; d < D16; d += 16) {
      __m256 a[R][2];
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i)
        a[i][0] = _mm256_loadu_ps(acc + int64_t(i) * ldacc + d),
        a[i][1] = _mm256_loadu_ps(acc + int64_t(i) * ldacc + d + 8);
#pragma GCC unroll 4
      for (int u = 0; u < G; ++u) {
        __m256 x0, x1;
        C::load(vg[u] + d, &x0, &x1);
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) {
          a[i][0] = _mm256_fmadd_ps(pb[i][u], x0, a[i][0]);
          a[i][1] = _mm256_fmadd_ps(pb[i][u], x1, a[i][1]);
        }
      }
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i)
        _mm256_storeu_ps(acc + int64_t(i) * ldacc + d, a[i][0]),
        _mm256_storeu_ps(acc + int64_t(i) * ldacc + d + 8, a[i][1]);
    }
  }

  // decode_pv: acc[r] += sum_j p[r][j] v_j, V widened in registers by C (bf16 / fp16 never
  // take a slow GEMM): keys in groups (pv_keys; each V row's lines prefetched), rows in groups
  // of C::kPvRows. acc's rows in the decode order (decode_to_order), the last Dv % 16 dims done
  // after (GenericOps).
  template <class C, class Rows, class T = typename Rows::Elem>
  static void pv_rows(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                      float* acc, int ldacc) {
    const int D16 = Dv & ~15;
    const bool pf = v.prefetches();
    auto c = v.cursor();
    const auto keys = [&](auto g, int j) {
      constexpr int G = decltype(g)::value;
      const T* vg[G];
      for (int u = 0; u < G; ++u, c.next()) {
        vg[u] = c.row();
        if (pf) prefetch_key(c, v, 0, Dv * int(sizeof(T)));
      }
      constexpr int kR = C::kPvRows;
      for (int r = 0; r < M; r += kR)
        with_rows<kR>(M - r < kR ? M - r : kR, [&](auto rows) {
          pv_keys<C, decltype(rows)::value, G>(vg, D16, p + int64_t(r) * ldp + j, ldp,
                                               acc + int64_t(r) * ldacc, ldacc);
        });
    };
    // One query row does little arithmetic per V row, and its reads follow the hardware
    // prefetchers better the fewer rows a group interleaves: two keys at a time. More rows
    // take four (their accumulators' loads and stores and the weights' broadcasts amortised
    // over more keys), two left over a pair: an all-heads item's sub-blocks of an fp32 cache
    // can be two keys (FlashDecode::sub_keys), which would otherwise load and store the
    // accumulators for every key. (Every group adds its keys in order: the same sums.)
    int j = 0;
    if (M == 1) {
      for (; j + 2 <= nk; j += 2) keys(std::integral_constant<int, 2>(), j);
    } else {
      for (; j + 4 <= nk; j += 4) keys(std::integral_constant<int, 4>(), j);
      if (j + 2 <= nk) keys(std::integral_constant<int, 2>(), j), j += 2;
    }
    for (; j < nk; ++j) keys(std::integral_constant<int, 1>(), j);
    if (D16 < Dv)
      GenericOps::decode_pv(v.shift(D16), nk, Dv - D16, p, ldp, M, acc + D16, ldacc);
  }


  // out[c] = x[c] * keep(bh, i, j0 + c) / (1 - p): 32 columns per Philox call on 8 counters.
  // Word k of counter g covers column 4g + k, so a 4 x 8 transpose puts the words in column order.
  static void dropout_row(const AttnParams& p, uint64_t bh, int64_t i, int64_t j0, int n,
                          const float* x, float* out) {
    if ((j0 & 3) != 0) return GenericOps::dropout_row(p, bh, i, j0, n, x, out);
    const __m256i thr = _mm256_set1_epi32(int(dropout_threshold(p.dropout_p)));
    const __m256 rscale = _mm256_set1_ps(1.0f / (1.0f - p.dropout_p));
    const uint32_t k0 = uint32_t(p.seed), k1 = uint32_t(p.seed >> 32);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < n; c += 32) {
      const __m256i g = _mm256_add_epi32(_mm256_set1_epi32(int((j0 + c) >> 2)), lane);
      __m256i w[4];
      philox8(g, uint32_t(i), uint32_t(bh), uint32_t(p.offset), k0, k1, w);
      // transpose: cols[q] = columns 8q .. 8q+7 of this 32-column chunk
      const __m256i t0 = _mm256_unpacklo_epi32(w[0], w[1]), t1 = _mm256_unpackhi_epi32(w[0], w[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(w[2], w[3]), t3 = _mm256_unpackhi_epi32(w[2], w[3]);
      const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
      __m256i cols[4];
      cols[0] = _mm256_permute2x128_si256(u0, u1, 0x20);  // groups 0, 1
      cols[1] = _mm256_permute2x128_si256(u2, u3, 0x20);  // groups 2, 3
      cols[2] = _mm256_permute2x128_si256(u0, u1, 0x31);  // groups 4, 5
      cols[3] = _mm256_permute2x128_si256(u2, u3, 0x31);  // groups 6, 7
      for (int q = 0; q < 4; ++q) {
        const int c8 = c + 8 * q;
        if (c8 >= n) break;
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_max_epu32(cols[q], thr), cols[q]));  // word >= thr
        if (c8 + 8 <= n) {
          const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + c8), rscale);
          _mm256_storeu_ps(out + c8, _mm256_and_ps(keep, v));
        } else {
          alignas(32) float kf[8];
          _mm256_store_ps(kf, keep);
          const float rs = 1.0f / (1.0f - p.dropout_p);
          for (int e = 0; e < n - c8; ++e)
            out[c8 + e] = f32_bits(kf[e]) ? x[c8 + e] * rs : 0.0f;
        }
      }
    }
  }




};

// The decode trait over float8_e4m3fn K / V: Avx2Ops with the bytes widened by E4m3Chunk16, so
// its units are 2^120 for K (in q) and 1 for V (P's weights carry the 2^120). For dims in
// multiples of 16 (no tails, which Avx2Ops's widening would read: plan.cpp) and items that
// FlashDecode::run_split allows (the others go to Avx2Ops): MXCSR.DAZ clear on the thread
// running the item (the subnormals, denormals here, would read as 0).
struct Avx2E4m3Ops : Avx2Ops {
  FLASHSDPA_TRAIT_CAPS(Avx2E4m3Ops, /*scale_in_a=*/true, /*prep_a=*/false,
                       /*inner_pack=*/1, /*fused_exp=*/true, /*transposed_s=*/false)
  static constexpr float kE4m3UnitK = 0x1p120f, kE4m3UnitV = 1.0f;
  static bool denormals_kept() { return (_mm_getcsr() & 0x40) == 0; }  // DAZ: bit 6
  // Whether bytes [0, n) hold a NaN byte (0x7F, 0xFF): 64 a step, the largest of the signed
  // bytes (0x7F) and of the unsigned ones (0xFF).
  static bool nan_bytes(const uint8_t* b, int64_t n) {
    __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 32));
      hi = _mm256_max_epi8(hi, _mm256_max_epi8(x, y));
      lo = _mm256_max_epu8(lo, _mm256_max_epu8(x, y));
    }
    const __m256i nan = _mm256_or_si256(_mm256_cmpeq_epi8(hi, _mm256_set1_epi8(0x7F)),
                                        _mm256_cmpeq_epi8(lo, _mm256_set1_epi8(char(0xFF))));
    bool any = !_mm256_testz_si256(nan, nan);
    for (; i < n; ++i) any |= (b[i] & 0x7F) == 0x7F;
    return any;
  }
  template <class Rows>
  static void decode_qk(const Rows& k, int nk, int D, const float* q, int ldq, int M,
                        float* s, int lds) {
    qk_rows<E4m3Chunk16>(k, nk, D, q, ldq, M, s, lds);
  }
  template <class Rows>
  static void decode_pv(const Rows& v, int nk, int Dv, const float* p, int ldp, int M,
                        float* acc, int ldacc) {
    pv_rows<E4m3Chunk16>(v, nk, Dv, p, ldp, M, acc, ldacc);
  }
};

template <class KV>
struct DecodeOpsOf<Avx2Ops, KV> {
  using type =
      typename std::conditional<std::is_same<KV, e4m3_t>::value, Avx2E4m3Ops, Avx2Ops>::type;
  using fp16_pv = type;
  using exact = Avx2Ops;
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
