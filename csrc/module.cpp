// Python bindings of flashsdpa._C: CPU feature report, tier selection, routing switch, and (in
// the `testing` submodule) the test and tuning hooks.
// The ops themselves are registered with TORCH_LIBRARY in ops.cpp.
#include <ATen/autocast_mode.h>
#include <torch/extension.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "cpu/isa.h"
#include "driver.h"
#include "ops.h"
#include "plan.h"
#include "routing.h"

#define FLASHSDPA_TIER_NS reference
#include "cpu/scalar.h"

namespace py = pybind11;
using flashsdpa::DType;
using flashsdpa::cpu::Feature;
using flashsdpa::cpu::Isa;

namespace {

DType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32") return DType::F32;
  if (s == "bfloat16" || s == "bf16") return DType::BF16;
  if (s == "float16" || s == "fp16") return DType::F16;
  throw py::value_error("flashsdpa: dtype must be float32, bfloat16 or float16, got '" + s + "'");
}

Isa parse_isa_or_throw(const std::string& name) {
  Isa isa;
  if (!flashsdpa::cpu::parse_isa(name, &isa))
    throw py::value_error("FLASHSDPA_CPU_ISA='" + name + "' is not a tier; use one of " +
                          flashsdpa::cpu::isa_names());
  return isa;
}

// A tier setting by name, "" clearing it (the cap, the emulated tier), and its reading.
template <void (*Set)(Isa), void (*Clear)()>
void set_tier(const std::string& name) {
  if (name.empty()) {
    Clear();
  } else {
    Set(parse_isa_or_throw(name));
  }
}
py::object tier_or_none(bool set, Isa isa) {
  return set ? py::object(py::str(flashsdpa::cpu::isa_name(isa))) : py::object(py::none());
}

py::list feature_names(uint32_t bits) {
  py::list out;
  for (int i = 0; i < int(Feature::kCount); ++i)
    if ((bits >> i) & 1u) out.append(flashsdpa::cpu::feature_name(Feature(i)));
  return out;
}

py::dict features_dict(const flashsdpa::cpu::CpuFeatures& f) {
  py::dict d;
  d["x86"] = f.x86;
  for (int i = 0; i < int(Feature::kCount); ++i)
    d[flashsdpa::cpu::feature_name(Feature(i))] = f.has(Feature(i));
  d["amx_permitted"] = f.amx_permitted;
  d["l2_bytes"] = f.l2_bytes;
  d["l1d_bytes"] = f.l1d_bytes;
  d["bf16_dot_slow"] = f.bf16_dot_slow;
  d["denormal_assists"] = f.denormal_assists;
  d["decode_block_bytes"] = flashsdpa::cpu::decode_block_bytes(f);
  d["decode_sub_bytes"] = flashsdpa::cpu::decode_sub_bytes(f);
  py::list runnable;
  for (int i = 0; i < int(Isa::kCount); ++i)
    if (f.can_run[i]) runnable.append(flashsdpa::cpu::isa_name(Isa(i)));
  d["runnable_tiers"] = runnable;
  return d;
}

// The tier table (tiers.def) with this binary's and this host's view of each row.
py::list tiers_list() {
  py::list out;
  const auto& f = flashsdpa::cpu::host_features();
  for (int i = 0; i < int(Isa::kCount); ++i) {
    const Isa isa = Isa(i);
    const auto& info = flashsdpa::cpu::tier_info(isa);
    py::dict t;
    t["name"] = info.name;
    t["built"] = flashsdpa::cpu::built_tier(isa) != nullptr;
    t["emulated"] = info.emulated;  // the table asks test builds for an emulated build
    t["emulated_build"] = flashsdpa::cpu::emulated_tier(isa) != nullptr;
    t["cpu_ok"] = f.can_run[i];
    t["needs"] = feature_names(info.needs);
    t["flags"] = info.flags;
    py::list paths;  // the trait's optional kernel paths (plan.cpp decides when they run)
    if (const flashsdpa::CpuTier* built = flashsdpa::cpu::built_tier(isa)) {
      if (built->fused_exp) paths.append("fused_exp");
      if (built->transposed_s) paths.append("transposed");
      if (built->fused_bwd_rows) paths.append("fused_bwd_rows");
      if (built->bwd_sdp) paths.append("bwd_sdp");
      if (built->fp16_pv) paths.append("fp16_pv");
      if (built->e4m3_fast) paths.append("e4m3_fast");
      if (built->near_pf) paths.append("near_pf");
      if (built->pv_whole) paths.append("pv_whole");
    }
    t["paths"] = paths;
    // the trait's GEMMs take bf16 operands (Q, K, V and P in bf16, products summed in fp32):
    // the tiers whose P V takes P in bf16, which is where the bf16 exponent's hook is set
    const flashsdpa::CpuTier* bt = flashsdpa::cpu::built_tier(isa);
    t["bf16_operands"] = bt != nullptr && bt->exp2_row_sum_bf16 != nullptr;
    py::list dts;
    for (const char* dt : {"float32", "bfloat16", "float16"})
      if (!info.bf16_only || std::string(dt) == "bfloat16") dts.append(dt);
    t["dtypes"] = dts;
    out.append(t);
  }
  return out;
}

// keep[b, h, i, j] of a dropout call: the exact bits the kernels use (for reference tests).
at::Tensor dropout_keep_mask(int64_t seed, int64_t offset, int64_t B, int64_t H, int64_t L,
                             int64_t S, double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "flashsdpa: dropout_p must be in [0, 1), got ", p);
  at::Tensor keep = at::empty({B, H, L, S}, at::kBool);
  auto* out = keep.data_ptr<bool>();
  const uint32_t thr = flashsdpa::cpu::reference::dropout_threshold(float(p));
  std::vector<uint8_t> row(S);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t i = 0; i < L; ++i) {
      flashsdpa::cpu::reference::dropout_keep_row(uint64_t(seed), uint64_t(offset), uint64_t(bh), i,
                                                  0, S, thr, row.data());
      for (int64_t j = 0; j < S; ++j) out[(bh * L + i) * S + j] = row[j] != 0;
    }
  }
  return keep;
}

flashsdpa::cpu::CpuFeatures fake_features(const py::dict& raw, bool is_x86) {
  flashsdpa::cpu::RawCpuid r;
  r.max_leaf = 7;  // the words not given are 0, the leaves up to 7 present
#define FLASHSDPA_GET(f) \
  if (raw.contains(#f)) r.f = decltype(r.f)(raw[#f].cast<uint64_t>());
  FLASHSDPA_RAW_CPUID_FIELDS(FLASHSDPA_GET)
#undef FLASHSDPA_GET
  return flashsdpa::cpu::decode_features(r, is_x86);
}

py::dict decode_raw(const py::dict& raw, bool is_x86) {
  return features_dict(fake_features(raw, is_x86));
}

// The tier selected_isa would choose on a CPU with these CPUID words (AMX tiles permitted, no
// cap), for a call of kind `call`: "none", "decode" or "light".
std::string choose_isa_for(const py::dict& raw, const std::string& dt, bool kv_e4m3,
                           const std::string& call) {
  using flashsdpa::cpu::DecodeCall;
  const DecodeCall c = call == "decode" ? DecodeCall::decode
                       : call == "light" ? DecodeCall::light
                       : call == "none"  ? DecodeCall::none
                                         : throw py::value_error("call: none, decode or light");
  const auto top = flashsdpa::cpu::Isa(int(flashsdpa::cpu::Isa::kCount) - 1);
  return flashsdpa::cpu::isa_name(flashsdpa::cpu::choose_isa(
      fake_features(raw, true), [] { return true; }, parse_dtype(dt), kv_e4m3, c, top, false));
}

py::dict raw_cpuid() {
  const auto r = flashsdpa::cpu::read_cpuid();
  py::dict d;
#define FLASHSDPA_PUT(f) d[#f] = uint64_t(r.f);
  FLASHSDPA_RAW_CPUID_FIELDS(FLASHSDPA_PUT)
#undef FLASHSDPA_PUT
  return d;
}

// The policy override as a dict and back (its fields: FLASHSDPA_POLICY_FIELDS, plan.h).

py::dict policy_dict(const flashsdpa::PolicyOverride& o) {
  py::dict d;
#define FLASHSDPA_PUT(f) d[#f] = o.f;
  FLASHSDPA_POLICY_FIELDS(FLASHSDPA_PUT)
#undef FLASHSDPA_PUT
  return d;
}

void set_policy(const py::dict& d) {
  flashsdpa::PolicyOverride o;
  for (const auto& item : d) {
    const std::string key = item.first.cast<std::string>();
    bool known = false;
#define FLASHSDPA_GET(f)                \
  if (key == #f) {                      \
    o.f = item.second.cast<int>();      \
    known = true;                       \
  }
    FLASHSDPA_POLICY_FIELDS(FLASHSDPA_GET)
#undef FLASHSDPA_GET
    if (!known) throw py::value_error("flashsdpa: unknown policy field '" + key + "'");
  }
  flashsdpa::set_policy_override(o);
}

py::dict kernel_policy_dict(const flashsdpa::KernelPolicy& pol) {
  py::dict d;
  d["tier"] = pol.tier ? flashsdpa::cpu::isa_name(pol.isa) : "";
#define FLASHSDPA_PUT(f) d[#f] = pol.f;
  FLASHSDPA_KERNEL_POLICY_FIELDS(FLASHSDPA_PUT)
#undef FLASHSDPA_PUT
  return d;
}

// The routing decision for explain() and the GPU direct path (flashsdpa/_api.py). Under CPU
// autocast the call is first cast as PyTorch's autocast rule for SDPA casts it (both entries see
// the cast inputs). Keys: backend ("cpu", "triton", "pytorch"), invalid, reasons (per flashsdpa
// backend), via, declined, kernel (the profiler event of what runs), policy (the CPU kernel's).
py::dict decision_dict(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask,
                       double dropout_p, bool is_causal, c10::optional<double> scale,
                       bool enable_gqa, const std::string& entry, bool routing_on,
                       FLASHSDPA_VARIANT_PARAMS) {
  using flashsdpa::Backend;
  if (q.device().is_cpu() && at::autocast::is_autocast_enabled(at::kCPU)) {
    const auto dt = at::autocast::get_autocast_dtype(at::kCPU);
    const auto cast = [&](const at::Tensor& t) {
      return at::autocast::cached_cast(dt, t, c10::DeviceType::CPU);
    };
    q = cast(q), k = cast(k), v = cast(v);
    if (mask.has_value() && mask->defined()) mask = cast(*mask);
  }
  const flashsdpa::Call c{q,           k,          v,          mask,          dropout_p,
                          is_causal,   scale,      enable_gqa, window_left,   window_right,
                          bottom_right, softcap,   &alibi_slopes, &sinks};
  if (entry != "direct" && entry != "aten")
    throw py::value_error("decide: entry must be 'direct' or 'aten'");
  const flashsdpa::Decision d = flashsdpa::decide(
      c, entry == "direct" ? flashsdpa::Entry::Direct : flashsdpa::Entry::AtenSdpa, routing_on);
  const char* names[4] = {"cpu", "triton", "pytorch", "math"};
  py::dict out;
  out["backend"] = names[int(d.backend)];
  out["invalid"] = d.invalid;
  py::dict reasons;
  for (int b = 0; b < 2; ++b) reasons[names[b]] = d.reasons[b];
  out["reasons"] = reasons;
  out["target"] = names[int(d.target)];
  out["dtype"] = std::string(c10::getDtypeNames(q.scalar_type()).first);  // after autocast
  out["via"] = d.via;
  out["declined"] = d.declined;
  out["kernel"] = "";
  if (d.backend == Backend::CpuKernel) {
    const flashsdpa::Shaped s = flashsdpa::to_4d(q, k, v, mask, /*kv_batch1=*/true);
    const auto plan = flashsdpa::forward_plan(s.q, s.k, s.v, s.mask, dropout_p, is_causal, scale,
                                              FLASHSDPA_VARIANT_ARGS);
    out["kernel"] = plan.second;
    out["policy"] = kernel_policy_dict(plan.first);
  } else if (d.backend == Backend::Triton) {
    out["kernel"] = "flashsdpa::triton_attn_fwd";
  } else if (d.backend == Backend::Math) {
    out["kernel"] = "flashsdpa::variants_math";
  } else if (d.invalid.empty()) {
    out["kernel"] = flashsdpa::pytorch_kernel(c);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashsdpa native extension (ops are registered as torch.ops.flashsdpa.*)";
  m.def("cpu_features", [] { return features_dict(flashsdpa::cpu::host_features()); },
        "CPU features seen by flashsdpa (CPUID + XCR0 + the Linux AMX permission)");
  m.def("raw_cpuid", &raw_cpuid, "the raw CPUID / XCR0 words feature detection decodes");
  m.def("cpu_brand", &flashsdpa::cpu::cpu_brand);
  m.def("tiers", &tiers_list, "every tier: built?, runnable on this CPU?, dtypes");
  m.def("set_isa_cap", &set_tier<&flashsdpa::cpu::set_isa_cap, &flashsdpa::cpu::clear_isa_cap>,
        py::arg("name"), "cap the CPU tier ('' removes the cap)");
  m.def("isa_cap", [] {
    return tier_or_none(flashsdpa::cpu::isa_cap_is_set(), flashsdpa::cpu::isa_cap());
  });
  m.def(
      "selected_isa",
      [](const std::string& dt) {
        return std::string(flashsdpa::cpu::isa_name(flashsdpa::cpu::selected_isa(parse_dtype(dt))));
      },
      py::arg("dtype"));
  m.def("routing_enable", &flashsdpa::routing_enable,
        "install the aten SDPA overrides (flashsdpa.enable)");
  m.def("routing_disable", &flashsdpa::routing_disable, "remove them (flashsdpa.disable)");
  m.def("routing_enabled", &flashsdpa::routing_enabled);
  m.def("set_overrideable_route", &flashsdpa::set_overrideable_route, py::arg("device"),
        "route SDPA calls on this device type to the overrideable aten op ('' for none)");
  m.def("set_triton_available", &flashsdpa::set_triton_available, py::arg("available"));
  m.def("decide", &decision_dict, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask"), py::arg("dropout_p"), py::arg("is_causal"), py::arg("scale"),
        py::arg("enable_gqa"), py::arg("entry"), py::arg("routing_on"),
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("bottom_right") = false,
        py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
        py::arg("sinks") = py::none(),
        "the routing decision for a call (routing.h), as explain() prints it");
  m.def(
      "set_fallback_logger",
      [](py::object fn) {
        // Leaked on purpose: a static py::object would be destroyed after the interpreter.
        static py::object* holder = new py::object();
        *holder = fn;
        if (fn.is_none()) {
          flashsdpa::set_fallback_sink(nullptr);
          return;
        }
        flashsdpa::set_fallback_sink([](const std::string& reason) {
          py::gil_scoped_acquire gil;
          try {
            (*holder)(reason);
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("flashsdpa fallback logger");
          }
        });
      },
      py::arg("fn"), "called once per distinct fallback reason");
  m.def("reset_fallback_notes", &flashsdpa::reset_fallback_notes);
  m.def(
      "check_varlen_layout",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
         const at::Tensor& cu_k, int64_t max_q, int64_t max_k) {
        std::vector<int32_t> a, b;
        flashsdpa::check_varlen_layout(q, k, v, cu_q, cu_k, max_q, max_k, &a, &b);
        return std::make_pair(a, b);
      },
      "the varlen ops' checks of the tensors' shapes and of cu_seqlens_q / _k (CPU): (cu_q, "
      "cu_k) as lists, or ValueError");
  m.def("quantize_e4m3", &flashsdpa::quantize_e4m3, py::arg("t"), py::arg("scale"),
        "k / v as a float8_e4m3fn cache stores them (flash_attn_with_kvcache's append rule)");
  m.def("kvcache_seqlens", &flashsdpa::kvcache_seqlens, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("cache_seqlens"),
        py::arg("block_table"), py::arg("k_scale"), py::arg("v_scale"),
        "flash_attn_with_kvcache's checks (cache_seqlens, block_table, scales on the CPU): the "
        "keys per sequence after the append, or ValueError");

  // Test and tuning hooks (flashsdpa/_testing.py wraps them): not part of the public surface.
  py::module_ t = m.def_submodule("testing", "test and tuning hooks (flashsdpa._testing)");
  t.def("decode_features", &decode_raw, py::arg("raw"), py::arg("is_x86") = true,
        "decode fake CPUID/XCR0 words");
  t.def("choose_isa", &choose_isa_for, py::arg("raw"), py::arg("dtype"), py::arg("kv_e4m3"),
        py::arg("call"), "the tier chosen on a CPU with fake CPUID words");
  t.def("set_emulated_tier",
        &set_tier<&flashsdpa::cpu::set_emulated_tier, &flashsdpa::cpu::clear_emulated_tier>,
        py::arg("name"), "run the SIMDe-emulated build of a tier ('' to stop)");
  t.def("emulated_tier", [] {
    Isa isa = Isa::portable;
    const bool set = flashsdpa::cpu::emulated_tier_set(&isa);
    return tier_or_none(set, isa);
  });
  t.def("set_debug_poison", &flashsdpa::set_debug_poison, py::arg("on"));
  t.def("debug_poison", &flashsdpa::debug_poison);
  t.def("set_policy", &set_policy, py::arg("policy"),
        "force parts of the kernel policy: a dict of PolicyOverride fields (-1 / 0: the plan's)");
  t.def("policy", [] { return policy_dict(flashsdpa::policy_override()); });
  t.def("last_policy", [] { return kernel_policy_dict(flashsdpa::last_policy()); },
        "the kernel policy of this thread's last CPU call");
  t.def("set_path_counting", &flashsdpa::set_path_counting, py::arg("on"),
        "count the fast paths taken inside the kernels (reset when switched)");
  t.def("path_counts", [] {
    py::dict d;
    const auto* c = flashsdpa::path_counters();
#define FLASHSDPA_PUT(f) d[#f] = c ? c->f.load() : 0;
    FLASHSDPA_PATH_COUNTERS(FLASHSDPA_PUT)
#undef FLASHSDPA_PUT
    return d;
  });
  t.def(
      "exp2_row_sum",
      [](const at::Tensor& x, double m, const std::string& dt, bool bf16_p) -> py::object {
        TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat, "exp2_row_sum: x must be a 1-D "
                    "float32 tensor");
        const int64_t n = x.numel();
        // padded to whole vectors of -inf, which the tiers' loops read
        at::Tensor buf = at::full({(n + 15) / 16 * 16 + 16}, -INFINITY, x.options());
        buf.narrow(0, 0, n).copy_(x);
        const auto& tier = flashsdpa::cpu::selected_tier(parse_dtype(dt));
        if (!bf16_p) {
          const float sum = tier.exp2_row_sum(buf.data_ptr<float>(), int(n), float(m));
          return py::make_tuple(buf.narrow(0, 0, n).clone(), sum);
        }
        if (!tier.exp2_row_sum_bf16) return py::none();
        at::Tensor p = at::empty({buf.numel()}, x.options().dtype(at::kBFloat16));
        const float sum = tier.exp2_row_sum_bf16(
            buf.data_ptr<float>(), int(n), 1.0f, float(m),
            reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>()));
        return py::make_tuple(p.narrow(0, 0, n).clone(), sum);
      },
      py::arg("x"), py::arg("m"), py::arg("dtype") = "float32", py::arg("bf16_p") = false,
      "the softmax exponent of the tier that runs `dtype` (cap / emulation honoured): "
      "(exp2(x - m), its sum); bf16_p: the one P V's bf16 operand is made with (P in bf16, "
      "the unrounded sum), None where that tier's P is not bf16");
  t.def(
      "softcap_row",
      [](const at::Tensor& x, double cap, const std::string& dt) {
        TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat, "softcap_row: x must be a 1-D "
                    "float32 tensor");
        TORCH_CHECK(cap > 0, "softcap_row: cap must be > 0");
        const int64_t n = x.numel();
        at::Tensor buf = at::zeros({(n + 15) / 16 * 16}, x.options());  // whole vectors
        buf.narrow(0, 0, n).copy_(x);
        flashsdpa::cpu::selected_tier(parse_dtype(dt))
            .softcap_row(buf.data_ptr<float>(), int(n), float(cap));
        return buf.narrow(0, 0, n).clone();
      },
      py::arg("x"), py::arg("cap"), py::arg("dtype") = "float32",
      "the softcap of the tier that runs `dtype` (cap / emulation honoured): cap tanh(x / cap)");
  // ItemQueue (params.h) by itself: next(t) for each t of `callers`, one call at a time; and
  // every queue thread draining it at once, thread t sleeping delay_us[t] after each item (a
  // core another process slows), each thread's items in the order it took them.
  t.def("item_queue_sequence",
        [](int64_t total, int threads, bool in_order, const std::vector<int>& callers) {
          flashsdpa::ItemQueue q(total, threads, in_order);
          std::vector<int64_t> got;
          for (int t : callers) {
            TORCH_CHECK(t >= 0 && t < q.threads(), "item_queue_sequence: caller ", t,
                        " is not one of the queue's ", q.threads(), " threads");
            got.push_back(q.next(t));
          }
          return got;
        },
        py::arg("total"), py::arg("threads"), py::arg("in_order"), py::arg("callers"));
  t.def("item_queue_drain",
        [](int64_t total, int threads, bool in_order, const std::vector<int64_t>& delay_us) {
          flashsdpa::ItemQueue q(total, threads, in_order);
          TORCH_CHECK(int64_t(delay_us.size()) == q.threads(),
                      "item_queue_drain: delay_us needs one entry a thread (", q.threads(), ")");
          std::vector<std::vector<int64_t>> got(q.threads());
          {
            py::gil_scoped_release no_gil;
            std::vector<std::thread> pool;
            for (int t = 0; t < q.threads(); ++t)
              pool.emplace_back([&, t] {
                for (int64_t i; (i = q.next(t)) >= 0;) {
                  got[t].push_back(i);
                  if (delay_us[t] > 0)
                    std::this_thread::sleep_for(std::chrono::microseconds(delay_us[t]));
                }
              });
            for (auto& th : pool) th.join();
          }
          return got;
        },
        py::arg("total"), py::arg("threads"), py::arg("in_order"), py::arg("delay_us"));
  t.def("dropout_keep_mask", &dropout_keep_mask, py::arg("seed"), py::arg("offset"), py::arg("B"),
        py::arg("H"), py::arg("L"), py::arg("S"), py::arg("p"));
}
