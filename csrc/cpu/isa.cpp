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

namespace flashsdpa {
namespace cpu {

namespace {
constexpr const char* kIsaNames[] = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};

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

const char* isa_name(Isa isa) { return kIsaNames[int(isa)]; }

bool parse_isa(const std::string& name, Isa* out) {
  for (int i = 0; i < int(Isa::kCount); ++i) {
    if (name == kIsaNames[i]) {
      *out = Isa(i);
      return true;
    }
  }
  return false;
}

RawCpuid read_cpuid() {
  RawCpuid r;
#if defined(FLASHSDPA_X86)
  unsigned a, b, c, d;
  r.max_leaf = __get_cpuid_max(0, nullptr);
  if (r.max_leaf >= 1) {
    __cpuid_count(1, 0, a, b, c, d);
    r.leaf1_ecx = c;
  }
  if (r.max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    r.leaf7_ebx = b;
    r.leaf7_edx = d;
    const unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      r.leaf7_1_eax = a;
    }
  }
  if (bit(r.leaf1_ecx, 27)) {  // OSXSAVE: xgetbv is available
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    r.xcr0 = (uint64_t(hi) << 32) | lo;
  }
#if defined(__linux__)
  r.amx_permitted = linux_amx_permitted();
#endif
#endif
  return r;
}

CpuFeatures decode_features(const RawCpuid& r, bool is_x86) {
  CpuFeatures f;
  f.x86 = is_x86;
  if (!is_x86) {
    f.can_run[int(Isa::Portable)] = true;
    return f;
  }
  const bool osxsave = bit(r.leaf1_ecx, 27);
  f.fma = bit(r.leaf1_ecx, 12);
  f.avx = bit(r.leaf1_ecx, 28);
  f.f16c = bit(r.leaf1_ecx, 29);
  if (r.max_leaf >= 7) {
    f.avx2 = bit(r.leaf7_ebx, 5);
    f.avx512f = bit(r.leaf7_ebx, 16);
    f.avx512dq = bit(r.leaf7_ebx, 17);
    f.avx512bw = bit(r.leaf7_ebx, 30);
    f.avx512vl = bit(r.leaf7_ebx, 31);
    f.amx_bf16 = bit(r.leaf7_edx, 22);
    f.amx_tile = bit(r.leaf7_edx, 24);
    f.avx512_bf16 = bit(r.leaf7_1_eax, 5);
  }
  f.os_avx = osxsave && bit(r.xcr0, 1) && bit(r.xcr0, 2);
  f.os_avx512 = f.os_avx && bit(r.xcr0, 5) && bit(r.xcr0, 6) && bit(r.xcr0, 7);
  f.os_amx = osxsave && bit(r.xcr0, 17) && bit(r.xcr0, 18);
  f.amx_permitted = r.amx_permitted;

  bool* run = f.can_run;
  run[int(Isa::Portable)] = true;
  run[int(Isa::Avx2)] = f.avx && f.avx2 && f.fma && f.f16c && f.os_avx;
  run[int(Isa::Avx512)] =
      run[int(Isa::Avx2)] && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.os_avx512;
  run[int(Isa::Avx512Bf16)] = run[int(Isa::Avx512)] && f.avx512_bf16;
  // The AMX permission can still be requested at first use, so it does not gate the tier here;
  // the report shows whether it is already granted.
  run[int(Isa::Amx)] = run[int(Isa::Avx512Bf16)] && f.amx_tile && f.amx_bf16 && f.os_amx;
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

std::string cpu_brand() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    if (key == "model name" || key == "Model" || key == "cpu model") {
      const auto start = line.find_first_not_of(" \t", colon + 1);
      return start == std::string::npos ? std::string() : line.substr(start);
    }
  }
  return "unknown";
}

const CpuTier* built_tier(Isa isa) {
  switch (isa) {
    case Isa::Portable: return portable_tier();
#if defined(FLASHSDPA_BUILD_AVX2)
    case Isa::Avx2: return avx2_tier();
#endif
#if defined(FLASHSDPA_BUILD_AVX512)
    case Isa::Avx512: return avx512_tier();
#endif
#if defined(FLASHSDPA_BUILD_AVX512_BF16)
    case Isa::Avx512Bf16: return avx512_bf16_tier();
#endif
#if defined(FLASHSDPA_BUILD_AMX)
    case Isa::Amx: return amx_tier();
#endif
    default: return nullptr;
  }
}

bool tier_supports_dtype(Isa isa, DType dt) {
  if (!built_tier(isa)) return false;
  if (isa == Isa::Avx512Bf16 || isa == Isa::Amx) return dt == DType::BF16;
  return true;
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

const CpuTier* emulated_tier(Isa isa) {
  switch (isa) {
#if defined(FLASHSDPA_BUILD_AVX512_EMU)
    case Isa::Avx512: return avx512_emu_tier();
#endif
#if defined(FLASHSDPA_BUILD_AVX512_BF16_EMU)
    case Isa::Avx512Bf16: return avx512_bf16_emu_tier();
#endif
#if defined(FLASHSDPA_BUILD_AMX_EMU)
    case Isa::Amx: return amx_emu_tier();
#endif
    default: return nullptr;
  }
}

void set_emulated_tier(Isa isa) {
  TORCH_CHECK(emulated_tier(isa) != nullptr, "flashsdpa: no emulated build of the ",
              isa_name(isa), " tier (build with SIMDe installed: Debian's libsimde-dev)");
  g_emulated.store(int(isa));
}
void clear_emulated_tier() { g_emulated.store(-1); }

bool emulated_tier_active(DType dt) {
  const int e = g_emulated.load();
  return e >= 0 && (Isa(e) == Isa::Avx512Bf16 || Isa(e) == Isa::Amx ? dt == DType::BF16 : true);
}

Isa selected_isa(DType dt) {
  if (emulated_tier_active(dt)) return Isa(g_emulated.load());
  const CpuFeatures& f = host_features();
  for (int i = int(isa_cap()); i > 0; --i) {
    if (!f.can_run[i] || !tier_supports_dtype(Isa(i), dt)) continue;
    if (Isa(i) == Isa::Amx && !amx_usable()) continue;
    return Isa(i);
  }
  return Isa::Portable;
}

const CpuTier& selected_tier(DType dt) {
  if (emulated_tier_active(dt)) return *emulated_tier(Isa(g_emulated.load()));
  return *built_tier(selected_isa(dt));
}

}  // namespace cpu
}  // namespace flashsdpa
