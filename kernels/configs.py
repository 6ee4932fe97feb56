"""Launch configurations per device kind.

Intel GPUs (the xpu backend) run 16 threads per warp and like large Q tiles, more warps and the
large register file (`grf_mode='256'`, an option only the xpu backend accepts); NVIDIA GPUs run
the classic flash-attention shapes; the interpreter (TRITON_INTERPRET=1, tests on CPU tensors)
gets one small config (autotuning would need a GPU driver).
"""
import os


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _backend():
    """'xpu', 'cuda' or 'interpreter', without touching the GPU driver at import time."""
    if interpreting():
        return "interpreter"
    import triton
    try:
        return triton.runtime.driver.active.get_current_target().backend
    except Exception:  # no driver: the caller only asks when a GPU tensor is at hand
        return "unknown"


def forward_config(head_dim):
    backend = _backend()
    if backend == "interpreter":
        return dict(BLOCK_M=32, BLOCK_N=32), {}
    if backend == "xpu":
        big = head_dim > 128
        return (dict(BLOCK_M=64 if big else 128, BLOCK_N=32 if big else 64),
                dict(num_warps=8 if big else 16, num_stages=2, grf_mode="256"))
    return (dict(BLOCK_M=64 if head_dim > 128 else 128, BLOCK_N=32 if head_dim > 128 else 64),
            dict(num_warps=4 if head_dim <= 64 else 8, num_stages=2))


def backward_config(head_dim):
    """(dK/dV kernel, dQ kernel) configurations."""
    backend = _backend()
    if backend == "interpreter":
        cfg = dict(BLOCK_M=32, BLOCK_N=32)
        return (cfg, {}), (cfg, {})
    small = head_dim <= 64
    if backend == "xpu":
        opts = dict(num_warps=8, num_stages=2, grf_mode="256")
        return (dict(BLOCK_M=32, BLOCK_N=64 if small else 32), opts), \
            (dict(BLOCK_M=64 if small else 32, BLOCK_N=32), opts)
    opts = dict(num_warps=4 if small else 8, num_stages=2)
    return (dict(BLOCK_M=32, BLOCK_N=64 if small else 32), opts), \
        (dict(BLOCK_M=64 if small else 32, BLOCK_N=32), opts)
