"""CPU tier selection: cpu_isa() and the FLASHSDPA_CPU_ISA cap."""
import os

import torch

from . import _C
from ._common import DTYPE_NAMES, swapped

ENV_VAR = "FLASHSDPA_CPU_ISA"


def configure_from_env():
    """Applies FLASHSDPA_CPU_ISA (called at import). An unknown tier name raises ValueError and
    a tier this CPU/OS cannot run raises RuntimeError, both naming the variable and the values
    it takes (every tier's name; the tiers this CPU runs)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    try:
        _C.set_isa_cap(value)
    except RuntimeError as e:  # the ValueError of an unknown name lists the tiers already
        runnable = [t["name"] for t in _C.tiers() if t["built"] and t["cpu_ok"]]
        raise RuntimeError(f"{e}; this CPU runs {', '.join(runnable)}") from None


def cpu_isa(dtype=torch.float32):
    """The CPU tier flashsdpa runs for `dtype`: the best tier that is built, that this CPU and OS
    support, that implements the dtype, and that FLASHSDPA_CPU_ISA allows."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"flashsdpa.cpu_isa: dtype must be one of {list(DTYPE_NAMES)}, "
                         f"got {dtype}")
    return _C.selected_isa(DTYPE_NAMES[dtype])


def cap(tier):
    """Temporarily cap the CPU tier (tests run the suite once per tier this way)."""
    return swapped(_C.isa_cap, lambda t: _C.set_isa_cap(t or ""), tier)
