// Glue from the blocked algorithms to the CpuTier interface: phase planning, dtype dispatch
// (instantiated once per tier by csrc/cpu/tier.cpp).
#pragma once
#include "flash_bwd.h"
#include "flash_decode.h"
#include "flash_fwd.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

// Per-thread setup a trait needs around a run of work items (Ops::thread_begin / thread_end).
template <class Ops>
struct ThreadState {
  ThreadState() { Ops::thread_begin(); }
  ~ThreadState() { Ops::thread_end(); }
  ThreadState(const ThreadState&) = delete;
  ThreadState& operator=(const ThreadState&) = delete;
};

template <class Ops>
struct TierImpl {
  static_assert(Ops::kBlockQ % Ops::MR == 0, "forward q blocks must hold whole row groups");

  // The decode phases over K / V of one storage type (Decode = FlashDecode<Ops, T, KV>).
  template <class Decode>
  static PhasePlan plan_decode(const AttnParams& p, Phase phase) {
    if (phase == Phase::DecodeSplit)
      return PhasePlan{Decode::split_items(p), 4 * Decode::scratch_floats(p), 4 * Decode::part_floats(p)};
    return PhasePlan{Decode::merge_items(p), 4 * Decode::scratch_floats(p), 0};
  }

  template <class T>
  static PhasePlan plan_typed(const AttnParams& p, Phase phase) {
    const Blocks bl(p);
    PhasePlan pl{0, 0, 0};
    switch (phase) {
      case Phase::PackKV:
        pl.n_items = FlashForward<Ops, T>::pack_items(p, bl);
        pl.shared_bytes = 4 * pl.n_items * FlashForward<Ops, T>::pack_block_floats(p, bl);
        break;
      case Phase::Forward:
      case Phase::ForwardTransposed:
        pl.n_items = FlashForward<Ops, T>::num_items(p, bl);
        pl.scratch_bytes =
            4 * FlashForward<Ops, T>::scratch_floats(p, bl, phase == Phase::ForwardTransposed);
        break;
      case Phase::BwdDelta:
        pl.n_items = FlashBackward<Ops, T>::delta_items(p, bl);
        break;
      case Phase::BwdDkDv:
        pl.n_items = FlashBackward<Ops, T>::dkdv_items(p, bl);
        pl.scratch_bytes = 4 * FlashBackward<Ops, T>::scratch_floats(p, bl);
        break;
      case Phase::BwdDq:
        pl.n_items = FlashBackward<Ops, T>::dq_items(p, bl);
        pl.scratch_bytes = 4 * FlashBackward<Ops, T>::scratch_floats(p, bl);
        break;
      case Phase::BwdFused:
        pl.n_items = FlashBackward<Ops, T>::fused_items(p);
        pl.scratch_bytes = 4 * FlashBackward<Ops, T>::scratch_floats(p, bl);
        pl.shared_bytes = 4 * FlashBackward<Ops, T>::dq_acc_floats(p, bl);
        break;
      case Phase::DecodeSplit:
      case Phase::DecodeMerge:
        return p.kv_e4m3 ? plan_decode<FlashDecode<Ops, T, e4m3_t>>(p, phase)
                         : plan_decode<FlashDecode<Ops, T>>(p, phase);
      case Phase::kCount:
        break;
    }
    return pl;
  }

  template <class T>
  static void run_typed(const AttnParams& p, Phase phase, int64_t begin, int64_t end,
                        void* scratch_v, ItemQueue* queue, int thread) {
    const Blocks bl(p);
    float* scratch = static_cast<float*>(scratch_v);
    const ThreadState<Ops> thread_state;  // e.g. AMX: tile configuration loaded / released
    int64_t item = queue ? queue->next(thread) : begin;
    for (; queue ? item >= 0 : item < end; item = queue ? queue->next(thread) : item + 1) {
      switch (phase) {
        case Phase::PackKV: FlashForward<Ops, T>::run_pack(p, bl, item); break;
        case Phase::Forward: FlashForward<Ops, T>::run_item(p, bl, item, scratch); break;
        case Phase::ForwardTransposed:
          FlashForward<Ops, T>::run_item_t(p, bl, item, scratch);
          break;
        case Phase::BwdDelta: FlashBackward<Ops, T>::run_delta(p, bl, item); break;
        case Phase::BwdDkDv: FlashBackward<Ops, T>::run_dkdv(p, bl, item, scratch); break;
        case Phase::BwdDq: FlashBackward<Ops, T>::run_dq(p, bl, item, scratch); break;
        case Phase::BwdFused: FlashBackward<Ops, T>::run_fused(p, bl, item, scratch); break;
        case Phase::DecodeSplit:
          p.kv_e4m3 ? FlashDecode<Ops, T, e4m3_t>::run_split(p, item, scratch)
                    : FlashDecode<Ops, T>::run_split(p, item, scratch);
          break;
        case Phase::DecodeMerge:  // (the splits, and so the partials, depend on the type)
          p.kv_e4m3 ? FlashDecode<Ops, T, e4m3_t>::run_merge(p, item, scratch)
                    : FlashDecode<Ops, T>::run_merge(p, item, scratch);
          break;
        case Phase::kCount: break;
      }
    }
  }

  static PhasePlan plan(const AttnParams& p, Phase phase) {
    switch (p.dtype) {
      case DType::F32: return plan_typed<float>(p, phase);
      case DType::BF16: return plan_typed<bf16_t>(p, phase);
      case DType::F16: return plan_typed<f16_t>(p, phase);
    }
    return PhasePlan{0, 0, 0};
  }

  static void run(const AttnParams& p, Phase phase, int64_t begin, int64_t end, void* scratch,
                  ItemQueue* queue, int thread) {
    switch (p.dtype) {
      case DType::F32: run_typed<float>(p, phase, begin, end, scratch, queue, thread); break;
      case DType::BF16: run_typed<bf16_t>(p, phase, begin, end, scratch, queue, thread); break;
      case DType::F16: run_typed<f16_t>(p, phase, begin, end, scratch, queue, thread); break;
    }
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
