"""The direct API: flashsdpa.scaled_dot_product_attention and flashsdpa.explain.

Each call is (1) validated (bad input raises an error that names the argument), then (2) either
served by a flashsdpa kernel or (3) declined with a reason and passed to PyTorch's own
scaled_dot_product_attention. `explain()` shows the same decision in words.
"""
import torch
import torch.nn.functional as F

from . import _C, _ops

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# PyTorch's own implementation, captured at import: the fallback must never route back to us
# once F.scaled_dot_product_attention itself is redirected.
_torch_sdpa = F.scaled_dot_product_attention


def _arg_error(msg):
    return ValueError("flashsdpa.scaled_dot_product_attention: " + msg)


def _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Raises ValueError/TypeError for input that no SDPA implementation accepts.

    Only errors PyTorch also raises are raised here (with a message naming the argument), so
    anything valid for F.scaled_dot_product_attention stays valid for flashsdpa."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashsdpa.scaled_dot_product_attention: {name} must be a Tensor, "
                            f"got {type(t).__name__}")
        if t.dim() < 2:
            raise _arg_error(f"{name} must have at least 2 dims (..., seq_len, head_dim), got "
                             f"{t.dim()}-D")
        if not (t.is_floating_point()):
            raise _arg_error(f"{name}.dtype must be a floating-point type, got {t.dtype}")
    if key.dtype != query.dtype:
        raise _arg_error(f"key.dtype ({key.dtype}) must match query.dtype ({query.dtype})")
    if value.dtype != query.dtype:
        raise _arg_error(f"value.dtype ({value.dtype}) must match query.dtype ({query.dtype})")
    if not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p <= 1.0):
        raise _arg_error(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise _arg_error(f"scale must be a float or None, got {type(scale).__name__}")
    if key.shape[-1] != query.shape[-1]:
        raise _arg_error(f"key head_dim ({key.shape[-1]}) must match query head_dim "
                         f"({query.shape[-1]})")
    if key.shape[-2] != value.shape[-2]:
        raise _arg_error(f"key seq_len ({key.shape[-2]}) must match value seq_len "
                         f"({value.shape[-2]})")
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        b = query.shape[0]
        for name, t in (("key", key), ("value", value)):
            if t.shape[0] not in (1, b):
                raise _arg_error(f"{name} batch size ({t.shape[0]}) must match query batch size "
                                 f"({b})")
        hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
        if hk != hv:
            raise _arg_error(f"key heads ({hk}) must match value heads ({hv})")
        if enable_gqa:
            if hk == 0 or hq % hk != 0:
                raise _arg_error(f"query heads ({hq}) must be a multiple of key/value heads "
                                 f"({hk}) with enable_gqa=True")
        elif hk not in (1, hq):
            raise _arg_error(f"query heads ({hq}) differ from key/value heads ({hk}); pass "
                             f"enable_gqa=True for grouped-query attention")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError("flashsdpa.scaled_dot_product_attention: attn_mask must be a Tensor "
                            f"or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != torch.float32 \
                and attn_mask.dtype != query.dtype:
            raise _arg_error(f"attn_mask.dtype must be bool, float32 or query.dtype "
                             f"({query.dtype}), got {attn_mask.dtype}")
        target = tuple(query.shape[:-1]) + (key.shape[-2],)
        if attn_mask.dim() > len(target) or any(
                m != 1 and m != t for m, t in zip(reversed(attn_mask.shape), reversed(target))):
            raise _arg_error(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"the attention shape {target} (..., L, S)")


def _decline_reasons(query, key, value, attn_mask, dropout_p, enable_gqa):
    """Why the flashsdpa CPU kernel cannot take this (valid) call; empty if it can."""
    reasons = []
    if query.device.type != "cpu" or key.device.type != "cpu" or value.device.type != "cpu":
        reasons.append(f"tensors on {query.device.type}: only CPU kernels are built in")
    if query.dtype not in _KERNEL_DTYPES:
        reasons.append(f"dtype {query.dtype}: kernels take float32, bfloat16, float16")
    if query.is_nested or key.is_nested or value.is_nested:
        reasons.append("nested tensors")
    if not (query.dim() == key.dim() == value.dim() and query.dim() in (3, 4)):
        reasons.append(f"ranks query {query.dim()}-D, key {key.dim()}-D, value {value.dim()}-D: "
                       "kernels take 3-D or 4-D query/key/value of the same rank")
    elif query.dim() == 3 and (key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]):
        reasons.append("3-D inputs with broadcast batch")
    if query.shape[-1] == 0 or value.shape[-1] == 0:
        reasons.append("head_dim 0")
    if dropout_p >= 1.0:
        reasons.append("dropout_p == 1 (the output is all zeros)")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        reasons.append("attn_mask requires grad: flashsdpa computes no mask gradient")
    return reasons


def _to_4d(query, key, value, attn_mask):
    """3-D (N, L, E) inputs become (N, 1, L, E); a 4-D batch of size 1 broadcasts by stride 0."""
    if query.dim() == 3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    else:
        b = query.shape[0]
        if key.shape[0] != b:
            key = key.expand(b, -1, -1, -1)
        if value.shape[0] != b:
            value = value.expand(b, -1, -1, -1)
    return query, key, value, attn_mask


def _autocast(query, key, value, attn_mask):
    """Mirror PyTorch's CPU autocast rule for SDPA: float inputs run in the autocast dtype."""
    if not torch.is_autocast_enabled("cpu") or query.device.type != "cpu":
        return query, key, value, attn_mask
    dt = torch.get_autocast_dtype("cpu")
    if query.dtype != torch.float32:
        return query, key, value, attn_mask
    query, key, value = query.to(dt), key.to(dt), value.to(dt)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(dt)
    return query, key, value, attn_mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention.

    Same arguments and semantics: causal masking is top-left aligned, a bool mask means
    "attend where True", a float mask is added to the scores, dropout applies to the attention
    probabilities (p in [0, 1)), scale defaults to 1/sqrt(head_dim), enable_gqa lets key/value
    have fewer heads. Rows with nothing to attend to give 0 (as PyTorch's fused CPU kernel).
    Differentiable in query, key and value. Calls the kernels cannot take go to PyTorch;
    `flashsdpa.explain(...)` says which and why.
    """
    _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    if _decline_reasons(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    squeeze = query.dim() == 3
    q, k, v, mask = _to_4d(query, key, value, attn_mask)
    out, _, _ = _ops.flash_attn_fwd(q, k, v, mask, float(dropout_p), bool(is_causal),
                                    scale=None if scale is None else float(scale))
    return out.squeeze(1) if squeeze else out


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
        _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    except (ValueError, TypeError) as e:
        lines.append(f"  invalid arguments, the call raises: {e}")
        return "\n".join(lines)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    reasons = _decline_reasons(query, key, value, attn_mask, dropout_p, enable_gqa)
    if reasons:
        lines.append("  flashsdpa declines:")
        lines += [f"    - {r}" for r in reasons]
        choice = _torch_choice(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa)
        lines.append(f"  runs instead: torch.nn.functional.scaled_dot_product_attention "
                     f"({choice})")
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
    return "\n".join(lines)
