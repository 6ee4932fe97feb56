"""Build flashsdpa: one extension, flashsdpa._C, plus the pure-Python package and Triton kernels.

csrc/ is split by how code is compiled:
  * generic sources (op schemas, checks, registration, feature detection, bindings) are compiled
    once with no ISA flags;
  * the tier source (csrc/cpu/tier.cpp) is compiled once per row of the tier table
    (csrc/cpu/tiers.def) with that row's flags only. Never -march=native: the binary must run on
    any CPU of its architecture, and the best tier is picked at run time from CPUID.

`pip install .` / `pip wheel .` build against the torch pyproject.toml pins (build isolation);
with torch already installed, `pip install --no-build-isolation [-e] .` builds against that one.
The wheel requires the torch version it was built against (a C++ extension's ABI is that of one
torch release).

Environment: FLASHSDPA_EMULATED=1 adds the test-only emulated tiers (`make build` sets it; never
in a release build), FLASHSDPA_TIERS=portable,avx2 builds only those tiers (`make sanitize`),
FLASHSDPA_DEBUG=1 keeps debug info (release builds are built without it and stripped), MAX_JOBS
caps the parallel compile jobs (default: the CPU count).
"""
import concurrent.futures
import os
import platform
import shutil
import sys
import time

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit("flashsdpa: building needs PyTorch. `pip install .` installs the version "
             "pyproject.toml pins in an isolated build environment; with --no-build-isolation, "
             "install torch first (pip install torch==2.13.0).")

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cpu"))
import tiers_def  # noqa: E402  (the tier table's reader)
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _simde_include():
    """Where SIMDe's headers are (Debian: libsimde-dev), or None."""
    for d in (os.environ.get("SIMDE_INCLUDE_DIR"), "/usr/include", "/usr/local/include"):
        if d and os.path.exists(os.path.join(d, "simde", "x86", "avx512.h")):
            return d
    return None


SIMDE = _simde_include()
# Test-only emulated tiers: the tiers tiers.def marks `emulated`, compiled against SIMDe with AVX2
# flags, so that their code runs (slowly) on CPUs without their instructions. Only in test builds
# (FLASHSDPA_EMULATED=1, which `make build` sets) and when SIMDe is installed (`make test`
# installs it): what `pip install` / `pip wheel` produce never holds them.
EMULATE = IS_X86 and SIMDE is not None and os.environ.get("FLASHSDPA_EMULATED") == "1"
EMU_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DFLASHSDPA_EMULATE"] + (
    ["-isystem", SIMDE] if SIMDE and SIMDE not in ("/usr/include", "/usr/local/include") else [])

GENERIC_SOURCES = ["csrc/ops.cpp", "csrc/plan.cpp", "csrc/driver.cpp", "csrc/routing.cpp",
                   "csrc/math_fallback.cpp", "csrc/autograd.cpp", "csrc/module.cpp",
                   "csrc/cpu/isa.cpp"]
TIER_SOURCE = "csrc/cpu/tier.cpp"  # compiled once per tier build below


# FLASHSDPA_TIERS=portable,avx2 builds only those rows of the table (and their emulated builds;
# tiers_def.asked): the rest are left out of the extension as on an architecture without them
# (their getters are weak symbols; _C.tiers() reports them not built). `make sanitize` builds
# the tiers this CPU runs, the only ones its tests can execute.
def tier_builds(only=tiers_def.requested()):
    """Tier builds from the table (csrc/cpu/tiers.def): build name -> compiler flags, for each row
    this architecture builds (of `only`, if given), plus `<name>_emu` for the rows marked
    emulated when SIMDe is here."""
    rows = tiers_def.rows()
    unknown = sorted(set(only) - {r["name"] for r in rows})
    if unknown:
        sys.exit(f"flashsdpa: FLASHSDPA_TIERS names no tier {', '.join(unknown)} "
                 f"(the rows of csrc/cpu/tiers.def: {', '.join(r['name'] for r in rows)})")
    builds = {}
    for row in rows:
        if not tiers_def.asked(row, only):
            continue
        if row["arch"] == "any" or IS_X86:
            builds[row["name"]] = tiers_def.macros(row) + row["flags"]
        if row["emulated"] and EMULATE:
            builds[row["name"] + "_emu"] = tiers_def.macros(row) + EMU_FLAGS
    return builds


TIERS = tier_builds()

# FLASHSDPA_SANITIZE=1 (`make sanitize`): AddressSanitizer + UndefinedBehaviorSanitizer; the
# process must preload libasan (the Makefile does).
SANITIZE = os.environ.get("FLASHSDPA_SANITIZE") == "1"
# Debug info (-g from Python's own flags) is most of the library's size: release builds drop it
# (-g0 after those flags) and strip the result; FLASHSDPA_DEBUG=1 or a sanitizer build keeps it.
DEBUG = os.environ.get("FLASHSDPA_DEBUG") == "1" or SANITIZE
# Loops and functions start on 64-byte boundaries: otherwise how fast a kernel's loop runs on
# some cores (Zen 2's fetch and op cache) depends on where the link happens to place it, which
# any unrelated change moves.
COMMON_FLAGS = ["-O3", "-falign-loops=64", "-falign-functions=64", "-std=c++17",
                "-fvisibility=hidden", "-Wall", "-Wno-unused-function"] + (
    [] if DEBUG else ["-g0"])
STRIP_FLAGS = [] if DEBUG else ["-s"]
# -O1 -g1 (after -O3 and Python's -g: the last wins): what ASan's documentation advises, line
# tables for the reports, and a tier compiles several times faster than at -O3 -g.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined", "-O1", "-g1"] if SANITIZE else []
# at::parallel_for is an inline template: it only runs in parallel in a translation unit compiled
# with OpenMP (PyTorch's CPU build uses OpenMP; its bundled libgomp.so.1 is the one loaded).
OPENMP_FLAGS = ["-fopenmp"]


def _jobs():
    jobs = os.environ.get("MAX_JOBS")
    return max(1, int(jobs)) if jobs and jobs.isdigit() else (os.cpu_count() or 1)


class TierBuildExtension(BuildExtension):
    """Compiles each tier source with its own flags (through the same ninja machinery: each tier
    its own build directory, so unchanged tiers are not recompiled), the tiers in parallel, then
    links the objects into the extension with the generic sources (ninja, in parallel). One
    progress line per tier on stderr."""

    def build_extension(self, ext):
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx.split()[0]) is None:
            sys.exit(f"flashsdpa: no C++ compiler ({cxx!r} not found): install g++ (or set CXX) "
                     "to build the extension")
        base = list(ext.extra_compile_args["cxx"])
        tiers = list(ext._flashsdpa_tiers.items())
        start = time.time()

        def compile_tier(item):
            name, flags = item
            return name, self.compiler.compile(
                [TIER_SOURCE],
                output_dir=os.path.join(self.build_temp, "tier_" + name),
                macros=ext.define_macros,
                include_dirs=ext.include_dirs,
                extra_postargs=base + flags,
                depends=ext.depends,
            )

        objects = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
            done = concurrent.futures.as_completed([pool.submit(compile_tier, t) for t in tiers])
            for n, future in enumerate(done, 1):
                name, objects[name] = future.result()
                print(f"flashsdpa: [{n}/{len(tiers)}] tier {name} compiled "
                      f"({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
        # linked in the table's order, whatever order they finished in
        ext.extra_objects = list(ext.extra_objects or []) + [
            o for name, _ in tiers for o in objects[name]]
        print("flashsdpa: compiling the generic sources and linking", file=sys.stderr, flush=True)
        super().build_extension(ext)
        print(f"flashsdpa: extension built ({time.time() - start:.0f} s)", file=sys.stderr,
              flush=True)


def make_extension():
    depends = [os.path.join("csrc", d, f) for d in ("", "cpu")
               for f in os.listdir(os.path.join(ROOT, "csrc", d)) if f.endswith((".h", ".def"))]
    ext = CppExtension(
        name="flashsdpa._C",
        sources=GENERIC_SOURCES,
        extra_compile_args={"cxx": COMMON_FLAGS + OPENMP_FLAGS + SANITIZE_FLAGS},
        extra_link_args=OPENMP_FLAGS + SANITIZE_FLAGS + STRIP_FLAGS,
        depends=depends,
    )
    ext._flashsdpa_tiers = TIERS
    return ext


setup(
    name="flashsdpa",
    version="0.1.0",
    description="Fused flash attention for CPUs (AVX2/AVX-512/AMX) and Intel GPUs (Triton), "
    "behind torch.nn.functional.scaled_dot_product_attention",
    license="BSD-3-Clause",
    packages=["flashsdpa", "flashsdpa.kernels"],
    py_modules=["flashsdpa_autoload"],
    package_dir={"flashsdpa": "flashsdpa", "flashsdpa.kernels": "kernels"},
    # FLASHSDPA_NO_EXT=1: the pure-Python part only (`make build` installs that in editable mode,
    # then builds the extension in place, incrementally)
    ext_modules=[] if os.environ.get("FLASHSDPA_NO_EXT") == "1" else [make_extension()],
    cmdclass={"build_ext": TierBuildExtension.with_options(use_ninja=True)},
    # FLASHSDPA_AUTOLOAD=1: `import torch` enables flashsdpa (PyTorch's backend autoload hook)
    entry_points={"torch.backends": ["flashsdpa = flashsdpa_autoload:autoload"]},
    python_requires=">=3.9",
    # the torch this extension was compiled against (its C++ ABI): pyproject.toml's pin under
    # build isolation, else the installed one
    install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
    zip_safe=False,
)
