"""Helpers shared across the flashsdpa package (one home each)."""
import contextlib
import logging

import torch

from . import _C

logger = logging.getLogger("flashsdpa")

# The dtypes the kernels compute in, with the names the C++ side takes.
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Device types whose tensors the Triton kernels take.
GPU_DEVICE_TYPES = ("xpu", "cuda")


@contextlib.contextmanager
def swapped(get, set_, value):
    """set_(value) inside the block; what get() returned before it is set back on exit, also when
    the block raises."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def log_fallback(reason):
    """Once per distinct reason (the C++ side dedupes): why a call went to PyTorch's kernels."""
    logger.debug("flashsdpa fallback to PyTorch: %s", reason)


_C.set_fallback_logger(log_fallback)


def decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, entry,
           routing_on=False, **variants):
    """The routing decision (csrc/routing.h) for a call: a dict (backend, invalid, reasons,
    target, via, declined, kernel, policy, dtype). entry: "direct" (flashsdpa's API) or "aten"
    (F.scaled_dot_product_attention, given whether routing is on). variants: the ops' variant
    keywords (window_left, window_right, bottom_right, softcap, alibi_slopes, sinks)."""
    return _C.decide(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                     None if scale is None else float(scale), bool(enable_gqa), entry,
                     bool(routing_on), **variants)
