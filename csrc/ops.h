// Entry points shared by ops.cpp (op registration) and module.cpp (Python bindings).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace flashsdpa {

using FwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
    double, bool, c10::optional<double>);
using BwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, double, bool,
    c10::optional<double>);

// q: [B, Hq, Lq, D], k: [B, Hkv, Lk, D], v: [B, Hkv, Lk, Dv] ->
// (out [B, Hq, Lq, Dv] laid out like query, logsumexp [B, Hq, Lq] fp32, rng_state int64[2])
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    c10::optional<double> scale);

// -> (grad_query, grad_key, grad_value), each (B, H, L, D) viewed on a (B, L, H, D) buffer
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attn_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& rng_state, const c10::optional<at::Tensor>& attn_mask, double dropout_p,
    bool is_causal, c10::optional<double> scale);

at::Tensor output_like_query(const at::Tensor& q, int64_t Dv);

// The kernel policy and first profiler event (driver.h, forward_event) of a forward call with
// these 4-D inputs, without running or recording it: explain().
struct KernelPolicy;
std::pair<KernelPolicy, std::string> forward_plan(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v,
                                                  const c10::optional<at::Tensor>& mask,
                                                  double dropout_p, bool is_causal,
                                                  c10::optional<double> scale);

}  // namespace flashsdpa
