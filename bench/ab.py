"""A/B benchmark: the working tree's flashsdpa against the build of another git revision, both
loaded in ONE process and timed in interleaved rounds.

    python bench/ab.py --base HEAD~1                          # fwd, train and decode suites
    python bench/ab.py --base main --mode fwd --dtypes bf16 --shapes 1x16x1024x64
    python bench/ab.py --base v0.1 --fail-above 3             # exit 1 if a mode is >3% slower
    python bench/ab.py --base HEAD --mode kvcache --dtypes bf16   # flash-attn's cache layouts
    make bench-ab BASE=HEAD~1 AB_ARGS="--mode decode"

"new" is the package importable from this checkout as it is built now (`make build`); "base" is
REV exported with `git archive` into bench/.build/ab/<sha>/, every lowercase `flashsdpa` in it
renamed to `flashsdpa_base` (package, op namespace, C++ namespace, module names) so that the two
extensions and their torch.ops libraries coexist, and built there once (cached per commit: delete
the folder to rebuild). Both run the direct API, flashsdpa[_base].scaled_dot_product_attention,
on the same tensors. Suites, inputs, step functions, timing and FLOP counts are bench_sdpa.py's;
the default shapes and rounds per mode are those of `make bench-all`. Per case: the medians over
rounds and the ratio new/base (> 1: new is slower); per mode: geomean, min and max of the ratios.
Table on stdout, JSON in bench/.build/ab/result_<tag>.json.

--mode kvcache: the decode suite's shapes through flash_attn_with_kvcache over flash-attn's
(B, L, Hkv, D) cache, contiguous, paged (16-key pages in shuffled order) and float8 (per-kv-head
scales), each a case (bench_serving.kvcache_calls): the layout decode items read across their
kv heads (FlashDecode::all_heads), which --mode decode's (B, H, S, D) tensors never reach.

Limits: "new" is whatever build is in flashsdpa/ now (run `make build` first, or use the make
target, which does); FLASHSDPA_* environment variables (e.g. FLASHSDPA_CPU_ISA) apply to both
builds; enable() routing is not measured, only the direct API. On a shared or busy machine
--threads 1 gives steadier ratios (an OpenMP team waits on its slowest, descheduled thread).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
AB_DIR = os.path.join(HERE, ".build", "ab")  # git-ignored (bench/.build/)
OLD, NEW = "flashsdpa", "flashsdpa_base"
MODES = ("fwd", "train", "decode", "kvcache")  # bench_sdpa's suites and rounds (kvcache: decode's)


def rename_tree(root, old=OLD, new=NEW):
    """Renames the identifier `old` to `new` in the contents and names of every file and folder
    under root. Case-sensitive on purpose: FLASHSDPA_* environment variables and macros keep their
    names. Files that are not UTF-8 (binaries) keep their contents; links are not followed."""
    pattern = re.compile(re.escape(old))
    # bottom-up, so that a folder is renamed only after everything inside it
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                try:
                    with open(path, encoding="utf-8", newline="") as f:
                        text = f.read()
                except UnicodeDecodeError:
                    text = None
                if text is not None and old in text:
                    with open(path, "w", encoding="utf-8", newline="") as f:
                        f.write(pattern.sub(new, text))
        for name in files + dirs:
            if old in name:
                os.rename(os.path.join(folder, name), os.path.join(folder, name.replace(old, new)))


def git(*args):
    res = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    if res.returncode:  # e.g. an unknown revision: git's own message, no traceback
        raise SystemExit(f"git {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout.strip()


def build_base(rev):
    """The folder holding REV's build, renamed to flashsdpa_base; exported and built on first use.
    The export is built in <sha>.tmp and renamed to <sha> only when the build succeeded, so a
    folder named after a commit always holds a complete build."""
    sha = git("rev-parse", "--short=12", rev + "^{commit}")
    dest = os.path.join(AB_DIR, sha)
    if os.path.isdir(os.path.join(dest, NEW)) and any(
            f.startswith("_C") and f.endswith(".so") for f in os.listdir(os.path.join(dest, NEW))):
        return sha, dest
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
    if archive.wait():
        raise SystemExit(f"git archive {sha} failed")
    rename_tree(tmp)
    # the Triton kernels live in kernels/ (setup.py maps them to the package); a link makes
    # flashsdpa_base.kernels importable from the copy. The CPU path never imports them.
    if os.path.isdir(os.path.join(tmp, "kernels")):
        os.symlink(os.path.join("..", "kernels"), os.path.join(tmp, NEW, "kernels"))
    log = os.path.join(tmp, "build.log")
    print(f"# building {rev} ({sha}) in {tmp} (several minutes; log: {log})", file=sys.stderr)
    env = dict(os.environ, FLASHSDPA_NO_EMULATED="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp,
                             env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        with open(log) as f:
            sys.stderr.write("".join(f.readlines()[-30:]))
        raise SystemExit(f"building {rev} ({sha}) failed; see {log}")
    os.rename(tmp, dest)
    return sha, dest


def describe_worktree():
    # untracked files count too: a new source the build compiles is part of "new"
    dirty = git("status", "--porcelain").splitlines()
    return f"working tree (HEAD {git('rev-parse', '--short=12', 'HEAD')}" + (
        f" + {len(dirty)} changed or untracked files)" if dirty else ", clean)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--mode", default="fwd,train,decode",
                    help="comma separated: fwd,train,decode,kvcache")
    ap.add_argument("--repeats", type=int, default=None,
                    help="rounds per case (default per mode as make bench-all: 5, 3, 11)")
    ap.add_argument("--shapes", default=None, help="BxH[/Hkv]xLxD,... (default per mode as "
                    "make bench-all; decode: L is the KV length)")
    ap.add_argument("--dtypes", default="fp32,bf16",
                    help="comma separated, as bench_sdpa.py --dtypes takes them")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    ap.add_argument("--tag", default=None, help="result_<tag>.json (default: the base sha)")
    ap.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                    help="exit 1 when a mode's geomean new/base is more than PCT%% slower")
    args = ap.parse_args(argv)
    modes = args.mode.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--mode: choose from {','.join(MODES)}")
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be >= 1")

    sys.path.insert(0, HERE)
    import bench_sdpa as bs  # imports torch and the working tree's flashsdpa
    from bench_serving import KV_LAYOUTS, kvcache_calls
    import torch
    try:  # bad arguments fail before a build of several minutes
        dtypes = bs.parse_dtypes(args.dtypes)
        cases = {m: bs.parse_shapes(args.shapes or "suite", "decode" if m == "kvcache" else m)
                 for m in modes}
    except ValueError as e:
        ap.error(str(e))
    sha, base_dir = build_base(args.base)
    sys.path.insert(0, base_dir)
    import flashsdpa_base
    # the two builds must really be two: the base from its copy, the new one from this checkout
    assert os.path.realpath(flashsdpa_base.__file__).startswith(os.path.realpath(base_dir))
    assert not os.path.realpath(bs.flashsdpa.__file__).startswith(os.path.realpath(AB_DIR))

    def base_call(q, k, v, causal, gqa):
        return flashsdpa_base.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=gqa)
    providers = {"base": base_call, "new": bs.provider("flashsdpa")}

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {"cpu": bs.flashsdpa._C.cpu_brand(), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "base": f"{args.base} ({sha})", "new": describe_worktree(),
            "tiers": {n: {dt: m.cpu_isa(bs.DTYPES[dt]) for dt in bs.DTYPES}
                      for n, m in (("base", flashsdpa_base), ("new", bs.flashsdpa))}}
    print(f"# A/B | {meta['cpu']} | {meta['threads']} threads | torch {meta['torch']}\n"
          f"# new:  {meta['new']}, tiers {meta['tiers']['new']}\n"
          f"# base: {meta['base']}, tiers {meta['tiers']['base']}\n"
          "# ratio = new / base median time: > 1 means new is slower\n")
    print("| mode | shape (B,H/Hkv,Lq,S,D) | dtype | causal (kvcache: layout) | base ms | new ms "
          "| new/base | new rate |\n|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    # decode: q_len 1 sees the whole cache, so causal or not is one case (as bench_sdpa);
    # kvcache: its layouts in that place
    variants = {m: KV_LAYOUTS if m == "kvcache" else [False] if m == "decode" else
                {"both": [False, True], "yes": [True], "no": [False]}[args.causal] for m in modes}
    progress = bs.Progress(sum(len(cases[m]) * len(dtypes) * len(variants[m]) for m in modes))
    mods = {"base": flashsdpa_base, "new": bs.flashsdpa}
    gen = torch.Generator().manual_seed(0)
    for mode in modes:
        repeats = args.repeats or bs.DEFAULT_REPEATS.get(mode, bs.DEFAULT_REPEATS["decode"])
        for (B, Hq, Hkv, L, D) in cases[mode]:
            for dtype in dtypes:
                for variant in variants[mode]:
                    kv = mode == "kvcache"
                    causal = False if kv else variant
                    q, k, v = bs.make_inputs(B, Hq, Hkv, L, D, dtype, "decode" if kv else mode)
                    Lq, gqa = q.shape[2], Hq != Hkv
                    if kv:  # bandwidth-bound: GB/s of K + V as the layout stores them
                        steps, work = kvcache_calls(mods, q, k, v, variant, gen)
                    else:
                        steps = {p: bs.make_step(fn, q, k, v, causal, gqa, mode)
                                 for p, fn in providers.items()}
                        work = bs.kv_bytes(B, Hkv, L, D, dtype) if mode == "decode" else \
                            bs.flops(B, Hq, Lq, L, D, causal, mode)
                    unit = "GB/s" if mode in ("decode", "kvcache") else "GFLOP/s"
                    for step in steps.values():  # first calls (allocator, lazy init) are
                        step()                       # slow: keep them out of time_case's sizing
                    samples = bs.time_case(steps, repeats, alternate=True)
                    med = {p: statistics.median(ts) for p, ts in samples.items()}
                    ratio = med["new"] / med["base"]
                    dt = str(dtype).replace("torch.", "")
                    rows.append({"mode": mode, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": Lq, "S": L,
                                 "D": D, "dtype": dt, "causal": causal, "repeats": repeats,
                                 "base_ms": med["base"] * 1e3, "new_ms": med["new"] * 1e3,
                                 "ratio": ratio, unit: work / med["new"] * 1e-9,
                                 "samples_s": samples, **({"layout": variant} if kv else {})})
                    heads = f"{Hq}/{Hkv}" if gqa else f"{Hq}"
                    what = variant if kv else "yes" if causal else "no"
                    print(f"| {mode} | {B},{heads},{Lq},{L},{D} | {dt} | {what} | "
                          f"{med['base'] * 1e3:.3f} | {med['new'] * 1e3:.3f} | {ratio:.3f} | "
                          f"{work / med['new'] * 1e-9:.1f} {unit} |", flush=True)
                    progress.case_done(f"{mode} {B},{heads},{Lq},{L},{D} {dt}"
                                       + (f" {variant}" if kv else " causal" if causal else "")
                                       + f": new/base {ratio:.3f}")

    summary = {}
    for mode in modes:
        rs = [r["ratio"] for r in rows if r["mode"] == mode]
        summary[mode] = {"geomean": bs.geomean(rs), "min": min(rs), "max": max(rs), "n": len(rs)}
    print("\n| mode | cases | geomean new/base | min | max |\n|---|---|---|---|---|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['n']} | {s['geomean']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    os.makedirs(AB_DIR, exist_ok=True)
    path = os.path.join(AB_DIR, f"result_{args.tag or sha}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    print(f"\nresults: {path}")
    if args.fail_above is not None:
        slow = [m for m, s in summary.items() if s["geomean"] > 1 + args.fail_above / 100]
        if slow:
            print(f"FAIL: geomean more than {args.fail_above}% slower in: {', '.join(slow)}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
