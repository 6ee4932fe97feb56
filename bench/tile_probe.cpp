// One CPU tier's GEMM micro-kernels on their own, outside the attention loops:
// bench/tile_probe.py compiles this once per tier (tiers.def's macros and flags, as setup.py
// compiles csrc/cpu/tier.cpp) and runs it on one thread.
//
//   tile_probe M N REPS CALLS K...
//
// For each inner dimension K: Ops::gemm over an M x N product (the kernels' P V, and the
// backward's GEMMs), and, on a trait with fused exponentials, Ops::gemm_exp<degree> (the
// forward's S GEMM with P = 2^(S - m) made in its tiles) for each degree the forward uses
// (kExp2DegreeP: 6 for fp32 inputs, 3 for 16-bit ones; 3 only where P is rounded to bf16).
// Operands are zeros in the trait's formats (A rows of K elements, or of K / 2 bf16 pairs; B
// panels of K inner steps), kept in the caches between calls as the kernels' blocks are. Each
// line: <kernel> <degree> <K> <ns per call: the best of REPS turns of CALLS calls>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>
#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define FLASHSDPA_STR2(x) #x
#define FLASHSDPA_STR(x) FLASHSDPA_STR2(x)
#define FLASHSDPA_TIER_NS FLASHSDPA_TIER
#include FLASHSDPA_STR(FLASHSDPA_TIER_HEADER)

using namespace flashsdpa::cpu::FLASHSDPA_TIER_NS;
using Ops = FLASHSDPA_TIER_OPS;

namespace {

struct Buffer {  // 64-byte aligned zeros (the packed panels are read with aligned loads)
  float* p;
  explicit Buffer(int64_t n)
      : p(static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64))) {
    for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
  }
  ~Buffer() { std::free(p); }
};

double now_ns() {
  return std::chrono::duration<double, std::nano>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The kernels of one K timed in turns (each rep: CALLS calls of each kernel in order), so that a
// shared machine's slow moments fall on all of them; the best rep of each, in ns per call.
template <class... F>
std::vector<double> best_ns(int reps, int calls, F&... f) {
  std::vector<double> best(sizeof...(F), 1e300);
  for (int r = 0; r < reps; ++r) {
    size_t i = 0;
    const auto time_one = [&](auto& g) {
      const double t0 = now_ns();
      for (int c = 0; c < calls; ++c) g();
      const double ns = (now_ns() - t0) / calls;
      if (ns < best[i]) best[i] = ns;
      ++i;
    };
    (time_one(f), ...);
  }
  return best;
}

// (a template, so that `if constexpr` leaves out what a trait has not: its exponentials)
template <class Tr>
int probe(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N REPS CALLS K...\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[1]), N = std::atoi(argv[2]);
  const int reps = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  constexpr int pack = caps<Tr>().inner_pack;  // elements per inner step of the operands
  if (M < 1 || N < Tr::NR || N % Tr::NR || reps < 1 || calls < 1) {
    std::fprintf(stderr, "M >= 1, N a multiple of %d, REPS and CALLS >= 1\n", Tr::NR);
    return 2;
  }
  Tr::thread_begin();  // (AMX: the tile configuration)
  for (int arg = 5; arg < argc; ++arg) {
    const int K = std::atoi(argv[arg]);
    if (K < pack || K % pack) {
      std::fprintf(stderr, "K must be a positive multiple of %d\n", pack);
      return 2;
    }
    const int steps = K / pack;
    const int lda = steps + 16;  // A's rows, in floats (padded off a power of two)
    const int64_t bstride = int64_t(steps) * Tr::NR;  // one B panel, in floats
    const int ldc = N + 16;
    Buffer a(int64_t(M) * lda), bp(bstride * (N / Tr::NR)), c(int64_t(M) * ldc);
    Buffer mref(M), sumv(int64_t(M) * 16);
    auto gemm = [&] {
      Tr::template gemm<false>(M, N, K, a.p, lda, bp.p, bstride, c.p, ldc, false);
    };
    const auto exp_of = [&](auto degree) {
      return [&, degree] {
        Tr::template gemm_exp<decltype(degree)::value>(
            M, N, K, a.p, lda, bp.p, bstride, c.p, ldc, mref.p, sumv.p, nullptr, 1.0f,
            reinterpret_cast<uint16_t*>(c.p), 2 * int64_t(ldc));
      };
    };
    const double warm_end = now_ns() + 2e8;  // 0.2 s first: clocks up, caches filled
    while (now_ns() < warm_end) gemm();
    if constexpr (!caps<Tr>().fused_exp) {
      std::printf("gemm 0 %d %.1f\n", K, best_ns(reps, calls, gemm)[0]);
    } else {
      auto exp3 = exp_of(std::integral_constant<int, kExp2DegreeBf16P>());
      if constexpr (caps<Tr>().prep_a) {  // P rounded to bf16: the degree-3 polynomial only
        const std::vector<double> t = best_ns(reps, calls, gemm, exp3);
        std::printf("gemm 0 %d %.1f\ngemm_exp %d %d %.1f\n", K, t[0], kExp2DegreeBf16P, K, t[1]);
      } else {
        auto exp6 = exp_of(std::integral_constant<int, 6>());
        const std::vector<double> t = best_ns(reps, calls, gemm, exp6, exp3);
        std::printf("gemm 0 %d %.1f\ngemm_exp 6 %d %.1f\ngemm_exp %d %d %.1f\n", K, t[0], K,
                    t[1], kExp2DegreeBf16P, K, t[2]);
      }
    }
  }
  Tr::thread_end();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__AMX_TILE__) && defined(__linux__)
  // tile data needs the process's permission (ARCH_REQ_XCOMP_PERM for XTILEDATA), as the
  // extension asks for it (csrc/cpu/isa.cpp): without it the tile instructions fault
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "Linux refused the AMX tile data permission\n");
    return 3;
  }
#endif
  return probe<Ops>(argc, argv);
}
