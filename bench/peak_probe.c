/* Machine peak probes for bench/peak.py, compiled once per ISA variant:
 *   cc -O2 -fopenmp [-mavx2 -mfma | -mavx512f] peak_probe.c
 *
 *   peak_probe fma  <threads> <seconds>   independent FMA chains on the widest vectors of the
 *                                         build; prints GFLOP/s over all threads
 *   peak_probe read <threads> <MiB>       sums a buffer much larger than the caches with
 *                                         vector loads; prints the best GB/s of a few passes
 *   peak_probe dpbf16 <threads> <seconds> (built with -mavx512bf16) independent vdpbf16ps
 *                                         chains: bf16 products accumulated in fp32, 64 FLOP
 *                                         per instruction; prints GFLOP/s over all threads
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define ISA "avx512"
typedef __m512 vec;
#define LANES 16
#define VZERO() _mm512_setzero_ps()
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOAD(p) _mm512_load_ps(p)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
typedef __m256 vec;
#define LANES 8
#define VZERO() _mm256_setzero_ps()
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOAD(p) _mm256_load_ps(p)
#define VADD(a, b) _mm256_add_ps(a, b)
static float VSUM(__m256 v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
#define ISA "sse2"
typedef __m128 vec;
#define LANES 4
#define VZERO() _mm_setzero_ps()
#define VSET(x) _mm_set1_ps(x)
#define VFMA(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c) /* no FMA: mul + add */
#define VLOAD(p) _mm_load_ps(p)
#define VADD(a, b) _mm_add_ps(a, b)
static float VSUM(__m128 v) {
  float t[4];
  _mm_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3];
}
#endif

/* Enough independent chains to cover FMA latency x throughput (4 cycles x 2 pipes, up to 5 x 2). */
#define CHAINS 12

static double fma_run(long iters, float* sink) {
  vec acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = VSET(1.0f + 1e-3f * c);
  const vec a = VSET(0.999999f), b = VSET(1e-7f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = VFMA(acc[c], a, b);
  }
  vec s = VZERO();
  for (int c = 0; c < CHAINS; ++c) s = VADD(s, acc[c]);
  *sink = VSUM(s);
  return 2.0 * LANES * CHAINS * (double)iters;
}

#if defined(__AVX512BF16__)
static double dpbf16_run(long iters, float* sink) {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(1.0f + 1e-3f * c);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380); /* bf16 ~6e-8 */
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 s = _mm512_setzero_ps();
  for (int c = 0; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  *sink = _mm512_reduce_add_ps(s);
  return 64.0 * CHAINS * (double)iters;
}
#endif

/* Runs `run` on every thread, doubling the iterations until one round lasts `seconds`;
 * returns GFLOP/s over all threads. */
static double timed_gflops(double (*run)(long, float*), double seconds, float* sink_out) {
  long iters = 1 << 20;
  for (;;) {
    double flops = 0.0;
    float sink = 0.0f;
    const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : flops)
    {
      float s;
      flops += run(iters, &s);
#pragma omp critical
      sink += s;
    }
    const double dt = omp_get_wtime() - t0;
    if (dt >= seconds || iters > (1L << 40)) {
      *sink_out = sink;
      return flops / dt * 1e-9;
    }
    iters *= 2;
  }
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s fma|dpbf16|read <threads> <seconds|MiB>\n", argv[0]);
    return 2;
  }
  const int threads = atoi(argv[2]);
  omp_set_num_threads(threads);
  if (strcmp(argv[1], "fma") == 0) {
    float sink;
    const double g = timed_gflops(fma_run, atof(argv[3]), &sink);
    printf("%s fma %.3f GFLOP/s threads=%d (sink %g)\n", ISA, g, threads, (double)sink);
    return 0;
  }
  if (strcmp(argv[1], "dpbf16") == 0) {
#if defined(__AVX512BF16__)
    float sink;
    const double g = timed_gflops(dpbf16_run, atof(argv[3]), &sink);
    printf("avx512_bf16 dpbf16 %.3f GFLOP/s threads=%d (sink %g)\n", g, threads, (double)sink);
    return 0;
#else
    fprintf(stderr, "dpbf16: build with -mavx512bf16\n");
    return 2;
#endif
  }
  if (strcmp(argv[1], "read") == 0) {
    const size_t bytes = (size_t)atol(argv[3]) << 20;
    const size_t n = bytes / sizeof(float);
    float* buf = aligned_alloc(64, n * sizeof(float));
    if (!buf) return 1;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) buf[i] = (float)(i & 1023) * 1e-3f; /* first touch per thread */
    double best = 0.0, total = 0.0;
    for (int pass = 0; pass < 5; ++pass) {
      const double t0 = omp_get_wtime();
      double sum = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
      for (size_t blk = 0; blk < n / 4096; ++blk) {
        vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        const float* p = buf + blk * 4096;
        for (int i = 0; i < 4096; i += 4 * LANES) {
          a0 = VADD(a0, VLOAD(p + i));
          a1 = VADD(a1, VLOAD(p + i + LANES));
          a2 = VADD(a2, VLOAD(p + i + 2 * LANES));
          a3 = VADD(a3, VLOAD(p + i + 3 * LANES));
        }
        sum += VSUM(VADD(VADD(a0, a1), VADD(a2, a3)));
      }
      const double dt = omp_get_wtime() - t0;
      total += sum;
      const double gbs = (double)(n / 4096 * 4096) * sizeof(float) / dt * 1e-9;
      if (gbs > best) best = gbs;
    }
    printf("%s read %.3f GB/s threads=%d (sum %g)\n", ISA, best, threads, total);
    free(buf);
    return 0;
  }
  fprintf(stderr, "unknown probe %s\n", argv[1]);
  return 2;
}
