// Test-only software model of the AMX tile instructions flashsdpa uses, so that the amx tier's
// code runs on CPUs without AMX (built with FLASHSDPA_EMULATE, next to SIMDe for AVX-512):
//   _tile_loadconfig / _tile_release / _tile_zero / _tile_loadd / _tile_stored / _tile_dpbf16ps
// Eight tile registers of up to 16 rows x 64 bytes per thread; the configuration (palette 1)
// gives each tile its rows and bytes per row. tdpbf16ps: C[m][n] (fp32) += sum over k pairs of
// A[m][2k] * B[k][n][0] + A[m][2k+1] * B[k][n][1], with bf16 widened exactly to fp32.
// An instruction on an unconfigured tile, or a shape mismatch, aborts with a message (as #UD
// would fault on the hardware), so the tests catch misuse.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace flashsdpa {
namespace amx_model {

struct TileConfig {  // the 64-byte ldtilecfg memory operand
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

struct State {
  bool configured;
  TileConfig cfg;
  alignas(64) uint8_t tile[8][16][64];
};

inline State& state() {
  thread_local State s = {};
  return s;
}

[[noreturn]] inline void fault(const char* what) {
  fprintf(stderr, "flashsdpa AMX emulation: %s\n", what);
  abort();
}

inline void check(int t) {
  const State& s = state();
  if (!s.configured) fault("tile instruction without a tile configuration");
  if (t < 0 || t > 7 || s.cfg.rows[t] == 0 || s.cfg.rows[t] > 16 || s.cfg.colsb[t] > 64)
    fault("tile not configured");
}

inline void loadconfig(const void* cfg) {
  State& s = state();
  memcpy(&s.cfg, cfg, sizeof(TileConfig));
  if (s.cfg.palette_id != 1) fault("palette must be 1");
  s.configured = true;
  memset(s.tile, 0, sizeof(s.tile));
}

inline void release() {
  State& s = state();
  s.configured = false;
  memset(&s.cfg, 0, sizeof(s.cfg));
}

inline void zero(int t) {
  check(t);
  memset(state().tile[t], 0, sizeof(state().tile[t]));
}

inline void loadd(int t, const void* base, long stride) {
  check(t);
  State& s = state();
  for (int r = 0; r < s.cfg.rows[t]; ++r)
    memcpy(s.tile[t][r], static_cast<const uint8_t*>(base) + r * stride, s.cfg.colsb[t]);
}

inline void stored(int t, void* base, long stride) {
  check(t);
  State& s = state();
  for (int r = 0; r < s.cfg.rows[t]; ++r)
    memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[t][r], s.cfg.colsb[t]);
}

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  check(c), check(a), check(b);
  State& s = state();
  const int M = s.cfg.rows[c], N = s.cfg.colsb[c] / 4, Kp = s.cfg.colsb[a] / 4;
  if (s.cfg.rows[a] != M || s.cfg.rows[b] != Kp || s.cfg.colsb[b] != s.cfg.colsb[c])
    fault("tdpbf16ps shape mismatch");
  for (int m = 0; m < M; ++m) {
    float* crow = reinterpret_cast<float*>(s.tile[c][m]);
    const uint16_t* arow = reinterpret_cast<const uint16_t*>(s.tile[a][m]);
    for (int n = 0; n < N; ++n) {
      float acc = crow[n];
      for (int k = 0; k < Kp; ++k) {
        const uint16_t* bw = reinterpret_cast<const uint16_t*>(s.tile[b][k]) + 2 * n;
        acc += bf16_bits_to_f32(arow[2 * k]) * bf16_bits_to_f32(bw[0]) +
               bf16_bits_to_f32(arow[2 * k + 1]) * bf16_bits_to_f32(bw[1]);
      }
      crow[n] = acc;
    }
  }
}

}  // namespace amx_model
}  // namespace flashsdpa

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) flashsdpa::amx_model::loadconfig(cfg)
#define _tile_release() flashsdpa::amx_model::release()
#define _tile_zero(t) flashsdpa::amx_model::zero(t)
#define _tile_loadd(t, base, stride) flashsdpa::amx_model::loadd(t, base, stride)
#define _tile_stored(t, base, stride) flashsdpa::amx_model::stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) flashsdpa::amx_model::dpbf16ps(c, a, b)
