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

// Debugging aid used by the tests: fill every output and scratch buffer with NaN before the
// kernels run, so that an element a kernel forgets to write shows up as NaN.
void set_debug_poison(bool on);
bool debug_poison();

// Whether the forward packs K^T / V once into a shared buffer (Phase::PackKV) or per block.
// Auto follows the tier's advice; the others exist so tests cover both paths.
enum class KvPrepack : int { Auto = 0, Never = 1, Always = 2 };
void set_kv_prepack(KvPrepack policy);

// Backward strategy: single pass (items per batch x kv head) or two sweeps (dk/dv per kv block,
// then dq per q block). Same bits either way; Auto picks by shape and thread count.
enum class BwdStrategy : int { Auto = 0, TwoSweep = 1, Fused = 2 };
void set_bwd_strategy(BwdStrategy s);

// Forward path for short queries: split-KV decode or the prefill blocking. Auto picks by q_len.
enum class DecodePolicy : int { Auto = 0, Never = 1, Always = 2 };
void set_decode_policy(DecodePolicy d);

// Tuning hook (bench/tune_blocks.py): block sizes replacing the tier's choice; 0 keeps it.
void set_block_override(int fwd_bq, int fwd_bk, int bwd_bq, int bwd_bk);

}  // namespace flashsdpa
