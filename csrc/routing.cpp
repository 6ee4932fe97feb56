// SDPA routing (routing.h): the backends' limits as data, the one decision, and the entries that
// act on it:
//   flashsdpa::sdpa (CompositeImplicitAutograd): the direct API. Validate, decide, run.
//   enable() registers, at run time, once (torch::Library objects kept; g_routing_on switches):
//     aten::_scaled_dot_product_flash_attention_for_cpu[_backward] @ CPU
//         what PyTorch sends to its fused CPU kernel runs flashsdpa's, under PyTorch's own
//         checks, autograd formula and meta kernels (so torch.compile graphs call it too);
//     aten::scaled_dot_product_attention @ CompositeImplicitAutograd
//         calls PyTorch would send to its math path but flashsdpa fuses (dropout in training,
//         3-D inputs, Dv != D, 3-D masks), and on the routed GPU device type the calls the
//         Triton kernels take; everything else passes through untouched.
// No Python runs on these paths.
#include "routing.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_native.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_native.h>
#include <ATen/ops/_scaled_dot_product_fused_attention_overrideable.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "ops.h"

namespace flashsdpa {

namespace {

// Routing code runs during torch.compile / torch.export tracing on tensors with symbolic sizes:
// it reads sizes as SymInts (never .size(), which would specialise a dynamic dimension) and
// branches through guards that never fail on data-dependent (unbacked) sizes: holds(b) is true
// when b is known to hold, may(b) unless b is known not to. Validation rejects only what may()
// rules out; what it lets through is checked again by the kernels' ops on real sizes.
// (SymInt's own ==, !=, > guard and return bool: compare with eq / ne / gt.)
inline bool holds(const c10::SymBool& b) { return b.guard_or_false(__FILE__, __LINE__); }
inline bool may(const c10::SymBool& b) { return b.guard_or_true(__FILE__, __LINE__); }
bool holds(bool) = delete;  // a bool here has already guarded
bool may(bool) = delete;
inline c10::SymBool eq(const c10::SymInt& a, const c10::SymInt& b) { return a.sym_eq(b); }
inline c10::SymBool ne(const c10::SymInt& a, const c10::SymInt& b) { return a.sym_ne(b); }
inline c10::SymBool gt(const c10::SymInt& a, const c10::SymInt& b) { return a.sym_gt(b); }

// PyTorch's kernel chooser (at::_fused_sdp_choice) divides the query heads by the key heads
// of 4-D calls with enable_gqa (SIGFPE when there are none): not asked about those.
bool chooser_safe(const Call& c) {
  return !c.enable_gqa || c.k.dim() != 4 || c.v.dim() != 4 ||
         (holds(gt(c.k.sym_size(1), 0)) && holds(gt(c.v.sym_size(1), 0)));
}

// The batch of a 4-D call: q, k and v broadcast over it (each has it or 1), as F.sdpa does.
c10::SymInt batch_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() != 4 || !holds(eq(q.sym_size(0), 1))) return q.sym_size(0);
  return holds(eq(k.sym_size(0), 1)) ? v.sym_size(0) : k.sym_size(0);
}

std::string torch_dtype_name(at::ScalarType st) {
  return "torch." + std::string(c10::getDtypeNames(st).first);
}

bool has_mask(const Call& c) { return c.mask.has_value() && c.mask->defined(); }

// ---- the backends' limits, as data ---------------------------------------------------------------
constexpr uint64_t device_bit(c10::DeviceType t) { return uint64_t(1) << int(t); }

struct BackendSpec {
  Backend backend;
  const char* name;
  uint64_t devices;          // device_bit of each device type it runs on
  const char* devices_text;  // the same, in words
  int64_t max_head_dim;      // of q / k and of v
  bool needs_triton;         // runs only where Triton is installed
  bool variants;             // windows, bottom-right alignment, softcap, ALiBi, sinks
};
// kBackends[b] describes Backend b.
const BackendSpec kBackends[] = {
    {Backend::CpuKernel, "flashsdpa CPU kernel", device_bit(c10::DeviceType::CPU), "CPU tensors",
     int64_t(1) << 16, false, true},
    {Backend::Triton, "flashsdpa Triton kernels",
     device_bit(c10::DeviceType::XPU) | device_bit(c10::DeviceType::CUDA), "xpu and cuda tensors",
     256, true, true},
};
// Both flashsdpa backends compute in these input dtypes.
bool kernel_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
}

std::atomic<bool> g_triton_available{false};
// The device type whose SDPA calls go to aten::_scaled_dot_product_fused_attention_overrideable,
// where flashsdpa's Triton kernels are registered (flashsdpa/_gpu.py); -1: none.
std::atomic<int> g_overrideable_device{-1};

constexpr const char* kDeclines = "PyTorch's SDPA: flashsdpa declines the call";

// Why backend `s` cannot take the valid call c (empty: it can).
std::vector<std::string> not_supported(const BackendSpec& s, const Call& c) {
  std::vector<std::string> r;
  const auto dev = c.q.device().type();
  uint64_t devices = s.devices;
  // the device type routed to the overrideable op runs the Triton kernels registered there
  // (tests stand the CPU in for xpu this way)
  const int routed = g_overrideable_device.load(std::memory_order_relaxed);
  if (s.backend == Backend::Triton && routed >= 0) devices |= device_bit(c10::DeviceType(routed));
  if (!(devices & device_bit(dev)) || c.k.device().type() != dev || c.v.device().type() != dev)
    r.push_back(std::string("tensors on ") + c10::DeviceTypeName(dev, true) + ": the " +
                s.name + " take " + s.devices_text);
  if (s.needs_triton && !g_triton_available.load(std::memory_order_relaxed))
    r.push_back("Triton is not installed");
  if (!kernel_dtype(c.q.scalar_type()))
    r.push_back("dtype " + torch_dtype_name(c.q.scalar_type()) +
                ": kernels take float32, bfloat16, float16");
  if (c.q.is_nested() || c.k.is_nested() || c.v.is_nested()) r.push_back("nested tensors");
  if (!(c.q.dim() == c.k.dim() && c.k.dim() == c.v.dim() && (c.q.dim() == 3 || c.q.dim() == 4))) {
    r.push_back("ranks query " + std::to_string(c.q.dim()) + "-D, key " +
                std::to_string(c.k.dim()) + "-D, value " + std::to_string(c.v.dim()) +
                "-D: kernels take 3-D or 4-D query/key/value of the same rank");
  } else if (c.q.dim() == 3 && (holds(ne(c.k.sym_size(0), c.q.sym_size(0))) ||
                                holds(ne(c.v.sym_size(0), c.q.sym_size(0))))) {
    r.push_back("3-D inputs with a broadcast batch");
  }
  if (holds(eq(c.q.sym_size(-1), 0)) || holds(eq(c.v.sym_size(-1), 0))) {
    r.push_back("head_dim 0");
  } else if (holds(gt(c.q.sym_size(-1), s.max_head_dim)) ||
             holds(gt(c.v.sym_size(-1), s.max_head_dim))) {
    r.push_back("head dim above " + std::to_string(s.max_head_dim) + " (" + s.name + ")");
  }
  if (c.dropout_p >= 1.0) r.push_back("dropout_p == 1 (the output is all zeros)");
  // The kernels scale the scores by scale * log2(e) in float32: beyond this, scores overflow
  // where PyTorch's do not (and a scale past float32's range would become inf there).
  if (c.scale.has_value() && !(std::abs(*c.scale) <= 1e30))
    r.push_back("|scale| above 1e30, or not finite: the scores would overflow differently");
  if (has_mask(c) && c.mask->requires_grad() && at::GradMode::is_enabled())
    r.push_back("attn_mask requires grad: flashsdpa computes no mask gradient");
  if (!s.variants && c.variants())
    r.push_back(std::string("window, bottom-right alignment, softcap, ALiBi or sinks: not in the ") +
                s.name + " yet");
  return r;
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

// A decision that sent the call to PyTorch for a reason the user may want to know.
void note_fallback(const Decision& d) {
  if (!d.invalid.empty()) return note_fallback("invalid arguments: PyTorch reports the error");
  if (!d.declined) return;
  const auto& reasons = d.reasons[d.target == Backend::PyTorch ? 0 : int(d.target)];
  note_fallback(reasons.empty() ? d.via : reasons.front());
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


// The rule of the aten flash CPU op's override: PyTorch's autograd formula for that op carries
// no dropout state, so only dropout-free calls in a kernel dtype are flashsdpa's.
void decide_aten_flash_cpu(const Call& c, Decision* d) {
  d->reasons[int(Backend::CpuKernel)] = not_supported(kBackends[int(Backend::CpuKernel)], c);
  if (c.dropout_p != 0.0)
    d->reasons[int(Backend::CpuKernel)].push_back(
        "dropout through aten::_scaled_dot_product_flash_attention_for_cpu (its backward "
        "formula carries no dropout state)");
  const bool ours = d->reasons[int(Backend::CpuKernel)].empty();
  d->backend = ours ? Backend::CpuKernel : Backend::PyTorch;
  d->target = Backend::CpuKernel;
  d->declined = !ours;
  d->via = ours ? "aten::_scaled_dot_product_flash_attention_for_cpu, which enable() overrides"
                : "aten::_scaled_dot_product_flash_attention_for_cpu: PyTorch's kernel";
}

// ---- running a decision -------------------------------------------------------------------------
const c10::optional<at::Tensor> kNoTensor;
const c10::optional<at::Tensor>& opt(const c10::optional<at::Tensor>* t) {
  return t ? *t : kNoTensor;
}

// flashsdpa::flash_attn_fwd on the call's 4-D views: (out, logsumexp) of those views
std::tuple<at::Tensor, at::Tensor> run_cpu_kernel_4d(const Call& c, const Shaped& s,
                                                     bool lse_neg_inf) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashsdpa::flash_attn_fwd", "")
                       .typed<FwdSignature>();
  auto res = op.call(s.q, s.k, s.v, s.mask, c.dropout_p, c.is_causal, c.scale, c.window_left,
                     c.window_right, c.bottom_right, c.softcap, opt(c.alibi_slopes),
                     opt(c.sinks), lse_neg_inf);
  return {std::get<0>(res), std::get<1>(res)};
}

at::Tensor run_cpu_kernel(const Call& c) {
  const Shaped s = to_4d(c.q, c.k, c.v, c.mask, /*kv_batch1=*/true);
  at::Tensor out = std::get<0>(run_cpu_kernel_4d(c, s, false));
  return s.squeeze ? out.squeeze(1) : out;
}

at::Tensor run_math(const Call& c) {
  const Shaped s = to_4d(c.q, c.k, c.v, c.mask);
  const Call c4{s.q,         s.k,          s.v,          s.mask,       c.dropout_p,
                c.is_causal, c.scale,      c.enable_gqa, c.window_left, c.window_right,
                c.bottom_right, c.softcap, c.alibi_slopes, c.sinks};
  at::Tensor out = std::get<0>(variants_math(c4, false));
  return s.squeeze ? out.squeeze(1) : out;
}

at::Tensor run_pytorch(const Call& c) {
  return at::native::scaled_dot_product_attention(c.q, c.k, c.v, c.mask, c.dropout_p,
                                                  c.is_causal, c.scale, c.enable_gqa);
}

// ---- the aten overrides --------------------------------------------------------------------------
// Registered at the first enable() and never removed: the dispatcher's tables are read without
// a lock, so deregistering a kernel while another thread dispatches through it crashed (a
// SIGSEGV under threads calling F.sdpa while one toggled enable()). routing_enabled() switches
// them: off, each runs exactly PyTorch's own kernel.

std::tuple<at::Tensor, at::Tensor> aten_flash_cpu(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double dropout_p,
                                                  bool is_causal,
                                                  const c10::optional<at::Tensor>& attn_mask,
                                                  c10::optional<double> scale) {
  if (!routing_enabled())
    return at::native::_scaled_dot_product_flash_attention_cpu(q, k, v, dropout_p, is_causal,
                                                               attn_mask, scale);
  const Call c{q, k, v, attn_mask, dropout_p, is_causal, scale, /*enable_gqa=*/true};
  const Decision d = decide(c, Entry::AtenFlashCpu);
  if (d.backend == Backend::CpuKernel) {
    auto res = flash_attn_fwd_cpu(q, k, v, attn_mask, 0.0, is_causal, scale, -1, -1, false, 0.0,
                                  kNoTensor, kNoTensor, /*lse_neg_inf=*/false);
    return {std::get<0>(res), std::get<1>(res)};
  }
  note_fallback(d);  // e.g. float64: PyTorch's kernel
  return at::native::_scaled_dot_product_flash_attention_cpu(q, k, v, dropout_p, is_causal,
                                                             attn_mask, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_flash_cpu_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double dropout_p, bool is_causal,
    const c10::optional<at::Tensor>& attn_mask, c10::optional<double> scale) {
  // The forward's decision again (it depends on dtype and dropout only): the backward of
  // whichever kernel made `out` and `lse` (toggled in between: the state now decides; both
  // kernels' logsumexp have the same meaning and layout).
  const Call c{q, k, v, attn_mask, dropout_p, is_causal, scale, /*enable_gqa=*/true};
  if (routing_enabled() && decide(c, Entry::AtenFlashCpu).backend == Backend::CpuKernel) {
    const at::Tensor no_rng = at::zeros({2}, q.options().dtype(at::kLong));
    auto g = flash_attn_bwd_cpu(grad_out, q, k, v, out, lse, no_rng, attn_mask, 0.0, is_causal,
                                scale, -1, -1, false, 0.0, kNoTensor, kNoTensor,
                                /*softmax_stats=*/kNoTensor);
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
  }
  return at::native::_scaled_dot_product_flash_attention_cpu_backward(
      grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale);
}

at::Tensor aten_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     c10::optional<double> scale, bool enable_gqa) {
  const Call c{q, k, v, mask, dropout_p, is_causal, scale, enable_gqa};
  if (!routing_enabled()) return run_pytorch(c);
  const Decision d = decide(c, Entry::AtenSdpa);
  switch (d.backend) {
    case Backend::CpuKernel:
      return run_cpu_kernel(c);
    case Backend::Triton:
      return std::get<0>(at::_scaled_dot_product_fused_attention_overrideable(
          q, k, v, mask, dropout_p, is_causal, /*return_debug_mask=*/false, scale));
    case Backend::PyTorch:
    case Backend::Math:  // (never: F.sdpa calls carry no variants)
      break;
  }
  note_fallback(d);
  return run_pytorch(c);
}

std::unique_ptr<torch::Library> g_cpu_lib, g_cia_lib;  // the overrides, once registered
std::mutex g_enable_mutex;                              // (guards their registration)
std::atomic<bool> g_routing_on{false};                  // the switch

// Overriding aten kernels makes the dispatcher warn ("Overriding a previously registered
// kernel"); that is the documented purpose of enable(), so the warning is kept out of the log.
struct SilentWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// ---- autocast for flashsdpa::sdpa ----------------------------------------------------------------
// PyTorch's rule for SDPA on CPU (lower_precision_fp): floating inputs run in the autocast dtype.
at::Tensor sdpa_autocast_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double dropout_p,
                             bool is_causal, c10::optional<double> scale, bool enable_gqa,
                             int64_t window_left, int64_t window_right, double softcap,
                             const c10::optional<at::Tensor>& alibi_slopes,
                             const c10::optional<at::Tensor>& sinks) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto dt = at::autocast::get_autocast_dtype(at::kCPU);
  const auto cast = [&](const at::Tensor& t) {
    return at::autocast::cached_cast(dt, t, c10::DeviceType::CPU);
  };
  c10::optional<at::Tensor> m = mask;
  if (mask.has_value() && mask->defined()) m = cast(*mask);
  return sdpa(cast(q), cast(k), cast(v), m, dropout_p, is_causal, scale, enable_gqa, window_left,
              window_right, softcap, alibi_slopes, sinks);
}

}  // namespace

// ---- validation ------------------------------------------------------------------------------------
namespace {
// The variants' arguments (after the SDPA ones are known to be valid): "" when valid.
std::string invalid_variant(const Call& c) {
  if (c.window_left < -1 || c.window_right < -1)
    return c10::str("flashsdpa: window_size must be (left, right) with each >= -1 (-1: "
                    "unbounded), got (", c.window_left, ", ", c.window_right, ")");
  if (!(c.softcap >= 0.0) || c.softcap == std::numeric_limits<double>::infinity())
    return c10::str("flashsdpa: softcap must be finite and >= 0 (0: none), got ", c.softcap);
  // per query head: H = q's heads (1 for 3-D inputs), B the call's batch
  const c10::SymInt B = batch_of(c.q, c.k, c.v);
  const c10::SymInt H = c.q.dim() == 4 ? c.q.sym_size(1) : c10::SymInt(1);
  const auto check = [&](const at::Tensor& t, const char* name, bool batched) -> std::string {
    if (t.scalar_type() != at::kFloat)
      return c10::str("flashsdpa: ", name, " must be float32, got ", t.scalar_type());
    if (t.device() != c.q.device())
      return c10::str("flashsdpa: ", name, " must be on query's device (", c.q.device(),
                      "), got ", t.device());
    const bool heads = t.dim() == 1 && may(eq(t.sym_size(0), H));
    const bool both = batched && t.dim() == 2 && may(eq(t.sym_size(0), B)) &&
                      may(eq(t.sym_size(1), H));
    if (!heads && !both)
      return c10::str("flashsdpa: ", name, " must have shape (H,) = (", H, ",)",
                      batched ? c10::str(" or (B, H) = (", B, ", ", H, ")") : std::string(),
                      ", got ", t.sym_sizes());
    return std::string();
  };
  if (c.has_alibi()) {
    const std::string e = check(**c.alibi_slopes, "alibi_slopes", true);
    if (!e.empty()) return e;
  }
  if (c.has_sinks()) return check(**c.sinks, "sinks", false);
  return std::string();
}
}  // namespace

std::string invalid_argument(const Call& c) {
  const char* names[3] = {"query", "key", "value"};
  const at::Tensor* ts[3] = {&c.q, &c.k, &c.v};
  for (int i = 0; i < 3; ++i) {
    if (ts[i]->dim() < 2)
      return c10::str("flashsdpa: ", names[i],
                      " must have at least 2 dims (..., seq_len, head_dim), got ", ts[i]->dim(),
                      "-D");
    if (!ts[i]->is_floating_point())
      return c10::str("flashsdpa: ", names[i], ".dtype must be a floating-point type, got ",
                      ts[i]->scalar_type());
  }
  const auto st = c.q.scalar_type();
  if (c.k.scalar_type() != st)
    return c10::str("flashsdpa: key.dtype (", c.k.scalar_type(), ") must match query.dtype (", st,
                    ")");
  if (c.v.scalar_type() != st)
    return c10::str("flashsdpa: value.dtype (", c.v.scalar_type(), ") must match query.dtype (",
                    st, ")");
  if (!(c.dropout_p >= 0.0 && c.dropout_p <= 1.0))
    return c10::str("flashsdpa: dropout_p must be in [0, 1], got ", c.dropout_p);
  if (!may(eq(c.k.sym_size(-1), c.q.sym_size(-1))))
    return c10::str("flashsdpa: key head_dim (", c.k.sym_size(-1), ") must match query head_dim (",
                    c.q.sym_size(-1), ")");
  if (!may(eq(c.k.sym_size(-2), c.v.sym_size(-2))))
    return c10::str("flashsdpa: key seq_len (", c.k.sym_size(-2), ") must match value seq_len (",
                    c.v.sym_size(-2), ")");
  if (c.q.dim() == 4 && c.k.dim() == 4 && c.v.dim() == 4) {
    const c10::SymInt B = batch_of(c.q, c.k, c.v);
    for (int i = 0; i < 3; ++i) {
      const c10::SymInt b = ts[i]->sym_size(0);
      if (!(may(eq(b, 1)) || may(eq(b, B))))
        return c10::str("flashsdpa: ", names[i], " batch size (", b,
                        ") must be 1 or the batch size of the others (", B, ")");
    }
    const c10::SymInt hq = c.q.sym_size(1), hk = c.k.sym_size(1);
    if (!may(eq(hk, c.v.sym_size(1))))
      return c10::str("flashsdpa: key heads (", hk, ") must match value heads (",
                      c.v.sym_size(1), ")");
    if (c.enable_gqa) {
      // (zero query and key heads: an empty output, as PyTorch gives)
      if (!((may(gt(hk, 0)) && may(eq(hq % hk, 0))) || (holds(eq(hq, 0)) && holds(eq(hk, 0)))))
        return c10::str("flashsdpa: query heads (", hq, ") must be a multiple of key/value heads (",
                        hk, ") with enable_gqa=True");
    } else if (!(may(eq(hk, 1)) || may(eq(hk, hq)))) {
      return c10::str("flashsdpa: query heads (", hq, ") differ from key/value heads (", hk,
                      "); pass enable_gqa=True for grouped-query attention");
    }
  }
  if (has_mask(c)) {
    const at::Tensor& m = *c.mask;
    const auto mt = m.scalar_type();
    if (!(mt == at::kBool || mt == at::kFloat || mt == st))
      return c10::str("flashsdpa: attn_mask.dtype must be bool, float32 or query.dtype (", st,
                      "), got ", mt);
    std::vector<c10::SymInt> target(c.q.sym_sizes().begin(), c.q.sym_sizes().end() - 1);
    if (c.q.dim() == 4) target[0] = batch_of(c.q, c.k, c.v);
    target.push_back(c.k.sym_size(-2));
    bool ok = m.dim() <= int64_t(target.size());
    for (int64_t d = 1; ok && d <= m.dim(); ++d) {
      const c10::SymInt ms = m.sym_size(-d);
      ok = may(eq(ms, 1)) || may(eq(ms, target[target.size() - d]));
    }
    if (!ok)
      return c10::str("flashsdpa: attn_mask of shape ", m.sym_sizes(),
                      " does not broadcast to the attention shape ", c10::SymIntArrayRef(target),
                      " (..., L, S)");
  }
  return invalid_variant(c);
}

void check_sdpa_args(const Call& c) {
  const std::string msg = invalid_argument(c);
  TORCH_CHECK_VALUE(msg.empty(), msg);
}

// ---- the decision ----------------------------------------------------------------------------------
const char* backend_name(Backend b) {
  return b == Backend::PyTorch ? "PyTorch's SDPA" : kBackends[int(b)].name;
}

Decision decide(const Call& c, Entry entry, bool routing_on) {
  Decision d;
  if (entry == Entry::AtenFlashCpu) {  // PyTorch validated the call and chose this op
    decide_aten_flash_cpu(c, &d);
    return d;
  }
  d.invalid = invalid_argument(c);
  if (!d.invalid.empty()) {
    d.via = "PyTorch's SDPA, which reports the error";
    return d;
  }
  for (int b = 0; b < 2; ++b) {
    d.reasons[b] = not_supported(kBackends[b], c);
    if (d.target == Backend::PyTorch &&
        (kBackends[b].devices & device_bit(c.q.device().type())))
      d.target = Backend(b);
  }
  const auto first_taker = [&]() -> Backend {
    for (int b = 0; b < 2; ++b)
      if (d.reasons[b].empty()) return Backend(b);
    return Backend::PyTorch;
  };
  if (entry == Entry::Direct) {
    d.backend = first_taker();
    d.declined = d.backend == Backend::PyTorch;
    // PyTorch's SDPA cannot express the variants (softcap and sinks at all): their math on
    // PyTorch's ops instead
    if (d.declined && c.variants()) d.backend = Backend::Math;
    d.via = d.backend == Backend::CpuKernel ? "flashsdpa::flash_attn_fwd"
            : d.backend == Backend::Triton  ? "flashsdpa::triton_attn_fwd"
            : d.backend == Backend::Math
                ? "flashsdpa's math on PyTorch ops: no flashsdpa kernel takes the call"
                : kDeclines;
    return d;
  }
  // Entry::AtenSdpa: what F.scaled_dot_product_attention does with the call.
  auto& ctx = at::globalContext();
  const int dev = int(c.q.device().type());
  if (!routing_on) {
    d.via = "PyTorch's SDPA: flashsdpa is not enabled (flashsdpa.enable() routes it)";
  } else if (dev == g_overrideable_device.load()) {
    if (!ctx.userEnabledFlashSDP() && !ctx.userEnabledOverrideableSDP()) {
      d.via = "PyTorch's SDPA: sdpa_kernel() excludes FLASH_ATTENTION and OVERRIDEABLE, so "
              "flashsdpa stays out";
    } else if (d.reasons[int(Backend::Triton)].empty()) {
      d.backend = Backend::Triton;
      d.via = "aten::_scaled_dot_product_fused_attention_overrideable, where enable() "
              "registered the Triton kernels";
    } else {
      d.via = kDeclines;
      d.declined = true;
    }
  } else if (dev != int(c10::DeviceType::CPU)) {
    d.via = std::string("PyTorch's SDPA: enable() routes CPU tensors") +
            (g_overrideable_device.load() >= 0 ? " and the Triton device type" : "");
  } else if (!ctx.userEnabledFlashSDP()) {
    d.via = "PyTorch's SDPA: sdpa_kernel() excludes FLASH_ATTENTION, so flashsdpa stays out";
  } else if (!tracing(c.q) && c.q.dim() == 4 && c.k.dim() == 4 && c.v.dim() == 4 &&
             chooser_safe(c) &&
             at::_fused_sdp_choice(c.q, c.k, c.v, c.mask, c.dropout_p, c.is_causal, c.scale,
                                   c.enable_gqa) == int64_t(at::SDPBackend::flash_attention)) {
    // Eager: what PyTorch sends to its fused kernel reaches flashsdpa's through the overridden
    // aten op, under PyTorch's own checks and (C++) autograd formula.
    const Decision flash = decide(c, Entry::AtenFlashCpu);
    d.backend = flash.backend;
    d.via = flash.via;
    d.reasons[0] = flash.reasons[0];  // the override notes its own fallback
  } else if (has_mask(c) && c.is_causal) {
    // PyTorch's math path rejects an explicit mask with is_causal=True: its error, unchanged
    d.via = "PyTorch's SDPA: an attn_mask with is_causal=True, which its math path rejects";
  } else if (d.reasons[int(Backend::CpuKernel)].empty()) {
    // What PyTorch would run on its math path (or, traced, any call the kernel takes: the graph
    // holds flashsdpa's own op)
    d.backend = Backend::CpuKernel;
    d.via = "flashsdpa::flash_attn_fwd";
  } else {
    d.via = kDeclines;
    d.declined = true;
  }
  return d;
}

std::string pytorch_kernel(const Call& c) {
  const bool cpu = c.q.device().is_cpu();
  int64_t choice = int64_t(at::SDPBackend::math);
  try {
    if (chooser_safe(c))
      choice = at::_fused_sdp_choice(c.q, c.k, c.v, c.mask, c.dropout_p, c.is_causal, c.scale,
                                     c.enable_gqa);
  } catch (const c10::Error&) {  // the chooser rejects some inputs its math path accepts
  }
  switch (at::SDPBackend(choice)) {
    case at::SDPBackend::flash_attention:
      return cpu ? "aten::_scaled_dot_product_flash_attention_for_cpu"
                 : "aten::_scaled_dot_product_flash_attention";
    case at::SDPBackend::efficient_attention:
      return "aten::_scaled_dot_product_efficient_attention";
    case at::SDPBackend::cudnn_attention:
      return "aten::_scaled_dot_product_cudnn_attention";
    case at::SDPBackend::overrideable:
      return "aten::_scaled_dot_product_fused_attention_overrideable";
    default:
      return "aten::_scaled_dot_product_attention_math";
  }
}

Shaped to_4d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const c10::optional<at::Tensor>& mask, bool kv_batch1) {
  Shaped s{q, k, v, mask, false};
  if (q.dim() == 3) {
    s.q = q.unsqueeze(1), s.k = k.unsqueeze(1), s.v = v.unsqueeze(1), s.squeeze = true;
    if (mask.has_value() && mask->defined() && mask->dim() == 3) s.mask = mask->unsqueeze(1);
    return s;
  }
  const c10::SymInt B = batch_of(q, k, v);
  const c10::SymInt keep = -1;
  if (holds(ne(q.sym_size(0), B))) s.q = q.expand_symint({B, keep, keep, keep});
  if (kv_batch1 && holds(eq(k.sym_size(0), 1)) && holds(eq(v.sym_size(0), 1))) return s;
  if (holds(ne(k.sym_size(0), B))) s.k = k.expand_symint({B, keep, keep, keep});
  if (holds(ne(v.sym_size(0), B))) s.v = v.expand_symint({B, keep, keep, keep});
  return s;
}

// ---- the direct API --------------------------------------------------------------------------------
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                c10::optional<double> scale, bool enable_gqa, int64_t window_left,
                int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes,
                const c10::optional<at::Tensor>& sinks) {
  const Call c{q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, window_left, window_right,
               false, softcap, &alibi_slopes, &sinks};
  const Decision d = decide(c, Entry::Direct);
  TORCH_CHECK_VALUE(d.invalid.empty(), d.invalid);
  switch (d.backend) {
    case Backend::CpuKernel:
      return run_cpu_kernel(c);
    case Backend::Math:
      return run_math(c);
    default:
      // The Triton kernels are launched from Python (flashsdpa/_api.py sends plain GPU calls
      // there before this op); here only PyTorch remains.
      note_fallback(d);
      return run_pytorch(c);
  }
}

// flashsdpa::flash_attn: flash-attn's layout (B, L, H, D) and bottom-right alignment.
std::tuple<at::Tensor, at::Tensor> flash_attn(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, double dropout_p,
                                              c10::optional<double> softmax_scale, bool causal,
                                              int64_t window_left, int64_t window_right,
                                              double softcap,
                                              const c10::optional<at::Tensor>& alibi_slopes,
                                              const c10::optional<at::Tensor>& sinks) {
  const char* names[3] = {"q", "k", "v"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK_VALUE(ts[i]->dim() == 4, "flashsdpa.flash_attn_func: ", names[i],
                      " must be 4-D (batch, seq_len, heads, head_dim), got ", ts[i]->dim(), "-D");
  const at::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
  const c10::optional<at::Tensor> no_mask;
  const Call c{qt,   kt,          vt,           no_mask, dropout_p, causal, softmax_scale,
               true, window_left, window_right, true,    softcap,   &alibi_slopes, &sinks};
  const Decision d = decide(c, Entry::Direct);
  TORCH_CHECK_VALUE(d.invalid.empty(), d.invalid);
  const Shaped s{qt, kt, vt, no_mask, false};
  auto res = d.backend == Backend::CpuKernel ? run_cpu_kernel_4d(c, s, /*lse_neg_inf=*/true)
                                             : variants_math(c, /*lse_neg_inf=*/true);
  return {std::get<0>(res).transpose(1, 2), std::get<1>(res)};
}

// ---- the switch ------------------------------------------------------------------------------------
void set_fallback_sink(FallbackSink sink) { g_sink = sink; }

void reset_fallback_notes() {
  std::lock_guard<std::mutex> lock(g_note_mutex);
  g_noted.clear();
}

void routing_enable() {
  std::lock_guard<std::mutex> lock(g_enable_mutex);
  g_routing_on.store(true, std::memory_order_release);
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

void set_triton_available(bool available) { g_triton_available.store(available); }

void routing_disable() { g_routing_on.store(false, std::memory_order_release); }

bool routing_enabled() { return g_routing_on.load(std::memory_order_acquire); }

}  // namespace flashsdpa

TORCH_LIBRARY_IMPL(flashsdpa, CompositeImplicitAutograd, m) {
  m.impl("sdpa", &flashsdpa::sdpa);
  m.impl("flash_attn", &flashsdpa::flash_attn);
}

TORCH_LIBRARY_IMPL(flashsdpa, AutocastCPU, m) {
  m.impl("sdpa", &flashsdpa::sdpa_autocast_cpu);
}
