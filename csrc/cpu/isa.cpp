#include "isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <fstream>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FLASHSDPA_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
constexpr int kOsxsaveBit = 27;  // CPUID.1:ECX: the OS enabled XSAVE (xgetbv works)
}

namespace flashsdpa {
namespace cpu {

// Tier getters, one per row of tiers.def, defined by csrc/cpu/tier.cpp's builds. Declared weak:
// a tier this binary does not build (another architecture, no SIMDe for an emulated one) has
// no definition, and its getter's address reads as null.
#define FLASHSDPA_TIER(name, ...)                              \
  const CpuTier* tier_##name() __attribute__((weak));          \
  const CpuTier* tier_##name##_emu() __attribute__((weak));
#include "tiers.def"

namespace {

// Each feature's bit in CpuFeatures::bits.
namespace feature_bit {
#define FLASHSDPA_CPU_FEATURE(name, word, bit) constexpr uint32_t name = 1u << int(Feature::name);
#define FLASHSDPA_OS_FEATURE(name, mask) constexpr uint32_t name = 1u << int(Feature::name);
#include "tiers.def"
}  // namespace feature_bit

constexpr bool ALL_DTYPES = false, BF16_ONLY = true;

const TierInfo kTiers[] = {
#define FLASHSDPA_TIER(name, arch, header, ops, dtypes, emulated, needs, flags) \
  {#name, [] {                                                                 \
     using namespace feature_bit;                                              \
     return uint32_t(needs);                                                   \
   }(),                                                                        \
   dtypes, emulated != 0, flags},
#include "tiers.def"
};

struct Getters {
  const CpuTier* (*built)();
  const CpuTier* (*emulated)();
};
const Getters kGetters[] = {
#define FLASHSDPA_TIER(name, ...) {&tier_##name, &tier_##name##_emu},
#include "tiers.def"
};

constexpr const char* kFeatureNames[] = {
#define FLASHSDPA_CPU_FEATURE(name, word, bit) #name,
#define FLASHSDPA_OS_FEATURE(name, mask) #name,
#include "tiers.def"
};

inline bool bit(uint64_t word, int b) { return (word >> b) & 1u; }

#if defined(__linux__) && defined(FLASHSDPA_X86)
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
bool linux_amx_permitted() {
  uint64_t bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return bit(bitmask, kXfeatureXtiledata);
}
#endif

// Tile data needs the process's permission on Linux (>= 5.16); asked once, the first time the
// amx tier could be selected. Without it, AMX instructions fault, so the tier is not used.
bool amx_usable() {
  static const bool ok = [] {
#if defined(__linux__) && defined(FLASHSDPA_X86)
    if (linux_amx_permitted()) return true;
    syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
    return linux_amx_permitted();
#else
    return false;
#endif
  }();
  return ok;
}

std::atomic<int> g_cap{-1};       // -1: no cap
std::atomic<int> g_emulated{-1};  // -1: no emulated tier
}  // namespace

const char* isa_name(Isa isa) { return kTiers[int(isa)].name; }
const char* feature_name(Feature f) { return kFeatureNames[int(f)]; }
const TierInfo& tier_info(Isa isa) { return kTiers[int(isa)]; }

bool parse_isa(const std::string& name, Isa* out) {
  for (int i = 0; i < int(Isa::kCount); ++i) {
    if (name == kTiers[i].name) {
      *out = Isa(i);
      return true;
    }
  }
  return false;
}

std::string isa_names() {
  std::string s;
  for (int i = 0; i < int(Isa::kCount); ++i) s += (i ? ", " : "") + std::string(kTiers[i].name);
  return s;
}

RawCpuid read_cpuid() {
  RawCpuid r;
#if defined(FLASHSDPA_X86)
  unsigned a, b, c, d;
  r.max_leaf = __get_cpuid_max(0, nullptr);
  __cpuid(0, a, b, c, d);
  r.vendor_ebx = b;
  if (r.max_leaf >= 1) {
    __cpuid_count(1, 0, a, b, c, d);
    r.leaf1_ecx = c;
  }
  if (r.max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    r.leaf7_ebx = b;
    r.leaf7_ecx = c;
    r.leaf7_edx = d;
    const unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      r.leaf7_1_eax = a;
    }
  }
  if (bit(r.leaf1_ecx, kOsxsaveBit)) {  // xgetbv is available
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    r.xcr0 = (uint64_t(hi) << 32) | lo;
  }
#if defined(__linux__)
  r.amx_permitted = linux_amx_permitted();
#endif
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000006u) {  // Intel and AMD alike
    __cpuid(0x80000006u, a, b, c, d);
    r.l2_kib = c >> 16;
  }
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000005u) {  // AMD's (Intel's reads 0)
    __cpuid(0x80000005u, a, b, c, d);
    r.l1d_kib = c >> 24;
  }
  for (unsigned i = 0; r.l1d_kib == 0 && r.max_leaf >= 4 && i < 8; ++i) {  // Intel's
    __cpuid_count(4, i, a, b, c, d);
    if ((a & 31) == 0) break;  // no more caches
    if ((a & 31) == 1 && ((a >> 5) & 7) == 1)  // a data cache, level 1
      r.l1d_kib = ((b >> 22) + 1) * (((b >> 12) & 0x3ff) + 1) * ((b & 0xfff) + 1) * (c + 1) / 1024;
  }
#endif
  return r;
}

CpuFeatures decode_features(const RawCpuid& r, bool is_x86) {
  CpuFeatures f;
  f.x86 = is_x86;
  f.can_run[int(Isa::portable)] = true;
  if (!is_x86) return f;
  const bool osxsave = bit(r.leaf1_ecx, kOsxsaveBit);
  const auto word = [&](uint64_t w, uint32_t min_leaf) { return r.max_leaf >= min_leaf ? w : 0; };
  const uint64_t leaf1_ecx = r.leaf1_ecx, leaf7_ebx = word(r.leaf7_ebx, 7),
                 leaf7_ecx = word(r.leaf7_ecx, 7), leaf7_edx = word(r.leaf7_edx, 7), leaf7_1_eax = word(r.leaf7_1_eax, 7);
#define FLASHSDPA_CPU_FEATURE(name, w, b) \
  if (bit(w, b)) f.bits |= feature_bit::name;
#define FLASHSDPA_OS_FEATURE(name, mask) \
  if (osxsave && (r.xcr0 & (mask)) == (mask)) f.bits |= feature_bit::name;
#include "tiers.def"
  f.amx_permitted = r.amx_permitted;
  f.l2_bytes = int64_t(r.l2_kib) * 1024;
  f.l1d_bytes = int64_t(r.l1d_kib) * 1024;
  // Intel cores issue vdpbf16ps at no more than their fp32 FMA rate (bench/peak.py measures
  // it), so widening bf16 to fp32 on the avx512 tier beats the avx512_bf16 tier there; AMD's
  // Zen 4 runs it at twice the FMA rate.
  constexpr uint32_t kGenu = 0x756e6547u;  // "Genu"ineIntel
  f.bf16_dot_slow = r.vendor_ebx == kGenu;
  // Intel cores take a microcode assist for each vector op with a denormal operand; AMD's FMAs
  // take them at full speed (the avx2 tier's fast float8 widening makes denormals: plan.cpp).
  f.denormal_assists = r.vendor_ebx == kGenu;
  // A tier needs its own row's features and those of every row above it. (The AMX permission
  // can still be requested at first use, so it does not gate the tier here; the report shows
  // whether it is already granted.)
  for (int i = 1; i < int(Isa::kCount); ++i)
    f.can_run[i] = f.can_run[i - 1] && (f.bits & kTiers[i].needs) == kTiers[i].needs;
  return f;
}

const CpuFeatures& host_features() {
#if defined(FLASHSDPA_X86)
  static const CpuFeatures f = decode_features(read_cpuid(), true);
#else
  static const CpuFeatures f = decode_features(RawCpuid{}, false);
#endif
  return f;
}

// A decode item reads a block of K rows and then of V rows while the next block of each,
// prefetched a block ahead, arrives: four blocks in flight, kept to half the core's L2 (the other
// half for its scratch and what else runs): an eighth of L2 each. At least 32 KiB (a block must
// still be many keys of compute ahead of DRAM latency), at most 128 KiB (a further prefetch
// distance hides no more latency, and larger blocks only evict more); 1 MiB of L2 assumed where
// the CPU does not say.
int64_t decode_block_bytes(const CpuFeatures& f) {
  constexpr int64_t kLo = 32 << 10, kHi = 128 << 10;
  const int64_t b = (f.l2_bytes > 0 ? f.l2_bytes : int64_t(1) << 20) / 8;
  return b < kLo ? kLo : (b > kHi ? kHi : b);
}

int64_t decode_block_bytes() {
  static const int64_t b = decode_block_bytes(host_features());
  return b;
}

// An item over a (.., L, Hkv, D) cache passes over its block head after head, each pass reading
// the head's slice of every row; sub-blocks of a quarter of L1d (the rows of each head's pass
// still in L1 when the next head's pass reads the rest of their lines, with room for q, the
// scores and the accumulators) make the item read whole rows in order, a few at a time. 32 KiB
// of L1d assumed where the CPU does not say; at least 4 KiB.
int64_t decode_sub_bytes(const CpuFeatures& f) {
  const int64_t b = (f.l1d_bytes > 0 ? f.l1d_bytes : int64_t(32) << 10) / 4;
  return b < (4 << 10) ? (4 << 10) : b;
}

int64_t decode_sub_bytes() {
  static const int64_t b = decode_sub_bytes(host_features());
  return b;
}

std::string cpu_brand() {
  // the first name the file gives, and on x86 the first family and model, which tell apart
  // cores that a virtual machine names alike ("AMD EPYC" for Zen 1 and Zen 4)
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    const auto start = line.find_first_not_of(" \t", colon + 1);
    const std::string value = start == std::string::npos ? std::string() : line.substr(start);
    std::string* field = key == "model name" || key == "Model" || key == "cpu model" ? &name
                         : key == "cpu family"                                     ? &family
                         : key == "model"                                          ? &model
                                                                                   : nullptr;
    if (field && field->empty()) *field = value;
  }
  if (name.empty()) return "unknown";
  if (family.empty() || model.empty()) return name;
  return name + " (family " + family + " model " + model + ")";
}

const CpuTier* built_tier(Isa isa) {
  const auto getter = kGetters[int(isa)].built;
  return getter ? getter() : nullptr;
}

const CpuTier* emulated_tier(Isa isa) {
  const auto getter = kGetters[int(isa)].emulated;
  return getter ? getter() : nullptr;
}

bool tier_supports_dtype(Isa isa, DType dt) {
  if (!built_tier(isa)) return false;
  return !kTiers[int(isa)].bf16_only || dt == DType::BF16;
}

void set_isa_cap(Isa cap) {
  TORCH_CHECK(host_features().can_run[int(cap)], "FLASHSDPA_CPU_ISA=", isa_name(cap),
              ": this CPU/OS cannot run the ", isa_name(cap),
              " tier (see `python -m flashsdpa` for the features it reports)");
  g_cap.store(int(cap));
}
void clear_isa_cap() { g_cap.store(-1); }
bool isa_cap_is_set() { return g_cap.load() >= 0; }
Isa isa_cap() {
  const int c = g_cap.load();
  return c < 0 ? Isa(int(Isa::kCount) - 1) : Isa(c);
}

void set_emulated_tier(Isa isa) {
  TORCH_CHECK(emulated_tier(isa) != nullptr, "flashsdpa: no emulated build of the ",
              isa_name(isa), " tier (build with SIMDe installed: Debian's libsimde-dev)");
  g_emulated.store(int(isa));
}
void clear_emulated_tier() { g_emulated.store(-1); }
bool emulated_tier_set(Isa* isa) {
  const int e = g_emulated.load();
  if (e >= 0) *isa = Isa(e);
  return e >= 0;
}

bool emulated_tier_active(DType dt) {
  const int e = g_emulated.load();
  return e >= 0 && (!kTiers[e].bf16_only || dt == DType::BF16);
}

Isa choose_isa(const CpuFeatures& f, bool (*amx_ok)(), DType dt, bool kv_e4m3, DecodeCall call,
               Isa cap, bool cap_named) {
  for (int i = int(cap); i > 0; --i) {
    if (!f.can_run[i] || !tier_supports_dtype(Isa(i), dt)) continue;
    if (Isa(i) == Isa::amx && !amx_ok()) continue;
    if (kv_e4m3 && (Isa(i) == Isa::avx512_bf16 || Isa(i) == Isa::amx) &&
        !f.has(Feature::avx512_vbmi))
      continue;  // (Avx512Bf16E4m3Ops' byte tables)
    // A slow vdpbf16ps: the avx512 tier is faster than the bf16 dot products of avx512_bf16, and
    // of amx on decode calls (its tiles take no short queries: it runs avx512_bf16's decode
    // kernels), unless FLASHSDPA_CPU_ISA names the tier (cap_named) or the call is a bf16
    // cache's light decode (params.h), where the dot products are few per byte and pairing keys
    // for vdpbf16ps costs fewer instructions than widening every element.
    const bool bf16_dots =
        Isa(i) == Isa::avx512_bf16 || (Isa(i) == Isa::amx && call != DecodeCall::none);
    if (bf16_dots && f.bf16_dot_slow && !(call == DecodeCall::light && !kv_e4m3) &&
        !(cap_named && cap == Isa(i)))
      continue;
    return Isa(i);
  }
  return Isa::portable;
}

Isa selected_isa(DType dt, bool kv_e4m3, DecodeCall call) {
  if (emulated_tier_active(dt)) return Isa(g_emulated.load());
  return choose_isa(host_features(), &amx_usable, dt, kv_e4m3, call, isa_cap(), isa_cap_is_set());
}

const CpuTier& selected_tier(DType dt, bool kv_e4m3, DecodeCall call) {
  if (emulated_tier_active(dt)) return *emulated_tier(Isa(g_emulated.load()));
  return *built_tier(selected_isa(dt, kv_e4m3, call));
}

}  // namespace cpu
}  // namespace flashsdpa
