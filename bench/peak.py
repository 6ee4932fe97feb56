"""Measure this machine's peaks: FMA throughput, bf16 dot-product throughput and read bandwidth.

Compiles bench/peak_probe.c once per ISA variant the CPU runs (sse2, avx2+fma, avx512f) with the
system C compiler, runs it on `threads` threads, and reports GFLOP/s per variant and the read
bandwidth. The machine's FMA peak is the fastest variant; on CPUs with AVX512-BF16 a vdpbf16ps
probe gives the bf16 dot-product peak (bf16 products accumulated in fp32). bench_sdpa.py reports
every kernel as a fraction of these numbers.

    python bench/peak.py [--threads N] [--json out.json]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "peak_probe.c")
BUILD_DIR = os.path.join(HERE, ".build")

# variant -> (compiler flags, cpu feature keys needed, from flashsdpa._C.cpu_features())
VARIANTS = {
    "sse2": ([], []),
    "avx2": (["-mavx2", "-mfma"], ["avx2", "fma", "os_avx"]),
    "avx512": (["-mavx512f"], ["avx512f", "os_avx512"]),
}
# The bf16 dot-product probe (vdpbf16ps: bf16 products, fp32 sums), where the CPU has it: the
# rate bf16 GEMMs can reach without AMX, so bf16 rows are reported against it.
BF16_VARIANT = ("avx512_bf16", ["-mavx512f", "-mavx512bf16"], ["avx512_bf16", "os_avx512"])


def compiler(lang="C"):
    """The compiler the bench probes build with: $CC / $CXX, else the first on PATH."""
    env, names = {"C": ("CC", ("cc", "gcc", "clang")),
                  "C++": ("CXX", ("c++", "g++", "clang++"))}[lang]
    for cc in (os.environ.get(env), *names):
        if cc and shutil.which(cc):
            return cc
    raise RuntimeError(f"the bench probes need a {lang} compiler ({', '.join(names)}) on PATH")


def _binary(variant):
    os.makedirs(BUILD_DIR, exist_ok=True)
    exe = os.path.join(BUILD_DIR, f"peak_probe_{variant}")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(SOURCE):
        flags = BF16_VARIANT[1] if variant == BF16_VARIANT[0] else VARIANTS[variant][0]
        subprocess.run([compiler(), "-O2", "-fopenmp", *flags, SOURCE, "-o", exe],
                       check=True, capture_output=True, text=True)
    return exe


def _run(exe, *args):
    out = subprocess.run([exe, *map(str, args)], check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_PROC_BIND="false")).stdout.split()
    return float(out[2])


def measure_read(threads, read_mib=1024):
    """Read bandwidth (GB/s) with the widest variant the CPU runs."""
    return _run(_binary(runnable_variants()[-1]), "read", threads, read_mib)


def _cpu_features():
    """flashsdpa's CPUID / XCR0 report, or None when flashsdpa is not built."""
    try:
        from flashsdpa import _C
    except ImportError:
        return None
    return _C.cpu_features()


def runnable_variants():
    feats = _cpu_features()
    if feats is None:  # flashsdpa not built: only the baseline is known to be safe
        return ["sse2"]
    return [v for v, (_, needs) in VARIANTS.items() if all(feats.get(k) for k in needs)]


def has_bf16_dot():
    feats = _cpu_features()
    return feats is not None and all(feats.get(k) for k in BF16_VARIANT[2])


def measure(threads=None, fma_seconds=0.5, read_mib=1024, tries=2):
    """Returns {"threads", "fma_gflops": {variant: GFLOP/s}, "fma_peak_gflops", "fma_peak_isa",
    "bf16_dot_gflops" (None without AVX512-BF16), "read_gbs"}: each the best of `tries` probes
    (a shared machine's noise only ever slows a probe: a single vdpbf16ps probe has read half
    the peak beside a busy neighbour, and every bf16 row's % peak with it)."""
    import torch
    threads = threads or torch.get_num_threads()
    best = lambda *args: max(_run(*args) for _ in range(max(1, tries)))  # noqa: E731
    fma = {}
    for variant in runnable_variants():
        fma[variant] = best(_binary(variant), "fma", threads, fma_seconds)
    top = max(fma, key=fma.get)
    bf16 = best(_binary(BF16_VARIANT[0]), "dpbf16", threads, fma_seconds) \
        if has_bf16_dot() else None
    read = best(_binary(top), "read", threads, read_mib)
    return {"threads": threads, "fma_gflops": fma, "fma_peak_gflops": fma[top],
            "fma_peak_isa": top, "bf16_dot_gflops": bf16, "read_gbs": read}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--read-mib", type=int, default=1024, help="read-probe buffer size")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    res = measure(args.threads, read_mib=args.read_mib)
    for v, g in res["fma_gflops"].items():
        print(f"FMA peak [{v:>6}] : {g:8.1f} GFLOP/s on {res['threads']} thread(s)")
    if res["bf16_dot_gflops"]:
        print(f"bf16 dot peak    : {res['bf16_dot_gflops']:8.1f} GFLOP/s (vdpbf16ps)")
    print(f"read bandwidth   : {res['read_gbs']:8.1f} GB/s ({args.read_mib} MiB buffer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
