"""flashsdpa on Intel GPUs (xpu) and other Triton devices: aten kernels and routing.

enable() (flashsdpa/_routing.py) registers the Triton kernels on the XPU dispatch key for the
ops PyTorch's XPU SDPA path calls:
    aten::_scaled_dot_product_fused_attention_overrideable (+ _backward)
    aten::_scaled_dot_product_flash_attention (+ _backward)
PyTorch's own autograd formulas and meta kernels stay in charge (so torch.compile graphs that
hold these aten ops call ours). The C++ override of aten::scaled_dot_product_attention also sends
the xpu calls PyTorch would run on its math path (dropout, masks, GQA, 3-D inputs, Dv != D) to
the overrideable op, i.e. to the Triton kernels. disable() removes all of it.

Nothing here imports Triton: the kernels load on the first launch. Registration happens only
when Triton is installed and an xpu device is present: the registrations are made and destroyed
per enable()/disable() cycle (a Python kernel cannot hand an xpu call back to the XPU kernel it
overrides, so they cannot stay and switch by a flag as the CPU overrides do), and each
torch.library.Library made and destroyed keeps about 100 bytes; machines without an Intel GPU
pay nothing per cycle.
"""
import warnings

import torch

from . import _C, _triton
from ._common import decide, log_fallback
from ._triton import as_4d

# The Triton backend's limits include "Triton is installed" (csrc/routing.cpp reads this flag).
_C.set_triton_available(_triton.available())


def _rng_tensors(rng):
    return (torch.tensor(rng[0], dtype=torch.int64), torch.tensor(rng[1], dtype=torch.int64))


def fused_attention_overrideable(query, key, value, attn_bias=None, dropout_p=0.0,
                                 is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_fused_attention_overrideable on the Triton kernels.
    The debug attention mask is never materialised (O(L) memory): returned undefined."""
    q, k, v, bias = _triton.to_4d(query, key, value, attn_bias)
    rng = _triton.new_rng_state() if dropout_p > 0 else (0, 0)
    out = _triton.alloc_like_query(query, tuple(query.shape[:-1]) + (value.shape[-1],))
    _, lse, shift = _triton.forward(q, k, v, bias, dropout_p, is_causal, scale, rng,
                                    out=as_4d(out))
    lse = _triton.full_lse(lse, shift)  # (aten's autograd keeps it alone: backward unshifted)
    seed, offset = _rng_tensors(rng)
    return (out, lse, None, None, query.shape[-2], key.shape[-2], seed, offset, None)


def fused_attention_overrideable_backward(grad_out, query, key, value, attn_bias, grad_input_mask,
                                          out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                          dropout_p, is_causal, philox_seed, philox_offset, *,
                                          scale=None):
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise NotImplementedError("flashsdpa: the Triton kernels do not compute the gradient of "
                                  "attn_mask; call flashsdpa.disable() to use PyTorch's kernels")
    dq, dk, dv = _backward(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p,
                           is_causal, philox_seed, philox_offset, scale)
    grad_bias = torch.empty_like(attn_bias) if attn_bias is not None else None
    return dq, dk, dv, grad_bias


def flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                    *, scale=None):
    """aten::_scaled_dot_product_flash_attention on the Triton kernels."""
    out, lse, _, _, max_q, max_k, seed, offset, _ = fused_attention_overrideable(
        query, key, value, None, dropout_p, is_causal, return_debug_mask, scale=scale)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, max_q, max_k, seed, offset, debug


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                             max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                             scale=None):
    return _backward(grad_out, query, key, value, None, out, logsumexp, dropout_p, is_causal,
                     philox_seed, philox_offset, scale)


def _backward(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p, is_causal,
              philox_seed, philox_offset, scale):
    q, k, v, bias = _triton.to_4d(query, key, value, attn_bias)
    rng = (int(philox_seed), int(philox_offset)) if dropout_p > 0 else (0, 0)
    lse = logsumexp.reshape(q.shape[:3])
    dq, dk, dv, _ = _triton.backward(as_4d(grad_out), q, k, v, as_4d(out), lse, bias,
                                     dropout_p, is_causal, scale, rng)
    if k.shape[0] != key.shape[0] and key.dim() == 4:  # broadcast key/value batch
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    if query.dim() == 3:
        dq, dk, dv = dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
    return (_like(dq, query), _like(dk, key), _like(dv, value))


def _like(grad, t):
    """The gradient laid out as torch.empty_like(t) (what the meta kernels promise)."""
    if grad.stride() == torch.empty_like(t).stride():
        return grad
    res = torch.empty_like(t)
    res.copy_(grad)
    return res


# ---- registration -----------------------------------------------------------------------------------
KERNELS = {
    "_scaled_dot_product_fused_attention_overrideable": fused_attention_overrideable,
    "_scaled_dot_product_fused_attention_overrideable_backward":
        fused_attention_overrideable_backward,
    "_scaled_dot_product_flash_attention": flash_attention,
    "_scaled_dot_product_flash_attention_backward": flash_attention_backward,
}


def register(dispatch_key="XPU", ops=None):
    """A torch.library.Library holding the Triton kernels for `dispatch_key` on the given aten
    ops (default: all four); destroying it (lib._destroy()) removes them. Tests register the
    overrideable pair on the CPU key as a stand-in for XPU."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        for name in (ops or KERNELS):
            lib.impl(name, KERNELS[name], dispatch_key)
    return lib


_lib = None


def _xpu_present():
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and xpu.is_available()


def enable():
    """Register on the XPU key and route xpu SDPA calls to the overrideable op (when Triton is
    installed and an xpu device is present; otherwise nothing changes for xpu)."""
    global _lib
    if _lib is not None or not _triton.available() or not _xpu_present():
        return
    _lib = register("XPU")
    _C.set_overrideable_route("xpu")


def disable():
    global _lib
    if _lib is None:
        return
    _C.set_overrideable_route("")
    _lib._destroy()
    _lib = None


def is_registered():
    return _lib is not None


# ---- the direct API on GPU tensors -------------------------------------------------------------------
_sdpa_op = torch.ops.flashsdpa.sdpa.default
_flash_attn_op = torch.ops.flashsdpa.flash_attn.default


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, **variants):
    """The direct API for tensors on a Triton device: the routing decision's backend (variants:
    the ops' variant keywords). Calls the Triton kernels decline take PyTorch's SDPA, or with
    variants flashsdpa's math on PyTorch ops (the sdpa op, which decides the same)."""
    d = decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, "direct",
               **variants)
    if d["invalid"]:
        raise ValueError(d["invalid"])
    if d["backend"] == "triton":
        return _triton.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                    is_causal, scale, enable_gqa, **variants)
    if variants:
        return _sdpa_op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa, **variants)
    log_fallback(d["reasons"]["triton"][0] if d["reasons"]["triton"] else d["via"])
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa)


def flash_attn(q, k, v, dropout_p, softmax_scale, causal, **variants):
    """flash_attn_func for tensors on a Triton device -> (out, lse): the Triton kernels, or
    where they decline flashsdpa's math on PyTorch ops (the flash_attn op, which decides the
    same)."""
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        d = decide(qt, kt, vt, None, dropout_p, causal, softmax_scale, True, "direct",
                   bottom_right=True, **variants)
        if d["invalid"]:
            raise ValueError(d["invalid"])
        if d["backend"] == "triton":
            return _triton.flash_attn(q, k, v, dropout_p, softmax_scale, causal, **variants)
    return _flash_attn_op(q, k, v, float(dropout_p), softmax_scale=softmax_scale,
                          causal=bool(causal), **variants)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, softmax_scale, causal, **variants):
    """flash_attn_varlen_func for tensors on a Triton device -> (out, lse) from one launch of
    each Triton kernel over all the sequences, or None where those kernels decline the call
    (the caller then runs flash_attn_func per sequence). The CPU op's checks: the layout, with
    cu_seqlens read back once (a sync; none when they are CPU tensors) so that a bad prefix sum
    is an error naming it, never a read outside q / k / v; the per-sequence checks on a
    (batch, H, 0, D) stand-in."""
    cu_q, _ = _C.check_varlen_layout(q, k, v, cu_seqlens_q.cpu(), cu_seqlens_k.cpu(),
                                     int(max_seqlen_q), int(max_seqlen_k))
    padded = [t.new_empty((len(cu_q) - 1, t.shape[1], 0, t.shape[2])) for t in (q, k, v)]
    d = decide(*padded, None, dropout_p, causal, softmax_scale, True, "direct",
               bottom_right=True, **variants)
    if d["invalid"]:
        raise ValueError(d["invalid"])
    if d["backend"] != "triton":
        return None
    cu_q, cu_k = (c.to(q.device).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
    return _triton.flash_attn_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, **variants)


# ---- flash_attn_with_kvcache on GPU tensors --------------------------------------------------------
_KVCACHE = "flashsdpa.flash_attn_with_kvcache: "


def _cpu(t):
    return None if t is None else t.cpu()


def _append(cache, new, start, block_table):
    """new (B, n, Hkv, D) written in place at rows start[b] .. start[b] + n of each sequence's
    cache (through its block table when paged); a float8 cache's new rows come quantised
    (_C.quantize_e4m3, the CPU op's rule) and are written as bytes."""
    b, n = new.shape[:2]
    pos = start.view(b, 1) + torch.arange(n, device=cache.device)
    if block_table is None:
        index = (torch.arange(b, device=cache.device).view(b, 1).expand(b, n), pos)
    else:
        page = cache.shape[1]
        index = (block_table.long().gather(1, pos // page), pos % page)
    as_bits = cache.dtype == torch.float8_e4m3fn  # index_put on the bytes: any backend has it
    target = cache.view(torch.uint8) if as_bits else cache
    target.index_put_(index, new.view(torch.uint8) if as_bits else new)


def _kvcache_gathered(q, k_cache, v_cache, block_table, seqlens, scales, softmax_scale, causal,
                      variants):
    """A call the Triton kernel declines (e.g. head dim > 256): each sequence's keys gathered
    (dequantised) and flash_attn (flash_attn_func's GPU entry, with its own fallback) over
    them."""
    outs, lses = [], []
    alibi = variants["alibi_slopes"]
    for b, n in enumerate(seqlens):
        pos = torch.arange(n, device=q.device)
        if block_table is None:
            keys, vals = k_cache[b, :n], v_cache[b, :n]
        else:
            page = k_cache.shape[1]
            blk = block_table[b].long()[pos // page]
            keys, vals = k_cache[blk, pos % page], v_cache[blk, pos % page]
        if scales is not None:
            keys, vals = ((t.float() * s.view(-1, 1)).to(q.dtype)
                          for t, s in zip((keys, vals), scales))
        o, lse = flash_attn(q[b:b + 1], keys[None], vals[None], 0.0, softmax_scale, causal,
                            **dict(variants, alibi_slopes=alibi[b] if alibi is not None and
                                   alibi.dim() == 2 else alibi))
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, *, softmax_scale=None, causal=False,
                            window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                            sinks=None, k_scale=None, v_scale=None):
    """flashsdpa::flash_attn_with_kvcache for xpu / cuda tensors (registered on their dispatch
    keys below): the CPU op's checks and semantics - cache_seqlens, block_table and the scales
    may live on either device (read back once for the checks, so that a block out of range or a
    length beyond the cache is an error naming it before anything is written) -, the append in
    place (PyTorch index writes), then the split-KV Triton kernel."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{_KVCACHE}{name} must be on q's device ({q.device}), got "
                             f"{t.device}")
    seqlens = _C.kvcache_seqlens(q, k_cache, v_cache, k, v, _cpu(cache_seqlens),
                                 _cpu(block_table), _cpu(k_scale), _cpu(v_scale))
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{_KVCACHE}k_cache and v_cache must have unit stride in their last "
                         "dim (written in place)")
    variants = dict(window_left=window_left, window_right=window_right, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
    b, hkv = q.shape[0], k_cache.shape[2]
    stand_in = [q.new_empty((b, hkv, 0, c.shape[3])) for c in (k_cache, v_cache)]
    d = decide(q.transpose(1, 2), *stand_in, None, 0.0, causal, softmax_scale, True, "direct",
               bottom_right=True, **variants)
    if d["invalid"]:
        raise ValueError(d["invalid"])
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    scales = None
    if fp8:
        scales = tuple(torch.ones(1) if s is None else s.reshape(-1) for s in (k_scale, v_scale))
        scales = tuple(s.to(q.device, torch.float32).contiguous() for s in scales)
    table = None if block_table is None else block_table.to(q.device).contiguous()
    if k is not None and k.shape[1]:
        start = torch.tensor([n - k.shape[1] for n in seqlens], device=q.device)
        for cache, new, i in ((k_cache, k, 0), (v_cache, v, 1)):
            _append(cache, _C.quantize_e4m3(new, scales[i]) if fp8 else new, start, table)
    if d["backend"] != "triton":
        log_fallback(d["reasons"]["triton"][0] if d["reasons"]["triton"] else d["via"])
        return _kvcache_gathered(q, k_cache, v_cache, table, seqlens, scales, softmax_scale,
                                 causal, variants)
    var = _triton.Variants(0, 0, causal, (window_left, window_right), True, softcap,
                           alibi_slopes, sinks, q.device)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=q.device)
    return _triton.kvcache_forward(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache,
                                   table, lens, max(seqlens, default=0), var, softmax_scale,
                                   *(scales or (None, None)))


_kvcache_lib = torch.library.Library("flashsdpa", "IMPL")
for _key in ("CUDA", "XPU"):
    _kvcache_lib.impl("flash_attn_with_kvcache", flash_attn_with_kvcache, _key)
