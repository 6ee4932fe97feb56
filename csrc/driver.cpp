// The parallel driver (driver.h). Compiled once, without ISA flags.
#include "driver.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace flashsdpa {

ItemQueue::ItemQueue(int64_t total, int threads, bool in_order)
    : total_(total),
      threads_(int(std::max<int64_t>(1, std::min<int64_t>(threads, total)))),
      in_order_(in_order || total > int64_t(std::numeric_limits<uint32_t>::max())) {
  if (in_order_) return;
  ranges_.reset(new Range[threads_]);
  for (int t = 0; t < threads_; ++t) {
    const uint64_t b = uint64_t(total * t / threads_), e = uint64_t(total * (t + 1) / threads_);
    ranges_[t].v.store(e << 32 | b, std::memory_order_relaxed);
  }
}

int64_t ItemQueue::next(int thread) {
  if (in_order_) {
    const int64_t i = counter_.fetch_add(1, std::memory_order_relaxed);
    return i < total_ ? i : -1;
  }
  constexpr uint64_t kBegin = 0xffffffffu;
  const auto left = [](uint64_t r) { return (r >> 32) - (r & kBegin); };
  std::atomic<uint64_t>& own = ranges_[thread].v;
  for (uint64_t r = own.load(std::memory_order_relaxed); left(r) > 0;)
    if (own.compare_exchange_weak(r, r + 1, std::memory_order_relaxed)) return int64_t(r & kBegin);
  for (;;) {  // ranges only shrink: this ends once every one is empty
    int victim = -1;
    uint64_t r = 0;
    for (int t = 0; t < threads_; ++t) {
      const uint64_t x = ranges_[t].v.load(std::memory_order_relaxed);
      if (left(x) > (victim < 0 ? 0 : left(r))) victim = t, r = x;  // (ties: the lowest t)
    }
    if (victim < 0) return -1;
    const uint64_t end = (r >> 32) - 1;
    if (ranges_[victim].v.compare_exchange_weak(r, end << 32 | (r & kBegin),
                                                std::memory_order_relaxed))
      return int64_t(end);
  }
}

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

// The phases whose items run_phase hands out in order (ItemQueue's in_order): the compute ones.
bool in_order_phase(Phase phase) {
  return phase == Phase::Forward || phase == Phase::ForwardTransposed ||
         phase == Phase::BwdDkDv || phase == Phase::BwdDq || phase == Phase::BwdFused;
}

// Per-thread scratch of a phase, NaN-poisoned under the debug flag.
c10::DataPtr thread_scratch(int64_t bytes) {
  c10::DataPtr scratch;
  if (bytes > 0) {
    scratch = c10::GetCPUAllocator()->allocate(bytes);
    if (g_debug_poison.load(std::memory_order_relaxed)) std::memset(scratch.get(), 0xFF, bytes);
  }
  return scratch;
}

// Runs one phase over the items of every segment (segment s's items numbered after those of
// segments 0..s-1) in one parallel loop, each thread with its own scratch, the items handed out
// by an ItemQueue: so one long segment's items spread over the threads too. plans[s]: segment
// s's plan of the phase.
void run_phase(const AttnParams* seg, int64_t n, const KernelPolicy& pol, Phase phase,
               const std::vector<PhasePlan>& plans) {
  RECORD_FUNCTION(profiler_name(phase, pol.isa, seg[0].dtype), c10::ArrayRef<const c10::IValue>{});
  std::vector<int64_t> start(n + 1, 0);  // segment s's items are [start[s], start[s + 1])
  int64_t scratch_bytes = 0;
  for (int64_t s = 0; s < n; ++s) {
    start[s + 1] = start[s] + std::max<int64_t>(plans[s].n_items, 0);
    scratch_bytes = std::max(scratch_bytes, plans[s].scratch_bytes);
  }
  const int64_t total = start[n];
  if (total <= 0) return;
  const CpuTier& tier = *pol.tier;
  ItemQueue queue(total, at::get_num_threads(), in_order_phase(phase));
  at::parallel_for(0, queue.threads(), 1, [&](int64_t begin, int64_t end) {
    const c10::DataPtr scratch = thread_scratch(scratch_bytes);
    for (int t = int(begin); t < int(end); ++t) {  // one a thread, unless the loop runs inline
      if (n == 1) {  // one segment: the tier takes the items from the queue itself
        tier.run(seg[0], phase, 0, 0, scratch.get(), &queue, t);
        continue;
      }
      for (int64_t g; (g = queue.next(t)) >= 0;) {
        const int64_t s = std::upper_bound(start.begin(), start.end(), g) - start.begin() - 1;
        tier.run(seg[s], phase, g - start[s], g - start[s] + 1, scratch.get(), nullptr, 0);
      }
    }
  });
}

std::vector<PhasePlan> plan_segments(const AttnParams* seg, int64_t n, const KernelPolicy& pol,
                                     Phase phase) {
  std::vector<PhasePlan> plans(n);
  for (int64_t s = 0; s < n; ++s) plans[s] = pol.tier->plan(seg[s], phase);
  return plans;
}

void run_phase(const AttnParams* seg, int64_t n, const KernelPolicy& pol, Phase phase) {
  run_phase(seg, n, pol, phase, plan_segments(seg, n, pol, phase));
}

// Each segment's share of one shared buffer: byte offsets (64-byte aligned, from the plans'
// shared_bytes), the total at the end.
std::vector<int64_t> shares(const std::vector<PhasePlan>& plans) {
  std::vector<int64_t> at(plans.size() + 1, 0);
  for (size_t s = 0; s < plans.size(); ++s)
    at[s + 1] = at[s] + (plans[s].shared_bytes + 63) / 64 * 64;
  return at;
}

void share_out(AttnParams* seg, int64_t n, const std::vector<PhasePlan>& plans,
               float* AttnParams::*field, c10::DataPtr* owner) {
  const std::vector<int64_t> at = shares(plans);
  char* base = reinterpret_cast<char*>(shared_buffer(at[n], owner));
  for (int64_t s = 0; s < n; ++s) seg[s].*field = reinterpret_cast<float*>(base + at[s]);
}

void set_blocks(AttnParams* seg, int64_t n, const KernelPolicy& pol) {
  for (int64_t s = 0; s < n; ++s) {
    seg[s].bq = pol.bq, seg[s].bk = pol.bk;
    seg[s].fused_exp = pol.fused_exp;
    seg[s].fused_rows = pol.fused_rows;
    seg[s].fused_sdp = pol.fused_sdp;
    seg[s].fp16_pv = pol.fp16_pv;
    seg[s].e4m3_fast = pol.e4m3_fast;
    seg[s].near_pf = pol.near_pf;
    seg[s].pv_whole = pol.pv_whole;
    seg[s].counters = path_counters();
  }
}

}  // namespace

void run_forward_segments(AttnParams* seg, int64_t n, const KernelPolicy& pol) {
  if (n <= 0) return;
  set_blocks(seg, n, pol);
  if (pol.decode) {
    const std::vector<PhasePlan> split = plan_segments(seg, n, pol, Phase::DecodeSplit);
    c10::DataPtr parts;
    share_out(seg, n, split, &AttnParams::dec_part, &parts);
    run_phase(seg, n, pol, Phase::DecodeSplit, split);
    run_phase(seg, n, pol, Phase::DecodeMerge);
    return;
  }
  c10::DataPtr pack_owner;
  if (pol.prepack) {  // the segments it pays for (each segment's panels in its own share)
    std::vector<PhasePlan> pack = plan_segments(seg, n, pol, Phase::PackKV);
    for (int64_t s = 0; s < n; ++s)
      if (!prepack_pays(seg[s], pol)) pack[s] = PhasePlan{0, 0, 0};
    const std::vector<int64_t> at = shares(pack);
    if (at[n] > 0) {
      char* base = reinterpret_cast<char*>(pack_workspace(at[n], &pack_owner));
      if (g_debug_poison.load(std::memory_order_relaxed)) std::memset(base, 0xFF, at[n]);
      for (int64_t s = 0; s < n; ++s)
        seg[s].kv_pack = pack[s].n_items > 0 ? reinterpret_cast<float*>(base + at[s]) : nullptr;
      run_phase(seg, n, pol, Phase::PackKV, pack);
    }
  }
  run_phase(seg, n, pol, pol.transposed ? Phase::ForwardTransposed : Phase::Forward);
}

void run_backward_segments(AttnParams* seg, int64_t n, const KernelPolicy& pol) {
  if (n <= 0) return;
  set_blocks(seg, n, pol);
  const std::vector<PhasePlan> delta = plan_segments(seg, n, pol, Phase::BwdDelta);
  c10::DataPtr dsink_part;
  const bool sinks = seg[0].sinks != nullptr;
  if (sinks) {
    std::vector<PhasePlan> parts = delta;
    for (auto& pl : parts) pl.shared_bytes = 4 * pl.n_items;
    share_out(seg, n, parts, &AttnParams::dsink_part, &dsink_part);
  }
  if (!pol.fused_bwd || !bwd_fused_owns_delta(seg[0]))
    run_phase(seg, n, pol, Phase::BwdDelta, delta);
  if (sinks) {
    // the sinks' gradient: each head's items (b, q block), segment after segment, summed in a
    // fixed order
    const int64_t Hq = seg[0].Hq;
    for (int64_t h = 0; h < Hq; ++h) {
      float sum = 0.0f;
      for (int64_t s = 0; s < n; ++s) {
        const int64_t B = seg[s].B, per_bh = delta[s].n_items / (B * Hq);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < per_bh; ++t)
            sum += seg[s].dsink_part[(b * Hq + h) * per_bh + t];
      }
      seg[0].dsinks[h] = sum;
    }
  }
  if (pol.fused_bwd) {
    const std::vector<PhasePlan> fused = plan_segments(seg, n, pol, Phase::BwdFused);
    c10::DataPtr dq_acc;
    share_out(seg, n, fused, &AttnParams::dq_acc, &dq_acc);
    run_phase(seg, n, pol, Phase::BwdFused, fused);
  } else {
    run_phase(seg, n, pol, Phase::BwdDq);  // Lk == 0 gives dq = 0
    run_phase(seg, n, pol, Phase::BwdDkDv);
  }
}

void run_forward(AttnParams& p, const KernelPolicy& pol) { run_forward_segments(&p, 1, pol); }
void run_backward(AttnParams& p, const KernelPolicy& pol) { run_backward_segments(&p, 1, pol); }

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
#define FLASHSDPA_RESET(f) g_counters.f.store(0);
  FLASHSDPA_PATH_COUNTERS(FLASHSDPA_RESET)
#undef FLASHSDPA_RESET
  g_counting.store(on);
}
PathCounters* path_counters() { return g_counting.load() ? &g_counters : nullptr; }

}  // namespace flashsdpa
