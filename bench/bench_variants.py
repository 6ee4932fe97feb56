"""Attention variants (sliding window, softcap, ALiBi, sinks), side by side in one process:
flashsdpa's variant kernel against flashsdpa's plain causal kernel on the same shape, and against
what PyTorch offers for the same attention:
    torch_flash+mask  F.scaled_dot_product_attention on PyTorch's flash CPU kernel with the
                      equivalent dense mask (a banded boolean mask for the window, a float bias
                      with the causal -inf for ALiBi; softcap and sinks have none)
    flex              FlexAttention compiled on CPU with the equivalent block_mask / score_mod
                      (forward only: it has no CPU backward; sinks are not expressible); compile
                      time excluded (each case's first call, before timing)
    eager             the materialised scores as Hugging Face's eager attention computes them
                      (softmax in fp32); skipped where the fp32 scores would pass EAGER_LIMIT
All causal, q/k/v (B, H, L, D) contiguous. Before timing, every peer's forward output is checked
against flashsdpa's (check_agreement). Providers run interleaved, medians over rounds
(bench_sdpa.time_case). Results: bench/out/variants.json (--out; `make bench-all`:
bench/results/variants.json); report.py renders its table.

    python bench/bench_variants.py                          # every case, fwd and train
    python bench/bench_variants.py --cases window --modes fwd --dtypes bf16 --repeats 3
    python bench/bench_variants.py --tiny --repeats 1     # smoke test (tests/test_bench.py)
    python bench/bench_sdpa.py --mode variants              # the same, from the main bench
    python bench/bench_variants.py --device cuda --cases window --dtypes bf16   # a GPU
With --device xpu|cuda the tensors live on that GPU: flashsdpa runs its Triton kernels, the peer
is PyTorch's own SDPA on that device with the dense mask (its default backend choice); flex
and eager are CPU-only peers here.
"""
import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sdpa import (Progress, add_run_args, apply_run_args, geomean,  # noqa: E402
                        gpu_name, host_meta, save_json, synchronize, time_case)

import flashsdpa  # noqa: E402

# name -> ((B, H, L, D), the variant's keyword arguments, the target its cost against the plain
# causal kernel must meet per mode (issue 18), as (kind, bound): "faster" plain/variant >= bound,
# "cost" variant/plain <= bound)
WINDOW = 1024
SOFTCAP = 30.0
CASES = {
    "window": ((1, 16, 8192, 64), {"window_size": (WINDOW, 0)},
               {"fwd": ("faster", 3.5), "train": ("faster", 3.0)}),
    "softcap": ((1, 16, 2048, 64), {"softcap": SOFTCAP},
                {"fwd": ("cost", 1.2), "train": ("cost", 1.3)}),
    "alibi": ((1, 16, 2048, 64), {"alibi_slopes": None},
              {"fwd": ("cost", 1.15), "train": ("cost", 1.15)}),
    "sinks": ((1, 16, 2048, 64), {"sinks": None},
              {"fwd": ("cost", 1.05), "train": ("cost", 1.05)}),
}
PEERS = ["torch_flash+mask", "flex", "eager"]
EAGER_LIMIT = 2 << 30  # bytes of fp32 scores the eager provider may materialise
DEFAULT_REPEATS = {"fwd": 7, "train": 5}


def alibi_slopes(H):
    """The ALiBi paper's geometric slopes (H a power of two here)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def variant_kwargs(name, H, mode):
    kw = dict(CASES[name][1])
    if name == "alibi":
        kw["alibi_slopes"] = alibi_slopes(H)
    if name == "sinks":  # learned per-head logits: trained, so they take a gradient too
        kw["sinks"] = torch.linspace(-1.0, 2.0, H).requires_grad_(mode == "train")
    return kw


def distance(L):
    i = torch.arange(L)
    return i[:, None] - i[None, :]  # query index - key index


def dense_mask(name, kw, L, dtype):
    """The mask F.scaled_dot_product_attention needs for the same attention, or None when the
    variant has no mask form."""
    d = distance(L)
    if name == "window":
        return (d >= 0) & (d <= kw["window_size"][0])
    if name == "alibi":
        bias = -kw["alibi_slopes"].view(-1, 1, 1) * d.abs()
        return bias.masked_fill(d < 0, float("-inf")).unsqueeze(0).to(dtype)
    return None


def flex_call(name, kw, H, L):
    """A compiled FlexAttention call for the variant, or the reason there is none."""
    if name == "sinks":
        return None, "sinks are not expressible as a score_mod"
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if name == "window":
        w = kw["window_size"][0]

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (qi - ki <= w)
    else:
        def mask_mod(b, h, qi, ki):
            return qi >= ki
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu")
    score_mod = None
    if name == "softcap":
        cap = kw["softcap"]

        def score_mod(s, b, h, qi, ki):
            return cap * torch.tanh(s / cap)
    if name == "alibi":
        slopes = kw["alibi_slopes"]

        def score_mod(s, b, h, qi, ki):
            return s - slopes[h] * (qi - ki).abs()
    compiled = torch.compile(flex_attention, dynamic=False)
    return (lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)), None


def eager(q, k, v, name, kw, mask):
    """Hugging Face's eager attention: scores materialised, softmax in fp32."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if name == "softcap":
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask
    if name == "sinks":
        B, H, L, _ = s.shape
        s = torch.cat([s, kw["sinks"].to(s.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if name == "sinks":
        p = p[..., :-1]
    return p @ v


def providers(name, kw, q, mode):
    """{provider: call(q, k, v) or the reason it does not run}."""
    B, H, L, D = q.shape
    out = {"flashsdpa": lambda q, k, v: flashsdpa.scaled_dot_product_attention(
               q, k, v, is_causal=True, **kw),
           "flashsdpa plain": lambda q, k, v: flashsdpa.scaled_dot_product_attention(
               q, k, v, is_causal=True)}
    gpu = q.device.type != "cpu"
    mask = dense_mask(name, kw, L, q.dtype)
    if mask is None:
        out["torch_flash+mask"] = "no dense-mask form"
    elif gpu:  # PyTorch's choice of GPU kernel for a masked call
        mask = mask.to(q.device)
        out["torch_flash+mask"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask)
    else:
        def torch_flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out["torch_flash+mask"] = torch_flash
    if gpu:
        out["flex"] = out["eager"] = "CPU-only peer"
        return out
    if mode == "train":
        out["flex"] = "no CPU backward"
    else:
        call, why = flex_call(name, kw, H, L)
        out["flex"] = call if call is not None else why
    scores = B * H * L * L * 4
    if scores > EAGER_LIMIT:
        out["eager"] = (f"fp32 scores {scores / 2 ** 30:.1f} GiB > "
                        f"{EAGER_LIMIT / 2 ** 30:.0f} GiB")
    else:
        emask = (distance(L) >= 0) if mask is None else mask
        out["eager"] = lambda q, k, v: eager(q, k, v, name, kw, emask)
    return out


AGREE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 4e-3}


def check_agreement(calls, q, k, v):
    """Every peer computes the same attention as flashsdpa's variant (the masks and score_mods
    above are the variant's equivalents, not approximations of them): max |difference| per
    provider, and an error when one is beyond the dtype's tolerance."""
    with torch.no_grad():
        ours = calls["flashsdpa"](q, k, v).float()
        diffs = {p: (c(q, k, v).float() - ours).abs().max().item() for p, c in calls.items()
                 if callable(c) and p in PEERS}
    bad = {p: d for p, d in diffs.items() if not d <= AGREE_ATOL[q.dtype]}
    if bad:
        raise SystemExit(f"providers disagree with flashsdpa beyond {AGREE_ATOL[q.dtype]}: {bad}")
    return diffs


def make_step(call, q, k, v, extra, mode):
    dev = q.device.type
    if mode == "fwd":
        def step():
            with torch.no_grad():
                call(q, k, v)
            synchronize(dev)
        return step
    grad = torch.randn(q.shape, dtype=q.dtype).to(q.device)

    def step():
        for t in (q, k, v, *extra):
            t.grad = None
        call(q, k, v).backward(grad)
        synchronize(dev)
    return step


def run_case(name, dtype, mode, repeats, device="cpu"):
    (B, H, L, D), _, targets = CASES[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, dtype)
               .requires_grad_(mode == "train") for _ in range(3))
    kw = {n: t.detach().to(device).requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
          for n, t in variant_kwargs(name, H, mode).items()}
    extra = [kw["sinks"]] if mode == "train" and "sinks" in kw else []
    calls = providers(name, kw, q, mode)
    steps = {p: make_step(c, q, k, v, extra, mode) for p, c in calls.items() if callable(c)}
    for step in steps.values():  # compiles FlexAttention, outside the timing
        step()
    agree = check_agreement(calls, q, k, v) if mode == "fwd" else None
    samples = time_case(steps, repeats)
    ms = {p: statistics.median(s) * 1e3 for p, s in samples.items()}
    kind, bound = targets[mode]
    ratio = (ms["flashsdpa plain"] / ms["flashsdpa"] if kind == "faster"
             else ms["flashsdpa"] / ms["flashsdpa plain"])
    return {"case": name, "mode": mode, "shape": [B, H, L, D],
            "dtype": str(dtype).replace("torch.", ""),
            "variant": {k: (list(v) if isinstance(v, tuple) else
                            "(H,) tensor" if torch.is_tensor(v) else v) for k, v in kw.items()},
            "ms": ms, "max_abs_diff": agree, "skipped": {p: c for p, c in calls.items() if not callable(c)},
            "vs_plain": ratio, "target": [kind, bound],
            "met": ratio >= bound if kind == "faster" else ratio <= bound,
            "speedup": {p: ms[p] / ms["flashsdpa"] for p in PEERS if p in ms}}


def markdown(meta, rows):
    where = meta.get("gpu") or meta["cpu"]
    lines = [f"variants | {where} | {meta['threads']} threads | torch {meta['torch']} | "
             "tiers " + ", ".join(f"{k}={v}" for k, v in meta["tiers"].items()), "",
             "| case (B,H,L,D), causal | dtype | mode | flashsdpa ms | plain causal ms | "
             "vs plain (target) | " + " | ".join(f"{p} ms (x)" for p in PEERS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(PEERS)]
    for r in rows:
        kind, bound = r["target"]
        vs = (f"{r['vs_plain']:.2f}x faster (>= {bound})" if kind == "faster"
              else f"{r['vs_plain']:.3f}x cost (<= {bound})")
        vs += "" if r["met"] else " **missed**"
        cells = []
        for p in PEERS:
            if p in r["ms"]:
                cells.append(f"{r['ms'][p]:.1f} ({r['speedup'][p]:.2f}x)")
            else:
                cells.append(f"- ({r['skipped'][p]})")
        opts = ", ".join(f"{k}={v}" for k, v in r["variant"].items())
        lines.append(f"| {r['case']}: {opts} {tuple(r['shape'])} | {r['dtype']} | {r['mode']} | "
                     f"{r['ms']['flashsdpa']:.1f} | {r['ms']['flashsdpa plain']:.1f} | {vs} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines.append("(x): that provider's time over flashsdpa's on the same case (above 1: flashsdpa "
                 "is faster).")
    for p in PEERS:
        xs = [r["speedup"][p] for r in rows if p in r["speedup"]]
        if xs:
            lines.append(f"geomean speedup over {p}: {geomean(xs):.2f}x ({len(xs)} cases); "
                         f"slowest case {min(xs):.2f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="fwd,train")
    ap.add_argument("--device", choices=["cpu", "xpu", "cuda"], default="cpu")
    add_run_args(ap, "variants.json", "rounds per case (default: fwd 7, train 5)")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        raise SystemExit(f"--device {args.device}: no such device available to PyTorch")
    dtypes, cases, modes = apply_run_args(ap, args, case=(args.cases, CASES),
                                          mode=(args.modes, DEFAULT_REPEATS))
    if args.tiny:
        for name, ((B, H, L, D), kw, targets) in list(CASES.items()):
            if "window_size" in kw:
                kw = dict(kw, window_size=(64, 0))
            CASES[name] = ((B, 2, 256, 32), kw, targets)
    meta = dict(host_meta("variants"), device=args.device)
    if args.device != "cpu":
        meta["gpu"] = gpu_name(args.device)
    rows = []
    progress = Progress(len(cases) * len(modes) * len(dtypes))
    for name in cases:
        for mode in modes:
            for dtype in dtypes:
                r = run_case(name, dtype, mode, args.repeats or DEFAULT_REPEATS[mode],
                             args.device)
                rows.append(r)
                progress.case_done(f"{name} {mode} {r['dtype']}: vs plain {r['vs_plain']:.3f} "
                                   f"({'met' if r['met'] else 'MISSED'}); "
                                   + ", ".join(f"{p} {x:.2f}x" for p, x in r["speedup"].items()))
    print(markdown(meta, rows))
    print(f"\nresults: {save_json(args.out, meta, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
