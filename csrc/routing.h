// The SDPA routing decision shared by the direct API, the F.scaled_dot_product_attention
// overrides that flashsdpa.enable() installs, and explain().
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace flashsdpa {

// Raises (ValueError, naming the argument) for input no SDPA implementation accepts; accepts
// everything F.scaled_dot_product_attention accepts.
void check_sdpa_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double dropout_p,
                     c10::optional<double> scale, bool enable_gqa);
bool valid_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool enable_gqa);

// Why flashsdpa's CPU kernel cannot take a valid call (empty: it can).
std::vector<std::string> decline_reasons(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v,
                                         const c10::optional<at::Tensor>& mask,
                                         double dropout_p, bool enable_gqa);
std::string decline_reason(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& mask, double dropout_p,
                           bool enable_gqa);

// flashsdpa::sdpa: the direct API. flashsdpa's kernel where it can, PyTorch's SDPA otherwise.
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                c10::optional<double> scale, bool enable_gqa);

// Install / remove the aten overrides. Idempotent and thread-safe.
void routing_enable();
void routing_disable();
// Send SDPA calls on this device type ("xpu"; "" for none) to
// aten::_scaled_dot_product_fused_attention_overrideable while routing is enabled.
void set_overrideable_route(const std::string& device);
bool routing_enabled();

// Called once per distinct fallback reason (the Python side logs it at DEBUG).
using FallbackSink = void (*)(const std::string& reason);
void set_fallback_sink(FallbackSink sink);
void reset_fallback_notes();

}  // namespace flashsdpa
