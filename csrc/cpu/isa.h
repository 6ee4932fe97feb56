// CPU feature detection and tier selection.
//
// A tier is usable when (1) its kernels are built into this binary, (2) the CPU reports the
// instructions (CPUID), (3) the OS saves the register state they use (XCR0), and for AMX (4) Linux
// granted the process the tile-data permission. The environment variable FLASHSDPA_CPU_ISA (or
// set_isa_cap) caps the choice. Compiled without ISA flags.
#pragma once
#include <stdint.h>

#include <string>
#include <vector>

#include "../params.h"

namespace flashsdpa {
namespace cpu {

enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3, Amx = 4, kCount = 5 };

// The raw words feature decoding looks at; tests feed fake ones through decode_features().
struct RawCpuid {
  uint32_t max_leaf = 0;
  uint32_t leaf1_ecx = 0;    // FMA(12) OSXSAVE(27) AVX(28) F16C(29)
  uint32_t leaf7_ebx = 0;    // AVX2(5) AVX512F(16) AVX512DQ(17) AVX512BW(30) AVX512VL(31)
  uint32_t leaf7_edx = 0;    // AMX-BF16(22) AMX-TILE(24)
  uint32_t leaf7_1_eax = 0;  // AVX512_BF16(5)
  uint64_t xcr0 = 0;         // valid only when OSXSAVE is set
  bool amx_permitted = false;  // Linux arch_prctl(ARCH_GET_XCOMP_PERM) includes XTILEDATA
};

struct CpuFeatures {
  bool x86 = false;
  bool avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, amx_tile = false, amx_bf16 = false;
  bool os_avx = false;     // XCR0 bits 1-2 (XMM, YMM state)
  bool os_avx512 = false;  // XCR0 bits 5-7 (opmask, ZMM_Hi256, Hi16_ZMM)
  bool os_amx = false;     // XCR0 bits 17-18 (XTILECFG, XTILEDATA)
  bool amx_permitted = false;
  // What the hardware + OS can run, per tier (independent of what is built).
  bool can_run[int(Isa::kCount)] = {};
};

const char* isa_name(Isa isa);
// Parses a tier name (portable, avx2, avx512, avx512_bf16, amx); false if unknown.
bool parse_isa(const std::string& name, Isa* out);

RawCpuid read_cpuid();
CpuFeatures decode_features(const RawCpuid& raw, bool is_x86);
const CpuFeatures& host_features();  // read once
std::string cpu_brand();

// The built tier table (null where a tier is not compiled in).
const CpuTier* built_tier(Isa isa);
// Whether a built tier implements a dtype (avx512_bf16 / amx are bf16-only, for example).
bool tier_supports_dtype(Isa isa, DType dt);

// Cap handling. set_isa_cap throws (TORCH_CHECK) on a tier the host cannot run.
void set_isa_cap(Isa cap);
void clear_isa_cap();  // back to "no cap": the best the host runs
Isa isa_cap();
bool isa_cap_is_set();

// The tier that runs for dtype dt: the highest built tier <= cap that the host can run and that
// implements dt. Never null (portable is always built).
Isa selected_isa(DType dt);
const CpuTier& selected_tier(DType dt);

// Test hook: run the emulated build of a tier (SIMDe, csrc/cpu/simde_emu.h) for the dtypes it
// implements, whatever the CPU; the other dtypes keep the normal choice. Throws if that
// emulation is not compiled in. clear_emulated_tier() ends it.
const CpuTier* emulated_tier(Isa isa);
void set_emulated_tier(Isa isa);
void clear_emulated_tier();
bool emulated_tier_active(DType dt);

}  // namespace cpu
}  // namespace flashsdpa
