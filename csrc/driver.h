// The parallel driver: runs the phases of a planned call (plan.h) on PyTorch's thread pool, each
// thread with its own scratch, and owns the shared buffers between phases.
#pragma once
#include <ATen/core/Tensor.h>

#include "params.h"
#include "plan.h"

namespace flashsdpa {

// p: a forward call (out, lse set); runs decode, or pre-pack + forward, as the policy says.
void run_forward(AttnParams& p, const KernelPolicy& pol);
// p: a backward call (dq / dk / dv / delta set); runs delta, then one pass or two sweeps.
void run_backward(AttnParams& p, const KernelPolicy& pol);

// A call made of independent segments, one AttnParams each (a packed variable-length batch: one
// per sequence, B = 1, pointers at its rows): every phase runs over the items of all segments in
// one parallel loop, so one long and many short sequences share the threads, and no result
// depends on the thread count. The policy is the whole call's (plan_forward of its largest
// segment); pre-packing runs for the segments it pays for (prepack_pays). Backward with sinks:
// seg[0].dsinks receives the sum over the segments (each segment's dsinks unused).
void run_forward_segments(AttnParams* seg, int64_t n, const KernelPolicy& pol);
void run_backward_segments(AttnParams* seg, int64_t n, const KernelPolicy& pol);

// The profiler event of the forward's first compute phase under pol ("flashsdpa::cpu_forward[
// avx2,fp32]", "...cpu_forward_transposed...", "...cpu_decode_split..."): what explain() names.
std::string forward_event(const KernelPolicy& pol, DType dt);

// Debugging aid used by the tests: every output and scratch buffer starts as NaN, so that an
// element a kernel forgets to write shows up as NaN.
void set_debug_poison(bool on);
bool debug_poison();
void poison(const at::Tensor& t);  // fills t with NaN when poisoning is on

// Test-only: the counters handed to the kernels (AttnParams::counters) while counting is on.
void set_path_counting(bool on);
PathCounters* path_counters();  // null while counting is off

}  // namespace flashsdpa
