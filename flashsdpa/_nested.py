"""Nested (jagged) tensors through torch.nn.functional.scaled_dot_product_attention.

PyTorch's jagged-layout NestedTensor takes SDPA calls in its __torch_function__ (before the
dispatcher, so routing.cpp never sees them) and on CPU runs its math path: per-sequence score
matrices. While flashsdpa is enabled, install() puts route() in that hook's place: the calls it
can take run flash_attn_varlen_fwd over the packed values (no padding, one kernel call, the
C++ autograd of the varlen op) on CPU tensors, and the Triton kernels' packed launch on xpu
tensors (where PyTorch has no fused jagged path; cuda keeps PyTorch's own, FA2); everything
else, and every call once disabled, goes to PyTorch's function unchanged.
"""
import torch

from . import _C, _gpu
from ._common import DTYPE_NAMES

_ORIGINAL = None  # PyTorch's jagged SDPA, while route() stands in for it
_NO_BOUND = 2**31 - 1
# The devices whose jagged calls go to the Triton kernels (tests add "cpu", the stand-in).
TRITON_DEVICES = ("xpu",)


def _ops_module():
    from torch.nested._internal import ops
    return ops


def is_jagged(t):
    from torch.nested._internal.nested_tensor import NestedTensor
    return isinstance(t, NestedTensor)


def takes(q, k, v, attn_mask, is_causal, enable_gqa):
    """Whether the varlen kernel computes exactly what PyTorch would for these (B, H, j, D)
    jagged tensors, in the current routing state (the cases it declines: README, Serving)."""
    if not (_C.routing_enabled() and torch.backends.cuda.flash_sdp_enabled()):
        return False  # disabled, or sdpa_kernel(...) without FLASH_ATTENTION
    if not all(is_jagged(t) for t in (q, k, v)) or attn_mask is not None:
        return False
    if not all(t.device == q.device and t.dtype == q.dtype and t.dim() == 4 and
               t._ragged_idx == 2 and t._lengths is None for t in (q, k, v)):
        return False  # (B, H, j, D) with contiguous offsets only; no holes
    if q.device.type not in ("cpu", *TRITON_DEVICES):
        return False
    if q.dtype not in DTYPE_NAMES or q.size(1) % k.size(1) or (
            q.size(1) != k.size(1) and not enable_gqa):
        return False  # PyTorch's own message for head counts it rejects
    # Jagged dims compare equal when the tensors share their offsets (as q, k, v cut from one
    # packed batch do), without reading them, also under torch.compile.
    if is_causal and q.size(2) != k.size(2):
        return False  # PyTorch aligns causal top-left, the varlen kernel bottom-right
    return k.size(2) == v.size(2)


def route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if not takes(query, key, value, attn_mask, is_causal, enable_gqa):
        return _ORIGINAL(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    from torch.nested._internal.nested_tensor import nested_view_from_values_offsets
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, j, H, D): values (total, H, D)
    off_q, off_k = q.offsets(), k.offsets()
    cu_q, cu_k = off_q.to(torch.int32), off_k.to(torch.int32)
    if query.device.type in TRITON_DEVICES:
        # the grids need the longest sequences: one read-back of the offsets, whose CPU copies
        # the Triton path then checks (and copies to the device) instead of reading them again
        cu_q, cu_k = cu_q.cpu(), cu_k.cpu()
        longest = [int((c[1:] - c[:-1]).max()) if c.numel() > 1 else 0 for c in (cu_q, cu_k)]
        res = _gpu.flash_attn_varlen(q.values(), k.values(), v.values(), cu_q, cu_k, *longest,
                                     float(dropout_p), scale, bool(is_causal))
        if res is None:  # declined by the Triton kernels
            return _ORIGINAL(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
        out = res[0]
    else:
        # max_seqlen_* only bound the sequence lengths (checked): the int32 maximum always
        # does, and a constant keeps torch.compile from specialising the jagged dimension
        out = torch.ops.flashsdpa.flash_attn_varlen_fwd(
            q.values(), k.values(), v.values(), cu_q, cu_k, _NO_BOUND, _NO_BOUND,
            float(dropout_p), softmax_scale=scale, causal=bool(is_causal))[0]
    return nested_view_from_values_offsets(out, off_q, min_seqlen=q._maybe_min_seqlen,
                                           max_seqlen=q._maybe_max_seqlen).transpose(1, 2)


def install():
    global _ORIGINAL
    ops = _ops_module()
    if _ORIGINAL is None:
        _ORIGINAL = ops.jagged_scaled_dot_product_attention
    ops.jagged_scaled_dot_product_attention = route


def uninstall():
    if _ORIGINAL is not None:
        _ops_module().jagged_scaled_dot_product_attention = _ORIGINAL
