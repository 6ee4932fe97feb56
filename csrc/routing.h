// The routing decision: for a scaled_dot_product_attention call, which backend runs it. One
// function, decide(), serves every entry: the direct API (flashsdpa::sdpa, and for GPU tensors
// flashsdpa/_api.py), the aten overrides that flashsdpa.enable() installs (csrc/routing.cpp),
// the XPU route to the Triton kernels, and explain(), which only prints what it returns.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace flashsdpa {

// The arguments of one call, as F.scaled_dot_product_attention takes them, and the variants
// flashsdpa adds (ops.h, FLASHSDPA_VARIANT_PARAMS; null tensor pointers: none given).
struct Call {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const c10::optional<at::Tensor>& mask;
  double dropout_p;
  bool is_causal;
  c10::optional<double> scale;
  bool enable_gqa;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right = false;
  double softcap = 0.0;
  const c10::optional<at::Tensor>* alibi_slopes = nullptr;
  const c10::optional<at::Tensor>* sinks = nullptr;
  bool has_alibi() const { return alibi_slopes && alibi_slopes->has_value() && (*alibi_slopes)->defined(); }
  bool has_sinks() const { return sinks && sinks->has_value() && (*sinks)->defined(); }
  // a variant PyTorch's SDPA cannot express beyond a dense mask (and none at all for softcap
  // and sinks)
  bool variants() const {
    return window_left >= 0 || window_right >= 0 || bottom_right || softcap != 0.0 ||
           has_alibi() || has_sinks();
  }
};

// Where a call comes in.
enum class Entry {
  Direct,        // flashsdpa.scaled_dot_product_attention
  AtenSdpa,      // F.scaled_dot_product_attention under enable() (the CIA override)
  AtenFlashCpu,  // aten::_scaled_dot_product_flash_attention_for_cpu under enable()
};

// Who runs it. The flashsdpa backends declare their limits as data (routing.cpp, kBackends);
// PyTorch's SDPA takes the plain calls they decline, and the variants' math on PyTorch ops
// (math_fallback.cpp) those PyTorch's SDPA cannot express.
enum class Backend { CpuKernel = 0, Triton = 1, PyTorch = 2, Math = 3 };

struct Decision {
  Backend backend = Backend::PyTorch;
  // Not empty: no SDPA implementation accepts the arguments (the direct API raises ValueError
  // with this message; PyTorch reports its own error on the other entries).
  std::string invalid;
  // Why each flashsdpa backend cannot take the call (empty: it can), in kBackends' order.
  std::vector<std::string> reasons[2];
  // The flashsdpa backend for the call's device type (PyTorch: none), whose reasons explain a
  // fallback.
  Backend target = Backend::PyTorch;
  // flashsdpa could have taken the call on this entry but a backend limit sent it to PyTorch
  // (the case the fallback log reports).
  bool declined = false;
  // The path the call takes to the backend: the op called ("flashsdpa::flash_attn_fwd"), or how
  // PyTorch gets it ("PyTorch's SDPA: ...") with the reason flashsdpa stays out.
  std::string via;
};

// The decision for `entry`. AtenSdpa: `routing_on` says whether enable() is in effect (explain()
// asks for the state; the override itself passes true).
Decision decide(const Call& c, Entry entry, bool routing_on = true);

// The name of each backend (kBackends), for explain().
const char* backend_name(Backend b);

// Raises ValueError naming the argument for input no SDPA implementation accepts; accepts
// everything F.scaled_dot_product_attention accepts. The single user-facing validation.
void check_sdpa_args(const Call& c);
// The same rules, as a message ("" when valid).
std::string invalid_argument(const Call& c);

// 3-D (N, L, E) inputs as (N, 1, L, E) (a 3-D mask likewise), a 4-D key/value batch of 1
// broadcast to the query's (stride 0). The C++ home of this reshaping; the Triton path, which
// torch.compile traces in Python, has its twin in flashsdpa/_triton.py (to_4d).
struct Shaped {
  at::Tensor q, k, v;
  c10::optional<at::Tensor> mask;
  bool squeeze;  // the inputs were 3-D: squeeze dim 1 of the output
};
// kv_batch1: key and value of batch 1 against a larger batch stay batch 1 (the CPU kernel
// reads them at batch stride 0 and sums their gradients over the batch in fp32, where an
// expanded view's per-batch gradients would each be rounded to the dtype before autograd sums
// them); otherwise every input is expanded to the call's batch.
Shaped to_4d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const c10::optional<at::Tensor>& mask, bool kv_batch1 = false);

// PyTorch's own choice for a valid call: its aten op name ("aten::_scaled_dot_product_..."),
// the profiler event it records.
std::string pytorch_kernel(const Call& c);

// The variants' semantics (params.h) on PyTorch ops, for calls no flashsdpa kernel takes
// (float64, devices without a variant kernel): 4-D (B, H, L, D) inputs -> (out, logsumexp),
// differentiable through PyTorch's autograd, O(L * S) memory. Profiler event
// "flashsdpa::variants_math".
std::tuple<at::Tensor, at::Tensor> variants_math(const Call& c, bool lse_neg_inf);

// flashsdpa::sdpa: the direct API in PyTorch's layout and alignment, with the variants.
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                c10::optional<double> scale, bool enable_gqa, int64_t window_left,
                int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
                const c10::optional<at::Tensor>& sinks);

// Install / remove the aten overrides. Idempotent and thread-safe.
void routing_enable();
void routing_disable();
bool routing_enabled();
// Send SDPA calls on this device type ("xpu"; "" for none) to
// aten::_scaled_dot_product_fused_attention_overrideable while routing is enabled.
void set_overrideable_route(const std::string& device);
// Whether the Triton kernels can be launched in this process (Triton is installed); set by
// flashsdpa at import, read by the Triton backend's limits.
void set_triton_available(bool available);

// Called once per distinct fallback reason (the Python side logs it at DEBUG).
using FallbackSink = void (*)(const std::string& reason);
void set_fallback_sink(FallbackSink sink);
void reset_fallback_notes();

}  // namespace flashsdpa
