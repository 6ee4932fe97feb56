"""The direct API: flashsdpa.scaled_dot_product_attention and flashsdpa.explain.

Each call is routed by one decision (csrc/routing.cpp, decide): invalid arguments raise an error
that names the argument; otherwise a flashsdpa backend takes the call, or PyTorch's own
scaled_dot_product_attention does, with the reason logged. `explain()` prints that decision.
"""
import torch

from . import _C, _gpu, _ops  # noqa: F401  (_ops registers the ops' fake kernels and autograd)
from ._common import GPU_DEVICE_TYPES, decide
from ._routing import is_enabled

_sdpa_op = torch.ops.flashsdpa.sdpa.default


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Same arguments and semantics: causal masking is top-left aligned, a bool mask means
    "attend where True", a float mask is added to the scores, dropout applies to the attention
    probabilities (p in [0, 1]), scale defaults to 1/sqrt(head_dim), enable_gqa lets key/value
    have fewer heads. Rows with nothing to attend to give 0 (as PyTorch's fused CPU kernel).
    Differentiable in query, key and value. Calls the kernels cannot take go to PyTorch;
    `flashsdpa.explain(...)` says which and why. Bad input raises ValueError naming the argument.
    CPU tensors run the C++ kernels; xpu (and cuda) tensors the Triton kernels.
    """
    if query.device.type in GPU_DEVICE_TYPES:
        return _gpu.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if scale is None and enable_gqa is False:  # keyword arguments cost ~0.9 us per op call
        return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal)
    return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa)


# ---- explain ---------------------------------------------------------------------------------------
def _describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    parts = [f"query {tuple(query.shape)} {query.dtype} on {query.device}",
             f"key {tuple(key.shape)}", f"value {tuple(value.shape)}"]
    if attn_mask is not None:
        parts.append(f"attn_mask {tuple(attn_mask.shape)} {attn_mask.dtype}")
    if is_causal:
        parts.append("causal")
    if dropout_p:
        parts.append(f"dropout_p={dropout_p}")
    if scale is not None:
        parts.append(f"scale={scale}")
    if enable_gqa:
        parts.append("enable_gqa")
    return ", ".join(parts)


_PATHS = (("decode", "split-KV decode (short queries; K/V read in place)"),
          ("transposed", "transposed scores (S^T = K Q^T; K and V read in place)"),
          ("prepack", "K^T / V panels packed once for every q block"))


def _cpu_lines(d, query, key, attn_mask, dropout_p, is_causal):
    dt = d["dtype"]  # what runs, after autocast
    tier = d["policy"]["tier"]
    built = [t["name"] for t in _C.tiers() if t["built"] and t["cpu_ok"] and dt in t["dtypes"]]
    width = "fp32 in" if dt == "float32" else f"{dt} widened to fp32"
    group = (query.shape[-3] // key.shape[-3]) if query.dim() == 4 else 1
    lines = [f"  runs: flashsdpa CPU kernel, tier '{tier}' (best of {built} for {dt}; "
             f"cap FLASHSDPA_CPU_ISA={_C.isa_cap() or 'unset'})",
             f"  dtype path: {width}, fp32 scores/softmax/accumulation, output rounded to "
             f"{dt}; logsumexp saved in fp32"]
    features = []
    if is_causal:
        features.append("causal (blocks past the diagonal skipped)")
    if attn_mask is not None:
        features.append(f"{attn_mask.dtype} mask read in place through broadcast strides")
    if group > 1:
        features.append(f"grouped-query attention, group {group} (K/V not repeated)")
    if dropout_p > 0:
        features.append(f"dropout p={dropout_p} (Philox keep-mask, regenerated in backward)")
    features += [text for key_, text in _PATHS if d["policy"][key_]]
    if features:
        lines.append("  with: " + "; ".join(features))
    lines.append("  ops: flashsdpa::flash_attn_fwd, backward flashsdpa::flash_attn_bwd "
                 "(blocked FA2, gradients accumulated in fp32)")
    return lines


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    """Which kernel flashsdpa.scaled_dot_product_attention would run for these arguments, or
    why flashsdpa declines them and what runs instead; and what F.scaled_dot_product_attention
    runs in the current routing state. A readable string; its `kernel:` lines name the profiler
    event of the kernel that runs (a flashsdpa phase, or PyTorch's aten op)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    lines = ["flashsdpa.explain: " + _describe_call(*args)]
    d = decide(*args, "direct")
    if d["invalid"]:
        lines.append(f"  invalid arguments, the call raises: {d['invalid']}")
        return "\n".join(lines)
    if d["backend"] == "pytorch":
        reasons = d["reasons"]["cpu" if d["target"] == "pytorch" else d["target"]]
        lines.append("  flashsdpa declines:")
        lines += [f"    - {r}" for r in reasons]
        lines.append("  runs instead: torch.nn.functional.scaled_dot_product_attention")
    elif d["backend"] == "cpu":
        lines += _cpu_lines(d, query, key, attn_mask, dropout_p, is_causal)
    else:
        lines.append(f"  runs: flashsdpa Triton kernels on {query.device.type} (FA2 forward, "
                     "dK/dV + dQ backward; fp32 accumulation, natural-log LSE)")
        if dropout_p > 0:
            lines.append(f"  with: dropout p={dropout_p} (Triton Philox keep-mask, "
                         "regenerated in backward)")
    lines.append(f"  kernel: {d['kernel']}")
    routed = decide(*args, "aten", is_enabled())
    lines.append(f"  F.scaled_dot_product_attention: {routed['via']}")
    lines.append(f"  F.scaled_dot_product_attention kernel: {routed['kernel']}")
    return "\n".join(lines)
