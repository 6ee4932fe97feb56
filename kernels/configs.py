"""Launch configurations per device kind.

Intel GPUs (the xpu backend) run 16 threads per warp and like large Q tiles, more warps and the
large register file (`grf_mode='256'`, an option only the xpu backend accepts: the CUDA backend
raises on it); NVIDIA GPUs run the classic flash-attention shapes; the interpreter
(TRITON_INTERPRET=1, tests on CPU tensors) gets one small config (autotuning would need a GPU
driver).

FLASHSDPA_TRITON_FWD / FLASHSDPA_TRITON_BWD_KV / FLASHSDPA_TRITON_BWD_Q /
FLASHSDPA_TRITON_KVCACHE override a kernel's
configuration for experiments and tuning sweeps, e.g. "BLOCK_M=256,BLOCK_N=32,num_warps=32".
The kernels are correct for any power-of-two blocks (>= 16 on a GPU), with BLOCK_M and BLOCK_N
independent (the dK/dV and dQ kernels share nothing).
"""
import os

_INT_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
# Splits of a KV-cache call at most (_triton._kv_splits): the combine kernel holds a row's splits
# x Dv in registers.
MAX_SPLITS = 64
_BLOCK_KEYS = {"BLOCK_M", "BLOCK_N"}


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _backend():
    """'xpu', 'cuda', 'hip' or 'interpreter'; asks the driver only when a kernel is launched."""
    if interpreting():
        return "interpreter"
    import triton
    try:
        return triton.runtime.driver.active.get_current_target().backend
    except Exception:  # noqa: BLE001  (no driver: the launcher is only reached with a GPU tensor)
        return "unknown"


def parse_override(name, backend=None):
    """(blocks, options) from the environment variable `name`, or None when unset. Raises
    ValueError naming the variable on a malformed value."""
    spec = os.environ.get(name, "").strip()
    if not spec:
        return None
    blocks, opts = {}, {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"{name}: expected key=value items, got {item!r}")
        if key in _INT_KEYS:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"{name}: {key} must be an integer, got {value!r}") from None
            if key in _BLOCK_KEYS and (number < 1 or number & (number - 1)):
                raise ValueError(f"{name}: {key} must be a power of two, got {number}")
            (blocks if key in _BLOCK_KEYS else opts)[key] = number
        elif key == "grf_mode":
            if (backend or _backend()) == "xpu":
                opts[key] = value
        else:
            raise ValueError(f"{name}: unknown key {key!r} (BLOCK_M, BLOCK_N, num_warps, "
                             "num_stages, grf_mode)")
    return blocks, opts


def _with_override(name, blocks, opts, backend):
    override = parse_override(name, backend)
    if override is None:
        return blocks, opts
    return dict(blocks, **override[0]), dict(opts, **override[1])


def forward_config(head_dim):
    """(blocks, launch options) of the forward kernel for the larger of D and Dv."""
    backend = _backend()
    if backend == "interpreter":
        blocks, opts = dict(BLOCK_M=32, BLOCK_N=32), {}
    elif backend == "xpu":
        if head_dim <= 64:
            blocks, warps = dict(BLOCK_M=128, BLOCK_N=64), 8
        elif head_dim <= 128:
            blocks, warps = dict(BLOCK_M=128, BLOCK_N=64), 16
        else:
            blocks, warps = dict(BLOCK_M=128, BLOCK_N=32), 16
        opts = dict(num_warps=warps, num_stages=2, grf_mode="256")
    else:
        big = head_dim > 128
        blocks = dict(BLOCK_M=64 if big else 128, BLOCK_N=32 if big else 64)
        opts = dict(num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    return _with_override("FLASHSDPA_TRITON_FWD", blocks, opts, backend)


def backward_config(head_dim):
    """((blocks, options) of the dK/dV kernel, (blocks, options) of the dQ kernel)."""
    backend = _backend()
    if backend == "interpreter":
        kv = q = (dict(BLOCK_M=32, BLOCK_N=32), {})
    else:
        small = head_dim <= 64
        if backend == "xpu":
            opts = dict(num_warps=8 if small else 16, num_stages=2, grf_mode="256")
            kv = (dict(BLOCK_M=32, BLOCK_N=128 if small else 64), opts)
            q = (dict(BLOCK_M=128 if small else 64, BLOCK_N=64 if small else 32), opts)
        else:
            opts = dict(num_warps=4 if small else 8, num_stages=2)
            kv = (dict(BLOCK_M=32, BLOCK_N=64 if small else 32), opts)
            q = (dict(BLOCK_M=64 if small else 32, BLOCK_N=32), opts)
    return (_with_override("FLASHSDPA_TRITON_BWD_KV", *kv, backend),
            _with_override("FLASHSDPA_TRITON_BWD_Q", *q, backend))


def kvcache_config(head_dim, rows):
    """(blocks, launch options) of the KV-cache kernel for the larger of D and Dv; rows: the
    query rows of one kv head (group * Lq), which BLOCK_M covers up to 64 (a dot needs >= 16)."""
    backend = _backend()
    if backend == "interpreter":
        blocks, opts = dict(BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=16), {}
    else:
        bm = min(64, max(16, next_pow2(rows)))
        blocks = dict(BLOCK_M=bm, BLOCK_N=64 if head_dim <= 128 else 32)
        opts = dict(num_warps=4, num_stages=2)
        if backend == "xpu":
            opts["grf_mode"] = "256"
    return _with_override("FLASHSDPA_TRITON_KVCACHE", blocks, opts, backend)


def next_pow2(n):
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


# The partials one program of the combine kernel holds (rows x splits x Dv): a row of
# MAX_SPLITS splits of Dv 128, as when it took one row a program.
COMBINE_TILE = MAX_SPLITS * 128


def combine_config(rows, splits, dv):
    """BLOCK_R / BLOCK_S / BLOCK_DV of the KV-cache combine kernel for `rows` query rows of
    `splits` partials of dv: as many rows a program as fit COMBINE_TILE (few splits of small
    heads, as in chunked prefill: fewer, fuller programs), at least one."""
    block_s, block_dv = next_pow2(splits), next_pow2(max(16, dv))
    fit = max(1, COMBINE_TILE // (block_s * block_dv))
    return dict(BLOCK_R=min(next_pow2(rows), 1 << (fit.bit_length() - 1)), BLOCK_S=block_s,
                BLOCK_DV=block_dv)
