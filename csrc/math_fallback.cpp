// The variants' math on PyTorch ops (routing.h, variants_math): what runs when a call asks for a
// window, softcap, ALiBi or sinks and no flashsdpa kernel takes it (float64, a device without a
// variant kernel). PyTorch's autograd differentiates it (q, k, v, sinks). Materialises the
// (B, H, L, S) scores: a fallback, not a fast path. Compiled once, without ISA flags.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <limits>

#include "routing.h"

namespace flashsdpa {

std::tuple<at::Tensor, at::Tensor> variants_math(const Call& c, bool lse_neg_inf) {
  RECORD_FUNCTION("flashsdpa::variants_math", c10::ArrayRef<const c10::IValue>{});
  const auto dt = c.q.scalar_type();
  // fp32 arithmetic for 16-bit inputs (as the kernels), the inputs' own otherwise
  const auto ct = dt == at::kHalf || dt == at::kBFloat16 ? at::kFloat : dt;
  at::Tensor q = c.q.to(ct), k = c.k.to(ct), v = c.v.to(ct);
  const int64_t Hq = q.size(1), Hkv = k.size(1), Lq = q.size(2), Lk = k.size(2);
  if (Hkv != Hq) {
    k = k.repeat_interleave(Hq / Hkv, 1);
    v = v.repeat_interleave(Hq / Hkv, 1);
  }
  const double scale = c.scale.has_value() ? *c.scale : 1.0 / std::sqrt(double(q.size(3)));
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * scale;  // (B, H, Lq, Lk)
  if (c.softcap > 0.0) s = at::tanh(s / c.softcap) * c.softcap;
  const auto opts = s.options();
  const int64_t d = c.bottom_right ? Lk - Lq : 0;
  const at::Tensor i = at::arange(Lq, opts).view({Lq, 1}) + double(d);  // i + d
  const at::Tensor j = at::arange(Lk, opts).view({1, Lk});
  if (c.has_alibi()) {
    const at::Tensor slopes = (*c.alibi_slopes)->to(ct);
    const at::Tensor sl = slopes.dim() == 1 ? slopes.view({1, Hq, 1, 1})
                                            : slopes.view({slopes.size(0), Hq, 1, 1});
    s = s - sl * (i - j).abs();
  }
  if (c.mask.has_value() && c.mask->defined()) {
    const at::Tensor& m = *c.mask;
    s = m.scalar_type() == at::kBool
            ? s.masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity())
            : s + m.to(ct);
  }
  const int64_t right = c.is_causal ? 0 : c.window_right;
  at::Tensor hidden = at::zeros({Lq, Lk}, opts.dtype(at::kBool));
  if (right >= 0) hidden = hidden.logical_or(j > i + double(right));
  if (c.window_left >= 0) hidden = hidden.logical_or(j < i - double(c.window_left));
  s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  if (c.has_sinks()) {  // a key per head with score sink[h] and no value
    const at::Tensor sink = (*c.sinks)->to(ct).view({1, Hq, 1, 1}).expand({s.size(0), Hq, Lq, 1});
    s = at::cat({s, sink}, -1);
  }
  at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);
  // a row that sees nothing: P = 0 (exp(-inf - -inf) would be NaN)
  const at::Tensor empty = lse.isneginf();
  at::Tensor p = at::exp(s - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0);
  if (c.has_sinks()) p = p.narrow(-1, 0, Lk);
  if (c.dropout_p > 0.0) p = at::dropout(p, c.dropout_p, /*train=*/true);
  at::Tensor out = at::matmul(p, v).to(dt);
  lse = lse.squeeze(-1).to(at::kFloat);
  if (!lse_neg_inf) lse = lse.masked_fill(lse.isneginf(), 0.0);
  return {out, lse};
}

}  // namespace flashsdpa
