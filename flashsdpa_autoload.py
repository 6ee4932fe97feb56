"""Opt-in auto-enable of flashsdpa for code you cannot edit.

Registered as a `torch.backends` entry point, so PyTorch calls `autoload()` at the end of
`import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0). It does nothing unless
FLASHSDPA_AUTOLOAD=1: then it imports flashsdpa and calls flashsdpa.enable(). Kept outside the
flashsdpa package so that, without the variable, `import torch` imports nothing of flashsdpa.
"""
import os
import sys


def autoload():
    if os.environ.get("FLASHSDPA_AUTOLOAD", "").strip() != "1":
        return
    pending = sys.modules.get("flashsdpa")
    if pending is not None and getattr(getattr(pending, "__spec__", None), "_initializing", False):
        return  # `import flashsdpa` came first and imported torch: it enables itself when done
    import flashsdpa

    flashsdpa.enable()
