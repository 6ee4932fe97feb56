"""The direct API: flashsdpa.scaled_dot_product_attention and flashsdpa.explain.

Each call is (1) validated (bad input raises an error that names the argument), then (2) either
served by a flashsdpa kernel or (3) declined with a reason and passed to PyTorch's own
scaled_dot_product_attention. `explain()` shows the same decision in words.
"""
import torch

from . import _C, _gpu, _ops  # noqa: F401  (_ops registers the ops' fake kernels and autograd)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

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
    if query.device.type in _gpu.GPU_DEVICE_TYPES:
        return _gpu.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if scale is None and enable_gqa is False:  # keyword arguments cost ~0.9 us per op call
        return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal)
    return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa)


def _autocast(query, key, value, attn_mask):
    """What PyTorch's CPU autocast rule for SDPA does to the inputs (explain() only)."""
    if not torch.is_autocast_enabled("cpu") or query.device.type != "cpu" \
            or query.dtype != torch.float32:
        return query, key, value, attn_mask
    dt = torch.get_autocast_dtype("cpu")
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(dt)
    return query.to(dt), key.to(dt), value.to(dt), attn_mask


# ---- explain ---------------------------------------------------------------------------------------

_TORCH_BACKENDS = {0: "math kernel", 1: "flash-attention CPU kernel",
                   2: "memory-efficient kernel", 3: "cuDNN kernel", 4: "overrideable kernel"}


def _torch_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    try:
        idx = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                      scale=scale, enable_gqa=enable_gqa)
        return "PyTorch's " + _TORCH_BACKENDS.get(int(idx), f"backend #{idx}")
    except Exception:  # torch's chooser rejects some inputs its math path accepts
        return "PyTorch's math kernel"


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


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    """Which kernel flashsdpa.scaled_dot_product_attention would run for these arguments, or
    why flashsdpa declines them and what runs instead. Returns a readable string."""
    lines = ["flashsdpa.explain: " + _describe_call(query, key, value, attn_mask, dropout_p,
                                                     is_causal, scale, enable_gqa)]
    try:
        _C.check_sdpa_args(query, key, value, attn_mask, float(dropout_p),
                           None if scale is None else float(scale), bool(enable_gqa))
    except (ValueError, TypeError, RuntimeError) as e:
        lines.append(f"  invalid arguments, the call raises: {e}")
        return "\n".join(lines)
    if query.device.type in _gpu.GPU_DEVICE_TYPES:
        return _explain_gpu(lines, query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    reasons = _C.decline_reasons(query, key, value, attn_mask, float(dropout_p), bool(enable_gqa))
    choice = _torch_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reasons:
        lines.append("  flashsdpa declines:")
        lines += [f"    - {r}" for r in reasons]
        lines.append(f"  runs instead: torch.nn.functional.scaled_dot_product_attention "
                     f"({choice})")
        lines.append(_routed_line(query, reasons, choice))
        return "\n".join(lines)

    dt = _DTYPE_NAMES[query.dtype]
    tier = _C.selected_isa(dt)
    built = [t["name"] for t in _C.tiers()
             if t["built"] and t["cpu_ok"] and dt in t["dtypes"]]
    cap = _C.isa_cap()
    width = "fp32 in" if query.dtype == torch.float32 else f"{dt} widened to fp32"
    group = (query.shape[-3] // key.shape[-3]) if query.dim() == 4 else 1
    lines.append(f"  runs: flashsdpa CPU kernel, tier '{tier}' (best of {built} for {dt}; "
                 f"cap FLASHSDPA_CPU_ISA={cap or 'unset'})")
    lines.append(f"  dtype path: {width}, fp32 scores/softmax/accumulation, output rounded to "
                 f"{dt}; logsumexp saved in fp32")
    features = []
    if is_causal:
        features.append("causal (blocks above the diagonal skipped)")
    if attn_mask is not None:
        features.append(f"{attn_mask.dtype} mask read in place through broadcast strides")
    if group > 1:
        features.append(f"grouped-query attention, group {group} (K/V not repeated)")
    if dropout_p > 0:
        features.append(f"dropout p={dropout_p} (Philox keep-mask, regenerated in backward)")
    if features:
        lines.append("  with: " + "; ".join(features))
    lines.append("  ops: flashsdpa::flash_attn_fwd, backward flashsdpa::flash_attn_bwd "
                 "(blocked FA2, gradients accumulated in fp32)")
    lines.append(_routed_line(query, reasons, choice))
    return "\n".join(lines)


def _explain_gpu(lines, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    from ._routing import is_enabled
    reasons = _gpu.decline_reasons(query, key, value, attn_mask, dropout_p, enable_gqa)
    if reasons:
        lines.append("  flashsdpa declines:")
        lines += [f"    - {r}" for r in reasons]
        lines.append("  runs instead: torch.nn.functional.scaled_dot_product_attention")
        return "\n".join(lines)
    lines.append(f"  runs: flashsdpa Triton kernels on {query.device.type} (FA2 forward, dK/dV + "
                 "dQ backward; fp32 accumulation, natural-log LSE)")
    if dropout_p > 0:
        lines.append(f"  with: dropout p={dropout_p} (Triton Philox keep-mask, regenerated in "
                     "backward)")
    if query.device.type == "xpu":
        state = ("registered on the XPU key for the overrideable and flash SDPA ops"
                 if _gpu.is_registered() else
                 "flashsdpa not enabled (flashsdpa.enable() to route)")
        lines.append(f"  F.scaled_dot_product_attention: {state}")
    else:
        lines.append("  F.scaled_dot_product_attention: PyTorch's own kernels (flashsdpa routes "
                     "CPU and xpu tensors)" if is_enabled() else
                     "  F.scaled_dot_product_attention: PyTorch's own kernels")
    return "\n".join(lines)


def _routed_line(query, reasons, choice):
    """What F.scaled_dot_product_attention does with the same arguments (routing state)."""
    from ._routing import is_enabled
    head = "  F.scaled_dot_product_attention: "
    if not is_enabled():
        return head + f"flashsdpa not enabled, so {choice} (flashsdpa.enable() to route)"
    if query.device.type != "cpu":
        return head + f"{choice} (flashsdpa routes CPU tensors only)"
    if not torch.backends.cuda.flash_sdp_enabled():
        return head + f"{choice} (sdpa_kernel() excludes FLASH_ATTENTION, so flashsdpa stays out)"
    if "flash" in choice:
        return head + ("flashsdpa's kernel through the overridden "
                       "aten::_scaled_dot_product_flash_attention_for_cpu"
                       if not reasons else f"{choice}")
    if not reasons:
        return head + "flashsdpa's kernel (a case PyTorch would run on its math path)"
    return head + choice
