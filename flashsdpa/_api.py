"""The direct API: flashsdpa.scaled_dot_product_attention and flashsdpa.explain.

Each call is routed by one decision (csrc/routing.cpp, decide): invalid arguments raise an error
that names the argument; otherwise a flashsdpa backend takes the call, or PyTorch's own
scaled_dot_product_attention does, with the reason logged. `explain()` prints that decision.
"""
import torch

from . import _C, _gpu, _nested, _ops  # noqa: F401  (_ops registers the ops' fake kernels and autograd)
from ._common import DTYPE_NAMES, GPU_DEVICE_TYPES, decide
from ._routing import is_enabled

_sdpa_op = torch.ops.flashsdpa.sdpa.default


def _window(window_size):
    """(left, right) of a window_size argument: a pair of ints, -1 meaning unbounded."""
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"flashsdpa: window_size must be a pair (left, right) of ints, got "
                         f"{window_size!r}") from None


def _variants(window_size, softcap, alibi_slopes, sinks):
    """The variant keyword arguments of the ops (None when the call asks for none)."""
    left, right = _window(window_size)
    if left == -1 and right == -1 and not softcap and alibi_slopes is None and sinks is None:
        return None
    return dict(window_left=left, window_right=right, softcap=float(softcap),
                alibi_slopes=alibi_slopes, sinks=sinks)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                 sinks=None):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, plus the variants.

    Same arguments and semantics: causal masking is top-left aligned, a bool mask means
    "attend where True", a float mask is added to the scores, dropout applies to the attention
    probabilities (p in [0, 1]), scale defaults to 1/sqrt(head_dim), enable_gqa lets key/value
    have fewer heads. Rows with nothing to attend to give 0 (as PyTorch's fused CPU kernel).
    Keyword-only variants (semantics: ../README.md, "Attention variants"): window_size
    (left, right) keys around each row's diagonal (top-left aligned here, -1 unbounded; causal
    is right = 0), softcap (s = softcap * tanh(s / softcap)), alibi_slopes (H,) or (B, H)
    float32 (s -= slope * |i - j|), sinks (H,) float32 (a per-head key with no value,
    differentiable). Differentiable in query, key, value and sinks. Calls the kernels cannot
    take go to PyTorch (or, with variants, to flashsdpa's math on PyTorch ops);
    `flashsdpa.explain(...)` says which and why. Bad input raises ValueError naming the
    argument. CPU tensors run the C++ kernels; xpu (and cuda) tensors the Triton kernels.
    """
    variants = None
    if window_size != (-1, -1) or softcap or alibi_slopes is not None or sinks is not None:
        variants = _variants(window_size, softcap, alibi_slopes, sinks)
    if query.device.type in GPU_DEVICE_TYPES:
        return _gpu.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         **(variants or {}))
    if variants is None:
        if scale is None and enable_gqa is False:  # keyword arguments cost ~0.9 us per op call
            return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal)
    return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa, **(variants or {}))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                    deterministic=True, return_lse=False):
    """flash-attn's flash_attn_func on flashsdpa's kernels: code written for flash-attn runs on
    CPU by changing the import.

    q (B, Lq, H, D), k / v (B, Lk, Hkv, D[v]) with H a multiple of Hkv (GQA / MQA from the
    shapes) -> out (B, Lq, H, Dv), and with return_lse also lse (B, H, Lq) float32 (natural log,
    -inf for a row that sees no key and has no sink). Queries are the last Lq positions
    (bottom-right alignment): row i sees key j when i + Lk - Lq - left <= j <= i + Lk - Lq +
    right (window_size = (left, right), -1 unbounded; causal is right = 0). softcap, alibi_slopes
    ((H,) or (B, H) float32, s -= slope * |i + Lk - Lq - j|) and sinks ((H,) float32,
    differentiable) as in flashsdpa.scaled_dot_product_attention. deterministic: the backward
    always is (accepted for flash-attn compatibility). Differentiable in q, k, v and sinks.
    """
    del deterministic  # every flashsdpa backward is deterministic
    variants = _variants(window_size, softcap, alibi_slopes, sinks) or {}
    if q.device.type in GPU_DEVICE_TYPES:
        out, lse = _gpu.flash_attn(q, k, v, dropout_p, softmax_scale, causal, **variants)
    else:
        out, lse = _flash_attn_op(q, k, v, float(dropout_p), softmax_scale=softmax_scale,
                                  causal=bool(causal), **variants)
    return (out, lse) if return_lse else out


_flash_attn_op = torch.ops.flashsdpa.flash_attn.default
_varlen_op = torch.ops.flashsdpa.flash_attn_varlen_fwd.default


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, sinks=None, deterministic=True,
                           return_lse=False):
    """flash-attn's flash_attn_varlen_func on flashsdpa's kernels: a packed batch of sequences of
    different lengths, no padding.

    q (total_q, H, D), k / v (total_k, Hkv, D[v]); sequence s has the rows
    cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k / v
    (cu_seqlens_* int32 (batch + 1,) prefix sums from 0 to total_q / total_k; max_seqlen_* at
    least the longest sequence). -> out (total_q, H, Dv), and with return_lse also lse
    (H, total_q) float32. Per sequence exactly flash_attn_func's semantics (bottom-right causal
    and windows, softcap, alibi_slopes (H,) or (batch, H), sinks (H,), dropout); positions
    (ALiBi, windows) count from each sequence's start. Differentiable in q, k, v and sinks. One
    kernel call for the whole batch: its work is split across and within the sequences.
    On xpu / cuda tensors the Triton kernels likewise run once over the whole batch (a grid over
    cu_seqlens); float64, and GPU calls the Triton kernels decline, run flash_attn_func per
    sequence (math fallback for the variants).
    """
    del deterministic  # every flashsdpa backward is deterministic
    left, right = _window(window_size)
    if q.device.type == "cpu" and q.dtype in DTYPE_NAMES:
        out, lse, _, _ = _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                    int(max_seqlen_k), float(dropout_p),
                                    softmax_scale=softmax_scale, causal=bool(causal),
                                    window_left=left, window_right=right,
                                    softcap=float(softcap), alibi_slopes=alibi_slopes,
                                    sinks=sinks)
        return (out, lse) if return_lse else out
    if q.device.type in GPU_DEVICE_TYPES:
        variants = _variants((left, right), softcap, alibi_slopes, sinks) or {}
        res = _gpu.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, dropout_p, softmax_scale, causal, **variants)
        if res is not None:
            return res if return_lse else res[0]
    # per sequence, through flash_attn_func (its routing; the same checks of cu_seqlens)
    cu_q, cu_k = _C.check_varlen_layout(q, k, v, cu_seqlens_q.cpu(), cu_seqlens_k.cpu(),
                                        int(max_seqlen_q), int(max_seqlen_k))
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        slopes = alibi_slopes[s] if alibi_slopes is not None and alibi_slopes.dim() == 2 \
            else alibi_slopes
        o, lse = flash_attn_func(
            q[cu_q[s]:cu_q[s + 1]].unsqueeze(0), k[cu_k[s]:cu_k[s + 1]].unsqueeze(0),
            v[cu_k[s]:cu_k[s + 1]].unsqueeze(0), dropout_p, softmax_scale, causal, (left, right),
            softcap, slopes, sinks, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v.shape[2]))
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return (out, lse) if return_lse else out


_kvcache_op = torch.ops.flashsdpa.flash_attn_with_kvcache.default


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                            k_scale=None, v_scale=None, return_lse=False):
    """flash-attn's flash_attn_with_kvcache on flashsdpa's kernels: attention of new queries over
    a KV cache, after appending the new keys / values to it in place.

    q (B, Lq, H, D). A contiguous cache: k_cache / v_cache (B, Lcache, Hkv, D[v]); a paged one:
    (num_blocks, block_size, Hkv, D[v]) with block_table int32 (B, max_blocks) (any block_size,
    blocks in any order). cache_seqlens: int32 (B,) or an int, the tokens already in each
    sequence's cache (None: the whole cache). k / v (B, Lnew, Hkv, D[v]), given: written at
    rows cache_seqlens .. cache_seqlens + Lnew (exactly those), then attended to. Queries are
    the last Lq of the cache_seqlens + Lnew keys (bottom-right causal / windows, as flash-attn):
    decode (Lq = 1), speculative decoding and chunked prefill. Every variant. -> out
    (B, Lq, H, Dv) [, lse (B, H, Lq) float32]. No gradient. Short queries take the split-KV
    decode path (a paged cache's blocks copied through the block table as it goes). CPU tensors
    in float32 / bfloat16 / float16; xpu / cuda tensors run the Triton split-KV kernel (any Lq;
    cache_seqlens, block_table and the scales on either device).

    float8_e4m3fn caches (k_cache and v_cache both): value = stored * k_scale (v_scale), each a
    float32 tensor of one element or one per kv head (Hkv,), or a float (None: 1.0). The decode
    path reads the bytes and widens them in registers; k / v to append (q's dtype) are stored as
    round-to-nearest(value / scale), saturated to +-448.
    """
    k_scale, v_scale = (torch.tensor([float(s)], dtype=torch.float32)
                        if isinstance(s, (int, float)) else s for s in (k_scale, v_scale))
    if (q.device.type != "cpu" and q.device.type not in GPU_DEVICE_TYPES) or \
            q.dtype not in DTYPE_NAMES:
        raise ValueError("flashsdpa.flash_attn_with_kvcache: q must be a CPU, xpu or cuda tensor "
                         f"in float32, bfloat16 or float16, got {q.dtype} on {q.device}")
    left, right = _window(window_size)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    out, lse = _kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                           softmax_scale=softmax_scale, causal=bool(causal), window_left=left,
                           window_right=right, softcap=float(softcap), alibi_slopes=alibi_slopes,
                           sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    return (out, lse) if return_lse else out


# ---- explain ---------------------------------------------------------------------------------------
def _describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   variants):
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
    if variants.get("window_left", -1) != -1 or variants.get("window_right", -1) != -1:
        parts.append(f"window_size=({variants['window_left']}, {variants['window_right']})")
    if variants.get("softcap"):
        parts.append(f"softcap={variants['softcap']}")
    for name in ("alibi_slopes", "sinks"):
        if variants.get(name) is not None:
            parts.append(f"{name} {tuple(variants[name].shape)}")
    return ", ".join(parts)


_PATHS = (("decode", "split-KV decode (short queries; K/V read in place)"),
          ("transposed", "transposed scores (S^T = K Q^T; K and V read in place)"),
          ("prepack", "K^T / V panels packed once for every q block"))


def _variant_features(variants):
    """explain()'s words for a call's variants, the same for the CPU and the Triton kernels."""
    features = []
    left, right = variants.get("window_left", -1), variants.get("window_right", -1)
    if left != -1 or right != -1:
        features.append(f"sliding window ({left}, {right}): key blocks outside the band skipped")
    if variants.get("softcap"):
        features.append(f"softcap {variants['softcap']} (tanh in the score pass, its derivative "
                        "in the backward)")
    if variants.get("alibi_slopes") is not None:
        features.append("ALiBi bias computed in the score pass")
    if variants.get("sinks") is not None:
        features.append("attention sinks in the softmax state (their gradient in the backward)")
    return features


def _cpu_lines(d, query, key, attn_mask, dropout_p, is_causal, variants):
    dt = d["dtype"]  # what runs, after autocast
    tier = d["policy"]["tier"]
    tiers = [t for t in _C.tiers() if t["built"] and t["cpu_ok"] and dt in t["dtypes"]]
    built = [t["name"] for t in tiers]
    if dt == "float32":
        width = "fp32 in"
    elif any(t["name"] == tier and t["bf16_operands"] for t in tiers):
        width = f"{dt} operands into fp32 dot products (P rounded to {dt} for P V)"
    else:
        width = f"{dt} widened to fp32"
    group = (query.shape[-3] // max(key.shape[-3], 1)) if query.dim() == 4 else 1
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
    features += _variant_features(variants)
    features += [text for key_, text in _PATHS if d["policy"][key_]]
    if features:
        lines.append("  with: " + "; ".join(features))
    lines.append("  ops: flashsdpa::flash_attn_fwd, backward flashsdpa::flash_attn_bwd "
                 "(blocked FA2, gradients accumulated in fp32)")
    return lines


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            sinks=None):
    """Which kernel flashsdpa.scaled_dot_product_attention would run for these arguments, or
    why flashsdpa declines them and what runs instead; and what F.scaled_dot_product_attention
    runs in the current routing state. A readable string; its `kernel:` lines name the profiler
    event of the kernel that runs (a flashsdpa phase, PyTorch's aten op, or
    flashsdpa::variants_math)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    variants = _variants(window_size, softcap, alibi_slopes, sinks) or {}
    lines = ["flashsdpa.explain: " + _describe_call(*args, variants)]
    if _nested.is_jagged(query):  # F.sdpa's jagged hook decides, before the dispatcher
        if not variants and _nested.takes(query, key, value, attn_mask, is_causal, enable_gqa):
            triton = query.device.type in _nested.TRITON_DEVICES
            lines += ["  F.scaled_dot_product_attention: flashsdpa's varlen kernel over the "
                      "packed values (flashsdpa/_nested.py)" + (
                          ": the Triton kernels' packed launch, where they take the call "
                          "(else PyTorch's jagged SDPA)" if triton else ""),
                      "  kernel: " + ("flashsdpa::triton_attn_fwd" if triton
                                      else "flashsdpa::flash_attn_varlen_fwd")]
        else:
            lines += ["  F.scaled_dot_product_attention: PyTorch's jagged-layout SDPA (flashsdpa "
                      "takes these calls only while enabled, without a mask, with flash allowed, "
                      "causal only when query and key share their offsets)",
                      "  kernel: PyTorch's"]
        return "\n".join(lines)
    d = decide(*args, "direct", **variants)
    if d["invalid"]:
        lines.append(f"  invalid arguments, the call raises: {d['invalid']}")
        return "\n".join(lines)
    if d["backend"] in ("pytorch", "math"):
        reasons = d["reasons"]["cpu" if d["target"] == "pytorch" else d["target"]]
        lines.append("  flashsdpa declines:")
        lines += [f"    - {r}" for r in reasons]
        lines.append("  runs instead: " + ("torch.nn.functional.scaled_dot_product_attention"
                                           if d["backend"] == "pytorch" else
                                           "flashsdpa's math on PyTorch ops (the variants' "
                                           "fallback: materialises the scores)"))
    elif d["backend"] == "cpu":
        lines += _cpu_lines(d, query, key, attn_mask, dropout_p, is_causal, variants)
    else:
        lines.append(f"  runs: flashsdpa Triton kernels on {query.device.type} (FA2 forward, "
                     "dK/dV + dQ backward; fp32 accumulation, natural-log LSE)")
        features = []
        if dropout_p > 0:
            features.append(f"dropout p={dropout_p} (Triton Philox keep-mask, regenerated in "
                            "backward)")
        features += _variant_features(variants)
        if features:
            lines.append("  with: " + "; ".join(features))
    lines.append(f"  kernel: {d['kernel']}")
    if variants:  # F.scaled_dot_product_attention has no variant arguments
        return "\n".join(lines)
    routed = decide(*args, "aten", is_enabled())
    lines.append(f"  F.scaled_dot_product_attention: {routed['via']}")
    lines.append(f"  F.scaled_dot_product_attention kernel: {routed['kernel']}")
    return "\n".join(lines)
