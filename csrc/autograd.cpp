// Autograd for flashsdpa::flash_attn_fwd, in C++ so that a call costs no Python: the backward
// is flashsdpa::flash_attn_bwd, called through the dispatcher (so torch.compile traces it as one
// node). Gradients flow to query, key, value and sinks; the mask and the ALiBi slopes get none
// (calls whose mask requires grad are routed to PyTorch).
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace flashsdpa {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}
c10::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

struct FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                               double dropout_p, bool is_causal, c10::optional<double> scale,
                               FLASHSDPA_VARIANT_PARAMS, bool lse_neg_inf) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_fwd", "")
                         .typed<FwdSignature>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse, rng, stats] = op.call(q, k, v, mask, dropout_p, is_causal, scale,
                                          FLASHSDPA_VARIANT_ARGS, lse_neg_inf);
    ctx->save_for_backward({q, k, v, or_undefined(mask), out, lse, rng, or_undefined(alibi_slopes),
                            or_undefined(sinks), stats});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["bottom_right"] = bottom_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->mark_non_differentiable({lse, rng, stats});
    return {out, lse, rng, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_bwd", "")
                         .typed<BwdSignature>();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[4]);
    const auto& d = ctx->saved_data;
    auto [dq, dk, dv, dsinks] = op.call(
        grad_out, saved[0], saved[1], saved[2], saved[4], saved[5], saved[6],
        defined_or_none(saved[3]), d.at("dropout_p").toDouble(), d.at("is_causal").toBool(),
        d.at("scale").toOptional<double>(), d.at("window_left").toInt(),
        d.at("window_right").toInt(), d.at("bottom_right").toBool(), d.at("softcap").toDouble(),
        defined_or_none(saved[7]), defined_or_none(saved[8]), saved[9]);
    // one gradient per forward input: q, k, v, mask, dropout_p, is_causal, scale, the variants
    // (window_left, window_right, bottom_right, softcap, alibi_slopes, sinks), lse_neg_inf
    return {dq,          dk,          dv,          at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            saved[8].defined() ? dsinks : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
    c10::optional<double> scale, FLASHSDPA_VARIANT_PARAMS, bool lse_neg_inf) {
  const ForBackwardScope scope(needs_backward(q, k, v, sinks));
  auto res = FlashAttnFunction::apply(q, k, v, mask, dropout_p, is_causal, scale,
                                      FLASHSDPA_VARIANT_ARGS, lse_neg_inf);
  return {res[0], res[1], res[2], res[3]};
}

// flashsdpa::flash_attn_varlen_fwd: the same, for packed variable-length batches.
struct FlashAttnVarlenFunction : public torch::autograd::Function<FlashAttnVarlenFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, FLASHSDPA_VARLEN_PARAMS) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_varlen_fwd", "")
                         .typed<VarlenFwdSignature>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse, rng, stats] = op.call(q, k, v, FLASHSDPA_VARLEN_ARGS);
    ctx->save_for_backward({q, k, v, out, lse, rng, cu_seqlens_q, cu_seqlens_k,
                            or_undefined(alibi_slopes), or_undefined(sinks), stats});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->mark_non_differentiable({lse, rng, stats});
    return {out, lse, rng, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_varlen_bwd", "")
                         .typed<VarlenBwdSignature>();
    const auto s = ctx->get_saved_variables();
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    const auto& d = ctx->saved_data;
    auto [dq, dk, dv, dsinks] =
        op.call(grad_out, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
                d.at("max_seqlen_q").toInt(), d.at("max_seqlen_k").toInt(),
                d.at("dropout_p").toDouble(), d.at("softmax_scale").toOptional<double>(),
                d.at("causal").toBool(), d.at("window_left").toInt(),
                d.at("window_right").toInt(), d.at("softcap").toDouble(), defined_or_none(s[8]),
                defined_or_none(s[9]), s[10]);
    // one gradient per forward input: q, k, v, cu_seqlens_q / _k, max_seqlen_q / _k, dropout_p,
    // softmax_scale, causal, window_left / _right, softcap, alibi_slopes, sinks
    std::vector<at::Tensor> g(15);
    g[0] = dq, g[1] = dk, g[2] = dv;
    if (s[9].defined()) g[14] = dsinks;
    return g;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_varlen_fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, FLASHSDPA_VARLEN_PARAMS) {
  const ForBackwardScope scope(needs_backward(q, k, v, sinks));
  auto res = FlashAttnVarlenFunction::apply(q, k, v, FLASHSDPA_VARLEN_ARGS);
  return {res[0], res[1], res[2], res[3]};
}

}  // namespace
}  // namespace flashsdpa

TORCH_LIBRARY_IMPL(flashsdpa, Autograd, m) {
  m.impl("flash_attn_fwd", &flashsdpa::flash_attn_fwd_autograd);
  m.impl("flash_attn_varlen_fwd", &flashsdpa::flash_attn_varlen_fwd_autograd);
}
