"""Build hygiene: the portable tier (and feature detection) compile for aarch64."""
import os
import shutil
import subprocess

import pytest
import torch.utils.cpp_extension as cpp_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 cross compiler (Debian: g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", ["csrc/cpu/tiers/portable.cpp", "csrc/cpu/isa.cpp"])
def test_portable_sources_compile_for_aarch64(tmp_path, source):
    includes = sum((["-I", p] for p in cpp_ext.include_paths()), [])
    res = subprocess.run(["aarch64-linux-gnu-g++", "-std=c++17", "-O2", "-Wall", "-c",
                          os.path.join(ROOT, source), "-o", str(tmp_path / "out.o"), *includes],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
