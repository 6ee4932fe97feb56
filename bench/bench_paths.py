"""The gain of each special kernel path, on the named case it was made for: the plan's own
choice (the path on) against the same call with the path forced off (flashsdpa._testing.policy),
interleaved in one process, medians over rounds. A path stays in the code only while its case
shows a gain here on some tier, and tests/test_paths.py proves that it runs.

    python bench/bench_paths.py                 # every path; JSON in bench/out/paths.json
    python bench/bench_paths.py --paths transposed,fused_exp --repeats 11
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sdpa import (OUT_DIR, Progress, flops, geomean, host_meta,  # noqa: E402
                        make_inputs, make_step, parse_names, save_json, time_case, _flashsdpa)
from bench_serving import kvcache_calls  # noqa: E402

import flashsdpa  # noqa: E402
from flashsdpa import _testing  # noqa: E402

# name (the policy field forced off: the name up to a "@", which names a second case) -> the
# case it was made for: (mode, (B, Hq, Hkv, L, D), dtype, causal); and what the path does.
PATHS = {
    "transposed": ("fwd", (1, 16, 16, 1024, 64), torch.float32, False),
    "transposed@causal": ("fwd", (1, 16, 16, 1024, 64), torch.float32, True),
    "fused_exp": ("fwd", (1, 16, 16, 1024, 64), torch.float32, True),
    "fused_exp@bf16": ("fwd", (1, 16, 16, 1024, 64), torch.bfloat16, True),
    "prepack": ("fwd", (1, 16, 4, 1024, 128), torch.bfloat16, True),
    "whole_q": ("fwd", (8, 12, 12, 256, 64), torch.float32, True),
    "fused_bwd": ("train", (1, 16, 16, 1024, 64), torch.bfloat16, True),
    "fused_rows": ("train", (1, 16, 16, 1024, 64), torch.float32, True),
    "fused_sdp": ("train", (1, 16, 16, 1024, 64), torch.bfloat16, False),
    "fused_sdp@fp32": ("train", (1, 16, 16, 1024, 64), torch.float32, False),
    "decode": ("decode", (1, 32, 8, 8192, 128), torch.bfloat16, False),
    "fp16_pv": ("decode-fp8", (1, 32, 8, 16384, 128), torch.bfloat16, False),
    "e4m3_fast": ("decode-fp8", (1, 32, 8, 16384, 128), torch.bfloat16, False),
    "near_pf": ("decode", (1, 32, 8, 16384, 128), torch.bfloat16, False),
    "near_pf@kvcache": ("decode-kvcache", (1, 32, 8, 16384, 128), torch.bfloat16, False),
    "pv_whole": ("decode-kvcache", (1, 32, 8, 16384, 128), torch.bfloat16, False),
}
WHAT = {
    "transposed": "S^T = K Q^T, K and V read in place (no K^T / V panels)",
    "transposed@causal": "the same under a causal band (its tiles cut as the row path's)",
    "fused_exp": "exponentials fused into the S GEMM's tile stores",
    "fused_exp@bf16": "the same on bf16 (avx512_bf16: P in bf16 into P V's operand)",
    "prepack": "K^T / V panels packed once for every q block and query head",
    "whole_q": "one q block per head on short sequences",
    "fused_bwd": "one backward pass per (batch, kv head) instead of two sweeps",
    "fused_rows": "backward: P and dS made per S / dP GEMM tile while it is in L1",
    "fused_sdp": "backward, bf16: S and dP in one micro-tile, P and dS in registers into the bf16 "
                 "operands of dV, dK and dQ",
    "fused_sdp@fp32": "the same on fp32 (avx512: P and dS stored from registers as the GEMMs' "
                      "operands)",
    "decode": "split-KV decode for short queries",
    "fp16_pv": "P V over a float8 cache in fp16 (AVX512-FP16)",
    "e4m3_fast": "a float8 cache widened without F16C's conversion (avx2)",
    "near_pf": "decode prefetches a sub-block ahead, non-temporal, not a block ahead into L2",
    "near_pf@kvcache": "the same over flash-attn's (B, L, Hkv, D) cache (flash_attn_with_kvcache)",
    "pv_whole": "(B, L, Hkv, D) cache: P V per kv head over a block, not a sub-block across heads",
}


# Rounds per case: a decode call takes a millisecond or two, over which a shared host's memory
# bandwidth swings more than the gains measured, so decode cases take more rounds.
REPEATS, DECODE_REPEATS = 9, 21


def policy_field(name):
    return name.split("@")[0]


def kvcache_decode_step(B, Hq, Hkv, L, D, dtype, fp8):
    """One decode query over a (B, L, Hkv, D) cache (flash_attn_with_kvcache) of make_inputs'
    keys and values: in dtype, or (fp8) quantised to float8_e4m3fn with per-kv-head scales."""
    q, k, v = make_inputs(B, Hq, Hkv, L, D, dtype, "decode")
    calls, _ = kvcache_calls({"flashsdpa": flashsdpa}, q, k, v, "float8" if fp8 else "contiguous")
    return calls["flashsdpa"]


def run_path(name, repeats):
    mode, (B, Hq, Hkv, L, D), dtype, causal = PATHS[name]
    field = policy_field(name)
    if mode in ("decode-fp8", "decode-kvcache"):
        step = kvcache_decode_step(B, Hq, Hkv, L, D, dtype, mode == "decode-fp8")
    else:
        q, k, v = make_inputs(B, Hq, Hkv, L, D, dtype, mode)
        step = make_step(_flashsdpa, q, k, v, causal, Hq != Hkv, mode)

    def with_policy(on):
        def call():
            with _testing.policy(**({} if on else {field: 0})):
                step()
        return call

    with _testing.policy():  # what the plan chooses for this case
        step()
        chosen = _testing.last_policy()
    samples = time_case({"on": with_policy(True), "off": with_policy(False)}, repeats,
                        alternate=True)
    on, off = (statistics.median(samples[k]) for k in ("on", "off"))
    Lq = 1 if mode.startswith("decode") else L
    return {"path": name, "mode": mode, "shape": [B, Hq, Hkv, Lq, L, D],
            "dtype": str(dtype).replace("torch.", ""), "causal": causal, "tier": chosen["tier"],
            "plan_takes_it": bool(chosen[field]), "on_ms": on * 1e3, "off_ms": off * 1e3,
            "gain": off / on, "gflops_on": flops(B, Hq, Lq, L, D, causal, mode) / on * 1e-9,
            "repeats": repeats}


def markdown(meta, rows):
    lines = [f"paths | {meta['cpu']} | {meta['threads']} threads | torch {meta['torch']}", "",
             "| path | what it does | case (B,H/Hkv,Lq,S,D) | dtype | causal | tier | on ms | "
             "off ms | gain (off/on) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        B, Hq, Hkv, Lq, S, D = r["shape"]
        h = f"{Hq}/{Hkv}" if Hq != Hkv else f"{Hq}"
        taken = "" if r["plan_takes_it"] else " (plan does not take it here)"
        lines.append(f"| {r['path']} | {WHAT[r['path']]} | {r['mode']} {B},{h},{Lq},{S},{D} | "
                     f"{r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['tier']}{taken} | "
                     f"{r['on_ms']:.2f} | {r['off_ms']:.2f} | {r['gain']:.3f}x |")
    lines += ["", f"geomean gain over {len(rows)} paths: "
              f"{geomean([r['gain'] for r in rows]):.3f}x"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"rounds per path (default: {REPEATS}, decode cases {DECODE_REPEATS})")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(OUT_DIR, "paths.json"),
                    help="JSON file (default: bench/out/paths.json)")
    args = ap.parse_args(argv)
    try:
        names = parse_names("path", args.paths, PATHS)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = host_meta("paths")
    rows = []
    progress = Progress(len(names))
    for n in names:
        repeats = args.repeats or (DECODE_REPEATS if PATHS[n][0].startswith("decode") else REPEATS)
        rows.append(run_path(n, repeats))
        progress.case_done(f"{n}: gain {rows[-1]['gain']:.3f}x")
    print(markdown(meta, rows))
    print(f"\nresults: {save_json(args.out, meta, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
