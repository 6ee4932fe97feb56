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
