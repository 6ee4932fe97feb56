// Scalar building blocks shared by every tier: fp16/bf16 <-> fp32 conversion, a polynomial
// exp2, and the Philox4x32-10 counter-based RNG used by dropout.
//
// Included inside each tier's own namespace (FLASHSDPA_TIER_NS), so every tier gets its own copy
// compiled with its own flags (no inline function is shared across ISA translation units).
#pragma once
#ifndef FLASHSDPA_TIER_NS
#error "define FLASHSDPA_TIER_NS before including csrc/cpu headers"
#endif

#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2)
constexpr float kNegInf = -__builtin_inff();
constexpr float kNaN = __builtin_nanf("");

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- bf16 -------------------------------------------------------------------------------------
inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN of the same sign.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  const uint32_t lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7fffu + lsb) >> 16);
}

// ---- fp16 (IEEE binary16) ------------------------------------------------------------------------
// Exact widening, subnormals included: normal numbers are re-biased by a multiply by 2^-112,
// subnormals are rebuilt by subtracting a magic 0.5.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // drops the sign
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t denorm_cutoff = 1u << 27;
  return bits_f32(sign | (two_w < denorm_cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}

// Round to nearest even, overflow to inf, NaN to quiet NaN: the rounding is done by the FPU by
// adding a power of two whose ulp equals the fp16 ulp at f's exponent.
inline uint16_t f32_to_f16(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;  // saturates huge values to inf
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;  // fp16 subnormal range shares one ulp
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Storage types, so that kernels are templated on the element type.
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };

// float8_e4m3fn storage (KV caches only: the decode path reads it, nothing writes it). Every
// widening of it, scalar or vector, yields the stored value x 2^-8 (kE4m3Unit^-1; the one
// exception, the avx2 tier's E4m3Chunk16, states its own units): the byte's
// sign, exponent and mantissa become an fp16 (sign << 8 | magnitude << 7), exact for normals
// and subnormals alike, as the fp16 exponent bias is 8 above e4m3's, and the conversion to fp32
// is then the fp16 one; the two NaN bytes (magnitude 0x7F) become an fp16 NaN. Callers fold
// kE4m3Unit into the scales they apply anyway.
struct e4m3_t { uint8_t x; };
constexpr float kE4m3Unit = 256.0f;
inline uint16_t e4m3_to_f16_scaled(uint8_t b) {
  const uint16_t mag = uint16_t(b & 0x7Fu);
  return uint16_t(((b & 0x80u) << 8) | (mag << 7) | (mag == 0x7Fu ? 0x7E00u : 0u));
}

inline float to_f32(float v) { return v; }
inline float to_f32(e4m3_t v) { return f16_to_f32(e4m3_to_f16_scaled(v.x)); }
inline float to_f32(bf16_t v) { return bf16_to_f32(v.x); }
inline float to_f32(f16_t v) { return f16_to_f32(v.x); }
template <class T> inline T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline bf16_t from_f32<bf16_t>(float v) { return bf16_t{f32_to_bf16(v)}; }
template <> inline f16_t from_f32<f16_t>(float v) { return f16_t{f32_to_f16(v)}; }

// ---- exp2 ----------------------------------------------------------------------------------------
// 2^x = 2^n * 2^f with n = rint(x), f in [-0.5, 0.5]. 2^f is a degree-6 polynomial fitted to
// near-minimax relative error on [-0.5, 0.5] (Lawson-weighted least squares); evaluated in fp32
// by Horner its error is below 1.1e-7 relative (1.8 ulp). x is clamped to [-127, 127]: from
// n = -127 on the exponent field is 0 and the result is exactly 0 (weights below 2^-126 of the
// row maximum do not matter to a softmax), so -inf gives 0; NaN propagates.
// Every tier evaluates exactly this formula (vectorised), so forward and backward agree (but for
// the weights rounded to bf16 below).
constexpr float kExp2C0 = 1.0f;
constexpr float kExp2C1 = 0.6931471824645996f;
constexpr float kExp2C2 = 0.24022646248340607f;
constexpr float kExp2C3 = 0.05550328642129898f;
constexpr float kExp2C4 = 0.009618489071726799f;
constexpr float kExp2C5 = 0.0013399930903688073f;
constexpr float kExp2C6 = 0.00015345810970757157f;
constexpr float kExp2Max = 127.0f, kExp2Min = -127.0f;

// A softmax weight rounded to bf16 before its GEMM (P V's operand on the bf16 dot-product tiers)
// keeps 8 significant bits, whose rounding is up to 3.9e-3 relative: there 2^f is the degree-3
// polynomial fitted the same way, 7.5e-5 relative at most (50x under that rounding), 3 of the
// exponential's 9 vector ops fewer. It is the only difference: the row sums and the backward
// use the same weights up to that 7.5e-5.
constexpr int kExp2DegreeBf16P = 3;
constexpr float kExp2P3C0 = 0.9999282360076904f;
constexpr float kExp2P3C1 = 0.693260908126831f;
constexpr float kExp2P3C2 = 0.24260830879211426f;
constexpr float kExp2P3C3 = 0.05517052486538887f;
// The fused exponentials' degree for inputs of type T (Ops::gemm_exp<kDegree>): 16-bit inputs
// (bf16, fp16), whose outputs keep 8 or 11 significant bits (fp16's rounding: up to 4.9e-4
// relative, 6.5x the polynomial's 7.5e-5), take the degree-3 one; fp32 the full one.
template <class T>
constexpr int kExp2DegreeP = sizeof(T) == 2 ? kExp2DegreeBf16P : 6;

// Written branch-free so that loops over it auto-vectorise.
// The polynomial on f = x - rint(x) in [-0.5, 0.5] by Horner's rule, on floats or on any vector
// type, given its splat and fused (or not) multiply-add: the scalar, vf4, ymm and zmm exp2.
// kDegree: 6 (exp2_poly), or kExp2DegreeBf16P for weights rounded to bf16 and the fused
// exponentials of 16-bit inputs (kExp2DegreeP).
template <int kDegree = 6, class R, class Splat, class Fma>
inline R exp2_horner(R f, Splat splat, Fma fma) {
  static_assert(kDegree == 6 || kDegree == kExp2DegreeBf16P, "the two fitted polynomials");
  if constexpr (kDegree == kExp2DegreeBf16P) {
    R p = splat(kExp2P3C3);
    p = fma(p, f, splat(kExp2P3C2));
    p = fma(p, f, splat(kExp2P3C1));
    return fma(p, f, splat(kExp2P3C0));
  }
  R p = splat(kExp2C6);
  p = fma(p, f, splat(kExp2C5));
  p = fma(p, f, splat(kExp2C4));
  p = fma(p, f, splat(kExp2C3));
  p = fma(p, f, splat(kExp2C2));
  p = fma(p, f, splat(kExp2C1));
  return fma(p, f, splat(kExp2C0));
}

inline float exp2_poly(float x) {
  float xc = x < kExp2Max ? x : kExp2Max;
  xc = xc > kExp2Min ? xc : kExp2Min;  // NaN -> kExp2Min, restored below
  const float n = __builtin_rintf(xc);
  const float f = xc - n;
  const float p = exp2_horner(f, [](float c) { return c; },
                              [](float a, float b, float c) { return a * b + c; });
  const float scale = bits_f32(uint32_t(int32_t(n) + 127) << 23);
  return x != x ? x : p * scale;
}

// ---- Philox4x32-10 -------------------------------------------------------------------------------
// Dropout keep bits. Element (bh, i, j) of a call with (seed, offset) uses output word (j & 3) of
// Philox(key = seed, counter = (j >> 2, i, bh, offset)); it is kept when that word >= threshold,
// threshold = round(p * 2^32). Forward, backward and every tier compute the same bits.
struct Philox4 {
  uint32_t v[4];
};

inline Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                             uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * c0;
    const uint64_t p1 = uint64_t(kMul1) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Threshold for keep = (word >= threshold); p in [0, 1).
inline uint32_t dropout_threshold(float p) {
  const double t = double(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : uint32_t(t + 0.5);
}

// Keep bits of one row segment: keep[j - j0] for columns [j0, j0 + n).
inline void dropout_keep_row(uint64_t seed, uint64_t offset, uint64_t bh, int64_t i, int64_t j0,
                             int64_t n, uint32_t threshold, uint8_t* keep) {
  const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  int64_t j = j0;
  const int64_t end = j0 + n;
  while (j < end) {
    const Philox4 r = philox4x32_10(uint32_t(j >> 2), uint32_t(i), uint32_t(bh), uint32_t(offset),
                                    k0, k1);
    for (int w = int(j & 3); w < 4 && j < end; ++w, ++j) keep[j - j0] = r.v[w] >= threshold;
  }
}

// f(std::integral_constant<int, R>{}) for a run-time row count r in [1, N]: the dispatch of
// the row-templated kernels (decode P.V row groups).
template <int N, class F>
inline void with_rows(int r, F&& f) {
  if constexpr (N > 1) {
    if (r < N) return with_rows<N - 1>(r, f);
  }
  f(std::integral_constant<int, N>{});
}

// max(mx, s[j..valid)) over whole vectors of W lanes (load / vmax: the ISA's unaligned load and
// max), j advanced past them: four independent chains (one would wait on the max latency).
template <int W, class V, class Load, class Max>
inline V max_chains(const float* s, int& j, int valid, V mx, Load load, Max vmax) {
  V m1 = mx, m2 = mx, m3 = mx;
  for (; j + 4 * W <= valid; j += 4 * W) {
    mx = vmax(mx, load(s + j));
    m1 = vmax(m1, load(s + j + W));
    m2 = vmax(m2, load(s + j + 2 * W));
    m3 = vmax(m3, load(s + j + 3 * W));
  }
  for (; j + W <= valid; j += W) mx = vmax(mx, load(s + j));
  return vmax(vmax(mx, m1), vmax(m2, m3));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
