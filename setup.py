"""Build flashsdpa: one extension, flashsdpa._C, plus the pure-Python package and Triton kernels.

csrc/ is split by how code is compiled:
  * generic sources (op schemas, checks, registration, feature detection, bindings) are compiled
    once with no ISA flags;
  * each ISA tier's kernel source (csrc/cpu/tiers/<tier>.cpp) is compiled once with that tier's
    flags only. Never -march=native: the binary must run on any CPU of its architecture, and the
    best tier is picked at run time from CPUID.

Build with torch already installed: pip install --no-build-isolation [-e] .
"""
import os
import platform

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _simde_include():
    """Where SIMDe's headers are (Debian: libsimde-dev), or None."""
    for d in (os.environ.get("SIMDE_INCLUDE_DIR"), "/usr/include", "/usr/local/include"):
        if d and os.path.exists(os.path.join(d, "simde", "x86", "avx512.h")):
            return d
    return None


SIMDE = _simde_include()
# Test-only emulated tiers: the AVX-512 tier sources built against SIMDe with AVX2 flags, so
# that their code runs (slowly) on CPUs without AVX-512. Only when SIMDe is installed
# (`make test` installs it); a normal build never needs it. FLASHSDPA_NO_EMULATED=1 skips them.
EMULATE = IS_X86 and SIMDE is not None and os.environ.get("FLASHSDPA_NO_EMULATED") != "1"
EMU_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DFLASHSDPA_EMULATE"] + (
    ["-isystem", SIMDE] if SIMDE and SIMDE not in ("/usr/include", "/usr/local/include") else [])

GENERIC_SOURCES = ["csrc/ops.cpp", "csrc/routing.cpp", "csrc/autograd.cpp", "csrc/module.cpp",
                   "csrc/cpu/isa.cpp"]

# tier name -> (source, compiler flags, build it on this architecture?)
TIERS = {
    "portable": ("csrc/cpu/tiers/portable.cpp", [], True),
    "avx2": ("csrc/cpu/tiers/avx2.cpp", ["-mavx2", "-mfma", "-mf16c"], IS_X86),
    "avx512": ("csrc/cpu/tiers/avx512.cpp",
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
               IS_X86),
    "avx512_bf16": ("csrc/cpu/tiers/avx512bf16.cpp",
                    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-mavx2", "-mfma", "-mf16c"],
                    IS_X86),
    "amx": ("csrc/cpu/tiers/amx.cpp",
            ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile",
             "-mamx-bf16", "-mavx2", "-mfma", "-mf16c"],
            IS_X86),
    # test-only emulations (same sources, SIMDe instead of AVX-512 instructions)
    "avx512_emu": ("csrc/cpu/tiers/avx512.cpp", EMU_FLAGS, EMULATE),
    "avx512_bf16_emu": ("csrc/cpu/tiers/avx512bf16.cpp", EMU_FLAGS, EMULATE),
    "amx_emu": ("csrc/cpu/tiers/amx.cpp", EMU_FLAGS, EMULATE),
}

COMMON_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
# at::parallel_for is an inline template: it only runs in parallel in a translation unit compiled
# with OpenMP (PyTorch's CPU build uses OpenMP; its bundled libgomp.so.1 is the one loaded).
OPENMP_FLAGS = ["-fopenmp"]


class TierBuildExtension(BuildExtension):
    """Compiles each tier source with its own flags (through the same ninja machinery), then
    links the objects into the extension with the generic sources."""

    def build_extension(self, ext):
        tier_objects = []
        base = list(ext.extra_compile_args["cxx"])
        for name, (src, flags, _) in ext._flashsdpa_tiers.items():
            tier_objects += self.compiler.compile(
                [src],
                output_dir=os.path.join(self.build_temp, "tier_" + name),
                macros=ext.define_macros,
                include_dirs=ext.include_dirs,
                extra_postargs=base + flags,
                depends=ext.depends,
            )
        ext.extra_objects = list(ext.extra_objects or []) + tier_objects
        super().build_extension(ext)


def make_extension():
    tiers = {k: v for k, v in TIERS.items() if v[2]}
    macros = [("FLASHSDPA_BUILD_" + k.upper(), "1") for k in tiers if k != "portable"]
    depends = [os.path.join("csrc", d, f) for d in ("", "cpu")
               for f in os.listdir(os.path.join(ROOT, "csrc", d)) if f.endswith(".h")]
    ext = CppExtension(
        name="flashsdpa._C",
        sources=GENERIC_SOURCES,
        define_macros=macros,
        extra_compile_args={"cxx": COMMON_FLAGS + OPENMP_FLAGS},
        extra_link_args=OPENMP_FLAGS,
        depends=depends,
    )
    ext._flashsdpa_tiers = tiers
    return ext


setup(
    name="flashsdpa",
    version="0.1.0",
    description="Fused flash attention for CPUs (AVX2/AVX-512/AMX) and Intel GPUs (Triton), "
    "behind torch.nn.functional.scaled_dot_product_attention",
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
