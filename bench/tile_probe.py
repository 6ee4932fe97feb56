"""Each CPU tier's GEMM micro-kernels on their own, outside the attention loops, against the peak.

bench/phase_profile.py times the kernels' steps inside attention calls; this takes the innermost
piece out of them. bench/tile_probe.cpp is compiled once per tier this CPU runs (the tier's
tiers.def macros and flags, as setup.py compiles csrc/cpu/tier.cpp; into bench/.build/) and run
on one thread: per inner dimension K (the head dim for the S GEMM; the key block for P V), the
plain GEMM (P V, the backward's GEMMs) and the S GEMM with the forward's fused exponentials
(gemm_exp, of each polynomial degree the forward uses), over an M x N product of the kernels'
block sizes, whose operands stay in the caches between calls. Reported: GFLOP/s, % of the
per-thread peak of the instructions the tier multiplies with (bench/peak.py on one thread, the
better of two probes: FMA, or vdpbf16ps for the bf16-only tiers), and how much the exponentials
add to the GEMM's time. What a GEMM step loses inside the kernel beyond these rates is the
loops' (operands further away, bookkeeping); what the fused exponentials cost is their share
here.

    python bench/tile_probe.py [--tiers avx2,avx512] [--k 64,128,256] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU_DIR = os.path.join(ROOT, "csrc", "cpu")
SOURCE = os.path.join(HERE, "tile_probe.cpp")
BUILD_DIR = os.path.join(HERE, ".build")
sys.path.insert(0, CPU_DIR)
import tiers_def  # noqa: E402  (the tier table's reader)
import peak  # noqa: E402  (the compiler the bench probes build with)

# the flags setup.py compiles the tiers with, but for what only the extension needs
FLAGS = ["-O3", "-falign-loops=64", "-std=c++17", "-Wall", "-Wno-unused-function"]


def binary(row):
    """The probe built for one tiers.def row (rebuilt when it or a csrc/cpu header is newer)."""
    os.makedirs(BUILD_DIR, exist_ok=True)
    exe = os.path.join(BUILD_DIR, f"tile_probe_{row['name']}")
    deps = [SOURCE] + [os.path.join(CPU_DIR, f) for f in os.listdir(CPU_DIR) if f.endswith(".h")]
    deps.append(os.path.join(ROOT, "csrc", "params.h"))
    if not os.path.exists(exe) or os.path.getmtime(exe) < max(map(os.path.getmtime, deps)):
        cmd = [peak.compiler("C++"), *FLAGS, *tiers_def.macros(row), *row["flags"], "-I", CPU_DIR,
               SOURCE, "-o", exe]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"compiling the tile probe for {row['name']} failed:\n"
                               f"{' '.join(cmd)}\n{res.stderr}")
    return exe


def run(row, ks, m=192, n=256, reps=60, calls=10):
    """{(kernel, degree, K): ns per call} for one tier; kernel "gemm" (degree 0) or "gemm_exp"."""
    out = subprocess.run([binary(row), str(m), str(n), str(reps), str(calls), *map(str, ks)],
                         check=True, capture_output=True, text=True).stdout
    times = {}
    for line in out.splitlines():
        kernel, degree, k, ns = line.split()
        times[(kernel, int(degree), int(k))] = float(ns)
    return times


def main(argv=None):
    from flashsdpa import _C
    import phase_profile  # (the tiers this CPU runs, the peak each tier is held to)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", help="comma separated (default: every native tier)")
    ap.add_argument("--k", default="64,128,256", help="inner dimensions, comma separated")
    ap.add_argument("--m", type=int, default=192, help="rows of the product (a q block)")
    ap.add_argument("--n", type=int, default=256, help="columns (a key block; a multiple of 32)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--no-peak", action="store_true", help="skip the peak probe (bench/peak.py)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    tiers = args.tiers.split(",") if args.tiers else phase_profile.native_tiers()
    unknown = set(tiers) - set(phase_profile.native_tiers())
    if unknown:
        ap.error(f"--tiers: {sorted(unknown)} not among the tiers this CPU runs: "
                 f"{phase_profile.native_tiers()}")
    ks = [int(k) for k in args.k.split(",")]
    peak = None if args.no_peak else phase_profile.measure_peak(1)
    rows_by_name = {r["name"]: r for r in tiers_def.rows()}
    print(f"tile probe | 1 thread | M {args.m} x N {args.n} | per-thread peak: "
          + (f"FMA {peak['fma_peak_gflops']:.1f} GFLOP/s"
             + (f", bf16 dot {peak['bf16_dot_gflops']:.1f}" if peak["bf16_dot_gflops"] else "")
             if peak else "not measured"))
    print(f"{'tier':11s} {'kernel':10s} {'degree':>6s} {'K':>5s} {'ns/call':>10s} "
          f"{'GF/s':>7s} {'% peak':>7s} {'exp adds':>9s}")
    rows = []
    for tier in tiers:
        times = run(rows_by_name[tier], ks, args.m, args.n, args.reps, args.calls)
        ref = phase_profile.tier_peak(tier, peak, 1)
        for (kernel, degree, k), ns in times.items():
            gflops = 2.0 * args.m * args.n * k / ns
            base = times[("gemm", 0, k)]
            row = dict(tier=tier, kernel=kernel, degree=degree, k=k, ns=ns, gflops=gflops,
                       peak_gflops=ref, exp_adds=ns / base - 1.0 if kernel == "gemm_exp" else None)
            rows.append(row)
            pct = f"{100 * gflops / ref:6.0f}%" if ref else "      -"
            adds = f"{100 * row['exp_adds']:8.0f}%" if row["exp_adds"] is not None else "        -"
            print(f"{tier:11s} {kernel:10s} {degree or '-':>6} {k:5d} {ns:10.0f} {gflops:7.1f} "
                  f"{pct} {adds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"m": args.m, "n": args.n, "peak": peak, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
