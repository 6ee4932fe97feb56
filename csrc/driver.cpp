// The parallel driver (driver.h). Compiled once, without ISA flags.
#include "driver.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <string>

namespace flashsdpa {

namespace {

std::atomic<bool> g_debug_poison{false};
PathCounters g_counters;
std::atomic<bool> g_counting{false};

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
  }
  return "?";
}

// "flashsdpa::<phase>[<tier>,<dtype>]": the profiler event of each phase, which the tests use to
// see which path ran.
const std::string& profiler_name(Phase phase, cpu::Isa isa, DType dt) {
  constexpr int np = int(Phase::kCount), ni = int(cpu::Isa::kCount), nd = 3;
  static const std::string* names = [] {
    const char* phases[np] = {"cpu_forward",      "cpu_bwd_delta",    "cpu_bwd_dkdv",
                              "cpu_bwd_dq",       "cpu_pack_kv",      "cpu_bwd_fused",
                              "cpu_decode_split", "cpu_decode_merge", "cpu_forward_transposed"};
    auto* out = new std::string[np * ni * nd];
    for (int a = 0; a < np; ++a)
      for (int b = 0; b < ni; ++b)
        for (int c = 0; c < nd; ++c)
          out[(a * ni + b) * nd + c] = std::string("flashsdpa::") + phases[a] + "[" +
                                       cpu::isa_name(cpu::Isa(b)) + "," + dtype_name(DType(c)) + "]";
    return out;
  }();
  return names[(int(phase) * ni + int(isa)) * nd + int(dt)];
}

// The pack buffer of the last forward on this thread, kept for the next call: a fresh multi-MB
// allocation costs page faults and kernel page clearing on every call. Buffers above
// kMaxCachedPackBytes are not kept, so a long prefill does not pin its memory.
constexpr int64_t kMaxCachedPackBytes = int64_t(64) << 20;

float* pack_workspace(int64_t bytes, c10::DataPtr* owner) {
  thread_local c10::DataPtr cached;
  thread_local int64_t cached_bytes = 0;
  if (bytes > kMaxCachedPackBytes) {
    *owner = c10::GetCPUAllocator()->allocate(bytes);
    return static_cast<float*>(owner->get());
  }
  if (cached_bytes < bytes) {
    cached = c10::DataPtr();  // free the old one first
    cached = c10::GetCPUAllocator()->allocate(bytes);
    cached_bytes = bytes;
  }
  return static_cast<float*>(cached.get());
}

// A shared buffer of a phase (kv_pack, dq_acc, dec_part), NaN-poisoned under the debug flag.
float* shared_buffer(int64_t bytes, c10::DataPtr* owner) {
  *owner = c10::GetCPUAllocator()->allocate(bytes);
  if (g_debug_poison.load(std::memory_order_relaxed)) std::memset(owner->get(), 0xFF, bytes);
  return static_cast<float*>(owner->get());
}

// Runs one phase: a parallel loop over the tier's work items, each thread with its own scratch.
// The compute phases hand out their items one at a time (an atomic counter) rather than as one
// fixed range per thread: a thread whose core is shared with another process then does fewer
// items instead of holding everyone up at the end. Same items, same results: no item's output
// depends on which thread runs it. The memory-bound phases (packing, decode) keep contiguous
// ranges.
void run_phase(const AttnParams& p, const KernelPolicy& pol, Phase phase, const PhasePlan& plan) {
  RECORD_FUNCTION(profiler_name(phase, pol.isa, p.dtype), c10::ArrayRef<const c10::IValue>{});
  if (plan.n_items <= 0) return;
  const CpuTier& tier = *pol.tier;
  const bool poison_scratch = g_debug_poison.load(std::memory_order_relaxed);
  const bool dynamic = phase == Phase::Forward || phase == Phase::ForwardTransposed ||
                       phase == Phase::BwdDkDv || phase == Phase::BwdDq ||
                       phase == Phase::BwdFused;
  std::atomic<int64_t> claim{0};
  const int64_t n_loop = dynamic ? std::min<int64_t>(at::get_num_threads(), plan.n_items)
                                 : plan.n_items;
  at::parallel_for(0, n_loop, 1, [&](int64_t begin, int64_t end) {
    c10::DataPtr scratch;
    if (plan.scratch_bytes > 0) {
      scratch = c10::GetCPUAllocator()->allocate(plan.scratch_bytes);
      if (poison_scratch) std::memset(scratch.get(), 0xFF, plan.scratch_bytes);  // NaN floats
    }
    if (dynamic)
      tier.run(p, phase, 0, plan.n_items, scratch.get(), &claim);
    else
      tier.run(p, phase, begin, end, scratch.get(), nullptr);
  });
}

void run_phase(const AttnParams& p, const KernelPolicy& pol, Phase phase) {
  run_phase(p, pol, phase, pol.tier->plan(p, phase));
}

}  // namespace

void run_forward(AttnParams& p, const KernelPolicy& pol) {
  p.bq = pol.bq, p.bk = pol.bk;
  p.fused_exp = pol.fused_exp;
  p.counters = path_counters();
  if (pol.decode) {
    const PhasePlan split = pol.tier->plan(p, Phase::DecodeSplit);
    c10::DataPtr parts;
    p.dec_part = shared_buffer(split.shared_bytes, &parts);
    run_phase(p, pol, Phase::DecodeSplit, split);
    run_phase(p, pol, Phase::DecodeMerge);
    return;
  }
  c10::DataPtr pack_owner;
  if (pol.prepack) {
    const PhasePlan pack = pol.tier->plan(p, Phase::PackKV);
    if (pack.n_items > 0) {
      p.kv_pack = pack_workspace(pack.shared_bytes, &pack_owner);
      if (g_debug_poison.load(std::memory_order_relaxed))
        std::memset(p.kv_pack, 0xFF, pack.shared_bytes);
      run_phase(p, pol, Phase::PackKV, pack);
    }
  }
  run_phase(p, pol, pol.transposed ? Phase::ForwardTransposed : Phase::Forward);
}

void run_backward(AttnParams& p, const KernelPolicy& pol) {
  p.bq = pol.bq, p.bk = pol.bk;
  p.counters = path_counters();
  const PhasePlan delta = pol.tier->plan(p, Phase::BwdDelta);
  c10::DataPtr dsink_part;
  if (p.sinks) p.dsink_part = shared_buffer(4 * delta.n_items, &dsink_part);
  run_phase(p, pol, Phase::BwdDelta, delta);
  if (p.sinks) {
    // the sinks' gradient: each head's items (b, q block) summed in a fixed order
    const int64_t per_bh = delta.n_items / (p.B * p.Hq);
    for (int64_t h = 0; h < p.Hq; ++h) {
      float sum = 0.0f;
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t t = 0; t < per_bh; ++t) sum += p.dsink_part[(b * p.Hq + h) * per_bh + t];
      p.dsinks[h] = sum;
    }
  }
  if (pol.fused_bwd) {
    const PhasePlan fused = pol.tier->plan(p, Phase::BwdFused);
    c10::DataPtr dq_acc;
    p.dq_acc = shared_buffer(fused.shared_bytes, &dq_acc);
    run_phase(p, pol, Phase::BwdFused, fused);
  } else {
    run_phase(p, pol, Phase::BwdDq);  // Lk == 0 gives dq = 0
    run_phase(p, pol, Phase::BwdDkDv);
  }
}

std::string forward_event(const KernelPolicy& pol, DType dt) {
  const Phase phase = pol.decode       ? Phase::DecodeSplit
                      : pol.transposed ? Phase::ForwardTransposed
                                       : Phase::Forward;
  return profiler_name(phase, pol.isa, dt);
}

void set_debug_poison(bool on) { g_debug_poison.store(on); }
bool debug_poison() { return g_debug_poison.load(); }

void poison(const at::Tensor& t) {
  if (g_debug_poison.load(std::memory_order_relaxed) && t.numel() > 0)
    t.fill_(std::numeric_limits<double>::quiet_NaN());
}

void set_path_counting(bool on) {
  for (auto* c : {&g_counters.fused_exp_blocks, &g_counters.fwd_tiles, &g_counters.bwd_tiles,
                  &g_counters.decode_blocks})
    c->store(0);
  g_counting.store(on);
}
PathCounters* path_counters() { return g_counting.load() ? &g_counters : nullptr; }

}  // namespace flashsdpa
