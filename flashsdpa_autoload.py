"""Opt-in auto-enable of flashsdpa for code you cannot edit.

Registered as a `torch.backends` entry point, so PyTorch calls `autoload()` at the end of
`import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0). It does nothing unless
FLASHSDPA_AUTOLOAD=1: then it imports flashsdpa and calls flashsdpa.enable(). Kept outside the
flashsdpa package so that, without the variable, `import torch` imports nothing of flashsdpa.
It never breaks `import torch`: if flashsdpa cannot be imported or enabled (a bad
FLASHSDPA_CPU_ISA, an extension not built, ...), it warns why and leaves flashsdpa off.
"""
import os
import sys
import warnings


def autoload():
    if os.environ.get("FLASHSDPA_AUTOLOAD", "").strip() != "1":
        return
    pending = sys.modules.get("flashsdpa")
    if pending is not None and getattr(getattr(pending, "__spec__", None), "_initializing", False):
        return  # `import flashsdpa` came first and imported torch: it enables itself when done
    try:
        import flashsdpa

        flashsdpa.enable()
    except Exception as e:  # noqa: BLE001
        # PyTorch turns an exception raised here into a failed `import torch`, which would
        # break every program run under the variable, flashsdpa or not. An explicit
        # `import flashsdpa` still raises the error.
        warnings.warn(f"FLASHSDPA_AUTOLOAD=1: flashsdpa is left off: {type(e).__name__}: {e}",
                      RuntimeWarning)
