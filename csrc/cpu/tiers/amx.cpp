// AMX-BF16 tier (bf16 inputs): the blocked algorithms with the tile trait (amx_ops.h).
// Compiled with the AVX-512, AVX512-BF16 and AMX flags only; selected for bf16 when CPUID
// reports AMX-TILE + AMX-BF16, XCR0 enables tile state and Linux grants the tile-data
// permission. Built a second time with FLASHSDPA_EMULATE (SIMDe + the test-only tile model in
// amx_emu.h, AVX2 flags) as the emulated tier.
#include <type_traits>
#if defined(FLASHSDPA_EMULATE)
#define FLASHSDPA_TIER_NS amx_emu_tier_ns
#include "../simde_emu.h"
#include "../amx_emu.h"
#else
#define FLASHSDPA_TIER_NS amx
#include <immintrin.h>
#endif
#include "../amx_ops.h"
#include "../tier_impl.h"

#if defined(FLASHSDPA_EMULATE)
FLASHSDPA_DEFINE_TIER(amx_emu_tier, AmxOps, "amx")
#else
FLASHSDPA_DEFINE_TIER(amx_tier, AmxOps, "amx")
#endif
