// The AMX-BF16 trait (bf16 inputs): GEMM blocks of 32 rows x 32 columns on the tile unit, a 2x2
// arrangement of 16x16 fp32 accumulator tiles (tmm0-3) fed by two A tiles (tmm4-5, 16 rows x 32
// bf16) and two B tiles (tmm6-7, 16 pairs x 16 columns, VNNI-2) per 32-deep step. Everything
// else - operand formats, softmax between the tile steps, the remainders that do not fill a
// 32 x 32 x 32 block - is the AVX512-BF16 trait's.
//
// Operand formats are those of avx512bf16_ops.h, except that the A operand of the transposed
// products (P^T dO, dS^T Q) is materialised row-major (a transposed bf16 copy): a tile load
// reads A rows.
//
// The tile configuration is loaded by each thread before its run of work items and released
// after it (thread_begin / thread_end); Linux's permission to use tile data is requested once
// per process before the tier is selected (csrc/cpu/isa.cpp).
#pragma once
#if defined(FLASHSDPA_EMULATE)
#include "amx_emu.h"  // the test-only tile model, beside SIMDe
#endif
#include "avx512bf16_ops.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

struct AmxOps : Avx512Bf16Ops {
  static constexpr int MR = 32;  // rows per block (and per causal row group)
  static constexpr int kTile = 16;
  static constexpr int kDepth = 32;  // bf16 elements per tile step (16 pairs)
  FLASHSDPA_TRAIT_CAPS(AmxOps, /*scale_in_a=*/false, /*prep_a=*/true,
                       /*inner_pack=*/2, /*fused_exp=*/false, /*transposed_s=*/false)

  struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };

  static void thread_begin() {
    TileConfig cfg = {};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = kTile;
      cfg.colsb[t] = 64;  // 16 fp32 (C) / 32 bf16 (A) / 16 bf16 pairs (B) per row
    }
    _tile_loadconfig(&cfg);
  }
  static void thread_end() { _tile_release(); }

  // The transposed products get a row-major copy: row m = column m of the tile, pairs along kk.
  template <bool TransA>
  static const float* prep_a(const float* tile, int ld, int M, int K, float* buf, int* lda) {
    if (!TransA) return Avx512Bf16Ops::prep_a<false>(tile, ld, M, K, buf, lda);
    const int pairs = int(round_up(K, kDepth)) / 2;  // floats (pairs) per row, zero padded
    *lda = pairs;
    for (int m = 0; m < M; ++m) {
      uint16_t* d = bf16_words(buf + int64_t(m) * pairs);
      for (int kk = 0; kk < K; ++kk) d[kk] = f32_to_bf16(tile[int64_t(kk) * ld + m]);
      for (int kk = K; kk < 2 * pairs; ++kk) d[kk] = 0;
    }
    return buf;
  }

  // One 32 x 32 block of C over `depth` (a multiple of 32) inner elements on the tile unit.
  // A rows: lda floats (= bf16 pairs) apart; B: a VNNI-2 panel of 32 columns (128 bytes a pair).
  static void amx_block(int depth, const float* a, int lda, const float* panel, float* c, int ldc,
                        bool accumulate) {
    const long a_stride = long(lda) * 4, c_stride = long(ldc) * 4, b_stride = 128;
    if (accumulate) {
      _tile_loadd(0, c, c_stride);
      _tile_loadd(1, c + 16, c_stride);
      _tile_loadd(2, c + int64_t(16) * ldc, c_stride);
      _tile_loadd(3, c + int64_t(16) * ldc + 16, c_stride);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const uint8_t* A = reinterpret_cast<const uint8_t*>(a);
    const uint8_t* B = reinterpret_cast<const uint8_t*>(panel);
    for (int k0 = 0; k0 < depth; k0 += kDepth) {
      const uint8_t* ak = A + int64_t(k0) * 2;           // 32 bf16 of each A row
      const uint8_t* bk = B + int64_t(k0 / 2) * b_stride;  // 16 pair-rows of the panel
      _tile_loadd(4, ak, a_stride);                           // rows 0..15
      _tile_loadd(5, ak + 16 * a_stride, a_stride);           // rows 16..31
      _tile_loadd(6, bk, b_stride);                           // columns 0..15
      _tile_loadd(7, bk + 64, b_stride);                      // columns 16..31
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + 16, c_stride);
    _tile_stored(2, c + int64_t(16) * ldc, c_stride);
    _tile_stored(3, c + int64_t(16) * ldc + 16, c_stride);
  }

  // Rows [0, R) x 32 columns over `depth` inner elements with the AVX512-BF16 micro-kernel.
  static void vector_rows(int R, int depth, const float* a, int lda, const float* panel, float* c,
                          int ldc, bool accumulate) {
    for (int r = 0; r < R; r += Avx512Bf16Ops::MR) {
      const int rows = R - r < Avx512Bf16Ops::MR ? R - r : Avx512Bf16Ops::MR;
      micro_tile_rows<Avx512Bf16Ops, false, Avx512Bf16Ops::MR>(
          rows, depth, a + int64_t(r) * lda, lda, panel, c + int64_t(r) * ldc, ldc, accumulate);
    }
  }

  // The tiles of gemm_loop (for_each_tile, generic_ops.h) in 32-row groups: full 32 x 32 x 32k
  // blocks on the tile unit, the rest on the vector unit. A is row-major in both cases (see
  // prep_a).
  template <bool TransA>
  static void gemm(int M, int N, int K, const float* a, int lda, const float* bp, int64_t bstride,
                   float* c, int ldc, bool accumulate, const RowLimit* lim = nullptr) {
    // (inner steps a band skips start at 0 here: the P columns there are 0)
    for_each_tile<NR, MR>(M, N, K, lim, [&](int p, int i, int R, int, int kk) {
      const float* panel = bp + p * bstride;
      const float* ai = a + int64_t(i) * lda;
      float* ci = c + p * NR + int64_t(i) * ldc;
      const int main = R == MR ? kk / kDepth * kDepth : 0;
      if (main > 0) amx_block(main, ai, lda, panel, ci, ldc, accumulate);
      if (main < kk) {  // what is left: rows of a partial block, or the last < 32 inner steps
        const float* a_rest = reinterpret_cast<const float*>(
            reinterpret_cast<const uint16_t*>(ai) + main);
        const float* b_rest = panel + int64_t(main / 2) * NR;  // pair-rows of 32 words
        vector_rows(R, kk - main, a_rest, lda, b_rest, ci, ldc, accumulate || main > 0);
      }
    });
  }
};

template <class KV>
struct DecodeOpsOf<AmxOps, KV> : DecodeOpsOf<Avx512Bf16Ops, KV> {};  // short queries fill no tiles

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
