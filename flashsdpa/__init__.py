"""flashsdpa: fused flash attention for CPUs and Intel GPUs, behind
torch.nn.functional.scaled_dot_product_attention.

    import flashsdpa
    out = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)   # direct API
    print(flashsdpa.explain(q, k, v, is_causal=True))                        # what would run
    flashsdpa.cpu_isa()        # the CPU tier fp32 runs on: 'portable', 'avx2', 'avx512', ...

Importing flashsdpa never imports Triton.
"""
import torch  # noqa: F401  (first: the extension links against the libraries it loads)

try:
    from . import _C  # noqa: F401  (everything below needs the compiled extension)
except ImportError:
    import importlib.util
    if importlib.util.find_spec(__name__ + "._C") is not None:
        raise  # built but it does not load (e.g. built against another torch): that error
    # not built (a fresh clone): Python would report the failed `from . import _C` inside this
    # package as "partially initialized module ... circular import"
    raise ImportError(
        f"flashsdpa's C++ extension (flashsdpa._C) is not built for this Python in "
        f"{__path__[0]}: build it with `make build` in the source tree, or install flashsdpa "
        "with `pip install --no-build-isolation -e .`") from None

from . import _ops  # noqa: F401,E402  (registers torch.ops.flashsdpa.* and their autograd)
from ._api import (explain, flash_attn_func, flash_attn_varlen_func,  # noqa: E402
                   flash_attn_with_kvcache, scaled_dot_product_attention)
from ._isa import configure_from_env as _configure_from_env  # noqa: E402
from ._isa import cpu_isa  # noqa: E402
from ._routing import disable, enable, enabled, is_enabled  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "scaled_dot_product_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "explain",
    "enable",
    "disable",
    "is_enabled",
    "enabled",
    "cpu_isa",
    "__version__",
]

_configure_from_env()
if __import__("os").environ.get("FLASHSDPA_AUTOLOAD", "").strip() == "1":
    enable()  # also when flashsdpa is imported before torch (see flashsdpa_autoload.py)
