"""Launch-configuration sweep for the Triton kernels on a GPU, interleaved in one process
(medians): TFLOP/s (causal FLOPs halved) of each FLASHSDPA_TRITON_FWD (and, --mode train,
FLASHSDPA_TRITON_BWD_KV / _BWD_Q) setting against PyTorch's own SDPA on the same device, so that
one GPU session tells which configuration kernels/configs.py should pick.

    python bench/tune_triton.py --device cuda                      # 1x32x8192x128 bf16, fwd
    python bench/tune_triton.py --device cuda --mode train --causal
    python bench/tune_triton.py --fwd "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=3;..."
A config list is ';'-separated kernels/configs.py override strings ('' = the default).
Results: bench/out/gpu_tune.json (--out). Under TRITON_INTERPRET=1, --device cpu runs the same
loop at a tiny --shape (a check of the script, not of speed).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sdpa import (OUT_DIR, dtype_of, flops, gpu_name, host_meta,  # noqa: E402
                        parse_shapes, synchronize, time_case)

import flashsdpa  # noqa: E402

# The classic flash-attention shapes around the current defaults (configs.py): wider kv tiles,
# more pipeline stages, 4 / 8 warps.
FWD = ["", "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=3",
       "BLOCK_M=128,BLOCK_N=64,num_warps=8,num_stages=3",
       "BLOCK_M=128,BLOCK_N=64,num_warps=4,num_stages=3",
       "BLOCK_M=64,BLOCK_N=64,num_warps=4,num_stages=4",
       "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=2"]
BWD = ["", "BLOCK_M=64,BLOCK_N=128,num_warps=8,num_stages=2",
       "BLOCK_M=32,BLOCK_N=128,num_warps=8,num_stages=3",
       "BLOCK_M=64,BLOCK_N=64,num_warps=4,num_stages=3"]
ENV = ("FLASHSDPA_TRITON_FWD", "FLASHSDPA_TRITON_BWD_KV", "FLASHSDPA_TRITON_BWD_Q")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "xpu", "cuda"], default="cuda")
    ap.add_argument("--shape", default="1x32x8192x128", help="BxH[/Hkv]xLxD")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--mode", choices=["fwd", "train"], default="fwd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fwd", default=";".join(FWD), help="forward configs, ';'-separated")
    ap.add_argument("--bwd", default=";".join(BWD),
                    help="train: backward configs (both backward kernels), ';'-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(OUT_DIR, "gpu_tune.json"))
    args = ap.parse_args(argv)
    try:
        dtype = dtype_of(args.dtype)
        (B, Hq, Hkv, L, D), = parse_shapes(args.shape, args.mode)
    except ValueError as e:
        ap.error(str(e))
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the Triton kernels only under TRITON_INTERPRET=1")
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        raise SystemExit(f"--device {args.device}: no such device available to PyTorch")
    from flashsdpa import _triton  # the Triton kernels themselves (also on CPU tensors)

    g = torch.Generator().manual_seed(0)
    train = args.mode == "train"
    q, k, v = (torch.randn(B, h, L, D, generator=g).to(args.device, dtype).requires_grad_(train)
               for h in (Hq, Hkv, Hkv))
    grad = torch.randn(q.shape, generator=g).to(args.device, dtype)
    configs = [(f, b) for f in args.fwd.split(";") for b in (args.bwd.split(";") if train
                                                                else [""])]

    def step_of(call, env):
        def step():
            os.environ.update(dict(zip(ENV, env)))
            for t in (q, k, v):
                t.grad = None
            out = call()
            if train:
                out.backward(grad)
            synchronize(args.device)
        return step

    steps = {}
    for fwd, bwd in configs:
        name = f"fwd[{fwd or 'default'}]" + (f" bwd[{bwd or 'default'}]" if train else "")
        steps[name] = step_of(lambda: _triton.scaled_dot_product_attention(
            q, k, v, is_causal=args.causal, enable_gqa=Hq != Hkv), (fwd, bwd, bwd))
    if args.device != "cpu":
        steps["torch"] = step_of(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=args.causal, enable_gqa=Hq != Hkv), ("", "", ""))
    try:
        samples = time_case(steps, args.repeats)
    finally:
        for name in ENV:
            os.environ.pop(name, None)
    work = flops(B, Hq, L, L, D, args.causal, args.mode)
    rows = [{"config": name, "ms": statistics.median(s) * 1e3,
             "tflops": work / statistics.median(s) / 1e12} for name, s in samples.items()]
    best = max((r for r in rows if r["config"] != "torch"), key=lambda r: r["tflops"])
    meta = dict(host_meta("gpu_tune"), device=args.device, shape=args.shape,
                dtype=str(dtype).replace("torch.", ""), causal=args.causal, mode=args.mode)
    if args.device != "cpu":
        meta["gpu"] = gpu_name(args.device)
    print(f"{args.mode} {args.shape} {meta['dtype']} causal={args.causal} on "
          f"{meta.get('gpu', 'the interpreter')}")
    for r in sorted(rows, key=lambda r: -r["tflops"]):
        print(f"  {r['tflops']:8.1f} TFLOP/s  {r['ms']:9.3f} ms  {r['config']}")
    print(f"best: {best['config']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "best": best["config"]}, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
