"""Global on/off state of flashsdpa's transparent routing.

enable() / disable() are idempotent and thread-safe; enabled() scopes a state and restores the
previous one on exit. (What enable() hooks into PyTorch is the routing module's job.)
"""
import contextlib
import threading

_lock = threading.RLock()
_enabled = False


def enable():
    """Route torch.nn.functional.scaled_dot_product_attention to flashsdpa where it can."""
    global _enabled
    with _lock:
        _enabled = True


def disable():
    """Restore PyTorch's own behaviour."""
    global _enabled
    with _lock:
        _enabled = False


def is_enabled():
    return _enabled


@contextlib.contextmanager
def enabled(on=True):
    """Context manager: flashsdpa enabled (or, with on=False, disabled) inside the block; the
    previous state is restored on exit, also when the block raises."""
    with _lock:
        previous = _enabled
    (enable if on else disable)()
    try:
        yield
    finally:
        (enable if previous else disable)()
