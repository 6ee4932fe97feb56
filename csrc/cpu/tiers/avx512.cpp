// AVX-512 tier (F/BW/VL/DQ): the blocked algorithms with the 12x32 zmm trait (avx512_ops.h).
// Compiled with the AVX-512 flags only; selected at run time when CPUID + XCR0 (opmask and ZMM
// state) allow it. Built a second time with FLASHSDPA_EMULATE (SIMDe, AVX2 flags) as the
// test-only emulated tier.
#if defined(FLASHSDPA_EMULATE)
#define FLASHSDPA_TIER_NS avx512_emu
#include "../simde_emu.h"
#else
#define FLASHSDPA_TIER_NS avx512
#endif
#include "../avx512_ops.h"
#include "../tier_impl.h"

#if defined(FLASHSDPA_EMULATE)
FLASHSDPA_DEFINE_TIER(avx512_emu_tier, Avx512Ops, "avx512")
#else
FLASHSDPA_DEFINE_TIER(avx512_tier, Avx512Ops, "avx512")
#endif
