// The kernel policy (plan.h). Compiled once, without ISA flags.
#include "plan.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace flashsdpa {

namespace {

std::mutex g_override_mutex;
PolicyOverride g_override;
std::atomic<bool> g_overridden{false};  // fast path: no lock while nothing is forced
thread_local KernelPolicy t_last{};

PolicyOverride current_override() {
  if (!g_overridden.load(std::memory_order_acquire)) return PolicyOverride{};
  std::lock_guard<std::mutex> lock(g_override_mutex);
  return g_override;
}

// A forced on/off (1 / 0) or the plan's own choice (-1).
bool choose(int forced, bool own) { return forced < 0 ? own : forced != 0; }

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Largest q_len the split-KV decode path takes: against the prefill blocking (AVX2 tier, H = 32,
// D = 128, KV 4096-8192, fp32 and bf16, MHA and GQA-4) decode is faster up to q_len 16, about
// even at 32, slower at 64.
constexpr int64_t kDecodeMaxLq = 16;

// Short sequences: one q block per (batch, head) spanning every query row (each kv block's
// panels packed once, into the thread's own scratch) beats q blocks of the tier's size when
// those B * H items keep the threads busy. It never changes a result: every output row is the
// same sum in the same order whichever block holds it.
constexpr int64_t kWholeQMaxLq = 512;

// The transposed-score path pays on q blocks of up to 256 rows: its P V reads P^T down the
// columns of the score tile, one line per key for each group of queries, which on the longer
// whole-q blocks costs more than the K^T / V packing it saves (bench_paths: transposed@causal).
// So lengths that may take a whole-q block of more rows (kTransposedMaxBq < Lq <=
// kWholeQMaxLq) take the row path, whether or not the thread count gives them that block: a
// path changes the rounding, and a result must not depend on the thread count.
constexpr int64_t kTransposedMaxBq = 256;

// Keys per block: the per-thread working set (K^T and V panels of one kv block plus the score
// tile) should stay in L2, bk = kL2PanelBytes / (4 * (D + Dv)), clamped, a whole number of
// panels. bk depends on the shape only: it sets the order of the online softmax.
constexpr int64_t kL2PanelBytes = 256 * 1024;
constexpr int64_t kMinBk = 64, kMaxBk = 256;

// The share of the threads' time n equally expensive items keep busy: at::parallel_for gives
// each of T threads ceil(n / T) of them.
double thread_busy(int64_t n_items) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1) return 1.0;
  return double(n_items) / double(threads * ((n_items + threads - 1) / threads));
}

void choose_blocks(const AttnParams& p, const CpuTier& tier, int bq_max, int forced_bq,
                   int forced_bk, KernelPolicy* pol) {
  int64_t bq = p.Lq >= bq_max ? bq_max : round_up(std::max<int64_t>(p.Lq, 1), tier.mr);
  int64_t bk = std::clamp(kL2PanelBytes / (4 * (p.D + p.Dv)), kMinBk, kMaxBk);
  bk = round_up(std::min(bk, round_up(std::max<int64_t>(p.Lk, 1), tier.nr)), tier.nr);
  if (forced_bq > 0) bq = round_up(forced_bq, tier.mr);
  if (forced_bk > 0) bk = round_up(forced_bk, tier.nr);
  pol->bq = int(bq);
  pol->bk = int(bk);
}

// decode: the call takes the split-KV decode path (decode calls, light or not, are the tier
// choice's call-dependent conditions, isa.cpp).
KernelPolicy base_policy(const AttnParams& p, bool decode = false) {
  KernelPolicy pol{};
  using cpu::DecodeCall;
  const DecodeCall call =
      !decode ? DecodeCall::none : light_decode(p) ? DecodeCall::light : DecodeCall::decode;
  pol.isa = cpu::selected_isa(p.dtype, p.kv_e4m3, call);
  pol.tier = &cpu::selected_tier(p.dtype, p.kv_e4m3, call);
  pol.decode = decode;
  return pol;
}

}  // namespace

KernelPolicy plan_forward(const AttnParams& p, bool record, bool for_backward) {
  const PolicyOverride o = current_override();
  KernelPolicy pol = base_policy(
      p, p.dropout_p == 0.0f && choose(o.decode, p.Lq <= kDecodeMaxLq && !for_backward));
  const CpuTier& tier = *pol.tier;
  pol.fused_exp = tier.fused_exp && choose(o.fused_exp, true);
  // (fp32 queries keep P V in fp32: fp16 products would fall short of their accuracy; emulated
  // tiers have no such kernel: tier.fp16_pv is false there)
  pol.fp16_pv = pol.decode && p.kv_e4m3 && p.dtype != DType::F32 && tier.fp16_pv &&
                cpu::host_features().has(cpu::Feature::avx512_fp16) && choose(o.fp16_pv, true);
  // (the fast widening's kernels have no tails: dims in multiples of 16; it makes e4m3's
  // subnormals denormals, which cores with denormal assists would take slowly)
  pol.e4m3_fast = pol.decode && p.kv_e4m3 && tier.e4m3_fast && p.D % 16 == 0 &&
                  p.Dv % 16 == 0 && !cpu::host_features().denormal_assists &&
                  choose(o.e4m3_fast, true);
  // (float8 caches, whose kernels do more work per byte read, keep the block-ahead prefetches;
  // bench_paths near_pf is the case that shows the gain)
  pol.near_pf = pol.decode && tier.near_pf && !p.kv_e4m3 && choose(o.near_pf, true);
  // (whole blocks of V read per head want them in L2: prefetched a block ahead, not near;
  // bench_paths pv_whole is the case that shows the gain)
  pol.pv_whole = pol.decode && tier.pv_whole && !pol.near_pf && choose(o.pv_whole, true);
  choose_blocks(p, tier, tier.block_q, o.fwd_bq, o.fwd_bk, &pol);
  pol.whole_q = o.fwd_bq == 0 &&
                choose(o.whole_q, p.Lq <= kWholeQMaxLq && thread_busy(p.B * p.Hq) >= 0.9);
  if (pol.whole_q) pol.bq = int(round_up(std::max<int64_t>(p.Lq, 1), tier.mr));
  // (the transposed path's column softmax takes scores without mask, dropout or a variant that
  // changes them; a band, causal or a window, only cuts its tiles)
  const bool plain = p.mask_type == MaskType::None && p.dropout_p == 0.0f &&
                     p.softcap == 0.0f && !p.alibi && !p.sinks;
  pol.transposed = !pol.decode && tier.transposed_s && p.dtype == DType::F32 && plain &&
                   p.k_sl <= INT32_MAX &&  // K's row stride is the GEMM's int lda
                   choose(o.transposed, p.Lq <= kTransposedMaxBq || p.Lq > kWholeQMaxLq);
  // Pack K^T / V once where that pays (prepack_pays); the transposed path reads K and V in place.
  pol.prepack = !pol.decode && !pol.transposed && prepack_pays(p, pol);
  if (record) t_last = pol;
  return pol;
}

bool prepack_pays(const AttnParams& p, const KernelPolicy& pol) {
  return choose(current_override().prepack, p.Lq > pol.bq || p.Hq > p.Hkv);
}

KernelPolicy plan_backward(const AttnParams& p) {
  const PolicyOverride o = current_override();
  KernelPolicy pol = base_policy(p);
  choose_blocks(p, *pol.tier, pol.tier->block_q_bwd, o.bwd_bq, o.bwd_bk, &pol);
  pol.fused_rows = pol.tier->fused_bwd_rows && choose(o.fused_rows, true);
  // (bench_paths fused_sdp is the case that shows the gain)
  pol.fused_sdp = pol.fused_rows && pol.tier->bwd_sdp && choose(o.fused_sdp, true);
  // The single pass has one item per (batch, kv head), all equally expensive; it wins unless
  // those items leave threads idle (the two sweeps do 7/5 of its gemm work). Both give the same
  // bits (the same tiles accumulated in the same order), so this thread-count choice never
  // changes a gradient.
  // Batch-1 key / value (kv_batch1): the dK / dV items of the two sweeps sum over the batch; the
  // single pass's (batch, kv head) items would each write the same rows.
  pol.fused_bwd = !p.kv_batch1 &&
                  choose(o.fused_bwd, thread_busy(p.B * p.Hkv) >= 5.0 / 7.0 * 1.1);
  t_last = pol;
  return pol;
}

void set_policy_override(const PolicyOverride& o) {
  std::lock_guard<std::mutex> lock(g_override_mutex);
  g_override = o;
  g_overridden.store(o.any(), std::memory_order_release);
}

bool PolicyOverride::any() const {
  const PolicyOverride none;
#define FLASHSDPA_FORCED(f) \
  if (f != none.f) return true;
  FLASHSDPA_POLICY_FIELDS(FLASHSDPA_FORCED)
#undef FLASHSDPA_FORCED
  return false;
}

PolicyOverride policy_override() { return current_override(); }

KernelPolicy last_policy() { return t_last; }

}  // namespace flashsdpa
