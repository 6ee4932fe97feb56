// CPU feature detection and tier selection, expanded from the tables in tiers.def.
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

// The tiers of tiers.def, in its order (best last).
enum class Isa : int {
#define FLASHSDPA_TIER(name, ...) name,
#include "tiers.def"
  kCount
};

// The CPU / OS features of tiers.def, as bit positions of CpuFeatures::bits.
enum class Feature : int {
#define FLASHSDPA_CPU_FEATURE(name, word, bit) name,
#define FLASHSDPA_OS_FEATURE(name, mask) name,
#include "tiers.def"
  kCount
};

// The raw words feature decoding looks at; tests feed fake ones through decode_features().
struct RawCpuid {
  uint32_t max_leaf = 0;
  uint32_t vendor_ebx = 0;   // CPUID.0:EBX, the vendor string's first 4 bytes ("Genu", "Auth")
  uint32_t leaf1_ecx = 0;    // OSXSAVE is bit 27
  uint32_t leaf7_ebx = 0;
  uint32_t leaf7_ecx = 0;
  uint32_t leaf7_edx = 0;
  uint32_t leaf7_1_eax = 0;
  uint64_t xcr0 = 0;         // valid only when OSXSAVE is set
  bool amx_permitted = false;  // Linux arch_prctl(ARCH_GET_XCOMP_PERM) includes XTILEDATA
  uint32_t l2_kib = 0;         // CPUID.80000006H:ECX[31:16], a core's L2 in KiB (0: not said)
  // a core's L1 data cache in KiB (0: not said): CPUID.80000005H:ECX[31:24] (AMD), else the
  // level-1 data cache of leaf 4 (Intel: ways x partitions x line x sets)
  uint32_t l1d_kib = 0;
};

// RawCpuid's fields, as a list (module.cpp reports them and reads fake ones).
#define FLASHSDPA_RAW_CPUID_FIELDS(X) \
  X(max_leaf) X(vendor_ebx) X(leaf1_ecx) X(leaf7_ebx) X(leaf7_ecx) X(leaf7_edx) X(leaf7_1_eax) X(xcr0) X(amx_permitted) \
  X(l2_kib) X(l1d_kib)

struct CpuFeatures {
  bool x86 = false;
  uint32_t bits = 0;  // bit Feature::f: the CPU (or the OS) has f
  bool amx_permitted = false;
  int64_t l2_bytes = 0;  // a core's L2 (0: the CPU does not say)
  int64_t l1d_bytes = 0;  // a core's L1 data cache (0: the CPU does not say)
  // vdpbf16ps does not outrun fp32 FMAs here, so bf16 runs faster widened to fp32 (isa.cpp)
  bool bf16_dot_slow = false;
  bool denormal_assists = false;  // vector ops on denormal operands take microcode assists
  // What the hardware + OS can run, per tier (independent of what is built).
  bool can_run[int(Isa::kCount)] = {};
  bool has(Feature f) const { return (bits >> int(f)) & 1u; }
};

const char* isa_name(Isa isa);
const char* feature_name(Feature f);
// Parses a tier name; false if unknown.
bool parse_isa(const std::string& name, Isa* out);
// "portable, avx2, ..." (error messages)
std::string isa_names();

RawCpuid read_cpuid();
CpuFeatures decode_features(const RawCpuid& raw, bool is_x86);
const CpuFeatures& host_features();  // read once

// Split-KV decode: bytes of K rows (and of V rows) per block on a CPU with features f (the
// rule and its reasons: isa.cpp; the host's: params.h's decode_block_bytes()).
int64_t decode_block_bytes(const CpuFeatures& f);
// Split-KV decode over a cache laid out (.., L, Hkv, D): bytes of K rows (of every kv head) per
// sub-block (isa.cpp; the host's: params.h's decode_sub_bytes()).
int64_t decode_sub_bytes(const CpuFeatures& f);
std::string cpu_brand();

// The table rows, as data for the report.
struct TierInfo {
  const char* name;
  uint32_t needs;  // Feature bits of this row alone (the rows above it are needed too)
  bool bf16_only;
  bool emulated;  // test builds also compile it against SIMDe
  const char* flags;
};
const TierInfo& tier_info(Isa isa);

// The built tier (null where this binary does not have it) and its emulated (SIMDe) build.
const CpuTier* built_tier(Isa isa);
const CpuTier* emulated_tier(Isa isa);
// Whether a built tier implements a dtype (tiers.def: BF16_ONLY rows take bf16 only).
bool tier_supports_dtype(Isa isa, DType dt);

// Cap handling. set_isa_cap throws (TORCH_CHECK) on a tier the host cannot run.
void set_isa_cap(Isa cap);
void clear_isa_cap();  // back to "no cap": the best the host runs
Isa isa_cap();
bool isa_cap_is_set();

// What a tier is chosen for: a split-KV decode call (short queries; the amx tier runs
// avx512_bf16's kernels there), a light one (one or two query rows per kv head), or neither.
enum class DecodeCall { none, decode, light };

// The tier that runs for dtype dt: the highest built tier <= cap that the host can run and that
// implements dt (with kv_e4m3, a float8_e4m3fn KV cache: the bf16 tiers read one with
// AVX512_VBMI byte tables, so they need that too), with isa.cpp's preferences for the call.
// Never null (portable is always built).
Isa selected_isa(DType dt, bool kv_e4m3 = false, DecodeCall call = DecodeCall::none);
// selected_isa's rule for CPU features f (amx_ok: whether the process may use AMX tiles, asked
// only when the amx tier is next in line), tiers up to cap (cap_named: FLASHSDPA_CPU_ISA names
// it); the tests' view of other CPUs.
Isa choose_isa(const CpuFeatures& f, bool (*amx_ok)(), DType dt, bool kv_e4m3, DecodeCall call,
               Isa cap, bool cap_named);
const CpuTier& selected_tier(DType dt, bool kv_e4m3 = false, DecodeCall call = DecodeCall::none);

// Test hook: run the emulated build of a tier for the dtypes it implements, whatever the CPU;
// the other dtypes keep the normal choice. Throws if that emulation is not compiled in.
// clear_emulated_tier() ends it.
void set_emulated_tier(Isa isa);
void clear_emulated_tier();
bool emulated_tier_set(Isa* isa);  // the emulated tier in effect, if any
bool emulated_tier_active(DType dt);

}  // namespace cpu
}  // namespace flashsdpa
