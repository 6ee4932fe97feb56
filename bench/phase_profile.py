"""Where a tier's forward time goes: the prefill forward's steps per tier, dtype and shape.

Runs flashsdpa's forward (prefill kernels) on each CPU tier this machine runs natively, with the
kernels' step clocks on (flashsdpa._testing.counting: nanoseconds per step, summed over
threads), and prints per case the share of the threads' time in each step:
    pack     K^T / V panels packed (in the items or the PackKV phase)
    scores   S = Q K^T, with the softmax's exponentials where they are fused into it
    softmax  row work: online softmax, P in the P V GEMM's operand format (AMX: VNNI pairs), ...
    pv       acc += P V
    other    the rest of the threads' wall time: scheduling, waiting for the last item, the
             call's setup
and the two GEMM steps' rates per thread against this machine's per-thread peak (bench/peak.py:
the FMA peak; for the bf16-only tiers, which multiply bf16 pairs, the vdpbf16ps peak). On a first machine with
a new tier (AMX) this says in one run whether its GEMMs, its softmax or its scheduling lose.

With --train, the same for the backward (flash_bwd.h's step clocks; the forward runs before the
timed calls, outside them):
    pack     operand copies and panels (the Q / dO side per tile, the K / V side per block)
    s        S = Q K^T and P (the exponentials)
    dp       dP = dO V^T and dS
    dkdv     dV += P^T dO and dK += dS^T Q, with their A operands (P^T, dS^T)
    dq       dQ += dS K, with its A operand
    rows     delta, the accumulators zeroed, the gradients stored
    other    scheduling, waiting for the last item, the call's setup
and each GEMM step's rate per thread (S and dP with the work fused into them).

With --decode, the same for split-KV decode (flash_attn_with_kvcache, q (B, 1, Hq, D) over a
contiguous (B, L, Hkv, D) cache of L keys; flash_decode.h's step clocks):
    qk       s = q K
    softmax  q rows loaded, online softmax, the split's partials written
    pv       acc += P V
    other    the merge of the splits, scheduling, the call's setup
and the K + V bytes read per second over the call against the read bandwidth probed here: on
an AVX2-only host this tells a decode bound by its kernels (qk / pv shares far above what the
bytes take at the probed rate) from one bound by memory.

    python bench/phase_profile.py [--tiers avx512,amx] [--dtypes fp32,bf16]
                                  [--shapes 1x16x1024x64,1x8x2048x128] [--calls 5] [--json F]
    python bench/phase_profile.py --train [--shapes ...] ...
    python bench/phase_profile.py --decode [1x32x8x16384x128,...] [--dtypes bf16,fp8] ...
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import flashsdpa  # noqa: E402
from flashsdpa import _C, _testing  # noqa: E402
from flashsdpa._isa import cap  # noqa: E402
from bench_sdpa import visible_pairs  # noqa: E402

STEPS = ("pack", "scores", "softmax", "pv")
BWD_STEPS = ("pack", "s", "dp", "dkdv", "dq", "rows")
# per mode: (counter prefix, steps, {GEMM step: its GEMMs, each 2 x visible pairs x D FLOPs})
MODES = {"fwd": ("fwd", STEPS, {"scores": 1, "pv": 1}),
         "train": ("bwd", BWD_STEPS, {"s": 1, "dp": 1, "dkdv": 2, "dq": 1})}
DECODE_STEPS = ("qk", "softmax", "pv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.float8_e4m3fn}


def native_tiers():
    return [t["name"] for t in _C.tiers() if t["built"] and t["cpu_ok"] and t["name"] != "portable"]


def tier_dtypes(tier):
    return {t["name"]: t["dtypes"] for t in _C.tiers()}[tier]


def measure_peak(threads):
    """bench/peak.py's peaks on `threads` threads (each the best of its probes)."""
    import peak as peak_mod
    return peak_mod.measure(threads, read_mib=64)


def tier_peak(tier, peak, threads):
    """The per-thread peak of the instructions a tier's GEMMs use (bench/peak.py's `peak` over
    `threads` threads): the vdpbf16ps one for the bf16-only tiers where measured (AMX: its
    tiles are faster), else FMA's. None without a peak."""
    if not peak:
        return None
    if tier_dtypes(tier) == ["bfloat16"] and peak["bf16_dot_gflops"]:
        return peak["bf16_dot_gflops"] / threads
    return peak["fma_peak_gflops"] / threads


def step_shares(run, tier, calls, threads, prefix, steps):
    """run's median call of `calls` (after a warm-up) with the step clocks on: (wall ns,
    {"<step>_share": its share of wall x threads, "other_share": the rest}, {step: ns})."""
    run()  # warm-up (buffers, the pack workspace)
    calls_ns = []  # (wall, {step: ns}) per call
    for _ in range(calls):
        with _testing.counting() as counts:
            t0 = time.perf_counter_ns()
            run()
            wall = time.perf_counter_ns() - t0
            c = counts()
        assert _testing.last_policy()["tier"] == tier, _testing.last_policy()
        calls_ns.append((wall, {s: c[f"{prefix}_{s}_ns"] for s in steps}))
    wall, ns = sorted(calls_ns, key=lambda x: x[0])[len(calls_ns) // 2]  # the median call
    busy = wall * threads
    shares = {f"{s}_share": ns[s] / busy for s in steps}
    shares["other_share"] = 1.0 - sum(ns.values()) / busy
    return wall, shares, ns


def profile(tier, dtype, shape, causal, calls, threads, mode="fwd"):
    """One case, its median call of `calls` (mode "train": of the backward alone): {"wall_ms",
    "<step>_share", "other_share" (shares of wall x threads), "<GEMM step>_gflops" (per thread
    while in the step)}."""
    B, H, L, D = shape
    prefix, steps, gemms = MODES[mode]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(3))
    with flashsdpa.enabled(), cap(tier):
        if mode == "train":
            for x in (q, k, v):
                x.requires_grad_()
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            do = torch.randn(o.shape, generator=gen).to(dtype)
            run = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
        else:
            run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        wall, shares, ns = step_shares(run, tier, calls, threads, prefix, steps)
    out = dict({"wall_ms": wall / 1e6}, **shares)
    flops = 2.0 * B * H * visible_pairs(L, L, causal) * D  # one GEMM's
    for step, n in gemms.items():
        out[f"{step}_gflops"] = n * flops / ns[step] if ns[step] else None
    # the backward's S and dP in one micro-tile (bwd_sdp): both GEMMs' time counted under s
    out["s_with_dp"] = mode == "train" and not ns["dp"] and bool(ns["s"])
    if out["s_with_dp"]:
        out["s_gflops"] = 2 * flops / ns["s"]
    return out


def profile_decode(tier, dtype, shape, calls, threads):
    """One decode case (B, Hq, Hkv, L, D), its median call of `calls`: {"wall_ms",
    "<step>_share", "other_share" (shares of wall x threads), "read_gbs" (K + V bytes over the
    call's wall time)}. A float8 cache takes bf16 queries and unit scales."""
    B, Hq, Hkv, L, D = shape
    gen = torch.Generator().manual_seed(0)
    fp8 = dtype == torch.float8_e4m3fn
    q = torch.randn(B, 1, Hq, D, generator=gen).to(torch.bfloat16 if fp8 else dtype)
    k, v = (torch.randn(B, L, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    seqlens = torch.full((B,), L, dtype=torch.int32)
    kw = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
    run = lambda: flashsdpa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, **kw)  # noqa: E731
    with cap(tier):
        wall, shares, _ = step_shares(run, tier, calls, threads, "decode", DECODE_STEPS)
    return dict({"wall_ms": wall / 1e6, "read_gbs": (k.nbytes + v.nbytes) / wall}, **shares)


def main_decode(args, tiers, threads):
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.decode.split(",")]
    read = None
    if not args.no_peak:
        import peak as peak_mod
        read = max(peak_mod.measure_read(threads, read_mib=1024) for _ in range(2))
    print(f"decode phase profile | {threads} threads | torch {torch.__version__} | read probe: "
          + (f"{read:.1f} GB/s" if read else "not measured"))
    print(f"{'tier':<12}{'dtype':<6}{'BxHqxHkvxLxD':<22}{'ms':>8}  "
          + "".join(f"{s:>9}" for s in DECODE_STEPS + ("other",)) + f"{'K+V GB/s (% probe)':>21}")
    rows = []
    for tier in tiers:
        for dt in args.dtypes.split(","):
            name = str(DTYPES[dt]).replace("torch.", "")
            if name not in tier_dtypes(tier) and not (dt == "fp8" and "bfloat16" in tier_dtypes(tier)):
                continue
            for shape in shapes:
                r = profile_decode(tier, DTYPES[dt], shape, args.calls, threads)
                gbs = f"{r['read_gbs']:.1f}" + (f" ({100 * r['read_gbs'] / read:.0f}%)" if read else "")
                print(f"{tier:<12}{dt:<6}{'x'.join(map(str, shape)):<22}{r['wall_ms']:8.2f}  "
                      + "".join(f"{100 * r[s + '_share']:8.0f}%" for s in DECODE_STEPS + ("other",))
                      + f"{gbs:>21}", flush=True)
                rows.append(dict(r, tier=tier, dtype=dt, shape=list(shape)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "torch": torch.__version__, "read_gbs": read,
                       "rows": rows}, f, indent=2)
    return 0


def print_header(mode, threads, torch_version, peak):
    _, steps, gemms = MODES[mode]
    print(f"{'backward ' if mode == 'train' else ''}phase profile | {threads} threads | "
          f"torch {torch_version} | per-thread peak: "
          + (f"FMA {peak['fma_peak_gflops'] / threads:.1f} GFLOP/s"
             + (f", bf16 dot {peak['bf16_dot_gflops'] / threads:.1f}" if peak and
                peak["bf16_dot_gflops"] else "") if peak else "not measured"))
    print(f"{'tier':<12}{'dtype':<6}{'shape':<16}{'causal':<7}{'ms':>8}  "
          + "".join(f"{s:>9}" for s in steps + ("other",))
          + "".join(f"{g + ' GF/s (% peak)':>{len(g) + 17}}" for g in gemms))


def print_row(mode, r):
    _, steps, gemms = MODES[mode]
    ref = r["peak_per_thread_gflops"]
    rate = lambda g: "-" if g is None else (  # noqa: E731
        f"{g:.1f}" + (f" ({100 * g / ref:.0f}%)" if ref else ""))
    mark = {"s": "*" if r.get("s_with_dp") else ""}
    print(f"{r['tier']:<12}{r['dtype']:<6}{'x'.join(map(str, r['shape'])):<16}"
          f"{'yes' if r['causal'] else 'no':<7}{r['wall_ms']:8.2f}  "
          + "".join(f"{100 * r[s + '_share']:8.0f}%" for s in steps + ("other",))
          + "".join(f"{rate(r[g + '_gflops']) + mark.get(g, ''):>{len(g) + 17}}" for g in gemms),
          flush=True)


def print_footer(rows):
    if any(r.get("s_with_dp") for r in rows):
        print("* S and dP in one micro-tile (bwd_sdp): the rate of both GEMMs, their time under s")


def render(path):
    """Print a --json file's table again (the README's tables are pasted from this)."""
    with open(path) as f:
        d = json.load(f)
    if "read_gbs" in d:
        sys.exit(f"--render: {path} is a --decode profile; only prefill and backward ones render")
    mode = d.get("mode", "fwd")  # files written before "mode" was recorded are prefill ones
    print_header(mode, d["threads"], d["torch"], d["peak"])  # (the run's, not this process's)
    for r in d["rows"]:
        print_row(mode, r)
    print_footer(d["rows"])
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default=None, help="comma separated (default: every native tier)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--shapes", default="1x16x1024x64,1x8x2048x128", help="BxHxLxD, comma separated")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-peak", action="store_true", help="skip the peak probe (bench/peak.py)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--decode", nargs="?", const="1x32x8x16384x128", default=None,
                    help="profile decode instead: BxHqxHkvxLxD, comma separated")
    ap.add_argument("--train", action="store_true", help="profile the backward instead")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="print the table of a --json file (prefill or backward) and exit")
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    tiers = args.tiers.split(",") if args.tiers else native_tiers()
    unknown = sorted(set(tiers) - set(native_tiers()))
    if unknown:
        ap.error(f"--tiers: {unknown} not among the tiers this CPU runs: {native_tiers()}")
    if args.decode:
        return main_decode(args, tiers, threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dtypes = args.dtypes.split(",")
    peak = None if args.no_peak else measure_peak(threads)
    mode = "train" if args.train else "fwd"
    print_header(mode, threads, torch.__version__, peak)
    rows = []
    for tier in tiers:
        for dt in dtypes:
            if str(DTYPES[dt]).replace("torch.", "") not in tier_dtypes(tier):
                continue
            for shape in shapes:
                for causal in (False, True):
                    r = profile(tier, DTYPES[dt], shape, causal, args.calls, threads, mode)
                    rows.append(dict(r, tier=tier, dtype=dt, shape=list(shape), causal=causal,
                                     peak_per_thread_gflops=tier_peak(tier, peak, threads)))
                    print_row(mode, rows[-1])
    print_footer(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "threads": threads, "torch": torch.__version__,
                       "peak": peak, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
