"""Build hygiene: the tier table is what the binary holds, and the portable tier (with feature
detection) compiles for aarch64.

Under FLASHSDPA_STRICT=1 (.ci/run sets it) what CI must run is never skipped: a missing cross
compiler fails here, as a missing emulated tier fails the tier fixture (conftest.py)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch.utils.cpp_extension as cpp_ext

from flashsdpa import _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cpu"))
import tiers_def  # noqa: E402

STRICT = os.environ.get("FLASHSDPA_STRICT") == "1"
CROSS = "aarch64-linux-gnu-g++"


def test_tier_table_matches_the_binary():
    rows = tiers_def.rows()
    tiers = _C.tiers()
    assert [r["name"] for r in rows] == [t["name"] for t in tiers]
    only = tiers_def.requested()  # `make sanitize` sets FLASHSDPA_TIERS for its build and tests
    for r, t in zip(rows, tiers):
        assert t["built"] == (tiers_def.asked(r, only) and
                              (r["arch"] == "any" or _C.cpu_features()["x86"])), r["name"]
        assert t["emulated"] == r["emulated"] and t["flags"] == " ".join(r["flags"])
        assert t["dtypes"] == (["bfloat16"] if r["dtypes"] == "BF16_ONLY"
                               else ["float32", "bfloat16", "float16"])


def test_tiers_variable_naming_no_row_stops_the_build():
    env = dict(os.environ, FLASHSDPA_TIERS="avx2,avx3")
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "FLASHSDPA_TIERS names no tier avx3" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("source", ["csrc/cpu/tier.cpp", "csrc/cpu/isa.cpp"])
def test_portable_sources_compile_for_aarch64(tmp_path, source):
    if shutil.which(CROSS) is None:
        msg = f"no aarch64 cross compiler ({CROSS}; Debian: g++-aarch64-linux-gnu, `make test` installs it)"
        if STRICT:
            pytest.fail(msg)
        pytest.skip(msg)
    portable = next(r for r in tiers_def.rows() if r["arch"] == "any")
    includes = sum((["-I", p] for p in cpp_ext.include_paths()), [])
    res = subprocess.run([CROSS, "-std=c++17", "-O2", "-Wall", "-c", *tiers_def.macros(portable),
                          os.path.join(ROOT, source), "-o", str(tmp_path / "out.o"), *includes],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def test_covering_subset_takes_every_value_on_emulated_tiers_and_every_pair_interpreted():
    import itertools
    from types import SimpleNamespace as NS
    from conftest import covering_subset

    def item(test, interpreted=False, **params):
        return NS(module=NS(__name__="m"), originalname=test, callspec=NS(params=params),
                  get_closest_marker=lambda mark: object() if interpreted else None)

    def pairs(cases):
        return {((a, p[a]), (b, p[b])) for p in cases for a, b in itertools.combinations(p, 2)}

    grid = [item("f", tier=t, dtype=d, L=L)
            for t in ("avx2", "emu-amx", "emu-avx512")
            for d in ("fp32", "bf16") for L in (1, 17, 97)]
    grid += [item("g", tier="emu-amx"), item("g", tier="emu-amx"), item("h")]
    kv = [item("kv", True, variant=a, block=b, lq=c, dtype=d)
          for a in ("causal", "window", "alibi") for b in (None, 16, 7) for c in (1, 4, 40)
          for d in ("fp32", "bf16", "fp16")]
    two = [item("two", True, case=n, dtype=d) for n in "abcd" for d in ("fp32", "bf16")]
    keep = covering_subset(grid + kv + two)
    assert [i for i in grid if i.callspec.params.get("tier") == "avx2"] == \
        [i for i in keep if i.callspec.params.get("tier") == "avx2"]  # native: every case
    for t in ("emu-amx", "emu-avx512"):
        kept = [i.callspec.params for i in keep
                if i.originalname == "f" and i.callspec.params["tier"] == t]
        assert {p["dtype"] for p in kept} == {"fp32", "bf16"} and {p["L"] for p in kept} == {1, 17, 97}
        assert len(kept) == 3  # (fp32, 1), (bf16, 17), then (fp32, 97): each adds a value
    assert sum(i.originalname == "g" for i in keep) == 1 and grid[-1] in keep
    kept = [i.callspec.params for i in keep if i.originalname == "kv"]
    assert pairs(kept) == pairs([i.callspec.params for i in kv])
    assert len(kept) == 9  # of 81: the least a pairwise cover of four 3-valued parameters takes
    assert [i for i in keep if i.originalname == "two"] == two  # two parameters: every pair
    assert keep == [i for i in grid + kv + two if i in keep]  # collection order kept
