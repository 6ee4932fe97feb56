"""Microbenchmark: flashsdpa against PyTorch's own SDPA kernels, side by side in one process.

Providers (--providers, comma separated):
    flashsdpa    flashsdpa.scaled_dot_product_attention (the direct API)
    flashsdpa@T  the same, capped at CPU tier T (portable, avx2, avx512, avx512_bf16, amx)
    torch_flash  F.scaled_dot_product_attention forced to PyTorch's flash CPU kernel
    torch_math   F.scaled_dot_product_attention forced to PyTorch's math kernel
    torch        F.scaled_dot_product_attention with PyTorch's own choice of kernel
    triton       flashsdpa's Triton kernels on any device (on CPU tensors only under
                 TRITON_INTERPRET=1: a smoke test, not a benchmark)
With --device xpu|cuda the tensors live on that GPU: flashsdpa runs its Triton kernels, the
default providers are "flashsdpa,torch" and rates are TFLOP/s (no CPU peak is measured).
Modes (--mode): fwd (forward), train (forward + backward), decode (q_len 1 against a KV cache),
variants (sliding window, softcap, ALiBi, sinks against PyTorch and FlexAttention: handed to
bench/bench_variants.py), serving (KV-cache decode / chunked prefill, contiguous and paged, and
varlen prefill: handed to bench/bench_serving.py), hf (Hugging Face models end to end:
handed to bench/bench_hf.py); those three with --dtypes, --repeats, --threads.

For every case the providers run interleaved (A B C A B C ...), each sample timing enough calls
to last ~20 ms; the table shows medians, GFLOP/s (GB/s of K+V for decode), the speedup against
torch_flash and the fraction of the machine's peak measured by bench/peak.py. Results also go to
JSON and CSV with the CPU model, tiers, threads and versions: in bench/out/ (untracked) unless
--out-dir says otherwise (`make bench-all` writes bench/results/, the tracked results behind
the README's tables). A progress line per case, with an estimate of the time left, goes to
stderr. Dtypes: fp32, bf16, fp16, or torch's names (float32, torch.bfloat16, ...).

    python bench/bench_sdpa.py                       # default: fwd, public suite, fp32+bf16
    python bench/bench_sdpa.py --mode train --dtypes bfloat16 --causal yes
    python bench/bench_sdpa.py --mode decode
    python bench/bench_sdpa.py --shapes 1x16x1024x64,1x16/4x1024x128   # BxH[/Hkv]xLxD
    python bench/bench_sdpa.py --device xpu --dtypes fp16,bf16 --mode train
    python bench/bench_sdpa.py --cap-isa avx2 --tag fwd_avx2   # both libraries held to AVX2

--cap-isa avx2 holds PyTorch (its kernels' CPU dispatch, MKL and oneDNN) and flashsdpa to AVX2 on
a newer x86 CPU: the nearest this machine gets to an AVX2-only host (the same core's caches and
FMA units, so not a measurement of an older core). Those caps are environment variables read
when the libraries load, so the script runs itself again with them set (CAP_ENV).
"""
import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

CAP_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FLASHSDPA_CPU_ISA": "avx2"}}
CAPPED = "FLASHSDPA_BENCH_CAP_ISA"  # set in the re-run: the cap its libraries were loaded under


def _rerun_capped(argv):
    """With --cap-isa NAME (before torch is imported): this script again under CAP_ENV[NAME].
    The option is read as main's parser reads it (abbreviations, --cap-isa=NAME), so that no
    spelling main accepts runs uncapped."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cap-isa")
    name = pre.parse_known_args(argv[1:])[0].cap_isa
    if name not in CAP_ENV or os.environ.get(CAPPED) == name:
        return  # (None, or an unknown name: main's parser reports it)
    env = dict(os.environ, **CAP_ENV[name], **{CAPPED: name})
    os.execve(sys.executable, [sys.executable] + argv, env)


if __name__ == "__main__":
    _rerun_capped(sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peak  # noqa: E402

import flashsdpa  # noqa: E402
from flashsdpa import _C  # noqa: E402

# The dtypes the benchmarks run, by short name. torch's names of the same dtypes ("float32",
# "torch.float32") are aliases, derived from this table so that the two never disagree; every
# bench/ CLI that takes a dtype reads it through dtype_of() / parse_dtypes().
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {alias: short for short, dt in DTYPES.items()
                 for alias in (short, str(dt), str(dt).replace("torch.", ""))}
DTYPE_HELP = "fp32, bf16, fp16, or torch's names (float32, torch.bfloat16, ...)"

# Where runs write their results unless told otherwise: untracked (.gitignore), so that a run
# leaves the checkout clean. bench/results/ holds the tracked results behind the README's
# tables; only `make bench-all` (and hw_check.sh / gpu_check.sh, whose results are kept) write
# there, through --out-dir / --out.
OUT_DIR = os.path.join(HERE, "out")

# (B, Hq, Hkv, L, D): the public prefill suite
PREFILL_SUITE = [
    (1, 16, 16, 1024, 64),
    (4, 16, 16, 512, 64),
    (1, 32, 32, 2048, 128),
    (1, 8, 8, 4096, 64),
    (8, 12, 12, 256, 64),
    (1, 16, 4, 1024, 128),
]
# (B, Hq, Hkv, L, D): the forward + backward suite (fewer shapes: each case costs 3.5 forwards)
TRAIN_SUITE = [
    (1, 16, 16, 1024, 64),
    (1, 8, 8, 2048, 128),
    (4, 16, 16, 512, 64),
    (1, 16, 4, 1024, 128),
]
# (B, Hq, Hkv, KV length, D): the public decode suite, q_len = 1
DECODE_SUITE = [
    (1, 32, 32, 4096, 128),
    (8, 32, 32, 2048, 128),
    (1, 32, 32, 16384, 128),
    (1, 32, 8, 8192, 128),
]
# Timing rounds per case by default: decode samples are short and the read bandwidth here swings
# within seconds, so decode takes more; forward + backward cases are long, so train takes fewer.
DEFAULT_REPEATS = {"fwd": 5, "train": 3, "decode": 11}
# Small cases for smoke tests of this script
TINY_SUITE = [(1, 2, 2, 64, 32), (1, 4, 2, 96, 16)]
TINY_DECODE = [(1, 4, 2, 256, 32)]


# ---- providers -------------------------------------------------------------------------------------
def _torch_with(backend):
    def call(q, k, v, causal, gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return call


def _flashsdpa(q, k, v, causal, gqa):
    return flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _torch_default(q, k, v, causal, gqa):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _triton(q, k, v, causal, gqa):
    from flashsdpa import _gpu
    return _gpu.sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)


PROVIDERS = {
    "flashsdpa": _flashsdpa,
    "torch": _torch_default,
    "triton": _triton,
    "torch_flash": _torch_with(SDPBackend.FLASH_ATTENTION),
    "torch_math": _torch_with(SDPBackend.MATH),
}


def provider(name):
    """A provider by name; "flashsdpa@<tier>" runs flashsdpa capped at that CPU tier."""
    if name in PROVIDERS:
        return PROVIDERS[name]
    base, _, tier = name.partition("@")
    if base == "flashsdpa" and tier:
        from flashsdpa._isa import cap

        def call(q, k, v, causal, gqa):
            with cap(tier):
                return _flashsdpa(q, k, v, causal, gqa)
        return call
    raise SystemExit(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)} "
                     "or flashsdpa@<tier>")


# ---- cost model ------------------------------------------------------------------------------------
def visible_pairs(L, S, causal):
    """(query, key) pairs that take part: all, or the top-left causal triangle."""
    if not causal:
        return L * S
    full = max(0, L - S)            # rows i >= S - 1 see every key
    tri = min(L, S)
    return tri * (tri + 1) // 2 + full * S


def flops(B, Hq, L, S, D, causal, mode):
    fwd = 4.0 * B * Hq * visible_pairs(L, S, causal) * D  # QK^T and PV
    return fwd * 3.5 if mode == "train" else fwd          # backward = 2.5x forward (5 GEMMs)


def kv_bytes(B, Hkv, S, D, dtype):
    return 2.0 * B * Hkv * S * D * torch.empty((), dtype=dtype).element_size()


# ---- timing ----------------------------------------------------------------------------------------
def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "xpu":
        torch.xpu.synchronize()


def make_step(fn, q, k, v, causal, gqa, mode):
    dev = q.device.type
    if mode != "train":
        def step():
            with torch.no_grad():
                fn(q, k, v, causal, gqa)
            synchronize(dev)
        return step
    grad = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, causal, gqa).backward(grad)
        synchronize(dev)
    return step


def time_case(steps, repeats, target_s=0.02, between=None, between_after=None, alternate=False):
    """Interleaved medians: {provider: [seconds per call, ...]}. `between` (if given) runs once
    per round of the providers: right after provider `between_after`'s sample, or at the end of
    the round (decode mode: a read-bandwidth probe right after flashsdpa's sample). `alternate`
    rotates the order by one each round (A B, B A, ...), so that no provider always runs first
    (bench/ab.py: an A/B of two builds, where a fixed order would bias the ratio)."""
    inner = {}
    for name, step in steps.items():  # warm-up, and calls per sample so a sample is ~target_s
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        inner[name] = max(1, min(1000, int(target_s / max(dt, 1e-7))))
    samples = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        shift = r % len(names) if alternate else 0
        for name in names[shift:] + names[:shift]:
            step, n = steps[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            samples[name].append((time.perf_counter() - t0) / n)
            if between and name == between_after:
                between()
        if between and between_after not in steps:
            between()
    return samples


def clock(seconds):
    """m:ss (h:mm:ss from an hour on)."""
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The progress of a run, one line per finished case on stderr (stdout keeps only the
    tables): the case's number of the total, what it measured, the time since the first case
    started and an estimate of the time left, the mean time of the finished cases times the
    number left (cases differ in size, so the first estimates are rough). Every bench mode
    (and ab.py) reports through it."""

    def __init__(self, total):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.start

    def case_done(self, what):
        self.done += 1
        elapsed = self.elapsed()
        left = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {what} | {clock(elapsed)} elapsed, "
              f"~{clock(left)} left", file=sys.stderr, flush=True)


# ---- cases -----------------------------------------------------------------------------------------
def parse_shapes(spec, mode):
    if spec == "suite":
        return {"decode": DECODE_SUITE, "train": TRAIN_SUITE}.get(mode, PREFILL_SUITE)
    if spec == "tiny":
        return TINY_DECODE if mode == "decode" else TINY_SUITE
    shapes = []
    for item in spec.split(","):
        try:
            b, h, l, d = item.split("x")
            hq, _, hkv = h.partition("/")
            shape = (int(b), int(hq), int(hkv or hq), int(l), int(d))
        except ValueError:
            raise ValueError(f"--shapes: {item!r} is not BxH[/Hkv]xLxD (e.g. 1x32/8x4096x128), "
                             "'suite' or 'tiny'") from None
        if min(shape) < 1 or shape[1] % shape[2]:
            raise ValueError(f"--shapes: {item!r}: sizes must be >= 1 and H a multiple of Hkv")
        shapes.append(shape)
    return shapes


def parse_names(flag, spec, allowed):
    """The comma-separated names of --<flag>s, each one of `allowed` (ValueError otherwise)."""
    names = spec.split(",")
    for n in names:
        if n not in allowed:
            raise ValueError(f"--{flag}s: unknown {flag} {n!r}; choose from {', '.join(allowed)}")
    return names


def dtype_of(name, flag="--dtype"):
    """A dtype by short or torch name (DTYPES, DTYPE_ALIASES); ValueError naming `flag`."""
    short = DTYPE_ALIASES.get(name.strip())
    if short is None:
        torch_names = ", ".join(str(dt).replace("torch.", "") for dt in DTYPES.values())
        raise ValueError(f"{flag}: unknown dtype {name!r}; choose from {', '.join(DTYPES)} "
                         f"or torch's names ({torch_names}, also as torch.<name>)")
    return DTYPES[short]


def parse_dtypes(spec, flag="--dtypes"):
    """Comma-separated dtype names -> torch dtypes, in order, each once (dtype_of)."""
    return list(dict.fromkeys(dtype_of(name, flag) for name in spec.split(",")))


def add_run_args(ap, out_name, repeats_help):
    """The options bench_variants.py, bench_serving.py and bench_hf.py share: --dtypes,
    --repeats, --threads, --tiny, --out (bench/out/<out_name>)."""
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma separated: " + DTYPE_HELP)
    ap.add_argument("--repeats", type=int, default=0, help=repeats_help)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="small shapes: a smoke test of this "
                    "script, not a benchmark")
    ap.add_argument("--out", default=os.path.join(OUT_DIR, out_name),
                    help=f"JSON file (default: bench/out/{out_name})")


def apply_run_args(ap, args, **names):
    """add_run_args' options checked and applied (--threads); returns the dtypes and, for each
    name=(spec, allowed) given, its parsed list, in that order."""
    try:
        parsed = [parse_names(n, spec, allowed) for n, (spec, allowed) in names.items()]
        dtypes = parse_dtypes(args.dtypes)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 0:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    return (dtypes, *parsed)


def make_inputs(B, Hq, Hkv, L, D, dtype, mode, device="cpu"):
    """q, k, v of one case, the same for every seed-0 run: q_len 1 in decode mode (L is then the
    KV length), and requiring grad in train mode."""
    Lq = 1 if mode == "decode" else L
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(device=device, dtype=dtype)
    if mode == "train":
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def run(args):
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    providers = args.providers.split(",")
    for p in providers:
        provider(p)  # validates the name
    dtypes = parse_dtypes(args.dtypes)
    causal_opts = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.mode == "decode":
        causal_opts = [False]  # q_len = 1 sees the whole cache either way
    shapes = parse_shapes(args.shapes, args.mode)
    device = args.device
    gpu = device != "cpu"

    pk = peak.measure(threads, read_mib=args.peak_read_mib) if not (args.no_peak or gpu) \
        else None
    meta = dict(host_meta(args.mode), device=device, gpu=gpu_name(device) if gpu else None,
                repeats=args.repeats, peak=pk)
    rows = []
    read_probes = []  # decode mode: per case, one probe per timing round
    progress = Progress(len(shapes) * len(dtypes) * len(causal_opts))
    for (B, Hq, Hkv, L, D) in shapes:
        for dtype in dtypes:
            for causal in causal_opts:
                q, k, v = make_inputs(B, Hq, Hkv, L, D, dtype, args.mode, device)
                Lq, gqa = q.shape[2], Hq != Hkv
                steps = {p: make_step(provider(p), q, k, v, causal, gqa, args.mode)
                         for p in providers}
                # memory bandwidth on this shared machine flips between about 31 and 48 GB/s
                # every few seconds: in decode mode a read probe runs right after flashsdpa's
                # sample in every round, and each row's % peak is the median over the rounds of
                # (its GB/s in the round / that round's probe), so that a sample and the probe it
                # is measured against come from the same second
                probing = args.mode == "decode" and pk and not gpu
                probes = []
                samples = time_case(
                    steps, args.repeats,
                    between=(lambda: probes.append(peak.measure_read(threads,
                                                                     args.peak_read_mib)))
                    if probing else None,
                    between_after="flashsdpa")
                if probing:
                    read_probes.append(probes)
                case_rows = summarize(B, Hq, Hkv, Lq, L, D, dtype, causal, args.mode, samples,
                                      pk, probes if probing else None)
                rows += case_rows
                heads = f"{Hq}/{Hkv}" if gqa else f"{Hq}"
                progress.case_done(
                    f"{args.mode} {B},{heads},{Lq},{L},{D} {case_rows[0]['dtype']}"
                    + (" causal" if causal else "") + ": "
                    + ", ".join(f"{r['provider']} {r['ms']:.2f} ms" for r in case_rows))
                if args.budget and progress.elapsed() > args.budget:
                    print(f"# time budget of {args.budget}s reached; stopping early",
                          file=sys.stderr)
                    return finish_meta(meta, read_probes), rows
    return finish_meta(meta, read_probes), rows


def host_meta(mode):
    """What every bench result records about where and with what it ran."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _C.cpu_brand(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "flashsdpa": flashsdpa.__version__,
        "python": platform.python_version(),
        "tiers": {name: flashsdpa.cpu_isa(dt) for name, dt in DTYPES.items()},
        "isa_cap": _C.isa_cap(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cap_isa": os.environ.get(CAPPED),  # --cap-isa: both libraries held to it
        "mode": mode,
    }


def save_json(path, meta, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return path


def gpu_name(device):
    try:
        return getattr(torch, device).get_device_name(0)
    except Exception:  # noqa: BLE001  (a name is only informative)
        return device


def finish_meta(meta, read_probes):
    """Decode mode: the read bandwidth reported is the median of every probe; read_probes_gbs
    lists each case's probes (one right after each of its flashsdpa samples; each row's fraction
    is the median over the rounds of the round's GB/s over that round's probe)."""
    if meta["mode"] == "decode" and meta["peak"] and read_probes:
        meta["read_probes_gbs"] = read_probes
        meta["peak"] = dict(meta["peak"],
                            read_gbs=statistics.median(x for c in read_probes for x in c))
    return meta


def baseline_of(providers):
    """The provider speedups are measured against: PyTorch's flash CPU kernel, or on a GPU
    PyTorch's own SDPA choice."""
    return next((p for p in ("torch_flash", "torch") if p in providers), None)


def summarize(B, Hq, Hkv, Lq, S, D, dtype, causal, mode, samples, pk, probes=None):
    """Rows of one case. Decode with `probes` (one read probe per round): % peak is the median
    over the rounds of the round's GB/s over the round's probe."""
    base_name = baseline_of(samples)
    base = statistics.median(samples[base_name]) if base_name else None
    out = []
    for name, ts in samples.items():
        med = statistics.median(ts)
        q20, q80 = (statistics.quantiles(ts, n=5)[0], statistics.quantiles(ts, n=5)[-1]) \
            if len(ts) >= 2 else (ts[0], ts[0])
        row = {
            "mode": mode, "provider": name, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": Lq, "S": S, "D": D,
            "dtype": str(dtype).replace("torch.", ""), "causal": causal,
            "ms": med * 1e3, "ms_p20": q20 * 1e3, "ms_p80": q80 * 1e3,
            f"speedup_vs_{base_name or 'torch_flash'}": (base / med) if base else None,
        }
        if mode == "decode":
            nbytes = kv_bytes(B, Hkv, S, D, dtype)
            gbs = nbytes / med * 1e-9
            row["GB/s"] = gbs
            row["frac_peak"] = gbs / pk["read_gbs"] if pk else None
            if probes:
                row["round_gbs"] = [nbytes / t * 1e-9 for t in ts]
                row["frac_peak"] = statistics.median(
                    g / p for g, p in zip(row["round_gbs"], probes))
            if pk:
                # the roofline: the read bandwidth, or the compute peak over the FLOPs a byte
                # read takes (2 Hq / Hkv over the element size), whichever is lower
                fpb = flops(B, Hq, Lq, S, D, causal, mode) / nbytes
                row["flop_per_byte"] = fpb
                roof = [min(p, peak_for(pk, dtype) / fpb) for p in probes or [pk["read_gbs"]]]
                row["roof_gbs"] = statistics.median(roof)
                row["frac_roof"] = statistics.median(
                    g / r for g, r in zip(row.get("round_gbs", [gbs]), roof))
        else:
            gf = flops(B, Hq, Lq, S, D, causal, mode) / med * 1e-9
            row["GFLOP/s"] = gf
            row["TFLOP/s"] = gf * 1e-3
            row["frac_peak"] = gf / peak_for(pk, dtype) if pk else None
        out.append(row)
    return out


# The tiers that compute bf16 on vdpbf16ps (or tiles): their bf16 rows' peak is the bf16 dot one.
BF16_DOT_TIERS = ("avx512_bf16", "amx")


def peak_for(pk, dtype):
    """The compute peak a dtype's rows are measured against: bf16 against the bf16 dot-product
    peak (vdpbf16ps) where its rows run on a tier that computes with it, everything else against
    the fp32 FMA peak."""
    if (dtype == torch.bfloat16 and pk.get("bf16_dot_gflops")
            and flashsdpa.cpu_isa(dtype) in BF16_DOT_TIERS):
        return pk["bf16_dot_gflops"]
    return pk["fma_peak_gflops"]


# ---- output ----------------------------------------------------------------------------------------
def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def markdown(meta, rows):
    mode = meta["mode"]
    gpu = meta.get("device", "cpu") != "cpu"
    rate = "GB/s" if mode == "decode" else ("TFLOP/s" if gpu else "GFLOP/s")
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    base_name = baseline_of(providers)
    head = ["shape (B,H/Hkv,L,S,D)", "dtype", "causal"]
    for p in providers:
        head += [f"{p} ms", f"{p} {rate}"]
    if base_name:
        head += [f"{p} vs {base_name}" for p in providers if p != base_name]
    head.append("flashsdpa % peak" if "flashsdpa" in providers else "% peak")
    roofline = mode == "decode" and any(r.get("frac_roof") for r in rows)
    if roofline:
        head += ["roofline GB/s", "% roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cases = {}
    for r in rows:
        key = (r["B"], r["Hq"], r["Hkv"], r["Lq"], r["S"], r["D"], r["dtype"], r["causal"])
        cases.setdefault(key, {})[r["provider"]] = r
    speedups = {}
    for key, by_p in cases.items():
        B, Hq, Hkv, Lq, S, D, dt, causal = key
        heads = f"{Hq}/{Hkv}" if Hq != Hkv else f"{Hq}"
        cells = [f"{B},{heads},{Lq},{S},{D}", dt, "yes" if causal else "no"]
        for p in providers:
            r = by_p.get(p)
            cells += [f"{r['ms']:.2f}", f"{r[rate]:.1f}"] if r else ["-", "-"]
        if base_name:
            for p in providers:
                if p == base_name:
                    continue
                s = by_p.get(p, {}).get(f"speedup_vs_{base_name}")
                cells.append(f"{s:.2f}x" if s else "-")
                if s:
                    speedups.setdefault((p, dt, causal), []).append(s)
        main = by_p.get("flashsdpa") or next(
            (r for name, r in by_p.items() if name.startswith("flashsdpa")),
            next(iter(by_p.values())))
        cells.append(f"{100 * main['frac_peak']:.0f}%" if main.get("frac_peak") else "-")
        if roofline:
            cells += [f"{main['roof_gbs']:.1f}", f"{100 * main['frac_roof']:.0f}%"] \
                if main.get("frac_roof") else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    summary = []
    for (p, dt, causal), ss in sorted(speedups.items(), key=str):
        summary.append(f"{p} vs {base_name}, {dt}, {'causal' if causal else 'non-causal'}: "
                       f"geomean {geomean(ss):.2f}x, min {min(ss):.2f}x over {len(ss)} shapes")
    pk = meta.get("peak")
    peak_line = (f"machine peak (bench/peak.py, {pk['threads']} threads): FMA "
                 f"{pk['fma_peak_gflops']:.0f} GFLOP/s ({pk['fma_peak_isa']}), "
                 + (f"bf16 dot {pk['bf16_dot_gflops']:.0f} GFLOP/s (vdpbf16ps"
                    + ("; bfloat16 rows' % peak" if meta["tiers"].get("bf16") in
                       BF16_DOT_TIERS else "") + "), "
                    if pk.get("bf16_dot_gflops") else "")
                 + "read "
                 f"{pk['read_gbs']:.1f} GB/s"
                 + (" (median of all probes; each row's % peak: the median over its timing "
                    "rounds of the round's GB/s over the probe taken right after it)"
                    if meta.get("read_probes_gbs") else "")
                 + ("; roofline: the lower of the read probe and the compute peak over the "
                    "row's FLOPs per byte read (2 x Hq/Hkv / the element size)" if roofline else "")
                 ) if pk else "machine peak: not measured"
    where = f"{meta['gpu']} ({meta['device']})" if gpu else meta["cpu"]
    kernels = ("flashsdpa: Triton kernels" if gpu else
               "flashsdpa tiers: " + ", ".join(f"{k}={v}" for k, v in meta["tiers"].items()))
    header = f"{mode} | {where} | {meta['threads']} threads | torch {meta['torch']} | {kernels}"
    if meta.get("cap_isa"):
        header += (f" | --cap-isa {meta['cap_isa']}: PyTorch's CPU capability "
                   f"{meta.get('torch_cpu_capability')}, MKL and oneDNN at "
                   f"{CAP_ENV[meta['cap_isa']]['ONEDNN_MAX_CPU_ISA']}")
    return "\n".join([header, peak_line, ""] + lines + [""] + summary)


def write_outputs(meta, rows, out_dir, tag):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, tag)
    save_json(base + ".json", meta, rows)
    with open(base + ".csv", "w", newline="") as f:
        fields = list(rows[0].keys()) if rows else []
        fields = list(dict.fromkeys(fields + ["GFLOP/s", "GB/s"]))
        w = csv.DictWriter(f, fieldnames=fields + ["cpu", "threads", "torch", "tier"],
                           extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, cpu=meta["cpu"], threads=meta["threads"], torch=meta["torch"],
                            tier=meta["tiers"].get(DTYPE_ALIASES[r["dtype"]])))
    return base + ".json"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--mode", choices=["fwd", "train", "decode", "variants", "serving", "hf"],
                    default="fwd")
    ap.add_argument("--device", choices=["cpu", "xpu", "cuda"], default="cpu")
    ap.add_argument("--providers", default=None,
                    help="default: flashsdpa,torch_flash (cpu) or flashsdpa,torch (GPU)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma separated: " + DTYPE_HELP)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--shapes", default="suite", help="suite, tiny, or BxH[/Hkv]xLxD,...")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timing rounds per case (default 5; decode 11: its samples are short "
                         "and this host's read bandwidth swings, so more rounds steady the medians)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    ap.add_argument("--budget", type=float, default=0, help="stop after this many seconds")
    ap.add_argument("--out-dir", default=OUT_DIR,
                    help="where the JSON / CSV go (default bench/out/, untracked; make "
                         "bench-all: bench/results/)")
    ap.add_argument("--tag", default=None, help="output file name (default: the mode)")
    ap.add_argument("--no-peak", action="store_true", help="skip bench/peak.py")
    ap.add_argument("--cap-isa", choices=sorted(CAP_ENV), default=None,
                    help="hold PyTorch and flashsdpa to this ISA (see above)")
    ap.add_argument("--peak-read-mib", type=int, default=1024)
    args = ap.parse_args(argv)
    if args.mode in ("variants", "serving", "hf"):
        import importlib
        return importlib.import_module(f"bench_{args.mode}").main(
            ["--dtypes", args.dtypes, "--repeats", str(args.repeats or 0),
             "--threads", str(args.threads),
             "--out", os.path.join(args.out_dir, f"{args.tag or args.mode}.json")])
    if args.repeats is None:
        args.repeats = DEFAULT_REPEATS[args.mode]
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:  # bad --dtypes / --shapes: a usage error naming the argument, before any timing
        parse_dtypes(args.dtypes)
        parse_shapes(args.shapes, args.mode)
    except ValueError as e:
        ap.error(str(e))
    if args.providers is None:
        args.providers = "flashsdpa,torch_flash" if args.device == "cpu" else "flashsdpa,torch"
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        raise SystemExit(f"--device {args.device}: no such device available to PyTorch")
    meta, rows = run(args)
    path = write_outputs(meta, rows, args.out_dir, args.tag or args.mode)
    print(markdown(meta, rows))
    print(f"\nresults: {path} (+ .csv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
