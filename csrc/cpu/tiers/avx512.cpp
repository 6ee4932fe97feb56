// AVX-512 tier (F/BW/VL/DQ): the blocked algorithms with the 12x32 zmm trait (avx512_ops.h).
// Compiled with the AVX-512 flags only; selected at run time when CPUID + XCR0 (opmask and ZMM
// state) allow it.
#define FLASHSDPA_TIER_NS avx512
#include "../avx512_ops.h"
#include "../tier_impl.h"

FLASHSDPA_DEFINE_TIER(avx512_tier, Avx512Ops, "avx512")
