// Entry points shared by ops.cpp (op registration) and module.cpp (Python bindings).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace flashsdpa {

// The ops' trailing keyword arguments: which keys a row sees beyond is_causal (a window, its
// alignment) and the score variants (params.h gives the semantics).
//   window_left / window_right: -1 unbounded; bottom_right: flash-attn's alignment (the queries
//   are the last Lq positions) instead of PyTorch's top-left; softcap 0: none; alibi_slopes
//   fp32 (H,) or (B, H); sinks fp32 (H,), differentiable.
#define FLASHSDPA_VARIANT_PARAMS                                                         \
  int64_t window_left, int64_t window_right, bool bottom_right, double softcap,          \
      const c10::optional<at::Tensor>&alibi_slopes, const c10::optional<at::Tensor>&sinks
#define FLASHSDPA_VARIANT_TYPES \
  int64_t, int64_t, bool, double, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&
#define FLASHSDPA_VARIANT_ARGS window_left, window_right, bottom_right, softcap, alibi_slopes, sinks
#define FLASHSDPA_VARIANT_SCHEMA                                                          \
  "int window_left=-1, int window_right=-1, bool bottom_right=False, float softcap=0., " \
  "Tensor? alibi_slopes=None, Tensor? sinks=None"

// The varlen ops' variants: flash-attn's alignment is implied (no bottom_right).
#define FLASHSDPA_VARLEN_VARIANT_SCHEMA                                               \
  "int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, " \
  "Tensor? sinks=None"
#define FLASHSDPA_VARLEN_PARAMS                                                          \
  const at::Tensor &cu_seqlens_q, const at::Tensor &cu_seqlens_k, int64_t max_seqlen_q, \
      int64_t max_seqlen_k, double dropout_p, c10::optional<double> softmax_scale, bool causal, \
      int64_t window_left, int64_t window_right, double softcap,                        \
      const c10::optional<at::Tensor>&alibi_slopes, const c10::optional<at::Tensor>&sinks
#define FLASHSDPA_VARLEN_TYPES                                                            \
  const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, c10::optional<double>, bool, \
      int64_t, int64_t, double, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&
#define FLASHSDPA_VARLEN_ARGS                                                              \
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, \
      window_left, window_right, softcap, alibi_slopes, sinks

using FwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
    double, bool, c10::optional<double>, FLASHSDPA_VARIANT_TYPES, bool);
using BwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, double, bool,
    c10::optional<double>, FLASHSDPA_VARIANT_TYPES, const c10::optional<at::Tensor>&);

// Whether a backward will follow this thread's forward call: set by the autograd kernels
// (autograd.cpp) around an autograd Function's forward, where GradMode is off, so that the
// forward ops plan for it (plan.h, for_backward).
class ForBackwardScope {
 public:
  explicit ForBackwardScope(bool on);
  ~ForBackwardScope();
  ForBackwardScope(const ForBackwardScope&) = delete;
  ForBackwardScope& operator=(const ForBackwardScope&) = delete;

 private:
  bool prev_;
};
// The inputs need gradients and grad mode is on (the caller's, or a ForBackwardScope's).
bool needs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& sinks);

// q: [B, Hq, Lq, D], k: [B, Hkv, Lk, D], v: [B, Hkv, Lk, Dv] ->
// (out [B, Hq, Lq, Dv] laid out like query, logsumexp [B, Hq, Lq] fp32, rng_state int64[2],
// softmax_stats [B, Hq, Lq, 2] fp32: each row's (m, l), params.h, for the backward).
// The logsumexp of a row that sees no key is 0 (PyTorch's convention), or -inf with lse_neg_inf.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    c10::optional<double> scale, FLASHSDPA_VARIANT_PARAMS, bool lse_neg_inf);

// -> (grad_query, grad_key, grad_value, grad_sinks), the first three (B, H, L, D) viewed on a
// (B, L, H, D) buffer; grad_sinks fp32 (H,), empty without sinks. softmax_stats: the forward's
// (P from them, exact at any logit size), or none (P from logsumexp alone, as PyTorch's fused
// kernel: what aten's autograd formula saves).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const c10::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, c10::optional<double> scale, FLASHSDPA_VARIANT_PARAMS,
    const c10::optional<at::Tensor>& softmax_stats);

using VarlenFwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, FLASHSDPA_VARLEN_TYPES);
using VarlenBwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, FLASHSDPA_VARLEN_TYPES,
    const c10::optional<at::Tensor>&);

// Packed variable-length batches (flash-attn's varlen semantics, bottom-right alignment):
// q (total_q, Hq, D), k / v (total_k, Hkv, D[v]) -> (out (total_q, Hq, Dv) contiguous,
// logsumexp (Hq, total_q) fp32, -inf for a row that sees nothing, rng_state int64[2],
// softmax_stats (Hq, total_q, 2) fp32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_varlen_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    FLASHSDPA_VARLEN_PARAMS);
// -> (grad_q, grad_k, grad_v contiguous like q / k / v, grad_sinks fp32 (H,) or empty)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_varlen_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, FLASHSDPA_VARLEN_PARAMS,
    const c10::optional<at::Tensor>& softmax_stats);

// A varlen call's layout, or a ValueError naming the argument: q, k, v 3-D (total, heads, dim),
// v with k's rows; cu_seqlens_q / _k (CPU int32, batch + 1 prefix sums from 0 to q's / k's rows,
// longest sequence within max_seqlen_q / _k), returned as vectors. Only shapes are read from
// q, k, v (any device).
void check_varlen_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                         int64_t max_seqlen_q, int64_t max_seqlen_k, std::vector<int32_t>* cu_q,
                         std::vector<int32_t>* cu_k);

// flash_attn_with_kvcache's checks of a call (shapes, dtypes, cache_seqlens, block_table and
// the scales, those three given as CPU tensors; the caches' data is never read), or a
// ValueError naming the argument: the keys of each sequence after the append. The Triton path
// (flashsdpa/_gpu.py) checks its calls with it.
std::vector<int64_t> kvcache_seqlens(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache,
                                     const c10::optional<at::Tensor>& k_new,
                                     const c10::optional<at::Tensor>& v_new,
                                     const c10::optional<at::Tensor>& cache_seqlens,
                                     const c10::optional<at::Tensor>& block_table,
                                     const c10::optional<at::Tensor>& k_scale,
                                     const c10::optional<at::Tensor>& v_scale);

// New k / v for a float8_e4m3fn cache (any device): round-to-nearest(value / scale), scale one
// element or one per kv head (t's dim -2), saturated to e4m3's range (+-448) rather than
// PyTorch's cast, which gives NaN out of range; NaN stays NaN.
at::Tensor quantize_e4m3(const at::Tensor& t, const at::Tensor& scale);

at::Tensor output_like_query(const at::Tensor& q, int64_t Dv);

// The kernel policy and first profiler event (driver.h, forward_event) of a forward call with
// these 4-D inputs, without running or recording it: explain().
struct KernelPolicy;
std::pair<KernelPolicy, std::string> forward_plan(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v,
                                                  const c10::optional<at::Tensor>& mask,
                                                  double dropout_p, bool is_causal,
                                                  c10::optional<double> scale,
                                                  FLASHSDPA_VARIANT_PARAMS);

}  // namespace flashsdpa
