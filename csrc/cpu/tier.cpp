// The one tier source: compiled once per row of tiers.def with that row's flags, and again
// against SIMDe (FLASHSDPA_EMULATE, AVX2 flags) for each emulated tier. setup.py passes the row:
//   FLASHSDPA_TIER         the tier's name, which is also its namespace (name_emu when emulated)
//   FLASHSDPA_TIER_HEADER  the traits header, FLASHSDPA_TIER_OPS its micro-kernel trait
// Everything here lives in the tier's own namespace, so no inline function is shared between
// translation units compiled for different instruction sets. The tier is reached only through
// the getter defined at the end (declared weak in isa.cpp: a tier not built reads as null).
#if !defined(FLASHSDPA_TIER) || !defined(FLASHSDPA_TIER_HEADER) || !defined(FLASHSDPA_TIER_OPS)
#error "csrc/cpu/tier.cpp is compiled by setup.py, once per row of csrc/cpu/tiers.def"
#endif
#define FLASHSDPA_CAT2(a, b) a##b
#define FLASHSDPA_CAT(a, b) FLASHSDPA_CAT2(a, b)
#define FLASHSDPA_STR2(x) #x
#define FLASHSDPA_STR(x) FLASHSDPA_STR2(x)
#if defined(FLASHSDPA_EMULATE)
#include "simde_emu.h"
#define FLASHSDPA_TIER_NS FLASHSDPA_CAT(FLASHSDPA_TIER, _emu)
#else
#define FLASHSDPA_TIER_NS FLASHSDPA_TIER
#endif
#include FLASHSDPA_STR(FLASHSDPA_TIER_HEADER)
#include "tier_impl.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {
// The bf16 P exponent's test hook, where the trait makes P in bf16 (prep_a).
template <class Ops>
decltype(CpuTier::exp2_row_sum_bf16) exp2_bf16_hook() {
  if constexpr (caps<Ops>().prep_a) return &Ops::Row::exp2_row_sum_bf16;
  return nullptr;
}
}  // namespace FLASHSDPA_TIER_NS

const CpuTier* FLASHSDPA_CAT(tier_, FLASHSDPA_TIER_NS)() {
  using Impl = FLASHSDPA_TIER_NS::TierImpl<FLASHSDPA_TIER_NS::FLASHSDPA_TIER_OPS>;
  using Ops = FLASHSDPA_TIER_NS::FLASHSDPA_TIER_OPS;
  constexpr auto caps = FLASHSDPA_TIER_NS::caps<Ops>();
  using E4m3 = FLASHSDPA_TIER_NS::DecodeOpsOf<Ops, FLASHSDPA_TIER_NS::e4m3_t>;
  constexpr bool fp16_pv = !std::is_same<E4m3::fp16_pv, E4m3::type>::value;
  constexpr bool e4m3_fast = !std::is_same<E4m3::exact, E4m3::type>::value;
  static const CpuTier tier{FLASHSDPA_STR(FLASHSDPA_TIER), Ops::MR, Ops::NR, Ops::kBlockQ,
                            Ops::kBlockQBwd, caps.fused_exp, caps.transposed_s,
                            FLASHSDPA_TIER_NS::fused_bwd_rows<Ops>(),
                            FLASHSDPA_TIER_NS::bwd_sdp<Ops>(), fp16_pv, e4m3_fast,
                            Ops::kDecodeNearPf, Ops::kDecodePvWhole,
                            &Impl::plan,
                            &Impl::run, &Ops::Row::exp2_row_sum,
                            FLASHSDPA_TIER_NS::exp2_bf16_hook<Ops>(),
                            &Ops::Row::softcap_row};
  return &tier;
}
}  // namespace cpu
}  // namespace flashsdpa
