// Test-only: build an AVX-512 tier source for a CPU without AVX-512. SIMDe (Debian's
// libsimde-dev) implements the _mm512_* intrinsics in portable code (AVX2 where available) behind
// its native aliases; the few it lacks are filled in here. Never part of a normal build:
// setup.py compiles the tiers this way, as extra "emulated" tiers, only when the SIMDe headers
// are present, and only tests select them (flashsdpa._C.set_emulated_tier).
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

namespace flashsdpa {
namespace emu {
inline float reduce_add_ps(simde__m512 v) {
  simde__m512_private p = simde__m512_to_private(v);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += p.f32[i];
  return s;
}
inline float reduce_max_ps(simde__m512 v) {
  simde__m512_private p = simde__m512_to_private(v);
  float m = p.f32[0];
  for (int i = 1; i < 16; ++i) m = p.f32[i] > m ? p.f32[i] : m;
  return m;
}
// vcvtneps2bf16: round to nearest even, NaN -> quiet NaN
inline simde__m256bh cvtneps_pbh(simde__m512 v) {
  simde__m512_private p = simde__m512_to_private(v);
  uint16_t out[16];
  for (int i = 0; i < 16; ++i) {
    uint32_t u;
    simde_memcpy(&u, &p.f32[i], 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      out[i] = uint16_t((u >> 16) | 0x0040u);
    } else {
      out[i] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  simde__m256bh r;
  simde_memcpy(&r, out, sizeof(r));
  return r;
}
// vcvtne2ps2bf16: b's 16 lanes in the low half, a's in the high half
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  const simde__m256bh lo = cvtneps_pbh(b), hi = cvtneps_pbh(a);
  simde__m512bh r;
  simde_memcpy(&r, &lo, 32);
  simde_memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
// masked loads (zero where the mask is clear; nothing read there) and masked stores
inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* mem) {
  simde__m512_private r = simde__m512_to_private(simde_mm512_setzero_ps());
  const float* m = static_cast<const float*>(mem);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) r.f32[i] = m[i];
  return simde__m512_from_private(r);
}
// N lanes of type E (uint8_t, uint16_t) of a vector type V
template <class E, class V, int N, class M>
inline V maskz_loadu_lanes(M k, const void* mem) {
  E v[N] = {};
  const E* m = static_cast<const E*>(mem);
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) v[i] = m[i];
  V r;
  simde_memcpy(&r, v, sizeof(r));
  return r;
}
inline void mask_storeu_ps(void* mem, simde__mmask16 k, simde__m512 a) {
  const simde__m512_private v = simde__m512_to_private(a);
  float* m = static_cast<float*>(mem);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) m[i] = v.f32[i];
}
template <class V, int N, class M>
inline void mask_storeu_epi16(void* mem, M k, V a) {
  uint16_t v[N];
  simde_memcpy(v, &a, sizeof(v));
  uint16_t* m = static_cast<uint16_t*>(mem);
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) m[i] = v[i];
}
// Zero extension of the lanes of a 256-bit vector to a 512-bit one (the two SIMDe resolves to
// GCC's own, AVX512BW-only, builtins).
template <class From, class To>
inline simde__m512i zext_lanes(simde__m256i a) {
  constexpr int N = 64 / int(sizeof(To));
  From v[N];
  simde_memcpy(v, &a, sizeof(v));
  To w[N];
  for (int i = 0; i < N; ++i) w[i] = v[i];
  simde__m512i r;
  simde_memcpy(&r, w, sizeof(r));
  return r;
}
// vpmovdw: the low halves of 16 32-bit lanes
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  uint32_t v[16];
  simde_memcpy(v, &a, sizeof(v));
  uint16_t w[16];
  for (int i = 0; i < 16; ++i) w[i] = uint16_t(v[i]);
  simde__m256i r;
  simde_memcpy(&r, w, sizeof(r));
  return r;
}
inline simde__m512 cvtph_ps(simde__m256i a) {  // fp16 -> fp32 through the F16C 8-wide op
  simde__m128i lo, hi;
  simde_memcpy(&lo, &a, 16);
  simde_memcpy(&hi, reinterpret_cast<const char*>(&a) + 16, 16);
  const simde__m256 l = simde_mm256_cvtph_ps(lo), h = simde_mm256_cvtph_ps(hi);
  simde__m512 r;
  simde_memcpy(&r, &l, 32);
  simde_memcpy(reinterpret_cast<char*>(&r) + 32, &h, 32);
  return r;
}
// vscalefps: a * 2^floor(b), rounded once (ldexpf), NaN in -> NaN out. (SIMDe's version goes
// through exp2 per lane and flushes denormal inputs.)
inline simde__m512 scalef_ps(simde__m512 a, simde__m512 b) {
  simde__m512_private pa = simde__m512_to_private(a), pb = simde__m512_to_private(b), r;
  for (int i = 0; i < 16; ++i) {
    const float x = pa.f32[i], e = pb.f32[i];
    if (x != x || e != e) {
      r.f32[i] = x + e;
    } else if (e == __builtin_inff() || e == -__builtin_inff()) {
      r.f32[i] = e > 0 ? x * __builtin_inff() : x * 0.0f;
    } else {
      const float fe = __builtin_floorf(e);
      r.f32[i] = __builtin_ldexpf(x, fe > 400.0f ? 400 : (fe < -400.0f ? -400 : int(fe)));
    }
  }
  return simde__m512_from_private(r);
}
}  // namespace emu
}  // namespace flashsdpa

#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) flashsdpa::emu::zext_lanes<uint16_t, uint32_t>(a)
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) flashsdpa::emu::zext_lanes<uint8_t, uint16_t>(a)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) flashsdpa::emu::cvtepi32_epi16(a)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) flashsdpa::emu::cvtph_ps(a)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) flashsdpa::emu::maskz_loadu_ps(k, p)
#undef _mm_maskz_loadu_epi8
#define _mm_maskz_loadu_epi8(k, p) flashsdpa::emu::maskz_loadu_lanes<uint8_t, simde__m128i, 16>(k, p)
#undef _mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8(k, p) flashsdpa::emu::maskz_loadu_lanes<uint8_t, simde__m512i, 64>(k, p)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) \
  flashsdpa::emu::maskz_loadu_lanes<uint16_t, simde__m256i, 16>(k, p)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) \
  flashsdpa::emu::maskz_loadu_lanes<uint16_t, simde__m512i, 32>(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) flashsdpa::emu::mask_storeu_ps(p, k, a)
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) flashsdpa::emu::mask_storeu_epi16<simde__m256i, 16>(p, k, a)
#undef _mm512_mask_storeu_epi16
#define _mm512_mask_storeu_epi16(p, k, a) flashsdpa::emu::mask_storeu_epi16<simde__m512i, 32>(p, k, a)
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(v) flashsdpa::emu::cvtneps_pbh(v)
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) flashsdpa::emu::cvtne2ps_pbh(a, b)
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_add_ps(v) flashsdpa::emu::reduce_add_ps(v)
#define _mm512_reduce_max_ps(v) flashsdpa::emu::reduce_max_ps(v)
#undef _mm512_scalef_ps
#define _mm512_scalef_ps(a, b) flashsdpa::emu::scalef_ps(a, b)
#undef _mm512_maskz_scalef_ps
#define _mm512_maskz_scalef_ps(k, a, b) _mm512_maskz_mov_ps(k, flashsdpa::emu::scalef_ps(a, b))
