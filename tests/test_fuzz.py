"""A short seeded run of the differential fuzzer (tests/fuzz_sdpa.py) in a subprocess, so that
a crash fails the test and names its case instead of killing the suite. `make fuzz` runs the
long one."""
import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _short_run(*flags, cases=300):
    done = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_sdpa.py"), "--cases",
                           str(cases), "--seed", "0", *flags], capture_output=True, text=True,
                          timeout=900)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, f"rc {done.returncode} (negative: killed by a signal)\n{tail}"
    assert f"{cases} cases, 0 failures" in done.stdout, tail


def test_fuzz_short_run():
    _short_run()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fuzz_short_run_triton():
    """The Triton kernels too (under the interpreter without a GPU; `make fuzz-triton` runs the
    long one). Its first 40 cases found a single key row of unaligned stride read through a
    descriptor and finfo.min mask values overflowing to -inf."""
    _short_run("--triton", cases=200)


def test_the_fuzzer_can_fail():
    """A deliberately wrong 'flashsdpa' must be caught by the fuzzer's verdicts."""
    sys.path.insert(0, HERE)
    import fuzz_sdpa
    real = fuzz_sdpa.routed
    fuzz_sdpa.routed = lambda *a, **kw: real(*a, **kw) * 1.01
    try:
        failed = [s for s in range(40) if fuzz_sdpa.run_case(s)]
    finally:
        fuzz_sdpa.routed = real
    assert failed, "a 1% error in every output went unnoticed"
