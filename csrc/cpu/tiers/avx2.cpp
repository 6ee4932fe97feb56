// AVX2 tier: the blocked algorithms with the hand-written AVX2 / FMA / F16C trait (avx2_ops.h).
// Compiled with -mavx2 -mfma -mf16c only; selected at run time when CPUID + XCR0 allow it.
#define FLASHSDPA_TIER_NS avx2
#include "../avx2_ops.h"
#include "../tier_impl.h"

FLASHSDPA_DEFINE_TIER(avx2_tier, Avx2Ops, "avx2")
