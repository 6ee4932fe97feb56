// The kernel policy of one call: which tier runs, which of its paths, with which blocks. Decided
// here and nowhere else, from the call's shape and the tier (and, for choices that never change
// a result, the thread count), so a special path is switched on in one place.
#pragma once
#include "cpu/isa.h"
#include "params.h"

namespace flashsdpa {

struct KernelPolicy {
  cpu::Isa isa;
  const CpuTier* tier;
  bool decode;      // forward: split-KV decode (short queries)
  bool transposed;  // forward: the transposed-score path (Phase::ForwardTransposed)
  bool prepack;     // forward: K^T / V panels packed once for all q blocks (Phase::PackKV)
  bool fused_exp;   // forward: exponentials fused into the S GEMM where that is exact
  bool whole_q;     // forward: one q block per (batch, head)
  bool fused_bwd;   // backward: one pass per (batch, kv head) instead of two sweeps
  bool fused_rows;  // backward: P and dS made per S / dP GEMM tile (flash_bwd.h, fused_rows)
  bool fused_sdp;   // backward, those tiles: S and dP in one micro-tile (gemm_sdp_loop)
  bool fp16_pv;     // decode over a float8 cache, bf16 / fp16 queries: P V in fp16
  bool e4m3_fast;   // decode over a float8 cache: the tier's fast widening (FlashDecode::run_split)
  bool near_pf;     // decode: prefetches a sub-block ahead, non-temporal (FlashDecode::ahead)
  bool pv_whole;    // decode, all-heads items: P V per kv head over whole blocks (FlashDecode::split)
  int bq, bk;       // the blocks of the call's phases (query rows, keys)
};

// KernelPolicy's fields after isa / tier, as a list (the report: module.cpp).
#define FLASHSDPA_KERNEL_POLICY_FIELDS(X) \
  X(decode) X(transposed) X(prepack) X(fused_exp) X(whole_q) X(fused_bwd) X(fused_rows) \
  X(fused_sdp) X(fp16_pv) X(e4m3_fast) X(near_pf) X(pv_whole) X(bq) X(bk)

// The policy of a forward / backward call described by p (sizes, strides, dtype, mask, dropout
// and causal filled in); records it as this thread's last_policy().
// (record = false: explain() asking, not a call). A call of many segments (driver.h,
// run_forward_segments) takes the policy of its largest segment.
// for_backward: a backward will recompute P from this forward's logsumexp, which the split-KV
// decode path does not reproduce closely enough (its scores are scaled in another order): such
// forwards take the prefill kernels.
KernelPolicy plan_forward(const AttnParams& p, bool record = true, bool for_backward = false);
// Whether packing K^T / V once pays for the call (or segment) p under pol's blocks: each kv
// block is read by more than one q block (several per head, or several query heads per kv head).
// (A forced prepack overrides it.)
bool prepack_pays(const AttnParams& p, const KernelPolicy& pol);
KernelPolicy plan_backward(const AttnParams& p);

// Testing and tuning: parts of the policy forced process-wide (-1 / 0: the plan's own choice).
// Forcing a path the tier or the call cannot take is ignored (the plan's conditions still hold).
// Its fields, listed once: paths (1 on, 0 off, -1 the plan's choice) and blocks (0: the plan's).
#define FLASHSDPA_POLICY_PATHS(X) \
  X(decode) X(transposed) X(prepack) X(fused_exp) X(whole_q) X(fused_bwd) X(fused_rows) \
  X(fused_sdp) X(fp16_pv) X(e4m3_fast) X(near_pf) X(pv_whole)
#define FLASHSDPA_POLICY_BLOCKS(X) X(fwd_bq) X(fwd_bk) X(bwd_bq) X(bwd_bk)
#define FLASHSDPA_POLICY_FIELDS(X) FLASHSDPA_POLICY_PATHS(X) FLASHSDPA_POLICY_BLOCKS(X)
struct PolicyOverride {
#define FLASHSDPA_PATH(f) int f = -1;
#define FLASHSDPA_BLOCK(f) int f = 0;
  FLASHSDPA_POLICY_PATHS(FLASHSDPA_PATH)
  FLASHSDPA_POLICY_BLOCKS(FLASHSDPA_BLOCK)
#undef FLASHSDPA_PATH
#undef FLASHSDPA_BLOCK
  bool any() const;  // some field forced
};
void set_policy_override(const PolicyOverride& o);
PolicyOverride policy_override();
// The policy of the last call planned on this thread (the tests' proof of which path ran).
KernelPolicy last_policy();

}  // namespace flashsdpa
