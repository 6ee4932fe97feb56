// SDPA routing: one decision for the direct API (flashsdpa::sdpa), for
// F.scaled_dot_product_attention once flashsdpa.enable() is on, and for explain().
//
//   flashsdpa::sdpa (CompositeImplicitAutograd): validate -> flashsdpa kernel, or PyTorch's own
//       at::native::scaled_dot_product_attention with the reason noted.
//   enable() registers, at run time (torch::Library objects, destroyed by disable()):
//     aten::_scaled_dot_product_flash_attention_for_cpu[_backward] @ CPU
//         everything PyTorch sends to its fused CPU kernel runs ours (its own autograd formula,
//         checks and meta kernels stay in charge; float64 goes back to PyTorch's kernel);
//     aten::scaled_dot_product_attention @ CompositeImplicitAutograd
//         calls PyTorch would send to its math path but flashsdpa can fuse (dropout in training,
//         3-D inputs, Dv != D, 3-D masks) run ours; everything else is passed through untouched.
// No Python runs on these paths.
#include "routing.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_fused_attention_overrideable.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_native.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_native.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "ops.h"

namespace flashsdpa {

namespace {

constexpr int64_t kSdpFlash = 1;  // sdp::SDPBackend::flash_attention, as _fused_sdp_choice returns

// Routing code runs during torch.compile tracing on tensors with symbolic sizes: it reads
// sizes as SymInts (never .size(), which would specialise a dynamic dimension) and branches
// through guards.
inline bool holds(const c10::SymBool& b) { return b.guard_bool(__FILE__, __LINE__); }

std::string torch_dtype_name(at::ScalarType st) {
  return "torch." + std::string(c10::getDtypeNames(st).first);
}

bool kernel_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
}

// ---- fallback notes ----------------------------------------------------------------------------
std::mutex g_note_mutex;
std::unordered_set<std::string> g_noted;
FallbackSink g_sink = nullptr;

void note_fallback(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(g_note_mutex);
    if (!g_noted.insert(reason).second) return;  // each distinct reason once
  }
  if (g_sink) g_sink(reason);
}

// ---- the shared decision ---------------------------------------------------------------------------
// 3-D (N, L, E) inputs run as (N, 1, L, E); a 4-D key/value batch of 1 broadcasts (stride 0).
struct Shaped {
  at::Tensor q, k, v;
  c10::optional<at::Tensor> mask;
  bool squeeze;
};

Shaped to_4d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const c10::optional<at::Tensor>& mask) {
  Shaped s{q, k, v, mask, false};
  if (q.dim() == 3) {
    s.q = q.unsqueeze(1), s.k = k.unsqueeze(1), s.v = v.unsqueeze(1), s.squeeze = true;
    if (mask.has_value() && mask->defined() && mask->dim() == 3) s.mask = mask->unsqueeze(1);
    return s;
  }
  const c10::SymInt B = q.sym_size(0);
  const c10::SymInt keep = -1;
  if (holds(k.sym_size(0) != B)) s.k = k.expand_symint({B, keep, keep, keep});
  if (holds(v.sym_size(0) != B)) s.v = v.expand_symint({B, keep, keep, keep});
  return s;
}

at::Tensor run_ours(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                    c10::optional<double> scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashsdpa::flash_attn_fwd", "")
                       .typed<FwdSignature>();
  const Shaped s = to_4d(q, k, v, mask);
  at::Tensor out = std::get<0>(op.call(s.q, s.k, s.v, s.mask, dropout_p, is_causal, scale));
  return s.squeeze ? out.squeeze(1) : out;
}

at::Tensor pytorch_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                        c10::optional<double> scale, bool enable_gqa) {
  return at::native::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale,
                                                  enable_gqa);
}

// ---- routed aten overrides -------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> aten_flash_cpu(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double dropout_p,
                                                  bool is_causal,
                                                  const c10::optional<at::Tensor>& attn_mask,
                                                  c10::optional<double> scale) {
  if (kernel_dtype(q.scalar_type()) && dropout_p == 0.0) {
    auto res = flash_attn_fwd_cpu(q, k, v, attn_mask, 0.0, is_causal, scale);
    return {std::get<0>(res), std::get<1>(res)};
  }
  note_fallback("aten flash CPU kernel with dtype " + torch_dtype_name(q.scalar_type()) +
                (dropout_p != 0.0 ? " and dropout" : "") + ": PyTorch's kernel runs");
  return at::native::_scaled_dot_product_flash_attention_cpu(q, k, v, dropout_p, is_causal,
                                                             attn_mask, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_flash_cpu_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double dropout_p, bool is_causal,
    const c10::optional<at::Tensor>& attn_mask, c10::optional<double> scale) {
  if (kernel_dtype(q.scalar_type()) && dropout_p == 0.0) {
    const at::Tensor no_rng = at::zeros({2}, q.options().dtype(at::kLong));
    return flash_attn_bwd_cpu(grad_out, q, k, v, out, lse, no_rng, attn_mask, 0.0, is_causal,
                              scale);
  }
  return at::native::_scaled_dot_product_flash_attention_cpu_backward(
      grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale);
}

// True while torch.compile / export traces (fake or functional tensors, or a Python dispatch
// mode). A traced graph must hold flashsdpa's own op: a graph holding the aten flash op would
// reach PyTorch's kernel directly through cpp_wrapper's C shim, bypassing the dispatcher.
bool tracing(const at::Tensor& t) {
  constexpr auto kTraceKeys = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  return t.key_set().has_any(kTraceKeys) ||
         c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python);
}

// The device type whose SDPA calls go to aten::_scaled_dot_product_fused_attention_overrideable,
// where flashsdpa's Triton kernels are registered (flashsdpa/_gpu.py); -1: none.
std::atomic<int> g_overrideable_device{-1};
constexpr int64_t kTritonMaxHeadDim = 256;

std::vector<std::string> decline_reasons_impl(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const c10::optional<at::Tensor>& mask,
                                              double dropout_p, bool cpu_only);

// A device routed to the overrideable op: every call the Triton kernels take goes there (PyTorch's
// autograd formula and meta kernel for that op stay in charge); the rest runs PyTorch's SDPA.
at::Tensor sdpa_via_overrideable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& mask, double dropout_p,
                                 bool is_causal, c10::optional<double> scale, bool enable_gqa) {
  auto& ctx = at::globalContext();
  if (!ctx.userEnabledFlashSDP() && !ctx.userEnabledOverrideableSDP())
    return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  auto reasons = decline_reasons_impl(q, k, v, mask, dropout_p, /*cpu_only=*/false);
  if (reasons.empty() && (holds(q.sym_size(-1) > kTritonMaxHeadDim) ||
                          holds(v.sym_size(-1) > kTritonMaxHeadDim)))
    reasons.push_back("head dim above 256 (Triton kernels)");
  if (reasons.empty() && valid_call(q, k, v, mask, dropout_p, enable_gqa)) {
    return std::get<0>(at::_scaled_dot_product_fused_attention_overrideable(
        q, k, v, mask, dropout_p, is_causal, /*return_debug_mask=*/false, scale));
  }
  note_fallback(reasons.empty() ? "invalid arguments: PyTorch reports the error"
                                : reasons.front());
  return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

at::Tensor aten_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     c10::optional<double> scale, bool enable_gqa) {
  if (static_cast<int>(q.device().type()) == g_overrideable_device.load())
    return sdpa_via_overrideable(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  // Not ours to take: other devices, or the user excluded the flash backend (sdpa_kernel).
  if (!q.device().is_cpu() || !at::globalContext().userEnabledFlashSDP())
    return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  // Eager: what PyTorch sends to its fused kernel reaches ours through the overridden aten op,
  // under PyTorch's own checks and (C++) autograd formula; only calls it would send to math are
  // taken here. Traced: every call flashsdpa supports becomes its own op.
  if (!tracing(q) && q.dim() == 4 && k.dim() == 4 && v.dim() == 4) {
    const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale,
                                                 enable_gqa);
    if (choice == kSdpFlash) return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  const std::string reason = decline_reason(q, k, v, mask, dropout_p, enable_gqa);
  if (reason.empty() && valid_call(q, k, v, mask, dropout_p, enable_gqa))
    return run_ours(q, k, v, mask, dropout_p, is_causal, scale);
  note_fallback(reason.empty() ? "invalid arguments: PyTorch reports the error" : reason);
  return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

std::unique_ptr<torch::Library> g_cpu_lib, g_cia_lib;
std::mutex g_enable_mutex;

// Overriding aten kernels makes the dispatcher warn ("Overriding a previously registered
// kernel"); that is the documented purpose of enable(), so the warning is kept out of the log.
struct SilentWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// ---- autocast for flashsdpa::sdpa ----------------------------------------------------------------
// PyTorch's rule for SDPA on CPU (lower_precision_fp): floating inputs run in the autocast dtype.
at::Tensor sdpa_autocast_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double dropout_p,
                             bool is_causal, c10::optional<double> scale, bool enable_gqa) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto dt = at::autocast::get_autocast_dtype(at::kCPU);
  const auto cast = [&](const at::Tensor& t) {
    return at::autocast::cached_cast(dt, t, c10::DeviceType::CPU);
  };
  c10::optional<at::Tensor> m = mask;
  if (mask.has_value() && mask->defined()) m = cast(*mask);
  return sdpa(cast(q), cast(k), cast(v), m, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace

// ---- public -----------------------------------------------------------------------------------------
void check_sdpa_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double dropout_p,
                     c10::optional<double> scale, bool enable_gqa) {
  const char* names[3] = {"query", "key", "value"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(ts[i]->dim() >= 2, "flashsdpa: ", names[i],
                      " must have at least 2 dims (..., seq_len, head_dim), got ", ts[i]->dim(),
                      "-D");
    TORCH_CHECK_VALUE(ts[i]->is_floating_point(), "flashsdpa: ", names[i],
                      ".dtype must be a floating-point type, got ", ts[i]->scalar_type());
  }
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), "flashsdpa: key.dtype (", k.scalar_type(),
                    ") must match query.dtype (", q.scalar_type(), ")");
  TORCH_CHECK_VALUE(v.scalar_type() == q.scalar_type(), "flashsdpa: value.dtype (",
                    v.scalar_type(), ") must match query.dtype (", q.scalar_type(), ")");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0,
                    "flashsdpa: dropout_p must be in [0, 1], got ", dropout_p);
  TORCH_CHECK_VALUE(holds(k.sym_size(-1) == q.sym_size(-1)), "flashsdpa: key head_dim (",
                    k.sym_size(-1), ") must match query head_dim (", q.sym_size(-1), ")");
  TORCH_CHECK_VALUE(holds(k.sym_size(-2) == v.sym_size(-2)), "flashsdpa: key seq_len (",
                    k.sym_size(-2), ") must match value seq_len (", v.sym_size(-2), ")");
  if (q.dim() == 4 && k.dim() == 4 && v.dim() == 4) {
    const c10::SymInt B = q.sym_size(0);
    TORCH_CHECK_VALUE(holds(k.sym_size(0) == 1) || holds(k.sym_size(0) == B),
                      "flashsdpa: key batch size (", k.sym_size(0),
                      ") must match query batch size (", B, ")");
    TORCH_CHECK_VALUE(holds(v.sym_size(0) == 1) || holds(v.sym_size(0) == B),
                      "flashsdpa: value batch size (", v.sym_size(0),
                      ") must match query batch size (", B, ")");
    const c10::SymInt hq = q.sym_size(1), hk = k.sym_size(1);
    TORCH_CHECK_VALUE(holds(hk == v.sym_size(1)), "flashsdpa: key heads (", hk,
                      ") must match value heads (", v.sym_size(1), ")");
    if (enable_gqa) {
      TORCH_CHECK_VALUE(holds(hk > 0) && holds(hq % hk == 0), "flashsdpa: query heads (", hq,
                        ") must be a multiple of key/value heads (", hk, ") with enable_gqa=True");
    } else {
      TORCH_CHECK_VALUE(holds(hk == 1) || holds(hk == hq), "flashsdpa: query heads (", hq,
                        ") differ from key/value heads (", hk,
                        "); pass enable_gqa=True for grouped-query attention");
    }
  }
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    const auto st = m.scalar_type();
    TORCH_CHECK_VALUE(st == at::kBool || st == at::kFloat || st == q.scalar_type(),
                      "flashsdpa: attn_mask.dtype must be bool, float32 or query.dtype (",
                      q.scalar_type(), "), got ", st);
    std::vector<c10::SymInt> target(q.sym_sizes().begin(), q.sym_sizes().end() - 1);
    target.push_back(k.sym_size(-2));
    bool ok = m.dim() <= int64_t(target.size());
    for (int64_t d = 1; ok && d <= m.dim(); ++d) {
      const c10::SymInt ms = m.sym_size(-d);
      ok = holds(ms == 1) || holds(ms == target[target.size() - d]);
    }
    TORCH_CHECK_VALUE(ok, "flashsdpa: attn_mask of shape ", m.sym_sizes(),
                      " does not broadcast to the attention shape ", c10::SymIntArrayRef(target),
                      " (..., L, S)");
  }
  (void)scale;
}

bool valid_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool enable_gqa) {
  try {
    check_sdpa_args(q, k, v, mask, dropout_p, c10::nullopt, enable_gqa);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

namespace {
std::vector<std::string> decline_reasons_impl(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const c10::optional<at::Tensor>& mask,
                                              double dropout_p, bool cpu_only) {
  std::vector<std::string> r;
  if (cpu_only && (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu()))
    r.push_back(std::string("tensors on ") + c10::DeviceTypeName(q.device().type(), true) +
                ": only CPU kernels are built in");
  if (!kernel_dtype(q.scalar_type()))
    r.push_back("dtype " + torch_dtype_name(q.scalar_type()) +
                ": kernels take float32, bfloat16, float16");
  if (q.is_nested() || k.is_nested() || v.is_nested()) r.push_back("nested tensors");
  if (!(q.dim() == k.dim() && k.dim() == v.dim() && (q.dim() == 3 || q.dim() == 4))) {
    r.push_back("ranks query " + std::to_string(q.dim()) + "-D, key " + std::to_string(k.dim()) +
                "-D, value " + std::to_string(v.dim()) +
                "-D: kernels take 3-D or 4-D query/key/value of the same rank");
  } else if (q.dim() == 3 &&
             (holds(k.sym_size(0) != q.sym_size(0)) || holds(v.sym_size(0) != q.sym_size(0)))) {
    r.push_back("3-D inputs with a broadcast batch");
  }
  if (holds(q.sym_size(-1) == 0) || holds(v.sym_size(-1) == 0)) r.push_back("head_dim 0");
  if (dropout_p >= 1.0) r.push_back("dropout_p == 1 (the output is all zeros)");
  if (mask.has_value() && mask->defined() && mask->requires_grad() &&
      at::GradMode::is_enabled())
    r.push_back("attn_mask requires grad: flashsdpa computes no mask gradient");
  return r;
}
}  // namespace

std::vector<std::string> decline_reasons(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v,
                                         const c10::optional<at::Tensor>& mask,
                                         double dropout_p, bool enable_gqa) {
  (void)enable_gqa;
  return decline_reasons_impl(q, k, v, mask, dropout_p, /*cpu_only=*/true);
}

std::string decline_reason(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& mask, double dropout_p,
                           bool enable_gqa) {
  auto r = decline_reasons(q, k, v, mask, dropout_p, enable_gqa);
  return r.empty() ? std::string() : r.front();
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                c10::optional<double> scale, bool enable_gqa) {
  check_sdpa_args(q, k, v, mask, dropout_p, scale, enable_gqa);
  const std::string reason = decline_reason(q, k, v, mask, dropout_p, enable_gqa);
  if (!reason.empty()) {
    note_fallback(reason);
    return pytorch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  return run_ours(q, k, v, mask, dropout_p, is_causal, scale);
}

void set_fallback_sink(FallbackSink sink) { g_sink = sink; }

void reset_fallback_notes() {
  std::lock_guard<std::mutex> lock(g_note_mutex);
  g_noted.clear();
}

void routing_enable() {
  std::lock_guard<std::mutex> lock(g_enable_mutex);
  if (g_cpu_lib) return;
  SilentWarnings silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  g_cpu_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                               c10::DispatchKey::CPU, __FILE__, __LINE__);
  g_cpu_lib->impl("_scaled_dot_product_flash_attention_for_cpu", &aten_flash_cpu);
  g_cpu_lib->impl("_scaled_dot_product_flash_attention_for_cpu_backward",
                  &aten_flash_cpu_backward);
  g_cia_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                               c10::DispatchKey::CompositeImplicitAutograd,
                                               __FILE__, __LINE__);
  g_cia_lib->impl("scaled_dot_product_attention", &aten_sdpa);
}

void set_overrideable_route(const std::string& device) {
  g_overrideable_device.store(
      device.empty() ? -1 : static_cast<int>(c10::Device(device).type()));
}

void routing_disable() {
  std::lock_guard<std::mutex> lock(g_enable_mutex);
  g_cia_lib.reset();  // destroying the Library deregisters its kernels
  g_cpu_lib.reset();
}

bool routing_enabled() {
  std::lock_guard<std::mutex> lock(g_enable_mutex);
  return bool(g_cpu_lib);
}

}  // namespace flashsdpa

TORCH_LIBRARY_IMPL(flashsdpa, CompositeImplicitAutograd, m) {
  m.impl("sdpa", &flashsdpa::sdpa);
}

TORCH_LIBRARY_IMPL(flashsdpa, AutocastCPU, m) {
  m.impl("sdpa", &flashsdpa::sdpa_autocast_cpu);
}
