"""`python -m flashsdpa`: versions, CPU features, tier per dtype, Triton / XPU availability."""
import importlib.util
import os
import platform
import sys

import torch

import flashsdpa
from flashsdpa import _C
from flashsdpa._isa import ENV_VAR

def _yes(flag):
    return "yes" if flag else "no"


def _triton_status():
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    try:
        import triton
        return f"{triton.__version__}"
    except Exception as e:  # a broken install should not break the report
        return f"installed but fails to import ({type(e).__name__}: {e})"


def _xpu_status():
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return "not in this torch build"
    try:
        if xpu.is_available():
            return f"{xpu.device_count()} device(s): {xpu.get_device_name(0)}"
        return "no device"
    except Exception as e:
        return f"unavailable ({type(e).__name__})"


def report():
    f = _C.cpu_features()
    raw = _C.raw_cpuid()
    lines = [
        f"flashsdpa {flashsdpa.__version__}",
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}",
        f"threads: {torch.get_num_threads()} (torch.set_num_threads / OMP_NUM_THREADS)",
        "",
        f"CPU: {_C.cpu_brand()}",
    ]
    if f["x86"]:
        cpuid = sorted({n for t in _C.tiers() for n in t["needs"] if not n.startswith("os_")})
        lines.append("  CPUID:  " + " ".join(f"{k}={_yes(f[k])}" for k in cpuid))
        lines.append(f"  XCR0:   0x{raw['xcr0']:x} -> OS saves YMM={_yes(f['os_avx'])} "
                     f"ZMM={_yes(f['os_avx512'])} AMX tiles={_yes(f['os_amx'])}")
        lines.append(f"  Linux AMX permission (XTILEDATA): "
                     f"{'granted' if f['amx_permitted'] else 'not granted yet'}")
        lines.append(f"  L2 per core: {f['l2_bytes'] // 1024 or '?'} KiB -> decode blocks of "
                     f"{f['decode_block_bytes'] // 1024} KiB")
        lines.append(f"  L1d per core: {f['l1d_bytes'] // 1024 or '?'} KiB -> decode sub-blocks of "
                     f"{f['decode_sub_bytes'] // 1024} KiB (caches laid out (.., L, Hkv, D))")
        if f["bf16_dot_slow"] and f["avx512_bf16"]:
            lines.append("  vdpbf16ps no faster than fp32 FMAs on this CPU (Intel): bfloat16 runs "
                         "on the avx512 tier unless the cap names avx512_bf16")
    else:
        lines.append("  not x86: portable tier only")
    lines.append("")
    lines.append(f"CPU tiers ({ENV_VAR}={os.environ.get(ENV_VAR) or 'unset'}, "
                 f"cap in effect: {_C.isa_cap() or 'none'}):")
    for t in _C.tiers():
        state = "built" if t["built"] else "not built"
        runs = "CPU ok" if t["cpu_ok"] else "CPU lacks it"
        lines.append(f"  {t['name']:<12} {state:<10} {runs:<13} dtypes: "
                     f"{', '.join(t['dtypes']) if t['built'] else '-'}")
    lines.append("selected per dtype: " + ", ".join(
        f"{name}: {flashsdpa.cpu_isa(dt)}"
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                         ("float16", torch.float16))))
    lines.append("")
    lines.append(f"Triton: {_triton_status()}")
    lines.append(f"XPU: {_xpu_status()}")
    from . import _gpu
    lines.append("Triton kernels on the XPU key: "
                 + ("registered" if _gpu.is_registered() else "not registered (enable() with an xpu device)"))
    lines.append(f"routing enabled: {flashsdpa.is_enabled()}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
    sys.exit(0)
