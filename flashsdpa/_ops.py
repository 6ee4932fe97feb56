"""The flashsdpa ops: native CPU kernels and autograd (flashsdpa._C), fake kernels here.

torch.ops.flashsdpa.flash_attn_fwd(query, key, value, attn_mask=None, dropout_p=0.,
                                   is_causal=False, *, scale=None, <variants>, lse_neg_inf=False)
    -> (output, logsumexp, rng_state, softmax_stats)
torch.ops.flashsdpa.flash_attn_bwd(grad_out, query, key, value, out, logsumexp, rng_state,
                                   attn_mask=None, dropout_p=0., is_causal=False, *, scale=None,
                                   <variants>, softmax_stats=None)
    -> (grad_query, grad_key, grad_value, grad_sinks)
torch.ops.flashsdpa.flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, dropout_p=0., *, softmax_scale=None,
                                          causal=False, <variants but bottom_right>)
    -> (out (total_q, H, Dv), logsumexp (H, total_q), rng_state, softmax_stats (H, total_q, 3));
flash_attn_varlen_bwd likewise (softmax_stats=None keyword) -> (grad_q, grad_k, grad_v,
    grad_sinks), the gradients contiguous
<variants>: window_left=-1, window_right=-1, bottom_right=False, softcap=0., alibi_slopes=None,
sinks=None (csrc/ops.h, csrc/params.h)

Layouts (the fake kernels below promise exactly what the CPU kernels return):
    output     like torch.empty_like(query) (when head dims match; else contiguous)
    logsumexp  float32 (B, H, L) stored as (B, L, H): natural-log LSE of scale*QK^T + mask
    rng_state  int64 (seed, offset) of the dropout keep-mask; zeros without dropout
    softmax_stats  float32 (B, H, L, 3) stored as (B, L, H, 3): each row's log2-domain
               logsumexp as hi + lo (hi its float32 rounding) relative to the row's float-mask
               shift, and the shift (csrc/params.h), from which the backward's P keeps every
               digit at any logit size; without them (aten's autograd formula saves only
               logsumexp) P carries the rounding of logsumexp
    grads      (B, H, L, D) stored as (B, L, H, D), as PyTorch's CPU kernel lays them out;
               grad_sinks float32 (H,), or (0,) without sinks
"""
import os

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.flashsdpa.*)

flash_attn_fwd = torch.ops.flashsdpa.flash_attn_fwd.default
flash_attn_bwd = torch.ops.flashsdpa.flash_attn_bwd.default


def _output_like_query(query, dv):
    if dv == query.shape[3]:
        out = torch.empty_like(query)
        if out.shape[3] <= 1 or out.stride(3) == 1:
            return out
    return query.new_empty((query.shape[0], query.shape[1], query.shape[2], dv))


@torch.library.register_fake("flashsdpa::flash_attn_fwd")
def _fwd_fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
              window_left=-1, window_right=-1, bottom_right=False, softcap=0.0,
              alibi_slopes=None, sinks=None, lse_neg_inf=False):
    batch, heads, seq_q = query.shape[0], query.shape[1], query.shape[2]
    out = _output_like_query(query, value.shape[3])
    lse = query.new_empty((batch, seq_q, heads), dtype=torch.float32).transpose(1, 2)
    rng_state = query.new_empty((2,), dtype=torch.int64)
    stats = query.new_empty((batch, seq_q, heads, 3), dtype=torch.float32).permute(0, 2, 1, 3)
    return out, lse, rng_state, stats


@torch.library.register_fake("flashsdpa::flash_attn_bwd")
def _bwd_fake(grad_out, query, key, value, out, logsumexp, rng_state, attn_mask=None,
              dropout_p=0.0, is_causal=False, *, scale=None, window_left=-1, window_right=-1,
              bottom_right=False, softcap=0.0, alibi_slopes=None, sinks=None, softmax_stats=None):
    def dense(t):  # c10's is_non_overlapping_and_dense: strides a permutation of contiguous
        expected = 1
        for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
            if t.shape[d] != 1:
                if t.stride(d) != expected:
                    return False
                expected *= t.shape[d]
        return True

    def grad_like(t):  # ops.cpp's: the input's layout where dense, else (B, L, H, D) buffers
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            t = t.contiguous()  # (as the kernel reads it)
        if dense(t):
            return torch.empty_like(t, memory_format=torch.preserve_format)
        return torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)

    dsinks = query.new_empty((query.shape[1] if sinks is not None else 0,), dtype=torch.float32)
    return grad_like(query), grad_like(key), grad_like(value), dsinks

@torch.library.register_fake("flashsdpa::flash_attn_varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p=0.0, *, softmax_scale=None, causal=False, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    total_q, heads = q.shape[0], q.shape[1]
    out = q.new_empty((total_q, heads, v.shape[2]))
    lse = q.new_empty((heads, total_q), dtype=torch.float32)
    stats = q.new_empty((heads, total_q, 3), dtype=torch.float32)
    return out, lse, q.new_empty((2,), dtype=torch.int64), stats


@torch.library.register_fake("flashsdpa::flash_attn_varlen_bwd")
def _varlen_bwd_fake(grad_out, q, k, v, out, logsumexp, rng_state, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, dropout_p=0.0, *, softmax_scale=None,
                     causal=False, window_left=-1, window_right=-1, softcap=0.0,
                     alibi_slopes=None, sinks=None, softmax_stats=None):
    dsinks = q.new_empty((q.shape[1] if sinks is not None else 0,), dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks)


@torch.library.register_fake("flashsdpa::flash_attn_with_kvcache")
def _kvcache_fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, *,
                  softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                  alibi_slopes=None, sinks=None, k_scale=None, v_scale=None):
    batch, seq_q, heads = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((batch, seq_q, heads, v_cache.shape[3]))
    return out, q.new_empty((batch, heads, seq_q), dtype=torch.float32)


# Autograd: a C++ torch::autograd::Function (csrc/autograd.cpp) on the Autograd key, so calls
# cost no Python; its backward calls flash_attn_bwd through the dispatcher.


# The ops the extension defines (csrc/ops.cpp), whose schemas key the compile caches.
NATIVE_OPS = ("flash_attn_fwd", "flash_attn_bwd", "sdpa", "flash_attn", "flash_attn_varlen_fwd",
              "flash_attn_varlen_bwd", "flash_attn_with_kvcache")


# The modules whose fake kernels give traced graphs their outputs' shapes and dtypes.
FAKE_SOURCES = ("_ops.py", "_triton.py")


def compile_cache_tag():
    """flashsdpa's part of torch.compile's cache key: a digest of the ops' schemas and of the
    sources of their fake kernels (FAKE_SOURCES). Inductor's on-disk caches hold compiled code
    that calls the ops with their schemas as they were, and buffers sized by the fake kernels
    as they were: an entry made with another build of flashsdpa whose schemas or outputs differ
    (softmax_stats once went from 2 to 3 floats a row with no schema change) would call the ops
    with the wrong arguments or assert the old sizes."""
    import hashlib
    digest = hashlib.sha1("\n".join(str(getattr(torch.ops.flashsdpa, name).default._schema)
                                    for name in NATIVE_OPS).encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in FAKE_SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return "flashsdpa-ops-" + digest.hexdigest()[:12]


def _tag_compile_caches():
    import torch.compiler.config as compiler_config
    tags = [t for t in compiler_config.cache_key_tag.split(",")
            if t and not t.startswith("flashsdpa-ops-")]
    compiler_config.cache_key_tag = ",".join(tags + [compile_cache_tag()])


_tag_compile_caches()
