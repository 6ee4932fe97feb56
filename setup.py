"""Build flashsdpa: one extension, flashsdpa._C, plus the pure-Python package and Triton kernels.

csrc/ is split by how code is compiled:
  * generic sources (op schemas, checks, registration, feature detection, bindings) are compiled
    once with no ISA flags;
  * the tier source (csrc/cpu/tier.cpp) is compiled once per row of the tier table
    (csrc/cpu/tiers.def) with that row's flags only. Never -march=native: the binary must run on
    any CPU of its architecture, and the best tier is picked at run time from CPUID.

Build with torch already installed: pip install --no-build-isolation [-e] .
"""
import os
import platform
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
# flags, so that their code runs (slowly) on CPUs without their instructions. Only when SIMDe is
# installed (`make test` installs it); a normal build never needs it. FLASHSDPA_NO_EMULATED=1
# skips them.
EMULATE = IS_X86 and SIMDE is not None and os.environ.get("FLASHSDPA_NO_EMULATED") != "1"
EMU_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DFLASHSDPA_EMULATE"] + (
    ["-isystem", SIMDE] if SIMDE and SIMDE not in ("/usr/include", "/usr/local/include") else [])

GENERIC_SOURCES = ["csrc/ops.cpp", "csrc/plan.cpp", "csrc/driver.cpp", "csrc/routing.cpp",
                   "csrc/math_fallback.cpp", "csrc/autograd.cpp", "csrc/module.cpp",
                   "csrc/cpu/isa.cpp"]
TIER_SOURCE = "csrc/cpu/tier.cpp"  # compiled once per tier build below


def tier_builds():
    """Tier builds from the table (csrc/cpu/tiers.def): build name -> compiler flags, for each row
    this architecture builds, plus `<name>_emu` for the rows marked emulated when SIMDe is here."""
    builds = {}
    for row in tiers_def.rows():
        if row["arch"] == "any" or IS_X86:
            builds[row["name"]] = tiers_def.macros(row) + row["flags"]
        if row["emulated"] and EMULATE:
            builds[row["name"] + "_emu"] = tiers_def.macros(row) + EMU_FLAGS
    return builds


TIERS = tier_builds()

COMMON_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
# FLASHSDPA_SANITIZE=1 (`make sanitize`): AddressSanitizer + UndefinedBehaviorSanitizer; the
# process must preload libasan (the Makefile does).
SANITIZE = os.environ.get("FLASHSDPA_SANITIZE") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined"] if SANITIZE else []
# at::parallel_for is an inline template: it only runs in parallel in a translation unit compiled
# with OpenMP (PyTorch's CPU build uses OpenMP; its bundled libgomp.so.1 is the one loaded).
OPENMP_FLAGS = ["-fopenmp"]


class TierBuildExtension(BuildExtension):
    """Compiles each tier source with its own flags (through the same ninja machinery), then
    links the objects into the extension with the generic sources."""

    def build_extension(self, ext):
        tier_objects = []
        base = list(ext.extra_compile_args["cxx"])
        for name, flags in ext._flashsdpa_tiers.items():
            tier_objects += self.compiler.compile(
                [TIER_SOURCE],
                output_dir=os.path.join(self.build_temp, "tier_" + name),
                macros=ext.define_macros,
                include_dirs=ext.include_dirs,
                extra_postargs=base + flags,
                depends=ext.depends,
            )
        ext.extra_objects = list(ext.extra_objects or []) + tier_objects
        super().build_extension(ext)


def make_extension():
    depends = [os.path.join("csrc", d, f) for d in ("", "cpu")
               for f in os.listdir(os.path.join(ROOT, "csrc", d)) if f.endswith((".h", ".def"))]
    ext = CppExtension(
        name="flashsdpa._C",
        sources=GENERIC_SOURCES,
        extra_compile_args={"cxx": COMMON_FLAGS + OPENMP_FLAGS + SANITIZE_FLAGS},
        extra_link_args=OPENMP_FLAGS + SANITIZE_FLAGS,
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
    install_requires=["torch"],
    zip_safe=False,
)
