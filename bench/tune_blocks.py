"""Block-size sweep for the CPU kernels, interleaved in one process (medians), so that the
comparison survives a noisy machine. Prints GFLOP/s per (bq, bk) for each case.

    python bench/tune_blocks.py --mode fwd --shapes 1x16x1024x64,1x32x2048x128 --dtype fp32
    python bench/tune_blocks.py --mode train --bq 64,96,128 --bk 128,256
"""
import argparse
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sdpa import DTYPE_ALIASES, DTYPE_HELP, dtype_of, flops, parse_shapes  # noqa: E402

import flashsdpa  # noqa: E402
from flashsdpa import _testing  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fwd", "train"], default="fwd")
    ap.add_argument("--shapes", default="1x16x1024x64,1x8x2048x128")
    ap.add_argument("--dtype", default="fp32", help=DTYPE_HELP)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bq", default="0,64,96,192", help="0: the tier's choice")
    ap.add_argument("--bk", default="0,128,256")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        dtype = dtype_of(args.dtype)
    except ValueError as e:
        ap.error(str(e))
    name = DTYPE_ALIASES[str(dtype)]  # the short name, however it was given
    configs = list(itertools.product([int(x) for x in args.bq.split(",")],
                                     [int(x) for x in args.bk.split(",")]))
    for (B, Hq, Hkv, L, D) in parse_shapes(args.shapes, args.mode):
        q = torch.randn(B, Hq, L, D, dtype=dtype, requires_grad=args.mode == "train")
        k = torch.randn(B, Hkv, L, D, dtype=dtype, requires_grad=args.mode == "train")
        v = torch.randn(B, Hkv, L, D, dtype=dtype, requires_grad=args.mode == "train")
        grad = torch.randn(B, Hq, L, D, dtype=dtype)

        def step():
            out = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=args.causal,
                                                         enable_gqa=Hq != Hkv)
            if args.mode == "train":
                out.backward(grad)

        def set_cfg(bq, bk):
            side = "fwd" if args.mode == "fwd" else "bwd"
            _testing.set_policy({f"{side}_bq": bq, f"{side}_bk": bk})

        times = {c: [] for c in configs}
        for c in configs:  # warm-up
            set_cfg(*c)
            step()
        for _ in range(args.repeats):
            for c in configs:
                set_cfg(*c)
                t0 = time.perf_counter()
                step()
                times[c].append(time.perf_counter() - t0)
        _testing.set_policy({})
        fl = flops(B, Hq, L, L, D, args.causal, args.mode)
        print(f"{B}x{Hq}/{Hkv}x{L}x{D} {name} {'causal' if args.causal else ''}")
        for c, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            print(f"  bq={c[0] or 'tier':>4} bk={c[1] or 'tier':>4}: "
                  f"{fl / statistics.median(ts) * 1e-9:7.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
