// Portable tier: the blocked algorithms with the plain C++ trait. No intrinsics and no ISA flags,
// so it builds on any CPU (x86-64 baseline, aarch64, ...). The correctness anchor of the suite.
#define FLASHSDPA_TIER_NS portable
#include "../generic_ops.h"
#include "../tier_impl.h"

FLASHSDPA_DEFINE_TIER(portable_tier, GenericOps, "portable")
