"""A short run of the enable()/disable() stress (tests/stress_toggle.py) in a subprocess: calls
from several threads stay correct while another toggles the routing, nothing crashes, the RSS
stays flat. `make stress` runs the long one."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_toggle_stress_short_run():
    done = subprocess.run([sys.executable, os.path.join(HERE, "stress_toggle.py"), "--seconds",
                           "8", "--threads", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert " 0 errors" in done.stdout and "toggle cycles" in done.stdout


def test_toggle_cycles_keep_no_memory():
    """enable()/disable() cycles keep nothing (issue 22 item 10: the XPU-key registrations made
    and destroyed per cycle kept ~100 bytes each; they are now made only with an xpu device)."""
    from conftest import run_python
    grown = run_python(
        "import torch, flashsdpa",
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096",
        "for _ in range(2000): flashsdpa.enable(); flashsdpa.disable()",
        "before = rss()",
        "for _ in range(20000): flashsdpa.enable(); flashsdpa.disable()",
        "print(rss() - before)")
    assert int(grown.strip()) < 256 * 1024, grown  # was ~2 MB per 20,000 cycles
