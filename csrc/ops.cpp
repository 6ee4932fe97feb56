// flashsdpa op schemas, input checks, AttnParams, tier dispatch and the parallel driver.
// Compiled once, without ISA flags; the kernels live in csrc/cpu/tiers/<tier>.cpp.
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "cpu/isa.h"

namespace flashsdpa {

namespace {

std::atomic<bool> g_debug_poison{false};
std::atomic<int> g_kv_prepack{int(KvPrepack::Auto)};
std::atomic<int> g_bwd_strategy{int(BwdStrategy::Auto)};
std::atomic<int> g_decode{int(DecodePolicy::Auto)};

// Largest q_len the split-KV decode path takes. Measured against the prefill path (AVX2 tier,
// H=32, D=128, KV 4096-8192, fp32 and bf16, MHA and GQA-4): decode is faster up to q_len 16,
// about even at 32, slower at 64. Dropout always takes the prefill path.
constexpr int64_t kDecodeMaxLq = 16;

bool use_decode_path(const AttnParams& p) {
  const auto policy = DecodePolicy(g_decode.load(std::memory_order_relaxed));
  if (p.dropout_p > 0.0f || policy == DecodePolicy::Never) return false;
  return policy == DecodePolicy::Always || p.Lq <= kDecodeMaxLq;
}
std::atomic<int> g_blocks[4] = {{0}, {0}, {0}, {0}};  // fwd bq, fwd bk, bwd bq, bwd bk

// The share of the threads' time n equally expensive items keep busy: at::parallel_for gives
// each of T threads ceil(n / T) of them.
double thread_busy(int64_t n_items) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1) return 1.0;
  return double(n_items) / double(threads * ((n_items + threads - 1) / threads));
}

// The single-pass backward has one item per (batch, kv head), all equally expensive; it wins
// unless those items leave threads idle (the two-sweep alternative does 7/5 of the gemm work).
bool fused_backward_pays(int64_t n_items) { return thread_busy(n_items) >= 5.0 / 7.0 * 1.1; }

// Forward over a short sequence: one q block per (batch, head) spanning every query row (each
// kv block's panels packed once, into the thread's own scratch; no K/V pre-pack phase unless
// GQA heads share them) is 3-12% faster than q blocks of the tier's size (measured: avx2, avx512, avx512_bf16; L 256-512,
// D 64 and 128, causal and not; L = 1024 was 1% slower), when those B * H items keep the threads
// busy. Which q blocking runs never changes a result: every output row is the same sum in the
// same order whichever block holds it.
constexpr int64_t kWholeQMaxLq = 512;
bool whole_q_block_pays(const AttnParams& p) {
  return p.Lq <= kWholeQMaxLq && thread_busy(p.B * p.Hq) >= 0.9;
}

// Largest head dim / block extent the kernels index with 32-bit ints.
constexpr int64_t kMaxHeadDim = 1 << 16;

DType to_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default: TORCH_CHECK(false, "unreachable dtype");
  }
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
  }
  return "?";
}

// Last-dim stride 1 is what the kernels read; anything else is copied once (O(L) memory).
at::Tensor last_dim_unit_stride(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "flashsdpa: query must be 4-D (batch, heads, seq_len, head_dim), got ",
              q.dim(), "-D");
  TORCH_CHECK(k.dim() == 4, "flashsdpa: key must be 4-D (batch, heads, seq_len, head_dim), got ",
              k.dim(), "-D");
  TORCH_CHECK(v.dim() == 4, "flashsdpa: value must be 4-D (batch, heads, seq_len, head_dim), got ",
              v.dim(), "-D");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "flashsdpa: query.dtype must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK(k.scalar_type() == st, "flashsdpa: key.dtype (", k.scalar_type(),
              ") must match query.dtype (", st, ")");
  TORCH_CHECK(v.scalar_type() == st, "flashsdpa: value.dtype (", v.scalar_type(),
              ") must match query.dtype (", st, ")");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "flashsdpa: the CPU kernel needs query, key and value on the CPU, got ", q.device(),
              ", ", k.device(), ", ", v.device());
  TORCH_CHECK(k.size(0) == q.size(0), "flashsdpa: key batch size (", k.size(0),
              ") must match query batch size (", q.size(0), ")");
  TORCH_CHECK(v.size(0) == q.size(0), "flashsdpa: value batch size (", v.size(0),
              ") must match query batch size (", q.size(0), ")");
  TORCH_CHECK(v.size(1) == k.size(1), "flashsdpa: value heads (", v.size(1),
              ") must match key heads (", k.size(1), ")");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "flashsdpa: query heads (", q.size(1),
              ") must be a multiple of key/value heads (", k.size(1), ") for grouped-query attention");
  TORCH_CHECK(v.size(2) == k.size(2), "flashsdpa: value seq_len (", v.size(2),
              ") must match key seq_len (", k.size(2), ")");
  TORCH_CHECK(k.size(3) == q.size(3), "flashsdpa: key head_dim (", k.size(3),
              ") must match query head_dim (", q.size(3), ")");
  TORCH_CHECK(q.size(3) > 0 && q.size(3) <= kMaxHeadDim, "flashsdpa: query head_dim must be in [1, ",
              kMaxHeadDim, "], got ", q.size(3));
  TORCH_CHECK(v.size(3) > 0 && v.size(3) <= kMaxHeadDim, "flashsdpa: value head_dim must be in [1, ",
              kMaxHeadDim, "], got ", v.size(3));
}

// Mask: bool, float32 or the query dtype; any shape that broadcasts to (B, Hq, Lq, Lk).
// Returns the (B, Hq, Lq, Lk) view (stride 0 on broadcast dims), never a copy.
at::Tensor check_mask(const at::Tensor& m, const at::Tensor& q, int64_t Lk) {
  const auto st = m.scalar_type();
  TORCH_CHECK(st == at::kBool || st == at::kFloat || st == q.scalar_type(),
              "flashsdpa: attn_mask.dtype must be bool, float32 or query.dtype (",
              q.scalar_type(), "), got ", st);
  TORCH_CHECK(m.device().is_cpu(), "flashsdpa: attn_mask must be on the CPU, got ", m.device());
  TORCH_CHECK(m.dim() <= 4, "flashsdpa: attn_mask must have at most 4 dims, got ", m.dim());
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), Lk};
  const int64_t off = 4 - m.dim();
  for (int64_t d = 0; d < m.dim(); ++d) {
    TORCH_CHECK(m.size(d) == 1 || m.size(d) == target[off + d], "flashsdpa: attn_mask of shape ",
                m.sizes(), " does not broadcast to (batch, heads, L, S) = (", target[0], ", ",
                target[1], ", ", target[2], ", ", target[3], ")");
  }
  return m.expand({target[0], target[1], target[2], target[3]});
}

MaskType mask_type_of(const at::Tensor& m) {
  switch (m.scalar_type()) {
    case at::kBool: return MaskType::Bool;
    case at::kFloat: return MaskType::F32;
    case at::kBFloat16: return MaskType::BF16;
    case at::kHalf: return MaskType::F16;
    default: TORCH_CHECK(false, "unreachable mask dtype");
  }
}

void check_dropout(double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "flashsdpa: dropout_p must be in [0, 1), got ", p);
}

void fill_common(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const c10::optional<at::Tensor>& mask4, double dropout_p, bool causal,
                 c10::optional<double> scale) {
  std::memset(&p, 0, sizeof(p));
  p.dtype = to_dtype(q.scalar_type());
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.Hkv = k.size(1);
  p.Lq = q.size(2);
  p.Lk = k.size(2);
  p.D = q.size(3);
  p.Dv = v.size(3);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sl = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_sl = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_sl = v.stride(2);
  p.mask_type = MaskType::None;
  if (mask4.has_value()) {
    const at::Tensor& m = *mask4;
    p.mask_type = mask_type_of(m);
    p.mask = m.data_ptr();
    p.m_sb = m.stride(0), p.m_sh = m.stride(1), p.m_sl = m.stride(2), p.m_sk = m.stride(3);
  }
  p.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(p.D)));
  p.causal = causal;
  p.dropout_p = float(dropout_p);
}

const std::string& profiler_name(Phase phase, cpu::Isa isa, DType dt) {
  static const std::string* names = [] {
    constexpr int np = 8, ni = int(cpu::Isa::kCount), nd = 3;
    const char* phases[np] = {"cpu_forward", "cpu_bwd_delta", "cpu_bwd_dkdv", "cpu_bwd_dq",
                              "cpu_pack_kv", "cpu_bwd_fused", "cpu_decode_split",
                              "cpu_decode_merge"};
    auto* out = new std::string[np * ni * nd];
    for (int a = 0; a < np; ++a)
      for (int b = 0; b < ni; ++b)
        for (int c = 0; c < nd; ++c)
          out[(a * ni + b) * nd + c] = std::string("flashsdpa::") + phases[a] + "[" +
                                       cpu::isa_name(cpu::Isa(b)) + "," + dtype_name(DType(c)) + "]";
    return out;
  }();
  return names[(int(phase) * int(cpu::Isa::kCount) + int(isa)) * 3 + int(dt)];
}

// The pack buffer of the last forward on this thread, kept for the next call: a fresh multi-MB
// allocation costs page faults and kernel page clearing on every call (a few % of a prefill).
// Buffers above kMaxCachedPackBytes are not kept, so a long prefill does not pin its memory.
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

void poison(const at::Tensor& t) {
  if (g_debug_poison.load(std::memory_order_relaxed) && t.numel() > 0)
    t.fill_(std::numeric_limits<double>::quiet_NaN());
}

void run_planned_phase(const AttnParams& p, Phase phase, cpu::Isa isa, const CpuTier& tier,
                       const PhasePlan& plan);

// Runs one phase: a parallel loop over the tier's work items, each thread with its own scratch.
void run_phase(const AttnParams& p, Phase phase) {
  const cpu::Isa isa = cpu::selected_isa(p.dtype);
  const CpuTier& tier = cpu::selected_tier(p.dtype);
  const PhasePlan plan = tier.plan(p, phase);
  run_planned_phase(p, phase, isa, tier, plan);
}

void run_planned_phase(const AttnParams& p, Phase phase, cpu::Isa isa, const CpuTier& tier,
                       const PhasePlan& plan) {
  RECORD_FUNCTION(profiler_name(phase, isa, p.dtype), c10::ArrayRef<const c10::IValue>{});
  if (plan.n_items <= 0) return;
  const bool poison_scratch = g_debug_poison.load(std::memory_order_relaxed);
  // The compute phases hand out their items one at a time (an atomic counter) rather than as
  // one fixed range per thread: a thread whose core is shared with another process (or slowed by
  // it) then does fewer items instead of holding everyone up at the end. Same items, same
  // results: no item's output depends on which thread runs it. Interleaved A/B, forward suite:
  // within 0.5% on a quiet machine; with a busy loop on one of the two cores, (1,16,1024,64)
  // fp32 44.5 -> 31.5 ms. The memory-bound phases (packing, decode) keep contiguous ranges.
  const bool dynamic = phase == Phase::Forward || phase == Phase::BwdDkDv ||
                       phase == Phase::BwdDq || phase == Phase::BwdFused;
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

// Seed and offset for one dropout call, drawn from PyTorch's default CPU generator, so that
// torch.manual_seed makes runs reproducible.
void draw_dropout_seed(AttnParams& p) {
  auto gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      c10::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  p.seed = gen->random64();
  p.offset = 0;
}

}  // namespace

void set_debug_poison(bool on) { g_debug_poison.store(on); }
void set_kv_prepack(KvPrepack policy) { g_kv_prepack.store(int(policy)); }
void set_bwd_strategy(BwdStrategy s) { g_bwd_strategy.store(int(s)); }
void set_decode_policy(DecodePolicy d) { g_decode.store(int(d)); }
void set_block_override(int fwd_bq, int fwd_bk, int bwd_bq, int bwd_bk) {
  g_blocks[0] = fwd_bq, g_blocks[1] = fwd_bk, g_blocks[2] = bwd_bq, g_blocks[3] = bwd_bk;
}
bool debug_poison() { return g_debug_poison.load(); }

at::Tensor output_like_query(const at::Tensor& q, int64_t Dv) {
  // Like PyTorch's own kernel: the output takes the memory format of query (empty_like), e.g. a
  // (B, L, H, D) buffer viewed as (B, H, L, D) gives the same layout back.
  if (Dv == q.size(3)) {
    at::Tensor o = at::empty_like(q, at::MemoryFormat::Preserve);
    if (o.size(3) <= 1 || o.stride(3) == 1) return o;
  }
  return at::empty({q.size(0), q.size(1), q.size(2), Dv}, q.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    c10::optional<double> scale) {
  check_qkv(query, key, value);
  check_dropout(dropout_p);
  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  c10::optional<at::Tensor> mask4;
  if (attn_mask.has_value() && attn_mask->defined()) mask4 = check_mask(*attn_mask, q, k.size(2));

  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  at::Tensor out = output_like_query(query, v.size(3));
  at::Tensor lse = at::empty({B, Lq, Hq}, q.options().dtype(at::kFloat)).transpose(1, 2);
  at::Tensor rng = at::zeros({2}, q.options().dtype(at::kLong));
  poison(out);
  poison(lse);

  AttnParams p;
  fill_common(p, q, k, v, mask4, dropout_p, is_causal, scale);
  if (dropout_p > 0.0) {
    draw_dropout_seed(p);
    auto* r = rng.data_ptr<int64_t>();
    r[0] = int64_t(p.seed);
    r[1] = int64_t(p.offset);
  }
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_sl = out.stride(2);
  p.bq_override = g_blocks[0], p.bk_override = g_blocks[1];
  if (p.bq_override == 0 && whole_q_block_pays(p)) p.bq_override = int32_t(p.Lq);
  p.lse = lse.data_ptr<float>();
  p.lse_sb = lse.stride(0), p.lse_sh = lse.stride(1), p.lse_sl = lse.stride(2);
  if (out.numel() > 0 && use_decode_path(p)) {
    const cpu::Isa isa = cpu::selected_isa(p.dtype);
    const CpuTier& tier = cpu::selected_tier(p.dtype);
    const PhasePlan split = tier.plan(p, Phase::DecodeSplit);
    c10::DataPtr parts = c10::GetCPUAllocator()->allocate(split.shared_bytes);
    p.dec_part = static_cast<float*>(parts.get());
    run_planned_phase(p, Phase::DecodeSplit, isa, tier, split);
    run_phase(p, Phase::DecodeMerge);
  } else if (out.numel() > 0) {
    // K^T / V panels packed once into a shared fp32 buffer when the forward would otherwise
    // repack each kv block for every q block (O(Lk) memory, freed on return)
    const cpu::Isa isa = cpu::selected_isa(p.dtype);
    const CpuTier& tier = cpu::selected_tier(p.dtype);
    const PhasePlan pack = tier.plan(p, Phase::PackKV);
    const auto policy = KvPrepack(g_kv_prepack.load(std::memory_order_relaxed));
    c10::DataPtr pack_owner;
    if (pack.n_items > 0 &&
        (policy == KvPrepack::Always || (policy == KvPrepack::Auto && pack.worthwhile))) {
      p.kv_pack = pack_workspace(pack.shared_bytes, &pack_owner);
      if (g_debug_poison.load(std::memory_order_relaxed))
        std::memset(p.kv_pack, 0xFF, pack.shared_bytes);
      run_planned_phase(p, Phase::PackKV, isa, tier, pack);
    }
    run_phase(p, Phase::Forward);
  }
  return {out, lse, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attn_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const c10::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, c10::optional<double> scale) {
  check_qkv(query, key, value);
  check_dropout(dropout_p);
  const int64_t B = query.size(0), Hq = query.size(1), Lq = query.size(2), Dv = value.size(3);
  const std::vector<int64_t> o_shape{B, Hq, Lq, Dv};
  TORCH_CHECK(grad_out.sizes() == o_shape, "flashsdpa: grad_out must have shape ", o_shape,
              ", got ", grad_out.sizes());
  TORCH_CHECK(out.sizes() == o_shape, "flashsdpa: out must have shape ", o_shape, ", got ",
              out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "flashsdpa: grad_out and out must have query's dtype (", query.scalar_type(), ")");
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && logsumexp.dim() == 3 &&
                  logsumexp.size(0) == B && logsumexp.size(1) == Hq && logsumexp.size(2) == Lq,
              "flashsdpa: logsumexp must be float32 of shape (", B, ", ", Hq, ", ", Lq, "), got ",
              logsumexp.scalar_type(), " ", logsumexp.sizes());
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
              "flashsdpa: rng_state must be the int64[2] (seed, offset) the forward returned");

  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  const at::Tensor o = last_dim_unit_stride(out);
  const at::Tensor dO = last_dim_unit_stride(grad_out);
  c10::optional<at::Tensor> mask4;
  if (attn_mask.has_value() && attn_mask->defined()) mask4 = check_mask(*attn_mask, q, k.size(2));

  // PyTorch's CPU gradient layout: (B, H, L, D) viewed on a (B, L, H, D) buffer.
  at::Tensor dq = at::empty_permuted(q.sizes(), {0, 2, 1, 3}, q.options());
  at::Tensor dk = at::empty_permuted(k.sizes(), {0, 2, 1, 3}, k.options());
  at::Tensor dv = at::empty_permuted(v.sizes(), {0, 2, 1, 3}, v.options());
  at::Tensor delta = at::empty({B, Hq, Lq}, q.options().dtype(at::kFloat));
  poison(dq);
  poison(dk);
  poison(dv);
  poison(delta);

  AttnParams p;
  fill_common(p, q, k, v, mask4, dropout_p, is_causal, scale);
  if (dropout_p > 0.0) {
    const at::Tensor rs = rng_state.cpu();
    p.seed = uint64_t(rs.data_ptr<int64_t>()[0]);
    p.offset = uint64_t(rs.data_ptr<int64_t>()[1]);
  }
  p.out = const_cast<void*>(o.data_ptr());
  p.o_sb = o.stride(0), p.o_sh = o.stride(1), p.o_sl = o.stride(2);
  p.lse = const_cast<float*>(logsumexp.data_ptr<float>());
  p.lse_sb = logsumexp.stride(0), p.lse_sh = logsumexp.stride(1), p.lse_sl = logsumexp.stride(2);
  p.dout = dO.data_ptr();
  p.do_sb = dO.stride(0), p.do_sh = dO.stride(1), p.do_sl = dO.stride(2);
  p.dq = dq.data_ptr();
  p.dq_sb = dq.stride(0), p.dq_sh = dq.stride(1), p.dq_sl = dq.stride(2);
  p.dk = dk.data_ptr();
  p.dk_sb = dk.stride(0), p.dk_sh = dk.stride(1), p.dk_sl = dk.stride(2);
  p.dv = dv.data_ptr();
  p.dv_sb = dv.stride(0), p.dv_sh = dv.stride(1), p.dv_sl = dv.stride(2);
  p.delta = delta.data_ptr<float>();
  p.bq_override = g_blocks[2], p.bk_override = g_blocks[3];

  if (q.numel() > 0) {
    run_phase(p, Phase::BwdDelta);
    // Two strategies with bit-identical results (the same tiles, accumulated in the same order),
    // so picking one by thread count keeps gradients independent of the thread count.
    const cpu::Isa isa = cpu::selected_isa(p.dtype);
    const CpuTier& tier = cpu::selected_tier(p.dtype);
    const PhasePlan fused = tier.plan(p, Phase::BwdFused);
    const auto strategy = BwdStrategy(g_bwd_strategy.load(std::memory_order_relaxed));
    const bool use_fused = strategy == BwdStrategy::Fused ||
                           (strategy == BwdStrategy::Auto && fused_backward_pays(fused.n_items));
    if (use_fused) {
      c10::DataPtr dq_acc = c10::GetCPUAllocator()->allocate(fused.shared_bytes);
      p.dq_acc = static_cast<float*>(dq_acc.get());
      run_planned_phase(p, Phase::BwdFused, isa, tier, fused);
    } else {
      run_phase(p, Phase::BwdDq);  // Lk == 0 gives dq = 0
      run_phase(p, Phase::BwdDkDv);
    }
  } else {  // no query rows: nothing flows back
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  return {dq, dk, dv};
}

}  // namespace flashsdpa

TORCH_LIBRARY(flashsdpa, m) {
  m.def(
      "flash_attn_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0., bool is_causal=False, *, float? scale=None) "
      "-> (Tensor output, Tensor logsumexp, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "flash_attn_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor rng_state, Tensor? attn_mask=None, float dropout_p=0., "
      "bool is_causal=False, *, float? scale=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // The direct API (a CompositeImplicitAutograd kernel in routing.cpp): same contract as
  // aten::scaled_dot_product_attention.
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0., "
      "bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor",
      {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(flashsdpa, CPU, m) {
  m.impl("flash_attn_fwd", &flashsdpa::flash_attn_fwd_cpu);
  m.impl("flash_attn_bwd", &flashsdpa::flash_attn_bwd_cpu);
}
