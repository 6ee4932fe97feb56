"""Per-call cost of the routing: F.scaled_dot_product_attention with flashsdpa enabled vs
disabled, and the direct API, on small shapes where fixed costs dominate. Interleaved in one
process, medians of many calls.

    python bench/bench_overhead.py [--shapes 1x8x64x64,1x1x16x16] [--dtype fp32]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sdpa import DTYPE_ALIASES, DTYPE_HELP, dtype_of, parse_shapes  # noqa: E402

import flashsdpa  # noqa: E402


def per_call_us(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x8x64x64,1x8x128x64,1x1x16x16")
    ap.add_argument("--dtype", default="fp32", help=DTYPE_HELP)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    try:
        dtype = dtype_of(args.dtype)
    except ValueError as e:
        ap.error(str(e))
    name = DTYPE_ALIASES[str(dtype)]  # the short name, however it was given
    print("| shape | dtype | causal | F.sdpa disabled us | F.sdpa enabled us | direct API us |"
          " enabled / disabled |")
    print("|---|---|---|---|---|---|---|")
    for (B, Hq, Hkv, L, D) in parse_shapes(args.shapes, "fwd"):
        for causal in (False, True):
            q = torch.randn(B, Hq, L, D, dtype=dtype)
            k = torch.randn(B, Hkv, L, D, dtype=dtype)
            v = torch.randn(B, Hkv, L, D, dtype=dtype)
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            d = lambda: flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa
            res = {"off": [], "on": [], "direct": []}
            for _ in range(3):  # warm-up
                f(), d()
            for _ in range(args.repeats):
                flashsdpa.disable()
                res["off"].append(per_call_us(f, args.calls))
                flashsdpa.enable()
                res["on"].append(per_call_us(f, args.calls))
                res["direct"].append(per_call_us(d, args.calls))
            flashsdpa.disable()
            off, on, direct = (statistics.median(res[k]) for k in ("off", "on", "direct"))
            print(f"| {B},{Hq},{L},{D} | {name} | {'yes' if causal else 'no'} | "
                  f"{off:.1f} | {on:.1f} | {direct:.1f} | {on / off:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
