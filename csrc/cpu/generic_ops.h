// GenericOps: the micro-kernel trait in plain C++ (no intrinsics). It is the portable tier's
// trait, and the base that faster tiers derive from, overriding what they accelerate.
//
// The blocked algorithms (flash_fwd.h, flash_bwd.h) only talk to a trait through these members:
//
//   NR                   panel width: B operands are packed in panels of NR columns
//   load_rows<T>         rows of T -> fp32 row-major (an A operand)
//   pack_b<T>            B[kk][n] = src[kk*ld + n]  -> panels   (e.g. V for O += P V)
//   pack_bt<T>           B[kk][n] = src[n*ld + kk]  -> panels   (e.g. K^T for S = Q K^T)
//   gemm<TransA>         C[M][Np] (= or +=) A[M][K] * B[K][Np], A row-major or transposed
//   score_row            s = raw * scale_log2 + mask (log2 domain), causal cut, returns max
//   exp2_row_sum         p = exp2(s - m), returns sum(p)
//   scale_row, store_row, dot_row
#pragma once
#include "scalar.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

struct GenericOps {
  static constexpr int NR = 16;  // panel width
  static constexpr int MR = 4;   // rows per micro-tile
  static constexpr int kBlockQ = 64;  // query rows per block (fewer when Lq is shorter)

  // dst[i*ldd + d] = src[i*ld + d] for i < rows, d < cols.
  template <class T>
  static void load_rows(const T* src, int64_t ld, int rows, int cols, float* dst, int ldd) {
    for (int i = 0; i < rows; ++i) {
      const T* s = src + i * ld;
      float* d = dst + int64_t(i) * ldd;
      for (int c = 0; c < cols; ++c) d[c] = to_f32(s[c]);
    }
  }

  // Panel layout: panel p holds columns [p*NR, p*NR + NR) as [K][NR]; columns >= N are zero.
  // B[kk][n] = src[kk*ld + n]: the source rows run along K.
  template <class T>
  static void pack_b(const T* src, int64_t ld, int K, int N, float* dst) {
    const int np = int(ceil_div(N, NR));
    for (int p = 0; p < np; ++p) {
      const int n0 = p * NR, w = int(min64(NR, N - n0));
      float* panel = dst + int64_t(p) * K * NR;
      for (int kk = 0; kk < K; ++kk) {
        const T* s = src + kk * ld + n0;
        float* d = panel + int64_t(kk) * NR;
        int n = 0;
        for (; n < w; ++n) d[n] = to_f32(s[n]);
        for (; n < NR; ++n) d[n] = 0.0f;
      }
    }
  }

  // B[kk][n] = src[n*ld + kk]: the source rows run along N (K^T from the rows of K).
  template <class T>
  static void pack_bt(const T* src, int64_t ld, int K, int N, float* dst) {
    const int np = int(ceil_div(N, NR));
    for (int p = 0; p < np; ++p) {
      const int n0 = p * NR, w = int(min64(NR, N - n0));
      float* panel = dst + int64_t(p) * K * NR;
      for (int n = 0; n < NR; ++n) {
        if (n < w) {
          const T* s = src + (n0 + n) * ld;
          for (int kk = 0; kk < K; ++kk) panel[int64_t(kk) * NR + n] = to_f32(s[kk]);
        } else {
          for (int kk = 0; kk < K; ++kk) panel[int64_t(kk) * NR + n] = 0.0f;
        }
      }
    }
  }

  // One R x NR tile: C[0..R)[0..NR) (=|+=) sum_kk A[i][kk] * panel[kk][0..NR).
  template <bool TransA, int R>
  static inline void micro_tile(int K, const float* a, int lda, const float* panel, float* c,
                                int ldc, bool accumulate) {
    float acc[R][NR];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = 0.0f;
    for (int kk = 0; kk < K; ++kk) {
      const float* b = panel + int64_t(kk) * NR;
      for (int i = 0; i < R; ++i) {
        const float av = TransA ? a[int64_t(kk) * lda + i] : a[int64_t(i) * lda + kk];
        for (int j = 0; j < NR; ++j) acc[i][j] += av * b[j];
      }
    }
    for (int i = 0; i < R; ++i) {
      float* cr = c + int64_t(i) * ldc;
      if (accumulate) {
        for (int j = 0; j < NR; ++j) cr[j] += acc[i][j];
      } else {
        for (int j = 0; j < NR; ++j) cr[j] = acc[i][j];
      }
    }
  }

  // C[M][round_up(N, NR)] (= or +=) A * B. A[i][kk] = a[i*lda + kk], or a[kk*lda + i] if TransA.
  // B comes from pack_b / pack_bt with the same K and N. Padding columns of C get A * 0.
  template <bool TransA>
  static void gemm(int M, int N, int K, const float* a, int lda, const float* bp, float* c,
                   int ldc, bool accumulate) {
    const int np = int(ceil_div(N, NR));
    for (int p = 0; p < np; ++p) {
      const float* panel = bp + int64_t(p) * K * NR;
      float* cp = c + p * NR;
      int i = 0;
      for (; i + MR <= M; i += MR) {
        const float* ai = TransA ? a + i : a + int64_t(i) * lda;
        micro_tile<TransA, MR>(K, ai, lda, panel, cp + int64_t(i) * ldc, ldc, accumulate);
      }
      for (; i < M; ++i) {
        const float* ai = TransA ? a + i : a + int64_t(i) * lda;
        micro_tile<TransA, 1>(K, ai, lda, panel, cp + int64_t(i) * ldc, ldc, accumulate);
      }
    }
  }

  // s[j] = s[j] * scale_log2 + madd[j] for j < valid (madd may be null), s[j] = -inf for
  // valid <= j < n. Returns max_j s[j] (-inf if every column is masked).
  static float score_row(float* s, int n, float scale_log2, const float* madd, int valid) {
    float mx = kNegInf;
    if (madd) {
      for (int j = 0; j < valid; ++j) {
        s[j] = s[j] * scale_log2 + madd[j];
        mx = s[j] > mx ? s[j] : mx;
      }
    } else {
      for (int j = 0; j < valid; ++j) {
        s[j] = s[j] * scale_log2;
        mx = s[j] > mx ? s[j] : mx;
      }
    }
    for (int j = valid; j < n; ++j) s[j] = kNegInf;
    return mx;
  }

  // s[j] = exp2(s[j] - m) for j < n; returns the sum. m must be finite.
  static float exp2_row_sum(float* s, int n, float m) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      s[j] = exp2_poly(s[j] - m);
      sum += s[j];
    }
    return sum;
  }

  static void scale_row(float* x, int n, float a) {
    for (int j = 0; j < n; ++j) x[j] *= a;
  }

  // dst[j] = round(src[j] * mul) for j < n.
  template <class T>
  static void store_row(const float* src, int n, float mul, T* dst) {
    for (int j = 0; j < n; ++j) dst[j] = from_f32<T>(src[j] * mul);
  }

  // sum_j to_f32(a[j]) * to_f32(b[j])
  template <class T>
  static float dot_row(const T* a, const T* b, int n) {
    float s = 0.0f;
    for (int j = 0; j < n; ++j) s += to_f32(a[j]) * to_f32(b[j]);
    return s;
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
