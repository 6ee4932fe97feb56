// AVX512-BF16 tier (bf16 inputs): the blocked algorithms with the vdpbf16ps trait
// (avx512bf16_ops.h). Compiled with the AVX-512 + AVX512-BF16 flags only; selected for bf16 when
// CPUID reports AVX512_BF16 and XCR0 allows AVX-512. Built a second time with FLASHSDPA_EMULATE
// (SIMDe, AVX2 flags) as the test-only emulated tier.
#include <type_traits>
#if defined(FLASHSDPA_EMULATE)
#define FLASHSDPA_TIER_NS avx512_bf16_emu
#include "../simde_emu.h"
#else
#define FLASHSDPA_TIER_NS avx512_bf16
#endif
#include "../avx512bf16_ops.h"
#include "../tier_impl.h"

#if defined(FLASHSDPA_EMULATE)
FLASHSDPA_DEFINE_TIER(avx512_bf16_emu_tier, Avx512Bf16Ops, "avx512_bf16")
#else
FLASHSDPA_DEFINE_TIER(avx512_bf16_tier, Avx512Bf16Ops, "avx512_bf16")
#endif
