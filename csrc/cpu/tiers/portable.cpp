// Portable tier: the blocked algorithms with the plain C++ trait. No intrinsics and no ISA flags,
// so it builds on any CPU (x86-64 baseline, aarch64, ...). The correctness anchor of the suite.
#define FLASHSDPA_TIER_NS portable
#include "../generic_ops.h"
#include "../tier_impl.h"

namespace flashsdpa {
namespace cpu {
namespace portable {
namespace {

// Peak probe: 64 independent multiply-add chains, vectorised by the compiler as it can.
double fma_probe(int64_t iters, float* sink) {
  constexpr int kChains = 64;
  float acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = 1.0f + 1e-3f * c;
  const float a = 0.999999f, b = 1e-7f;
  for (int64_t it = 0; it < iters; ++it)
    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
  float s = 0.0f;
  for (int c = 0; c < kChains; ++c) s += acc[c];
  *sink = s;
  return 2.0 * kChains * double(iters);
}

}  // namespace
}  // namespace portable
}  // namespace cpu
}  // namespace flashsdpa

FLASHSDPA_DEFINE_TIER(portable_tier, GenericOps, "portable", &portable::fma_probe)
