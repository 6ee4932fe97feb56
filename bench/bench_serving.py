"""The serving path, side by side in one process: decode and chunked prefill over contiguous and
paged KV caches (flashsdpa.flash_attn_with_kvcache) and packed variable-length prefill
(flashsdpa.flash_attn_varlen_func), against what PyTorch offers for the same attention and the
loop of per-sequence calls:
    torch (gathered)  F.scaled_dot_product_attention over the sequence's keys (a paged cache's
                      blocks gathered first, inside the timing), with the bottom-right causal
                      mask where the queries are several
    torch (padded)    F.scaled_dot_product_attention on the batch padded to its longest sequence,
                      with the padding (and causal) mask
    loop              flashsdpa.flash_attn_func called once per sequence
and flashsdpa over the same caches quantised to float8_e4m3fn (per-kv-head scales; "fp8"),
checked against flashsdpa over the dequantised cache (the quantisation is not an error of the
kernel). Decode rows report GB/s of K + V read (fp8: its bytes) and its fraction of the read
bandwidth probed right after each round's flashsdpa sample (bench/peak.py, as bench_sdpa.py
--mode decode), from flashsdpa's providers timed again without PyTorch's in the rounds. Every provider's
output is checked against flashsdpa's before timing. Results: bench/out/serving.json (--out;
`make bench-all`: bench/results/serving.json).

    python bench/bench_serving.py                  # every case, fp32 and bf16
    python bench/bench_serving.py --cases decode --dtypes bf16
    python bench/bench_sdpa.py --mode serving      # the same, from the main bench
    python bench/bench_serving.py --device cuda --cases varlen --dtypes bf16   # a GPU
With --device xpu|cuda the tensors live on that GPU: flashsdpa runs its Triton kernels (the
split-KV kernel over the caches; the attention kernels once over the packed batch), the loop
its Triton kernels per sequence, the torch providers PyTorch's own SDPA there; the read probe is
a sum over a --peak-read-mib x 4 MiB buffer on the GPU.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peak  # noqa: E402
from bench_sdpa import (Progress, add_run_args, apply_run_args, geomean,  # noqa: E402
                        gpu_name, host_meta, save_json, synchronize, time_case)

import flashsdpa  # noqa: E402

# name -> (kind, description, parameters)
CASES = {
    "decode": ("decode", "q (1,1,32,128), 16384 cached keys, 8 kv heads",
               dict(B=1, H=32, Hkv=8, D=128, seqlens=[16384], lq=1, block=16)),
    "decode-batch": ("decode", "8 sequences of 1000-4096 cached keys, 32 / 8 heads, D 128",
                     dict(B=8, H=32, Hkv=8, D=128,
                          seqlens=[4096, 1000, 3000, 2048, 3500, 1500, 4000, 2500],
                          lq=1, block=16)),
    "chunked-prefill": ("decode", "256 new queries after 4096 cached keys, 32 / 8 heads, D 128",
                        dict(B=1, H=32, Hkv=8, D=128, seqlens=[4096], lq=256, block=16)),
    "varlen": ("varlen", "one 4000-token and forty 50-token sequences, 8 heads, D 64, causal",
               dict(lens=[4000] + [50] * 40, H=8, D=64)),
}
AGREE_ATOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 4e-3}
DEFAULT_REPEATS = {"decode": 11, "varlen": 3}


def paged_copy(cache, block, order):
    """The batch's cache as blocks of `block` rows, block i of sequence b at pool[order[b * per
    + i]]: (pool, block_table int32)."""
    B, L = cache.shape[:2]
    per = -(-L // block)
    table = order.view(B, per).to(torch.int32)
    pool = torch.empty((B * per, block) + cache.shape[2:], dtype=cache.dtype)
    pool[order] = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per * block - L)).reshape(
        (B * per, block) + cache.shape[2:])
    return pool, table


def e4m3_per_kv_head(x):
    """A (B, L, Hkv, D) cache as float8_e4m3fn with one scale per kv head, each head's absolute
    maximum at 448 (e4m3's largest): (the bytes, the scales)."""
    scale = x.float().abs().amax(dim=(0, 1, 3)) / 448
    return (x.float() / scale.view(-1, 1)).to(torch.float8_e4m3fn), scale


# flash_attn_with_kvcache's cache layouts that kvcache_calls makes (bench/ab.py --mode kvcache)
KV_LAYOUTS = ("contiguous", "paged16", "float8")
KV_PAGE = 16


def kvcache_calls(mods, q, k, v, layout, gen=None):
    """{name: call} calling each module's flash_attn_with_kvcache on the same cache, made from
    bench_sdpa.make_inputs' (B, H, S, D) q / k / v in flash-attn's layout: contiguous, paged
    (KV_PAGE-key pages, shuffled by gen) or float8 (e4m3_per_kv_head); and the K + V bytes one
    call reads."""
    q = q.transpose(1, 2).contiguous()  # (B, 1, Hq, D)
    kc, vc = (x.transpose(1, 2).contiguous() for x in (k, v))  # (B, L, Hkv, D)
    B, L = kc.shape[:2]
    kw = {"cache_seqlens": torch.full((B,), L, dtype=torch.int32)}
    if layout == "paged16":
        order = torch.randperm(B * -(-L // KV_PAGE), generator=gen)
        (kc, kw["block_table"]), (vc, _) = (paged_copy(x, KV_PAGE, order) for x in (kc, vc))
    if layout == "float8":
        (kc, kw["k_scale"]), (vc, kw["v_scale"]) = (e4m3_per_kv_head(x) for x in (kc, vc))
    nbytes = 2 * B * L * kc.shape[-2] * kc.shape[-1] * kc.element_size()
    return {n: (lambda m=m: m.flash_attn_with_kvcache(q, kc, vc, **kw)) for n, m in mods.items()}, \
        nbytes


def bottom_right_mask(lq, lk):
    return torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)


def kv_providers(c, dtype, g, device="cpu"):
    """Decode / chunked prefill over a KV cache: {provider: call}, bytes of K + V read."""
    B, H, Hkv, D, lq = c["B"], c["H"], c["Hkv"], c["D"], c["lq"]
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    L = max(c["seqlens"])
    q = torch.randn(B, lq, H, D, generator=g).to(dtype)
    kc, vc = (torch.randn(B, L, Hkv, D, generator=g).to(dtype) for _ in range(2))
    order = torch.randperm(B * -(-L // c["block"]), generator=g)
    (kp, table), (vp, _) = (paged_copy(x, c["block"], order) for x in (kc, vc))
    causal = lq > 1

    def torch_gathered(paged):
        outs = []
        for b in range(B):
            n = int(seqlens[b])
            if paged:  # the sequence's blocks gathered, then SDPA
                idx = table[b, :-(-n // c["block"])].long()
                k, v = (p[idx].flatten(0, 1)[:n] for p in (kp, vp))
            else:
                k, v = kc[b, :n], vc[b, :n]
            outs.append(F.scaled_dot_product_attention(
                q[b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=bottom_right_mask(lq, n) if causal else None,
                enable_gqa=True).transpose(0, 1))
        return torch.stack(outs)

    # float8_e4m3fn copies, one scale per kv head (each head's absolute maximum at 448)
    fp8 = {}
    for name, x in (("k", kc), ("v", vc)):
        x8, scale = e4m3_per_kv_head(x)
        fp8[name] = (x8, scale, paged_copy(x8, c["block"], order)[0],
                     (x8.float() * scale.view(-1, 1)).to(dtype))
    k8, v8 = fp8["k"][0], fp8["v"][0]
    kp8, vp8 = fp8["k"][2], fp8["v"][2]
    scales = dict(k_scale=fp8["k"][1], v_scale=fp8["v"][1])
    if device != "cpu":  # everything built on the CPU (the same values), then moved
        q, kc, vc, kp, vp, table, seqlens, k8, v8, kp8, vp8 = (
            t.to(device) for t in (q, kc, vc, kp, vp, table, seqlens, k8, v8, kp8, vp8))
        scales = {n: t.to(device) for n, t in scales.items()}
        fp8 = {n: (*x[:3], x[3].to(device)) for n, x in fp8.items()}

    calls = {
        "flashsdpa": lambda: flashsdpa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                               causal=causal),
        "flashsdpa paged": lambda: flashsdpa.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=causal),
        "flashsdpa fp8": lambda: flashsdpa.flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, causal=causal, **scales),
        "flashsdpa paged fp8": lambda: flashsdpa.flash_attn_with_kvcache(
            q, kp8, vp8, cache_seqlens=seqlens, block_table=table, causal=causal, **scales),
        "torch (gathered)": lambda: torch_gathered(False),
        "torch (paged, gathered)": lambda: torch_gathered(True),
    }
    dequantised = lambda: flashsdpa.flash_attn_with_kvcache(  # noqa: E731
        q, fp8["k"][3], fp8["v"][3], cache_seqlens=seqlens, causal=causal)
    refs = {"flashsdpa fp8": dequantised, "flashsdpa paged fp8": dequantised}
    keys = int(seqlens.sum()) * Hkv * D
    kv_bytes = {p: 2 * keys * (1 if p.endswith("fp8") else kc.element_size()) for p in calls}
    return calls, refs, kv_bytes


def varlen_providers(c, dtype, g, device="cpu"):
    lens, H, D = c["lens"], c["H"], c["D"]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T, L = sum(lens), max(lens)
    q, k, v = (torch.randn(T, H, D, generator=g).to(device, dtype) for _ in range(3))
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    cu = cu.to(device)
    pad = torch.zeros(len(lens), 3, L, H, D, dtype=dtype, device=device)
    for s, (a, b) in enumerate(bounds):
        for t, x in enumerate((q, k, v)):
            pad[s, t, :b - a] = x[a:b]
    valid = torch.arange(L)[None] < torch.tensor(lens)[:, None]  # (batch, L)
    mask = (valid[:, None, :] & torch.ones(L, L, dtype=torch.bool).tril()).unsqueeze(1).to(device)

    def padded():
        out = F.scaled_dot_product_attention(*(pad[:, t].transpose(1, 2) for t in range(3)),
                                             attn_mask=mask).transpose(1, 2)
        return torch.cat([out[s, :b - a] for s, (a, b) in enumerate(bounds)])

    calls = {
        "flashsdpa": lambda: flashsdpa.flash_attn_varlen_func(q, k, v, cu, cu, L, L, causal=True),
        "loop": lambda: torch.cat([flashsdpa.flash_attn_func(
            q[a:b][None], k[a:b][None], v[a:b][None], causal=True)[0] for a, b in bounds]),
        "torch (padded)": padded,
    }
    return calls, {}, None


def device_read_probe(device, read_mib):
    """A GPU's read bandwidth (GB/s): the best of 5 sums over a read_mib buffer (x 4, so that it
    is far beyond the GPU's caches), a reduction that reads each byte once."""
    buf = torch.ones(read_mib * 2 ** 20, dtype=torch.float32, device=device)

    def probe():
        best = float("inf")
        for _ in range(5):
            synchronize(device)
            t0 = time.perf_counter()
            buf.sum()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best / 1e9
    return probe


def run_case(name, dtype, repeats, read_mib, device="cpu"):
    kind, what, c = CASES[name]
    g = torch.Generator().manual_seed(0)
    if kind == "decode":
        calls, refs, kv_bytes = kv_providers(c, dtype, g, device)
    else:
        calls, refs, kv_bytes = varlen_providers(c, dtype, g, device)
    with torch.no_grad():
        ours = calls["flashsdpa"]().float()
        diffs = {p: (f().float() - (refs[p]().float() if p in refs else ours)).abs().max().item()
                 for p, f in calls.items() if p != "flashsdpa"}
    bad = {p: d for p, d in diffs.items() if not d <= AGREE_ATOL[dtype]}
    if bad:
        raise SystemExit(f"{name}: providers disagree with flashsdpa beyond "
                         f"{AGREE_ATOL[dtype]}: {bad}")

    def no_grad(f):
        def step():
            with torch.no_grad():
                f()
            synchronize(device)
        return step
    samples = time_case({p: no_grad(f) for p, f in calls.items()}, repeats)
    ms = {p: statistics.median(s) * 1e3 for p, s in samples.items()}
    row = {"case": name, "kind": kind, "what": what, "dtype": str(dtype).replace("torch.", ""),
           "device": device, "ms": ms, "max_abs_diff": diffs,
           "speedup": {p: ms[p] / ms["flashsdpa"] for p in ms if p != "flashsdpa"}}
    if kind == "decode" and c["lq"] == 1:
        # Bandwidth: flashsdpa's providers timed again on their own, each round's read probe
        # right after its flashsdpa sample. (Interleaved with PyTorch's calls, which take
        # ~300 ms each, the same kernels measured up to 1.7x slower than alone while the probe
        # read as fast: a state those calls leave the machine in, not the kernels' speed.)
        own = [p for p in calls if p.startswith("flashsdpa")]
        probes = []
        probe = (lambda: peak.measure_read(torch.get_num_threads(), read_mib)) \
            if device == "cpu" else device_read_probe(device, read_mib)
        alone = time_case({p: no_grad(calls[p]) for p in own}, repeats,
                          between=lambda: probes.append(probe()), between_after="flashsdpa")
        row["ms_alone"] = {p: statistics.median(alone[p]) * 1e3 for p in own}
        row["gbs"] = {p: kv_bytes[p] / (row["ms_alone"][p] * 1e-3) / 1e9 for p in own}
        row["read_probes_gbs"] = probes
        # each round's GB/s over the probe taken right after it, the median over the rounds
        row["frac_read"] = {p: statistics.median(kv_bytes[p] / t / 1e9 / pr for t, pr in
                                                  zip(alone[p], probes))
                            for p in own}
    return row


def markdown(meta, rows):
    where = f"{meta['gpu']} (Triton) | " if meta.get("gpu") else ""
    lines = [f"serving | {where}{meta['cpu']} | {meta['threads']} threads | "
             f"torch {meta['torch']} | tiers " + ", ".join(f"{k}={v}" for k, v in meta["tiers"].items()), "",
             "| case | dtype | flashsdpa ms | other providers ms (flashsdpa's speedup) | "
             "K+V GB/s (% of read probe), flashsdpa timed alone |", "|---|---|---|---|---|"]
    for r in rows:
        others = "; ".join(f"{p} {r['ms'][p]:.2f} ({r['speedup'][p]:.2f}x)"
                           for p in r["ms"] if p != "flashsdpa")
        bw = "; ".join(f"{p} {r['gbs'][p]:.1f} ({100 * r['frac_read'][p]:.0f}%)"
                       for p in r.get("gbs", {}))
        lines.append(f"| {r['case']}: {r['what']} | {r['dtype']} | {r['ms']['flashsdpa']:.2f} | "
                     f"{others} | {bw or '-'} |")
    lines.append("")
    for p in sorted({p for r in rows for p in r["speedup"]}):
        if p.startswith("flashsdpa "):  # flashsdpa's own other cache forms: below
            continue
        xs = [r["speedup"][p] for r in rows if p in r["speedup"]]
        lines.append(f"flashsdpa over {p}: geomean {geomean(xs):.2f}x, range "
                     f"{min(xs):.2f}-{max(xs):.2f}x ({len(xs)} cases)")
    for r in rows:
        if "flashsdpa fp8" in r["ms"]:
            ms = r.get("ms_alone", r["ms"])
            lines.append(
                f"{r['case']} {r['dtype']}: paged cache at {ms['flashsdpa'] / ms['flashsdpa paged']:.2f}x "
                f"the contiguous cache's speed; fp8 cache {ms['flashsdpa'] / ms['flashsdpa fp8']:.2f}x "
                f"(paged {ms['flashsdpa paged'] / ms['flashsdpa paged fp8']:.2f}x) the speed of the "
                f"{r['dtype']} one")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--peak-read-mib", type=int, default=1024)
    ap.add_argument("--device", choices=["cpu", "xpu", "cuda"], default="cpu")
    add_run_args(ap, "serving.json", "rounds per case (default: decode 11, varlen 3)")
    args = ap.parse_args(argv)
    dtypes, cases = apply_run_args(ap, args, case=(args.cases, CASES))
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        raise SystemExit(f"--device {args.device}: no such device available to PyTorch")
    if args.tiny:
        for name, (kind, what, c) in list(CASES.items()):
            c = dict(c)
            if kind == "decode":
                c.update(H=4, Hkv=2, D=16, seqlens=[min(n, 100) - i for i, n in
                                                    enumerate(c["seqlens"])],
                         lq=min(c["lq"], 8), block=7)
            else:
                c.update(lens=[120, 5, 9, 0, 1], H=2, D=16)
            CASES[name] = (kind, what + " (tiny)", c)
    meta = dict(host_meta("serving"), device=args.device)
    if args.device != "cpu":
        meta["gpu"] = gpu_name(args.device)
    rows = []
    progress = Progress(len(cases) * len(dtypes))
    for name in cases:
        for dtype in dtypes:
            kind = CASES[name][0]
            rows.append(run_case(name, dtype, args.repeats or DEFAULT_REPEATS[kind],
                                 args.peak_read_mib, args.device))
            r = rows[-1]
            progress.case_done(
                f"{name} {r['dtype']}: flashsdpa {r['ms']['flashsdpa']:.2f} ms; "
                + ", ".join(f"{p} {x:.2f}x" for p, x in r["speedup"].items())
                + ("; read " + ", ".join(f"{p} {100 * f:.0f}%" for p, f in
                                         r["frac_read"].items()) if "frac_read" in r else ""))
    print(markdown(meta, rows))
    print(f"\nresults: {save_json(args.out, meta, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
