// AttnParams: everything a CPU kernel needs, as plain data.
//
// This header is included by the ISA-specific kernel sources, which are compiled with their own
// -m flags. It must therefore stay free of torch / c10 / std headers with inline code: any inline
// function instantiated in an AVX2 translation unit could be picked by the linker for a portable
// caller (an ODR hazard that turns into an illegal instruction on older CPUs).
#pragma once

#include <stdint.h>

#include <atomic>
#include <chrono>
#include <memory>

namespace flashsdpa {

// Element type of q/k/v/out (and of the gradients).
enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// Element type of the attention mask. Bool masks mean "attend where true".
enum class MaskType : int32_t { None = 0, Bool = 1, F32 = 2, BF16 = 3, F16 = 4 };

// Strides are in elements. The last dimension of q/k/v/out/grads has stride 1 (ops.cpp makes it so).
struct AttnParams {
  DType dtype;
  // sizes
  int64_t B;    // batch
  // key / value of batch 1 read by every batch (batch stride 0; ops.cpp): the backward sums
  // their gradients over the batch in its fp32 accumulators, the forward packs them once
  bool kv_batch1;
  int64_t Hq;   // query heads
  int64_t Hkv;  // key/value heads (Hq % Hkv == 0; group = Hq / Hkv)
  int64_t Lq;   // query length
  int64_t Lk;   // key/value length
  int64_t D;    // q/k head dim
  int64_t Dv;   // v/out head dim

  // q: [B, Hq, Lq, D]   k: [B, Hkv, Lk, D]   v: [B, Hkv, Lk, Dv]   out: [B, Hq, Lq, Dv]
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t q_sb, q_sh, q_sl;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int64_t o_sb, o_sh, o_sl;

  // Paged K / V (flash_attn_with_kvcache; the split-KV decode path only): key j of this call's
  // (single) sequence is row j % page_size of page block_table[j / page_size], at
  // k + page * k_spage + (j % page_size) * k_sl + hk * k_sh (v likewise). page_size 0: not paged.
  const int32_t* block_table;
  int64_t page_size, k_spage, v_spage;
  // float8_e4m3fn K / V (the split-KV decode path only; q and out keep `dtype`): value = stored *
  // k_scale[hk * k_scale_sh] (v likewise; sh 0 for one scale, 1 for one per kv head).
  bool kv_e4m3;
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_sh, v_scale_sh;

  // logsumexp: [B, Hq, Lq] fp32, natural log of sum_j exp(scale * q.k_j + mask_j); 0 for rows
  // with no key to attend to (PyTorch's convention: the backward then sees P = 0 for them).
  float* lse;
  int64_t lse_sb, lse_sh, lse_sl;
  // Each row's log2-domain logsumexp as an unevaluated sum hi + lo (null: not kept): slot kStatHi
  // = hi, its float32 rounding, kStatLo = lo, the rest (-inf and 0 for a row that sees
  // nothing), both relative to kStatShift, the row's float-mask shift M (natural domain;
  // cpu/flash_common.h mask_shift: lse = ln(2) * (hi + lo) + M), at stats + b * st_sb +
  // h * st_sh + i * st_sl. The backward's P = 2^(s - hi) * 2^-lo, s relative to M, keeps what
  // lse's float32 rounding loses: ulp(|lse|) in every P (2.4e-4 at |lse| ~ 4000), and for a row
  // at one huge constant log(l) whole. The same value whichever forward path ran.
  float* stats;
  int64_t st_sb, st_sh, st_sl;
  enum StatsSlot : int { kStatHi = 0, kStatLo = 1, kStatShift = 2, kStatsPerRow = 3 };

  // Mask, broadcast to [B, Hq, Lq, Lk] through strides (0 on broadcast dims). Never expanded.
  MaskType mask_type;
  const void* mask;
  int64_t m_sb, m_sh, m_sl, m_sk;

  float scale;  // softmax scale (1/sqrt(D) by default)
  // Which keys row i sees (csrc/cpu/visibility.h): with d = diag, keys j with
  //   i + d - win_left <= j (win_left >= 0)  and  j <= i + d + win_right (win_right >= 0),
  // causal meaning win_right = 0. diag is 0 for PyTorch's top-left alignment and Lk - Lq for
  // flash-attn's bottom-right one.
  bool causal;
  int64_t win_left, win_right;  // -1: unbounded
  int64_t diag;

  // Score variants, applied in this order to s = scale * q.k (natural units):
  //   softcap > 0:  s = softcap * tanh(s / softcap)
  //   alibi:        s += -slope[b, h] * |i + diag - j|   (slopes fp32, slope_sb 0 for (H,) slopes)
  //   mask:         s += mask (bool: -inf where false)
  //   sinks:        a key per head with score sink[h] (fp32) and no value: it takes probability
  //                 mass in the softmax's denominator only (lse includes it)
  float softcap;
  const float* alibi;
  int64_t alibi_sb, alibi_sh;
  const float* sinks;
  // logsumexp of a row that sees nothing (and has no sink): 0 (PyTorch's fused kernels) or -inf
  // (flash-attn's API)
  float lse_empty;

  // Dropout on the normalised probabilities: element (b, h, i, j) is kept with probability
  // 1 - dropout_p (then scaled by 1/(1-p)); the keep bit comes from Philox(seed, offset, b, h, i, j).
  float dropout_p;
  uint64_t seed;
  uint64_t offset;

  // Backward only. dout: [B, Hq, Lq, Dv] (as out); dq like q; dk like k; dv like v.
  const void* dout;
  int64_t do_sb, do_sh, do_sl;
  void* dq;
  int64_t dq_sb, dq_sh, dq_sl;
  void* dk;
  int64_t dk_sb, dk_sh, dk_sl;
  void* dv;
  int64_t dv_sb, dv_sh, dv_sl;
  // delta[b, h, i] = sum_d dout[b,h,i,d] * out[b,h,i,d] in fp32, contiguous [B, Hq, Lq].
  float* delta;
  // Sinks' gradient, per BwdDelta item (b, h, q block): -sum_i exp(sink[h] - lse[i]) delta[i]
  // over its rows, contiguous [B * Hq * n_q_blocks]; the driver sums the items of each head in
  // a fixed order into dsinks (Hq).
  float* dsink_part;
  float* dsinks;

  // Shared buffer written by Phase::PackKV (K^T and V in the tier's fp32 panel layout, one
  // block after another), read by the forward. Null: the forward packs each block itself.
  float* kv_pack;

  // Phase::BwdFused: fp32 dq accumulator [B, Hq, Lq, ld] (ld from the tier's plan).
  float* dq_acc;

  // Phase::DecodeSplit / DecodeMerge: partial results of every kv split (layout: the tier's).
  float* dec_part;

  // The blocks of this call's phases (query rows, keys per block), from the plan (plan.cpp):
  // the forward's for a forward call, the backward's for a backward one. bq is a multiple of the
  // tier's row-group height and bk of its panel width.
  int32_t bq, bk;

  // Forward: the S GEMM may fuse the softmax's exponentials into its tile stores on the blocks
  // where that is exact (traits with fused_exp; plan.cpp decides).
  bool fused_exp;
  // Backward: P and dS may be made tile by tile from the S and dP GEMMs' stores (tiers with
  // fused_bwd_rows; plan.cpp decides).
  bool fused_rows;
  // Backward, those tiles: S and dP in one micro-tile, P and dS into the bf16 operands of the dV,
  // dK and dQ GEMMs in registers (tiers with bwd_sdp; plan.cpp decides).
  bool fused_sdp;
  // Decode over a float8_e4m3fn cache with bf16 / fp16 queries: P V in fp16 (the tier's
  // DecodeOpsOf<..>::fp16_pv trait; plan.cpp decides).
  bool fp16_pv;
  // Decode over a float8_e4m3fn cache: the tier's fast widening (DecodeOpsOf<..>::exact differs
  // from its type; plan.cpp decides, FlashDecode::run_split item by item).
  bool e4m3_fast;
  // Decode: prefetches one sub-block's bytes ahead with the non-temporal hint rather than a
  // block ahead into L2 (FlashDecode::ahead; plan.cpp decides).
  bool near_pf;
  // Decode, items taking every kv head (FlashDecode::all_heads): P V per head over the whole
  // block rather than a sub-block at a time across the heads (FlashDecode::split; plan.cpp
  // decides).
  bool pv_whole;

  // Test-only counters of the fast paths chosen inside a phase, block by block (null normally).
  struct PathCounters* counters;
};

// The test-only counters (PathCounters; flashsdpa._testing.counting): the fast paths taken,
// block by block, and the nanoseconds the prefill forward's items and K / V packing, and the
// decode splits, spend in each step, summed over threads (where a tier's time goes:
// bench/phase_profile.py).
#define FLASHSDPA_PATH_COUNTERS(X)                                                            \
  X(fused_exp_blocks)       /* forward kv blocks whose exponentials were fused */            \
  X(fused_exp_band_blocks)  /* ... of them, blocks a band's edge crosses (causal, window) */  \
  X(fwd_tiles)              /* forward (q block, kv block) score tiles computed */           \
  X(bwd_tiles)              /* backward (q block, kv block) score tiles computed */          \
  X(bwd_fused_tiles)        /* of those, P and dS made per GEMM tile (fused_bwd_rows) */      \
  X(bwd_sdp_tiles)          /* of those, S and dP in one micro-tile (bwd_sdp) */             \
  X(decode_blocks)          /* decode (split, kv block) score blocks computed */             \
  X(decode_gathered_blocks) /* of those, from a paged cache copied first */                  \
  X(decode_fp16_pv_blocks)  /* of those, P V over float8 V in fp16 (AVX512-FP16) */          \
  X(decode_sub_blocks)      /* sub-blocks of those read across an item's kv heads (sub_keys) */ \
  X(decode_pv_whole_blocks) /* of the blocks with sub-blocks, P V per head over the block */  \
  X(decode_e4m3_fast_blocks)  /* of those, over float8 K / V the tier's fast widening read */ \
  X(decode_e4m3_nan_patched)  /* sub-blocks (K, V; pv_whole V: blocks) NaN bytes set after */ \
  X(decode_e4m3_exact_items)  /* float8 items its exact one took instead (run_split) */      \
  X(decode_near_pf_blocks)  /* decode blocks whose K / V prefetches ran near (near_pf) */     \
  X(fwd_pack_ns)            /* K^T / V panels packed (in the items or Phase::PackKV) */       \
  X(fwd_scores_ns)          /* S = Q K^T (with the exponentials where fused) */              \
  X(fwd_softmax_ns)         /* row work: Q load, online softmax, P's operand format, finish */ \
  X(fwd_pv_ns)              /* acc += P V */                                                \
  X(bwd_pack_ns)            /* backward: operand copies and panels (Q, dO, K, V sides) */  \
  X(bwd_s_ns)               /* backward: S = Q K^T and P */                                 \
  X(bwd_dp_ns)              /* backward: dP = dO V^T and dS */                              \
  X(bwd_dkdv_ns)            /* backward: dV += P^T dO, dK += dS^T Q (with their A operands) */ \
  X(bwd_dq_ns)              /* backward: dQ += dS K (with its A operand) */                 \
  X(bwd_rows_ns)            /* backward: delta, accumulators zeroed, gradients stored */    \
  X(decode_qk_ns)           /* decode: s = q K (small pages gathered; float8 NaN scan) */   \
  X(decode_softmax_ns)      /* decode: q rows loaded, online softmax, partials written */    \
  X(decode_pv_ns)           /* decode: acc += P V (small pages gathered; float8 NaN scan) */

struct PathCounters {
#define FLASHSDPA_COUNTER(f) std::atomic<int64_t> f{0};
  FLASHSDPA_PATH_COUNTERS(FLASHSDPA_COUNTER)
#undef FLASHSDPA_COUNTER
};

// Split-KV decode folds the query rows of every query head sharing a kv head into one block:
// (Hq / Hkv) * Lq rows. One or two (MHA decode) is light: little compute per byte read, which
// the V prefetch density (flash_decode.h) and, where vdpbf16ps is slow, the tier (isa.cpp) follow.
// (static: one copy per translation unit, so no tier's -m flags reach a portable caller)
static inline int64_t decode_rows(const AttnParams& p) {
  return p.Hq / (p.Hkv > 0 ? p.Hkv : 1) * p.Lq;
}
static inline bool light_decode(const AttnParams& p) { return decode_rows(p) <= 2; }

namespace cpu {
// Split-KV decode: bytes of K rows (and of V rows) per block, decided once from the host's L2
// (isa.cpp, which tier code cannot include: its tier table redefines the tier macros).
int64_t decode_block_bytes();
// ... and per sub-block of an all-heads item, from the host's L1d (isa.cpp)
int64_t decode_sub_bytes();
}  // namespace cpu

// Adds n to a path counter when counting is on (tests only; one branch otherwise).
inline void count_path(const AttnParams& p, std::atomic<int64_t> PathCounters::*c, int64_t n) {
  if (p.counters && n) (p.counters->*c).fetch_add(n);
}

// When counting is on, the nanoseconds since the previous lap (or the start) added to a step's
// counter at each lap; otherwise nothing is read (one branch a lap).
class StepClock {
 public:
  explicit StepClock(const AttnParams& p) : c_(p.counters), t_(c_ ? now() : 0) {}
  void lap(std::atomic<int64_t> PathCounters::*step) {
    if (!c_) return;
    const int64_t t = now();
    (c_->*step).fetch_add(t - t_, std::memory_order_relaxed);
    t_ = t;
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  PathCounters* c_;
  int64_t t_;
};

// The phases a kernel call is made of. Each phase is a parallel loop over independent work items;
// driver.cpp runs the loop (at::parallel_for) and the tier runs the items.
enum class Phase : int32_t {
  PackKV = 4,    // items: (b, hkv, kv-block): K^T and V panels into kv_pack (when worth it)
  Forward = 0,   // items: (b, hq, q-block)
  ForwardTransposed = 8,  // the same items on the transposed-score path (traits with
                          // transposed_s; fp32, no mask / dropout, every key visible)
  BwdDelta = 1,  // items: (b, hq, q-block): delta = rowsum(dout * out)
  BwdDkDv = 2,   // items: (b, hkv, kv-block): dk, dv, looping over the query heads of the group
  BwdDq = 3,     // items: (b, hq, q-block): dq
  BwdFused = 5,  // items: (b, hkv): dk, dv and dq (into dq_acc) in one pass; replaces the two above
                 // (and BwdDelta where bwd_fused_owns_delta)
  DecodeSplit = 6,  // short queries, items (b, hkv, kv-split): partial softmax into dec_part
  DecodeMerge = 7,  // items (b, hkv): merge the splits' partials into out / lse
  kCount = 9
};

// A BwdFused item owns every row of its query heads, so it computes their delta itself (where
// it then reads dO) and the BwdDelta phase is skipped, except with sinks, whose gradient sums
// the BwdDelta items' parts in a fixed order.
inline bool bwd_fused_owns_delta(const AttnParams& p) { return p.sinks == nullptr; }

// The work items [0, total) of one phase's parallel loop, handed to its threads (driver.cpp's
// run_phase). in_order: one at a time, in order, to whichever thread asks next (the compute
// phases, whose items differ in cost). Otherwise each thread owns a contiguous range (the
// memory-bound phases: a thread's decode splits follow one another in memory, so its K / V
// streams run on from item to item) and takes its items from the front; a thread whose range
// is empty takes items from the back of the range with the most left (of equals, the first
// thread's). Either way a thread whose core another process shares does fewer items instead of
// holding the others up at the end, and no item's output depends on which thread runs it.
class ItemQueue {
 public:
  ItemQueue(int64_t total, int threads, bool in_order);  // (threads: at most total)
  int threads() const { return threads_; }
  int64_t next(int thread);  // that thread's next item; -1 once none is left

 private:
  struct alignas(64) Range {  // end << 32 | begin: taken from both ends by compare-exchange
    std::atomic<uint64_t> v{0};
  };
  int64_t total_;
  int threads_;
  bool in_order_;  // (also where the items outnumber 32-bit ranges)
  std::atomic<int64_t> counter_{0};
  std::unique_ptr<Range[]> ranges_;
};

struct PhasePlan {
  int64_t n_items;        // the phase's items are [0, n_items); 0: skip the phase
  int64_t scratch_bytes;  // per-thread scratch the items need (64-byte aligned by the caller)
  int64_t shared_bytes;   // PackKV / BwdFused / DecodeSplit: shared buffer size (kv_pack,
                          // dq_acc, dec_part)
};

// What one ISA tier provides. Item decomposition depends on the shape only (never on the
// thread count), and each item is computed by one thread, so results are bit-identical at any
// thread count.
struct CpuTier {
  const char* name;
  // What the plan (plan.cpp) needs to know of the trait: row-group height and panel width (block
  // sizes are multiples of them), the default q blocks, and the trait's optional paths.
  int mr, nr, block_q, block_q_bwd;
  bool fused_exp, transposed_s;
  bool fused_bwd_rows;  // backward: P and dS made per tile while it is in L1 (not on AMX)
  bool bwd_sdp;  // backward: those tiles' S and dP in one micro-tile (gemm_sdp_loop)
  bool fp16_pv;  // decode kernels running P V over float8 V in fp16 (AVX512-FP16)
  bool e4m3_fast;  // decode kernels widening float8 without F16C (dims multiples of 16)
  bool near_pf;  // decode kernels whose prefetches may run near (the trait's kDecodeNearPf)
  bool pv_whole;  // decode kernels whose P V wants whole blocks (the trait's kDecodePvWhole)
  PhasePlan (*plan)(const AttnParams& p, Phase phase);
  // Runs work items [begin, end), or, with a queue, the items it hands to `thread`.
  void (*run)(const AttnParams& p, Phase phase, int64_t begin, int64_t end, void* scratch,
              ItemQueue* queue, int thread);
  // Test hook: the tier's softmax exponent, s[j] = exp2(s[j] - m) for j < n, returns the sum
  // (s padded to a multiple of 16 floats; lanes from n on must hold -inf).
  float (*exp2_row_sum)(float* s, int n, float m);
  // Test hook, on tiers whose P V takes P in bf16 (null elsewhere): that exponent, P =
  // 2^(s[j] * mul - m) rounded to bf16 into dst (n padded to 16), returns the unrounded sum.
  float (*exp2_row_sum_bf16)(const float* s, int n, float mul, float m, uint16_t* dst);
  // Test hook: the tier's softcap, x[j] = cap * tanh(x[j] / cap) (x padded to 16 floats).
  void (*softcap_row)(float* x, int n, float cap);
};

}  // namespace flashsdpa
