"""flashsdpa: fused flash attention for CPUs and Intel GPUs, behind
torch.nn.functional.scaled_dot_product_attention.

    import flashsdpa
    out = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)   # direct API
    print(flashsdpa.explain(q, k, v, is_causal=True))                        # what would run
    flashsdpa.cpu_isa()                                                      # e.g. 'avx2'

Importing flashsdpa never imports Triton.
"""
from . import _ops  # noqa: F401  (registers torch.ops.flashsdpa.* and their autograd)
from ._api import (explain, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                   scaled_dot_product_attention)
from ._isa import configure_from_env as _configure_from_env
from ._isa import cpu_isa
from ._routing import disable, enable, enabled, is_enabled

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
