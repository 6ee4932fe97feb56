// Autograd for flashsdpa::flash_attn_fwd, in C++ so that a call costs no Python: the backward
// is flashsdpa::flash_attn_bwd, called through the dispatcher (so torch.compile traces it as one
// node). The mask gets no gradient (calls whose mask requires grad are routed to PyTorch).
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace flashsdpa {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                               double dropout_p, bool is_causal, c10::optional<double> scale) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_fwd", "")
                         .typed<FwdSignature>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse, rng] = op.call(q, k, v, mask, dropout_p, is_causal, scale);
    ctx->save_for_backward({q, k, v, mask.has_value() ? *mask : at::Tensor(), out, lse, rng});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({lse, rng});
    return {out, lse, rng};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashsdpa::flash_attn_bwd", "")
                         .typed<BwdSignature>();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& mask = saved[3];
    c10::optional<at::Tensor> opt_mask;
    if (mask.defined()) opt_mask = mask;
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[4]);
    auto [dq, dk, dv] = op.call(grad_out, saved[0], saved[1], saved[2], saved[4], saved[5],
                                saved[6], opt_mask, ctx->saved_data["dropout_p"].toDouble(),
                                ctx->saved_data["is_causal"].toBool(),
                                ctx->saved_data["scale"].toOptional<double>());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attn_fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
    c10::optional<double> scale) {
  auto res = FlashAttnFunction::apply(q, k, v, mask, dropout_p, is_causal, scale);
  return {res[0], res[1], res[2]};
}

}  // namespace
}  // namespace flashsdpa

TORCH_LIBRARY_IMPL(flashsdpa, Autograd, m) {
  m.impl("flash_attn_fwd", &flashsdpa::flash_attn_fwd_autograd);
}
