// flashsdpa's op schemas and CPU kernels' entry points: input checks, outputs, AttnParams; the
// plan (plan.cpp) and the parallel driver (driver.cpp) do the rest. Compiled once, without ISA
// flags; the kernels live in csrc/cpu/tier.cpp's builds.
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "driver.h"
#include "plan.h"
#include "routing.h"

namespace flashsdpa {

namespace {

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

// Last-dim stride 1 is what the kernels read; anything else is copied once (O(L) memory).
at::Tensor last_dim_unit_stride(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

// The ops' inputs. The SDPA rules themselves are the direct API's (routing.cpp: one validation,
// ValueError naming the argument); on top of them the ops take only what routing hands the
// kernels (RuntimeError): 4-D CPU tensors in a kernel dtype, key / value batch already
// broadcast, dropout below 1, head dims the kernels index with 32-bit ints.
void check_op_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double dropout_p,
                     FLASHSDPA_VARIANT_PARAMS) {
  const char* names[3] = {"query", "key", "value"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(ts[i]->dim() == 4, "flashsdpa: ", names[i],
                " must be 4-D (batch, heads, seq_len, head_dim), got ", ts[i]->dim(), "-D");
  check_sdpa_args(Call{q, k, v, mask, dropout_p, false, c10::nullopt, /*enable_gqa=*/true,
                       window_left, window_right, bottom_right, softcap, &alibi_slopes, &sinks});
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "flashsdpa: query.dtype must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  (!mask.has_value() || !mask->defined() || mask->device().is_cpu()),
              "flashsdpa: the CPU kernel needs its tensors on the CPU, got ", q.device(), ", ",
              k.device(), ", ", v.device());
  const bool kv_batch1 = k.size(0) == 1 && v.size(0) == 1;  // (read by every batch)
  for (int i = 1; i < 3; ++i)
    TORCH_CHECK(ts[i]->size(0) == q.size(0) || kv_batch1, "flashsdpa: ", names[i],
                " batch size (", ts[i]->size(0), ") must match query batch size (", q.size(0),
                "), or key and value must both have batch size 1");
  TORCH_CHECK(dropout_p < 1.0, "flashsdpa: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK(q.size(3) > 0 && q.size(3) <= kMaxHeadDim && v.size(3) > 0 &&
                  v.size(3) <= kMaxHeadDim,
              "flashsdpa: head dims must be in [1, ", kMaxHeadDim, "], got query ", q.size(3),
              ", value ", v.size(3));
}

// The mask as a (B, Hq, Lq, Lk) view (stride 0 on broadcast dims), never a copy.
at::Tensor mask_4d(const at::Tensor& m, const at::Tensor& q, int64_t Lk) {
  return m.expand({q.size(0), q.size(1), q.size(2), Lk});
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


// What the kernels read of the variants: the slopes and sinks as contiguous fp32 (CPU) tensors,
// kept alive by the caller for the call.
struct VariantTensors {
  at::Tensor alibi, sinks;
  VariantTensors(const c10::optional<at::Tensor>& alibi_slopes,
                 const c10::optional<at::Tensor>& sinks_) {
    if (alibi_slopes.has_value() && alibi_slopes->defined()) alibi = alibi_slopes->contiguous();
    if (sinks_.has_value() && sinks_->defined()) sinks = sinks_->contiguous();
  }
};

void fill_variants(AttnParams& p, int64_t window_left, int64_t window_right, bool bottom_right,
                   double softcap, const VariantTensors& vt, bool lse_neg_inf) {
  p.win_left = window_left;
  p.win_right = window_right;
  p.diag = bottom_right ? p.Lk - p.Lq : 0;
  p.softcap = float(softcap);
  if (vt.alibi.defined()) {
    p.alibi = vt.alibi.data_ptr<float>();
    p.alibi_sb = vt.alibi.dim() == 2 ? p.Hq : 0;  // (B, H) or (H,) slopes
    p.alibi_sh = 1;
  }
  if (vt.sinks.defined()) p.sinks = vt.sinks.data_ptr<float>();
  p.lse_empty = lse_neg_inf ? -std::numeric_limits<float>::infinity() : 0.0f;
}

// The softmax stats (params.h) of a forward whose logsumexp is `lse`: lse's shape and layout
// with a trailing (hi, lo, shift) triple (AttnParams::StatsSlot).
constexpr int64_t kStatsPerRow = AttnParams::kStatsPerRow;
at::Tensor stats_like(const at::Tensor& lse) {
  std::vector<int64_t> sizes = lse.sizes().vec(), strides;
  for (const int64_t st : lse.strides()) strides.push_back(kStatsPerRow * st);
  sizes.push_back(kStatsPerRow);
  strides.push_back(1);
  return at::empty_strided(sizes, strides, lse.options());
}

// A backward's softmax_stats: undefined when not given, else the forward's (checked).
at::Tensor checked_stats(const c10::optional<at::Tensor>& stats, const at::Tensor& lse) {
  if (!stats.has_value() || !stats->defined()) return at::Tensor();
  std::vector<int64_t> want = lse.sizes().vec();
  want.push_back(kStatsPerRow);
  TORCH_CHECK(stats->scalar_type() == at::kFloat && stats->sizes() == want,
              "flashsdpa: softmax_stats must be the forward's: float32 of shape ", want, ", got ",
              stats->scalar_type(), " ", stats->sizes());
  return last_dim_unit_stride(*stats);
}

void check_rng_state(const at::Tensor& rng_state) {
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
              "flashsdpa: rng_state must be the int64[2] (seed, offset) the forward returned");
}

// A backward's sinks gradient (fp32 (Hq,), zeros; (0,) without sinks), pointed to by p, and the
// forward's dropout stream (rng_state: seed, offset) when there is dropout.
at::Tensor fill_backward(AttnParams& p, const VariantTensors& vt, int64_t Hq, const at::Tensor& q,
                         double dropout_p, const at::Tensor& rng_state) {
  at::Tensor dsinks = at::zeros({vt.sinks.defined() ? Hq : 0}, q.options().dtype(at::kFloat));
  p.dsinks = dsinks.data_ptr<float>();
  if (dropout_p > 0.0) {
    const at::Tensor rs = rng_state.cpu();
    p.seed = uint64_t(rs.data_ptr<int64_t>()[0]);
    p.offset = uint64_t(rs.data_ptr<int64_t>()[1]);
  }
  return dsinks;
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

// The SDPA ops' key and value of batch 1 against a larger query batch (check_op_inputs: both
// or neither; routing's to_4d leaves them so): read by every batch at batch stride 0, their
// gradients summed over the batch (AttnParams::kv_batch1). Not fill_common's: a paged cache's
// first dim counts blocks.
void set_kv_batch1(AttnParams& p, const at::Tensor& k) {
  p.kv_batch1 = p.B > 1 && k.size(0) == 1;
  if (p.kv_batch1) p.k_sb = p.v_sb = 0;
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

at::Tensor output_like_query(const at::Tensor& q, int64_t Dv) {
  // Like PyTorch's own kernel: the output takes the memory format of query (empty_like), e.g. a
  // (B, L, H, D) buffer viewed as (B, H, L, D) gives the same layout back.
  if (Dv == q.size(3)) {
    at::Tensor o = at::empty_like(q, at::MemoryFormat::Preserve);
    if (o.size(3) <= 1 || o.stride(3) == 1) return o;
  }
  return at::empty({q.size(0), q.size(1), q.size(2), Dv}, q.options());
}

namespace {
thread_local bool t_for_backward = false;
}  // namespace

ForBackwardScope::ForBackwardScope(bool on) : prev_(t_for_backward) { t_for_backward = on; }
ForBackwardScope::~ForBackwardScope() { t_for_backward = prev_; }

bool needs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& sinks) {
  const bool grads = q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                     (sinks.has_value() && sinks->defined() && sinks->requires_grad());
  return grads && (t_for_backward || at::GradMode::is_enabled());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    c10::optional<double> scale, FLASHSDPA_VARIANT_PARAMS, bool lse_neg_inf) {
  check_op_inputs(query, key, value, attn_mask, dropout_p, FLASHSDPA_VARIANT_ARGS);
  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  c10::optional<at::Tensor> mask4;
  if (attn_mask.has_value() && attn_mask->defined()) mask4 = mask_4d(*attn_mask, q, k.size(2));

  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  at::Tensor out = output_like_query(query, v.size(3));
  at::Tensor lse = at::empty({B, Lq, Hq}, q.options().dtype(at::kFloat)).transpose(1, 2);
  at::Tensor stats = stats_like(lse);
  at::Tensor rng = at::zeros({2}, q.options().dtype(at::kLong));
  poison(out);
  poison(lse);
  poison(stats);

  AttnParams p;
  fill_common(p, q, k, v, mask4, dropout_p, is_causal, scale);
  set_kv_batch1(p, k);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(p, window_left, window_right, bottom_right, softcap, vt, lse_neg_inf);
  if (dropout_p > 0.0) {
    draw_dropout_seed(p);
    auto* r = rng.data_ptr<int64_t>();
    r[0] = int64_t(p.seed);
    r[1] = int64_t(p.offset);
  }
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sh = out.stride(1), p.o_sl = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.lse_sb = lse.stride(0), p.lse_sh = lse.stride(1), p.lse_sl = lse.stride(2);
  p.stats = stats.data_ptr<float>();
  p.st_sb = stats.stride(0), p.st_sh = stats.stride(1), p.st_sl = stats.stride(2);
  const KernelPolicy pol = plan_forward(p, true, needs_backward(query, key, value, sinks));
  if (out.numel() > 0) run_forward(p, pol);
  return {out, lse, rng, stats};
}

std::pair<KernelPolicy, std::string> forward_plan(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v,
                                                  const c10::optional<at::Tensor>& mask,
                                                  double dropout_p, bool is_causal,
                                                  c10::optional<double> scale,
                                                  FLASHSDPA_VARIANT_PARAMS) {
  c10::optional<at::Tensor> mask4;
  if (mask.has_value() && mask->defined()) mask4 = mask_4d(*mask, q, k.size(2));
  AttnParams p;
  fill_common(p, last_dim_unit_stride(q), last_dim_unit_stride(k), last_dim_unit_stride(v),
              mask4, dropout_p, is_causal, scale);
  set_kv_batch1(p, k);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(p, window_left, window_right, bottom_right, softcap, vt, false);
  const KernelPolicy pol = plan_forward(p, /*record=*/false, needs_backward(q, k, v, sinks));
  return {pol, forward_event(pol, p.dtype)};
}

namespace {
// The gradient of a (B, H, L, D) input: in the input's own layout where that is dense (a
// contiguous leaf's .grad then takes it without a copy; a transposed (B, L, H, D) projection's
// view gets that buffer back), otherwise (B, H, L, D) viewed on a (B, L, H, D) buffer, PyTorch's
// CPU gradient layout.
at::Tensor grad_like(const at::Tensor& x) {
  if (x.is_non_overlapping_and_dense()) return at::empty_like(x, at::MemoryFormat::Preserve);
  return at::empty_permuted(x.sizes(), {0, 2, 1, 3}, x.options());
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const c10::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, c10::optional<double> scale, FLASHSDPA_VARIANT_PARAMS,
    const c10::optional<at::Tensor>& softmax_stats) {
  check_op_inputs(query, key, value, attn_mask, dropout_p, FLASHSDPA_VARIANT_ARGS);
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
  check_rng_state(rng_state);
  const at::Tensor stats = checked_stats(softmax_stats, logsumexp);

  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  const at::Tensor o = last_dim_unit_stride(out);
  const at::Tensor dO = last_dim_unit_stride(grad_out);
  c10::optional<at::Tensor> mask4;
  if (attn_mask.has_value() && attn_mask->defined()) mask4 = mask_4d(*attn_mask, q, k.size(2));

  at::Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  at::Tensor delta = at::empty({B, Hq, Lq}, q.options().dtype(at::kFloat));
  poison(dq);
  poison(dk);
  poison(dv);
  poison(delta);

  AttnParams p;
  fill_common(p, q, k, v, mask4, dropout_p, is_causal, scale);
  set_kv_batch1(p, k);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(p, window_left, window_right, bottom_right, softcap, vt, false);
  const at::Tensor dsinks = fill_backward(p, vt, Hq, q, dropout_p, rng_state);
  p.out = const_cast<void*>(o.data_ptr());
  p.o_sb = o.stride(0), p.o_sh = o.stride(1), p.o_sl = o.stride(2);
  p.lse = const_cast<float*>(logsumexp.data_ptr<float>());
  p.lse_sb = logsumexp.stride(0), p.lse_sh = logsumexp.stride(1), p.lse_sl = logsumexp.stride(2);
  if (stats.defined()) {
    p.stats = const_cast<float*>(stats.data_ptr<float>());
    p.st_sb = stats.stride(0), p.st_sh = stats.stride(1), p.st_sl = stats.stride(2);
  }
  p.dout = dO.data_ptr();
  p.do_sb = dO.stride(0), p.do_sh = dO.stride(1), p.do_sl = dO.stride(2);
  p.dq = dq.data_ptr();
  p.dq_sb = dq.stride(0), p.dq_sh = dq.stride(1), p.dq_sl = dq.stride(2);
  p.dk = dk.data_ptr();
  p.dk_sb = dk.stride(0), p.dk_sh = dk.stride(1), p.dk_sl = dk.stride(2);
  p.dv = dv.data_ptr();
  p.dv_sb = dv.stride(0), p.dv_sh = dv.stride(1), p.dv_sl = dv.stride(2);
  p.delta = delta.data_ptr<float>();

  const KernelPolicy pol = plan_backward(p);
  if (q.numel() > 0) {
    run_backward(p, pol);
  } else {  // no query rows: nothing flows back
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  return {dq, dk, dv, dsinks};
}

// ---- packed variable-length batches ----------------------------------------------------------------
namespace {

// A packed batch: sequence s has the query rows [cu_q[s], cu_q[s + 1]) of q (total_q, Hq, D)
// and the key rows [cu_k[s], cu_k[s + 1]) of k / v (total_k, Hkv, D[v]).
struct Varlen {
  std::vector<int32_t> cu_q, cu_k;
  int64_t batch() const { return int64_t(cu_q.size()) - 1; }
  int64_t len_q(int64_t s) const { return cu_q[s + 1] - cu_q[s]; }
  int64_t len_k(int64_t s) const { return cu_k[s + 1] - cu_k[s]; }
};

constexpr const char* kVarlen = "flashsdpa.flash_attn_varlen_func: ";

std::vector<int32_t> prefix_sums(const at::Tensor& cu, const char* name, int64_t rows,
                                 const char* rows_of, int64_t max_len, const char* max_name) {
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 1, kVarlen,
                    name, " must be a 1-D int32 tensor of batch + 1 prefix sums, got ",
                    cu.scalar_type(), " of shape ", cu.sizes());
  TORCH_CHECK_VALUE(cu.device().is_cpu(), kVarlen, name, " must be on the CPU with q, got ",
                    cu.device());
  const at::Tensor c = cu.contiguous();
  const int32_t* d = c.data_ptr<int32_t>();
  std::vector<int32_t> out(d, d + c.numel());
  TORCH_CHECK_VALUE(out[0] == 0, kVarlen, name, "[0] must be 0, got ", out[0]);
  int64_t longest = 0;
  for (size_t s = 0; s + 1 < out.size(); ++s) {
    TORCH_CHECK_VALUE(out[s + 1] >= out[s], kVarlen, name, " must be non-decreasing, but ", name,
                      "[", s + 1, "] = ", out[s + 1], " < ", name, "[", s, "] = ", out[s]);
    longest = std::max<int64_t>(longest, out[s + 1] - out[s]);
  }
  TORCH_CHECK_VALUE(out.back() == rows, kVarlen, name, "[-1] must be the number of rows of ",
                    rows_of, " (", rows, "), got ", out.back());
  TORCH_CHECK_VALUE(longest <= max_len, kVarlen, max_name, " (", max_len,
                    ") must be at least the longest sequence in ", name, " (", longest, ")");
  return out;
}

}  // namespace

void check_varlen_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                         int64_t max_seqlen_q, int64_t max_seqlen_k, std::vector<int32_t>* cu_q,
                         std::vector<int32_t>* cu_k) {
  const char* names[3] = {"q", "k", "v"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK_VALUE(ts[i]->dim() == 3, kVarlen, names[i],
                      " must be 3-D (total_tokens, heads, head_dim), got ", ts[i]->dim(), "-D");
  TORCH_CHECK_VALUE(v.size(0) == k.size(0), kVarlen, "v must have as many rows as k (", k.size(0),
                    "), got ", v.size(0));
  *cu_q = prefix_sums(cu_seqlens_q, "cu_seqlens_q", q.size(0), "q", max_seqlen_q, "max_seqlen_q");
  *cu_k = prefix_sums(cu_seqlens_k, "cu_seqlens_k", k.size(0), "k", max_seqlen_k, "max_seqlen_k");
  TORCH_CHECK_VALUE(cu_k->size() == cu_q->size(), kVarlen,
                    "cu_seqlens_k must have as many entries as cu_seqlens_q (", cu_q->size(),
                    "), got ", cu_k->size());
}

namespace {

// The checks of a varlen call: the layout (check_varlen_layout) and, on the (batch, H, 0, D)
// shape of the padded batch, which holds no data, the ops' own checks.
Varlen check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
                    FLASHSDPA_VARIANT_PARAMS) {
  Varlen vl;
  check_varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, &vl.cu_q,
                      &vl.cu_k);
  const int64_t B = vl.batch();
  const auto padded = [&](const at::Tensor& t) {
    return at::empty({B, t.size(1), 0, t.size(2)}, t.options());
  };
  check_op_inputs(padded(q), padded(k), padded(v), c10::nullopt, dropout_p,
                  FLASHSDPA_VARIANT_ARGS);
  return vl;
}

// (1, H, total, D) views of the packed tensors: fill_common's shape, B = 1 and L = total rows.
at::Tensor as_4d(const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); }

const char* element_at(const void* base, int64_t row, int64_t row_stride, int64_t esize) {
  return static_cast<const char*>(base) + row * row_stride * esize;
}

// Sequence s of a packed call as one segment (driver.h): B = 1, its lengths, its rows, its
// bottom-right diagonal, its ALiBi slopes, and its own dropout stream (offset + s).
AttnParams segment(const AttnParams& base, const Varlen& vl, int64_t s, int64_t esize) {
  AttnParams p = base;
  const int64_t q0 = vl.cu_q[s], k0 = vl.cu_k[s];
  p.Lq = vl.len_q(s);
  p.Lk = vl.len_k(s);
  p.diag = p.Lk - p.Lq;
  p.q = element_at(base.q, q0, base.q_sl, esize);
  p.k = element_at(base.k, k0, base.k_sl, esize);
  p.v = element_at(base.v, k0, base.v_sl, esize);
  p.out = const_cast<char*>(element_at(base.out, q0, base.o_sl, esize));
  p.lse = base.lse + q0 * base.lse_sl;
  if (base.stats) p.stats = base.stats + q0 * base.st_sl;
  if (base.alibi && base.alibi_sb) p.alibi = base.alibi + s * base.alibi_sb, p.alibi_sb = 0;
  p.offset = base.offset + uint64_t(s);
  if (base.dout) {  // backward
    p.dout = element_at(base.dout, q0, base.do_sl, esize);
    p.dq = const_cast<char*>(element_at(base.dq, q0, base.dq_sl, esize));
    p.dk = const_cast<char*>(element_at(base.dk, k0, base.dk_sl, esize));
    p.dv = const_cast<char*>(element_at(base.dv, k0, base.dv_sl, esize));
    p.delta = base.delta + q0 * base.Hq;  // contiguous (Hq, Lq) per segment
  }
  return p;
}

// What a call of many segments is planned for: its largest segment (the bulk of the work), with
// the longest query length of all (so that a path chosen for short queries suits every segment).
AttnParams largest(const std::vector<AttnParams>& seg) {
  size_t best = 0;
  int64_t lq = 0;
  for (size_t s = 0; s < seg.size(); ++s) {
    if (seg[s].Lq * seg[s].Lk > seg[best].Lq * seg[best].Lk) best = s;
    lq = std::max(lq, seg[s].Lq);
  }
  AttnParams p = seg[best];
  p.Lq = lq;
  return p;
}


}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_varlen_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    FLASHSDPA_VARLEN_PARAMS) {
  const bool bottom_right = true;
  const Varlen vl = check_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dropout_p, FLASHSDPA_VARIANT_ARGS);
  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  const int64_t total_q = q.size(0), Hq = q.size(1);
  at::Tensor out = at::empty({total_q, Hq, v.size(2)}, q.options());
  at::Tensor lse = at::empty({Hq, total_q}, q.options().dtype(at::kFloat));
  at::Tensor stats = stats_like(lse);
  at::Tensor rng = at::zeros({2}, q.options().dtype(at::kLong));
  poison(out);
  poison(lse);
  poison(stats);

  AttnParams base;
  fill_common(base, as_4d(q), as_4d(k), as_4d(v), c10::nullopt, dropout_p, causal,
              softmax_scale);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(base, window_left, window_right, bottom_right, softcap, vt, /*lse_neg_inf=*/true);
  if (dropout_p > 0.0) {
    draw_dropout_seed(base);
    rng.data_ptr<int64_t>()[0] = int64_t(base.seed);
    rng.data_ptr<int64_t>()[1] = int64_t(base.offset);
  }
  base.out = out.data_ptr();
  base.o_sh = out.stride(1), base.o_sl = out.stride(0);
  base.lse = lse.data_ptr<float>();
  base.lse_sh = lse.stride(0), base.lse_sl = 1;
  base.stats = stats.data_ptr<float>();
  base.st_sh = stats.stride(0), base.st_sl = stats.stride(1);

  std::vector<AttnParams> seg;
  for (int64_t s = 0; s < vl.batch(); ++s) {
    if (vl.len_q(s) == 0) continue;
    if (vl.len_k(s) == 0) {  // rows that see no key: 0, lse the sink's score or -inf
      out.narrow(0, vl.cu_q[s], vl.len_q(s)).zero_();
      at::Tensor l = lse.narrow(1, vl.cu_q[s], vl.len_q(s));
      at::Tensor st = stats.narrow(1, vl.cu_q[s], vl.len_q(s));  // (log2(e) sink or -inf, 0, 0)
      if (vt.sinks.defined())
        l.copy_(vt.sinks.view({Hq, 1}).expand_as(l));
      else
        l.fill_(-std::numeric_limits<float>::infinity());
      st.select(2, AttnParams::kStatHi).copy_(l * float(M_LOG2E));
      st.select(2, AttnParams::kStatLo).zero_();
      st.select(2, AttnParams::kStatShift).zero_();
      continue;
    }
    seg.push_back(segment(base, vl, s, q.element_size()));
  }
  if (!seg.empty()) {
    const KernelPolicy pol =
        plan_forward(largest(seg), true, needs_backward(query, key, value, sinks));
    run_forward_segments(seg.data(), int64_t(seg.size()), pol);
  }
  return {out, lse, rng, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_varlen_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, FLASHSDPA_VARLEN_PARAMS,
    const c10::optional<at::Tensor>& softmax_stats) {
  const bool bottom_right = true;
  const Varlen vl = check_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dropout_p, FLASHSDPA_VARIANT_ARGS);
  const int64_t total_q = query.size(0), Hq = query.size(1);
  const std::vector<int64_t> o_shape{total_q, Hq, value.size(2)};
  TORCH_CHECK(grad_out.sizes() == o_shape && out.sizes() == o_shape, "flashsdpa: grad_out and "
              "out must have shape ", o_shape, ", got ", grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "flashsdpa: grad_out and out must have q's dtype (", query.scalar_type(), ")");
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && logsumexp.dim() == 2 &&
                  logsumexp.size(0) == Hq && logsumexp.size(1) == total_q,
              "flashsdpa: logsumexp must be float32 of shape (", Hq, ", ", total_q, "), got ",
              logsumexp.scalar_type(), " ", logsumexp.sizes());
  check_rng_state(rng_state);
  const at::Tensor q = last_dim_unit_stride(query);
  const at::Tensor k = last_dim_unit_stride(key);
  const at::Tensor v = last_dim_unit_stride(value);
  const at::Tensor o = last_dim_unit_stride(out);
  const at::Tensor dO = last_dim_unit_stride(grad_out);
  const at::Tensor lse = logsumexp.stride(1) == 1 ? logsumexp : logsumexp.contiguous();
  const at::Tensor stats = checked_stats(softmax_stats, logsumexp);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty({total_q * Hq}, q.options().dtype(at::kFloat));
  poison(dq);
  poison(dk);
  poison(dv);
  poison(delta);

  AttnParams base;
  fill_common(base, as_4d(q), as_4d(k), as_4d(v), c10::nullopt, dropout_p, causal,
              softmax_scale);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(base, window_left, window_right, bottom_right, softcap, vt, false);
  const at::Tensor dsinks = fill_backward(base, vt, Hq, q, dropout_p, rng_state);
  base.out = const_cast<void*>(o.data_ptr());
  base.o_sh = o.stride(1), base.o_sl = o.stride(0);
  base.lse = const_cast<float*>(lse.data_ptr<float>());
  base.lse_sh = lse.stride(0), base.lse_sl = 1;
  if (stats.defined()) {
    base.stats = const_cast<float*>(stats.data_ptr<float>());
    base.st_sh = stats.stride(0), base.st_sl = stats.stride(1);
  }
  base.dout = dO.data_ptr();
  base.do_sh = dO.stride(1), base.do_sl = dO.stride(0);
  base.dq = dq.data_ptr();
  base.dq_sh = dq.stride(1), base.dq_sl = dq.stride(0);
  base.dk = dk.data_ptr();
  base.dk_sh = dk.stride(1), base.dk_sl = dk.stride(0);
  base.dv = dv.data_ptr();
  base.dv_sh = dv.stride(1), base.dv_sl = dv.stride(0);
  base.delta = delta.data_ptr<float>();

  std::vector<AttnParams> seg;
  for (int64_t s = 0; s < vl.batch(); ++s) {
    if (vl.len_q(s) == 0 || vl.len_k(s) == 0) {  // nothing flows between q and k rows
      dq.narrow(0, vl.cu_q[s], vl.len_q(s)).zero_();
      dk.narrow(0, vl.cu_k[s], vl.len_k(s)).zero_();
      dv.narrow(0, vl.cu_k[s], vl.len_k(s)).zero_();
      continue;
    }
    seg.push_back(segment(base, vl, s, q.element_size()));
  }
  if (!seg.empty()) run_backward_segments(seg.data(), int64_t(seg.size()), plan_backward(largest(seg)));
  return {dq, dk, dv, dsinks};
}

// ---- attention over a KV cache ----------------------------------------------------------------------
namespace {

constexpr const char* kKvcache = "flashsdpa.flash_attn_with_kvcache: ";

// What a KV-cache call reads: per sequence b, its keys so far (seqlen[b], the new ones included)
// and, paged, its row of the block table.
struct KvCache {
  bool paged = false;
  bool e4m3 = false;            // float8_e4m3fn cache
  at::Tensor k_scale, v_scale;  // e4m3: float32, one element or one per kv head, contiguous
  int64_t page = 0, capacity = 0, n_new = 0;
  std::vector<int64_t> seqlen;  // keys per sequence after the append
  at::Tensor table;             // paged: int32 (B, max_blocks), contiguous
};

KvCache check_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const c10::optional<at::Tensor>& k_new,
                      const c10::optional<at::Tensor>& v_new,
                      const c10::optional<at::Tensor>& cache_seqlens,
                      const c10::optional<at::Tensor>& block_table,
                      const c10::optional<at::Tensor>& k_scale,
                      const c10::optional<at::Tensor>& v_scale) {
  const char* names[3] = {"q", "k_cache", "v_cache"};
  const at::Tensor* ts[3] = {&q, &k_cache, &v_cache};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK_VALUE(ts[i]->dim() == 4, kKvcache, names[i], " must be 4-D, got ", ts[i]->dim(),
                      "-D");
  const int64_t B = q.size(0), Hkv = k_cache.size(2);
  KvCache c;
  c.paged = block_table.has_value() && block_table->defined();
  TORCH_CHECK_VALUE(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                        v_cache.size(2) == Hkv,
                    kKvcache, "v_cache must match k_cache in its first three dims ",
                    k_cache.sizes().slice(0, 3), ", got ", v_cache.sizes());
  c.e4m3 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE((k_cache.scalar_type() == q.scalar_type() || c.e4m3) &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    kKvcache, "k_cache and v_cache must both have q's dtype (", q.scalar_type(),
                    ") or both be float8_e4m3fn, got ", k_cache.scalar_type(), " and ",
                    v_cache.scalar_type());
  const char* scale_names[2] = {"k_scale", "v_scale"};
  const c10::optional<at::Tensor>* scales[2] = {&k_scale, &v_scale};
  for (int i = 0; i < 2; ++i) {
    const c10::optional<at::Tensor>& sc = *scales[i];
    if (!sc.has_value() || !sc->defined()) {  // a float8 cache without a scale: scale 1
      if (c.e4m3) (i == 0 ? c.k_scale : c.v_scale) = at::ones({1}, q.options().dtype(at::kFloat));
      continue;
    }
    TORCH_CHECK_VALUE(c.e4m3, kKvcache, scale_names[i], " is for float8_e4m3fn caches only (the "
                      "cache is ", k_cache.scalar_type(), ")");
    TORCH_CHECK_VALUE(sc->scalar_type() == at::kFloat && sc->device().is_cpu() &&
                          (sc->numel() == 1 || (sc->dim() == 1 && sc->size(0) == Hkv)),
                      kKvcache, scale_names[i], " must be a float32 CPU tensor with one element or "
                      "one per kv head (", Hkv, ",), got ", sc->scalar_type(), " ", sc->sizes(),
                      " on ", sc->device());
    (i == 0 ? c.k_scale : c.v_scale) = sc->reshape({-1}).contiguous();
  }
  if (c.paged) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == B &&
                          bt.device().is_cpu(),
                      kKvcache, "block_table must be an int32 CPU tensor of shape (batch, "
                      "max_blocks) = (", B, ", ...), got ", bt.scalar_type(), " ", bt.sizes(),
                      " on ", bt.device());
    c.page = k_cache.size(1);
    TORCH_CHECK_VALUE(c.page >= 1, kKvcache, "k_cache's block_size (dim 1) must be >= 1");
    c.capacity = bt.size(1) * c.page;
    c.table = bt.contiguous();
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == B, kKvcache, "k_cache must have q's batch size (", B,
                      ") in dim 0 (or pass block_table for a paged cache), got ", k_cache.size(0));
    c.capacity = k_cache.size(1);
  }
  const bool has_k = k_new.has_value() && k_new->defined();
  const bool has_v = v_new.has_value() && v_new->defined();
  TORCH_CHECK_VALUE(has_k == has_v, kKvcache, "k and v must be given together");
  if (has_k) {
    const at::Tensor &kn = *k_new, &vn = *v_new;
    TORCH_CHECK_VALUE(kn.dim() == 4 && kn.size(0) == B && kn.size(2) == Hkv &&
                          kn.size(3) == k_cache.size(3),
                      kKvcache, "k must be (batch, new tokens, kv heads, head_dim) = (", B,
                      ", n, ", Hkv, ", ", k_cache.size(3), "), got ", kn.sizes());
    TORCH_CHECK_VALUE(vn.dim() == 4 && vn.size(0) == B && vn.size(1) == kn.size(1) &&
                          vn.size(2) == Hkv && vn.size(3) == v_cache.size(3),
                      kKvcache, "v must be (batch, new tokens, kv heads, head_dim_v) = (", B,
                      ", ", kn.size(1), ", ", Hkv, ", ", v_cache.size(3), "), got ", vn.sizes());
    TORCH_CHECK_VALUE(kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(),
                      kKvcache, "k and v must have q's dtype (", q.scalar_type(), "; a float8 "
                      "cache stores them quantised), got ", kn.scalar_type(), " and ",
                      vn.scalar_type());
    c.n_new = kn.size(1);
  }
  c.seqlen.assign(B, c.capacity);
  if (cache_seqlens.has_value() && cache_seqlens->defined()) {
    const at::Tensor& sl = *cache_seqlens;
    TORCH_CHECK_VALUE(sl.scalar_type() == at::kInt && sl.dim() == 1 && sl.size(0) == B &&
                          sl.device().is_cpu(),
                      kKvcache, "cache_seqlens must be an int32 CPU tensor of shape (batch,) = (",
                      B, ",) or an int, got ", sl.scalar_type(), " ", sl.sizes());
    const at::Tensor slc = sl.contiguous();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = slc.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(n >= 0 && n + c.n_new <= c.capacity, kKvcache, "cache_seqlens[", b,
                        "] = ", n, " plus the ", c.n_new, " new tokens must fit the cache (",
                        c.capacity, c.paged ? " = max_blocks * block_size" : " rows", ")");
      c.seqlen[b] = n + c.n_new;
    }
  } else {
    TORCH_CHECK_VALUE(!has_k, kKvcache, "cache_seqlens is needed to append k / v (where the "
                      "new tokens go)");
  }
  if (c.paged) {  // every block a sequence reads (or appends to) is a block of the cache
    const int32_t* bt = c.table.data_ptr<int32_t>();
    const int64_t nb = k_cache.size(0), w = c.table.size(1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < (c.seqlen[b] + c.page - 1) / c.page; ++i)
        TORCH_CHECK_VALUE(bt[b * w + i] >= 0 && bt[b * w + i] < nb, kKvcache, "block_table[", b,
                          ", ", i, "] = ", bt[b * w + i], " is not a block of k_cache (",
                          nb, " blocks)");
  }
  return c;
}

// Rows [n0, n0 + n) of sequence b's cache (its pages when paged) as a list of (page or b, row,
// count) runs of consecutive rows.
template <class Fn>
void cache_runs(const KvCache& c, int64_t b, int64_t n0, int64_t n, Fn&& fn) {
  if (!c.paged) return fn(b, n0, n);
  const int32_t* bt = c.table.data_ptr<int32_t>() + b * c.table.size(1);
  for (int64_t j = n0; j < n0 + n;) {
    const int64_t row = j % c.page, m = std::min(n0 + n - j, c.page - row);
    fn(int64_t(bt[j / c.page]), row, m);
    j += m;
  }
}

// A float8_e4m3fn cache's rows t (L, Hkv, D) in `dtype`, contiguous: stored * scale (scale: one
// element or one per kv head), the product in fp32 rounded once, in one pass over the bytes.
at::Tensor dequantize(const at::Tensor& t, const at::Tensor& scale, at::ScalarType dtype) {
  static const std::vector<float> value = [] {  // every byte's value
    std::vector<float> v(256);
    for (int b = 0; b < 256; ++b)
      v[b] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(b), c10::Float8_e4m3fn::from_bits()));
    return v;
  }();
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  const int64_t L = t.size(0), H = t.size(1), D = t.size(2);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(t.data_ptr());
  const float* sc = scale.data_ptr<float>();
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2), sh = scale.numel() > 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, L * H, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* row = src + (r / H) * s0 + (r % H) * s1;
        const float f = sc[(r % H) * sh];
        for (int64_t d = 0; d < D; ++d) dst[r * D + d] = scalar_t(value[row[d * s2]] * f);
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor quantize_e4m3(const at::Tensor& t, const at::Tensor& scale) {
  return (t.to(at::kFloat) / scale.view({-1, 1})).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn);
}

std::vector<int64_t> kvcache_seqlens(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache,
                                     const c10::optional<at::Tensor>& k_new,
                                     const c10::optional<at::Tensor>& v_new,
                                     const c10::optional<at::Tensor>& cache_seqlens,
                                     const c10::optional<at::Tensor>& block_table,
                                     const c10::optional<at::Tensor>& k_scale,
                                     const c10::optional<at::Tensor>& v_scale) {
  return check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale,
                       v_scale)
      .seqlen;
}

std::tuple<at::Tensor, at::Tensor> flash_attn_with_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
    const c10::optional<at::Tensor>& cache_seqlens, const c10::optional<at::Tensor>& block_table,
    c10::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, const c10::optional<at::Tensor>& alibi_slopes,
    const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale) {
  const bool bottom_right = true;
  const KvCache c = check_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                  k_scale, v_scale);
  const int64_t B = q.size(0), Lq = q.size(1), Hq = q.size(2);
  const at::Tensor q4 = last_dim_unit_stride(q).transpose(1, 2);  // (B, Hq, Lq, D)
  // the kernels' checks (dtype, device, head counts and dims, the variants) on the shape of a
  // contiguous cache, which holds no data
  const auto shaped = [&](const at::Tensor& t) {
    return at::empty({B, t.size(2), 0, t.size(3)}, q.options());
  };
  check_op_inputs(q4, shaped(k_cache), shaped(v_cache), c10::nullopt, 0.0, FLASHSDPA_VARIANT_ARGS);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, kKvcache,
              "k_cache and v_cache must have unit stride in their last dim (written in place)");

  // the append: exactly the new tokens' rows of the cache, in place
  at::Tensor k_in, v_in;  // the new rows in the cache's dtype
  if (c.n_new > 0) {
    k_in = c.e4m3 ? quantize_e4m3(*k_new, c.k_scale) : *k_new;
    v_in = c.e4m3 ? quantize_e4m3(*v_new, c.v_scale) : *v_new;
  }
  for (int64_t b = 0; b < B && c.n_new > 0; ++b) {
    int64_t t = 0;
    cache_runs(c, b, c.seqlen[b] - c.n_new, c.n_new, [&](int64_t page, int64_t row, int64_t m) {
      k_cache[page].narrow(0, row, m).copy_(k_in[b].narrow(0, t, m));
      v_cache[page].narrow(0, row, m).copy_(v_in[b].narrow(0, t, m));
      t += m;
    });
  }

  at::Tensor out = at::empty({B, Lq, Hq, v_cache.size(3)}, q.options());
  at::Tensor lse = at::empty({B, Hq, Lq}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  AttnParams base;
  // (B, Hkv, L, D) views: a contiguous cache per sequence; a paged one per block (k_sb: the
  // block stride)
  fill_common(base, q4, k_cache.transpose(1, 2), v_cache.transpose(1, 2), c10::nullopt, 0.0,
              causal, softmax_scale);
  const VariantTensors vt(alibi_slopes, sinks);
  fill_variants(base, window_left, window_right, bottom_right, softcap, vt, /*lse_neg_inf=*/true);
  base.out = out.data_ptr();
  base.o_sb = out.stride(0), base.o_sh = out.stride(2), base.o_sl = out.stride(1);
  base.lse = lse.data_ptr<float>();
  base.lse_sb = lse.stride(0), base.lse_sh = lse.stride(1), base.lse_sl = lse.stride(2);
  if (c.e4m3) {
    base.kv_e4m3 = true;
    base.k_scale = c.k_scale.data_ptr<float>(), base.k_scale_sh = c.k_scale.numel() > 1;
    base.v_scale = c.v_scale.data_ptr<float>(), base.v_scale_sh = c.v_scale.numel() > 1;
  }
  const int64_t esize = q.element_size(), kv_esize = k_cache.element_size();

  std::vector<AttnParams> seg;
  std::vector<int64_t> seg_b;  // each segment's sequence
  for (int64_t b = 0; b < B; ++b) {
    if (Lq == 0) break;
    if (c.seqlen[b] == 0) {  // rows that see no key: 0, lse the sink's score or -inf
      out[b].zero_();
      if (vt.sinks.defined())
        lse[b].copy_(vt.sinks.view({Hq, 1}).expand({Hq, Lq}));
      else
        lse[b].fill_(-std::numeric_limits<float>::infinity());
      continue;
    }
    AttnParams p = base;
    p.B = 1;
    p.Lk = c.seqlen[b];
    p.diag = p.Lk - p.Lq;
    p.q = element_at(base.q, b, base.q_sb, esize);
    p.out = const_cast<char*>(element_at(base.out, b, base.o_sb, esize));
    p.lse = base.lse + b * base.lse_sb;
    if (base.alibi && base.alibi_sb) p.alibi = base.alibi + b * base.alibi_sb, p.alibi_sb = 0;
    if (c.paged) {
      p.block_table = c.table.data_ptr<int32_t>() + b * c.table.size(1);
      p.page_size = c.page;
      p.k_spage = base.k_sb, p.v_spage = base.v_sb;
    } else {
      p.k = element_at(base.k, b, base.k_sb, kv_esize);
      p.v = element_at(base.v, b, base.v_sb, kv_esize);
    }
    seg.push_back(p);
    seg_b.push_back(b);
  }
  if (seg.empty()) return {out, lse};
  const KernelPolicy pol = plan_forward(largest(seg));
  // Not on the decode path (a long chunk of queries), a paged or float8 cache: each sequence's
  // keys are gathered (and dequantised to q's dtype) into contiguous K / V first, a copy that
  // is small next to the prefill's work.
  std::vector<at::Tensor> gathered;
  if ((c.paged || c.e4m3) && !pol.decode) {
    for (int64_t i = 0; i < int64_t(seg.size()); ++i) {
      AttnParams& p = seg[i];
      const int64_t b = seg_b[i];
      for (int kv = 0; kv < 2; ++kv) {
        const at::Tensor& cache = kv == 0 ? k_cache : v_cache;
        at::Tensor g;  // (Lk, Hkv, D)
        if (c.paged) {
          const int64_t nblocks = (p.Lk + c.page - 1) / c.page;
          const at::Tensor idx = c.table[b].narrow(0, 0, nblocks).to(at::kLong);
          g = cache.index_select(0, idx).flatten(0, 1).narrow(0, 0, p.Lk);
        } else {
          g = cache[b].narrow(0, 0, p.Lk);
        }
        if (c.e4m3) g = dequantize(g, kv == 0 ? c.k_scale : c.v_scale, q.scalar_type());
        gathered.push_back(g);
        (kv == 0 ? p.k : p.v) = g.data_ptr();
        (kv == 0 ? p.k_sh : p.v_sh) = g.stride(1);
        (kv == 0 ? p.k_sl : p.v_sl) = g.stride(0);
      }
      p.block_table = nullptr;
      p.page_size = 0;
      p.kv_e4m3 = false;
    }
  }
  run_forward_segments(seg.data(), int64_t(seg.size()), pol);
  return {out, lse};
}

}  // namespace flashsdpa

TORCH_LIBRARY(flashsdpa, m) {
  m.def(
      "flash_attn_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0., bool is_causal=False, *, float? scale=None, " FLASHSDPA_VARIANT_SCHEMA
      ", bool lse_neg_inf=False) -> (Tensor output, Tensor logsumexp, Tensor rng_state, "
      "Tensor softmax_stats)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "flash_attn_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor rng_state, Tensor? attn_mask=None, float dropout_p=0., "
      "bool is_causal=False, *, float? scale=None, " FLASHSDPA_VARIANT_SCHEMA
      ", Tensor? softmax_stats=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, "
      "Tensor grad_sinks)");
  // The direct API (a CompositeImplicitAutograd kernel in routing.cpp): same contract as
  // aten::scaled_dot_product_attention.
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0., "
      "bool is_causal=False, *, float? scale=None, bool enable_gqa=False, int window_left=-1, "
      "int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None) "
      "-> Tensor",
      {at::Tag::nondeterministic_seeded});
  // flash-attn's layout and alignment: q (B, Lq, H, D), k / v (B, Lk, Hkv, D[v]), bottom-right
  // windows and causal -> (out (B, Lq, H, Dv), logsumexp (B, H, Lq) fp32, -inf for a row that
  // sees nothing). A CompositeImplicitAutograd kernel in routing.cpp.
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, float dropout_p=0., *, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0., "
      "Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor out, Tensor logsumexp)",
      {at::Tag::nondeterministic_seeded});
  // Packed variable-length batches, flash-attn's varlen layout and bottom-right alignment: q
  // (total_q, H, D), k / v (total_k, Hkv, D[v]), cu_seqlens int32 (batch + 1) ->
  // (out (total_q, H, Dv), logsumexp (H, total_q) fp32, -inf for a row that sees nothing,
  // rng_state); autograd in autograd.cpp.
  m.def(
      "flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p=0., *, "
      "float? softmax_scale=None, bool causal=False, " FLASHSDPA_VARLEN_VARIANT_SCHEMA
      ") -> (Tensor out, Tensor logsumexp, Tensor rng_state, Tensor softmax_stats)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "flash_attn_varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor logsumexp, Tensor rng_state, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float dropout_p=0., *, float? softmax_scale=None, "
      "bool causal=False, " FLASHSDPA_VARLEN_VARIANT_SCHEMA
      ", Tensor? softmax_stats=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_sinks)");
  // Attention over a KV cache, flash-attn's flash_attn_with_kvcache: q (B, Lq, H, D); a
  // contiguous cache (B, Lcache, Hkv, D) or a paged one (num_blocks, block_size, Hkv, D) with
  // block_table int32 (B, max_blocks); k / v (B, Lnew, Hkv, D) appended in place at
  // cache_seqlens (int32 (B,)) first -> (out (B, Lq, H, Dv), logsumexp (B, H, Lq) fp32).
  // Bottom-right alignment; no gradient.
  m.def(
      "flash_attn_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, "
      "Tensor? v=None, Tensor? cache_seqlens=None, Tensor? block_table=None, *, "
      "float? softmax_scale=None, bool causal=False, " FLASHSDPA_VARLEN_VARIANT_SCHEMA
      ", Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor out, Tensor logsumexp)");
}

TORCH_LIBRARY_IMPL(flashsdpa, CPU, m) {
  m.impl("flash_attn_fwd", &flashsdpa::flash_attn_fwd_cpu);
  m.impl("flash_attn_bwd", &flashsdpa::flash_attn_bwd_cpu);
  m.impl("flash_attn_varlen_fwd", &flashsdpa::flash_attn_varlen_fwd_cpu);
  m.impl("flash_attn_varlen_bwd", &flashsdpa::flash_attn_varlen_bwd_cpu);
  m.impl("flash_attn_with_kvcache", &flashsdpa::flash_attn_with_kvcache_cpu);
}
