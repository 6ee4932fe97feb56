"""Opt-in auto-enable of flashsdpa for code you cannot edit.

Registered as a `torch.backends` entry point, so PyTorch calls `autoload()` at the end of
`import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0). It does nothing unless
FLASHSDPA_AUTOLOAD=1: then it imports flashsdpa and calls flashsdpa.enable(). Kept outside the
flashsdpa package so that, without the variable, `import torch` imports nothing of flashsdpa.
"""
import os


def autoload():
    if os.environ.get("FLASHSDPA_AUTOLOAD", "").strip() != "1":
        return
    import flashsdpa

    flashsdpa.enable()
