"""flashsdpa.enable() / disable() / enabled(): route torch.nn.functional.scaled_dot_product_attention
to flashsdpa's kernels.

enable() installs C++ kernels (csrc/routing.cpp) for
  * aten::_scaled_dot_product_flash_attention_for_cpu and its backward (CPU key): everything
    PyTorch sends to its fused CPU kernel runs flashsdpa's, under PyTorch's own checks, autograd
    formula and meta kernels (so torch.compile graphs call it too);
  * aten::scaled_dot_product_attention (CompositeImplicitAutograd): calls PyTorch would send to
    its math path but flashsdpa fuses (dropout in training, 3-D inputs, Dv != D, 3-D masks);
  * torch.nested's jagged-layout SDPA hook (flashsdpa/_nested.py): nested (jagged) CPU tensors
    run the varlen kernel instead of PyTorch's per-sequence math path;
  * on the XPU key, when Triton is installed (flashsdpa/_gpu.py): the Triton kernels for
    aten::_scaled_dot_product_fused_attention_overrideable and aten::_scaled_dot_product_flash_attention
    (+ backwards), and xpu SDPA calls PyTorch would run on its math path go to the overrideable op.
Everything else runs exactly what PyTorch would have run. `sdpa_kernel(...)` without
SDPBackend.FLASH_ATTENTION keeps flashsdpa out. The C++ kernels stay registered after the first
enable() (removing kernels while other threads dispatch through them is not safe); disable()
switches them to PyTorch's own kernels (and removes the Python-level hooks).

torch.compile: while enabled, traced graphs hold flashsdpa's own ops, and the routing state is
part of the compile cache key (torch.compiler.config.cache_key_tag), so Inductor's on-disk
caches never hand a graph traced in one state to the other. Functions already compiled in this
process keep the graph they were traced with: call torch._dynamo.reset() after toggling.
"""
import contextlib
import threading

from . import _C, _gpu, _nested

_lock = threading.RLock()

_CACHE_TAG = "flashsdpa-routing"


def _set_cache_tag(on):
    import torch.compiler.config as compiler_config
    tags = [t for t in compiler_config.cache_key_tag.split(",") if t and t != _CACHE_TAG]
    if on:
        tags.append(_CACHE_TAG)
    compiler_config.cache_key_tag = ",".join(tags)


def enable():
    """Route torch.nn.functional.scaled_dot_product_attention (and the modules built on it) to
    flashsdpa wherever it can take the call. Idempotent, thread-safe."""
    with _lock:
        _C.routing_enable()
        _nested.install()
        _gpu.enable()
        _set_cache_tag(True)


def disable():
    """Restore PyTorch's own SDPA kernels. Idempotent, thread-safe."""
    with _lock:
        _gpu.disable()
        _nested.uninstall()
        _C.routing_disable()
        _set_cache_tag(False)


def is_enabled():
    return _C.routing_enabled()


@contextlib.contextmanager
def enabled(on=True):
    """Context manager: flashsdpa enabled (or, with on=False, disabled) inside the block; the
    previous state is restored on exit, also when the block raises."""
    with _lock:
        previous = is_enabled()
        (enable if on else disable)()
    try:
        yield
    finally:
        with _lock:
            (enable if previous else disable)()
