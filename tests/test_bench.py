"""The bench scripts stay runnable: a tiny run of every mode, the cost model, the report."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import bench_sdpa  # noqa: E402



def rendered_readme(tmp_path, results, text="<!-- bench:begin -->\n<!-- bench:end -->\n"):
    """A README holding `text`, after report.py --readme renders `results` into it."""
    readme = tmp_path / "README.md"
    readme.write_text(text)
    rep = subprocess.run([sys.executable, os.path.join(BENCH, "report.py"), str(results),
                          "--readme", str(readme)], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    return readme.read_text()


def assert_progress_per_case(res, cases):
    """A finished bench run printed one progress line per case, all on stderr (stdout holds
    the tables); returns them."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in lines] == [f"[{i}/{cases}" for i in range(1, cases + 1)]
    assert all(" elapsed, ~" in ln and ln.endswith(" left") for ln in lines), lines
    assert " elapsed, ~" not in res.stdout
    return lines


def test_dtype_names_short_or_torchs():
    """--dtypes takes fp32 / bf16 / fp16 and torch's names for them, with or without "torch.";
    each dtype once, in the order given."""
    import torch
    assert bench_sdpa.parse_dtypes("float32,torch.bfloat16, fp16,fp32,torch.float16") == [
        torch.float32, torch.bfloat16, torch.float16]
    for short, dt in bench_sdpa.DTYPES.items():
        name = str(dt).replace("torch.", "")
        assert bench_sdpa.dtype_of(name) == bench_sdpa.dtype_of(f"torch.{name}") == dt
        assert bench_sdpa.DTYPE_ALIASES[name] == short  # how results name a dtype's tier
    with pytest.raises(ValueError, match="--dtype: unknown dtype 'half'"):
        bench_sdpa.dtype_of("half")


def test_progress_estimates_the_time_left(capsys, monkeypatch):
    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(bench_sdpa.time, "perf_counter", lambda: next(clock))
    progress = bench_sdpa.Progress(4)
    progress.case_done("first")   # 10 s for 1 case: 3 left, ~30 s
    progress.case_done("second")  # 30 s for 2 cases: 2 left, ~30 s
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["[1/4] first | 0:10 elapsed, ~0:30 left",
                                "[2/4] second | 0:30 elapsed, ~0:30 left"]
    assert bench_sdpa.clock(3725) == "1:02:05"


def test_bench_output_is_untracked_unless_bench_all():
    """Runs write to bench/out/ (ignored by git) unless told otherwise; `make bench-all` points
    every bench it runs at the tracked bench/results/ and renders the README from there."""
    assert bench_sdpa.OUT_DIR == os.path.join(BENCH, "out")
    import shutil
    if not shutil.which("git") or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", "bench/out/fwd.json"])
    assert ignored.returncode == 0, "bench/out/ is not in .gitignore"
    if not shutil.which("make"):
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "-C", ROOT, "bench-all", "bench"], capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    runs = [ln for ln in dry.stdout.splitlines() if "bench/bench_" in ln]
    default = [ln for ln in runs if "bench/results" not in ln]
    assert len(runs) == 9 and len(default) == 1 and "--out" not in default[0], runs  # make bench
    assert "report.py --readme README.md --plots bench/results" in dry.stdout  # + figures
    rendered = dry.stdout.split("report.py", 1)[1]
    assert "bench/results/fwd.json" in rendered and "bench/results/fwd_avx2.json" in rendered
    assert any("--cap-isa avx2 --tag fwd_avx2 --out-dir bench/results" in r for r in runs)


def test_bench_avx2_host_results_rendered(tmp_path):
    """`make bench-avx2-host` runs the forward, decode and serving suites and the avx2 tier's
    decode paths natively into the tracked *_avx2_host results and renders the README from the
    same file list as bench-all;
    such a table is titled as an AVX2-only host's (an uncapped run where PyTorch's CPU
    capability is AVX2), a capped one as capped."""
    import shutil
    if not shutil.which("make"):
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "-C", ROOT, "bench-avx2-host"], capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "--mode fwd --tag fwd_avx2_host --out-dir bench/results" in dry.stdout
    assert "--mode decode --tag decode_avx2_host --out-dir bench/results" in dry.stdout
    assert "--mode serving --tag serving_avx2_host --out-dir bench/results" in dry.stdout
    assert "--paths decode,e4m3_fast,near_pf,near_pf@kvcache --out bench/results/paths_avx2_host.json" in dry.stdout
    rendered = dry.stdout.split("report.py", 1)[1]
    # every AVX2 host's files (AVX2_HOST=avx2_host_<core> for another core's)
    assert all(f"{m}_avx2_host*.json" in rendered for m in ("fwd", "decode", "serving", "paths"))
    other = subprocess.run(["make", "-n", "-C", ROOT, "bench-avx2-host",
                            "AVX2_HOST=avx2_host_zen1"], capture_output=True, text=True, timeout=60)
    assert "--mode decode --tag decode_avx2_host_zen1 --out-dir" in other.stdout
    assert "--out bench/results/paths_avx2_host_zen1.json" in other.stdout
    import report
    with open(os.path.join(BENCH, "results", "fwd.json")) as f:
        rows = json.load(f)["rows"][:2]
    for cap, capability, title in ((None, "AVX2", "on an AVX2-only host"),
                                   ("avx2", "AVX2", "both held to AVX2"),
                                   (None, "AVX512", None)):
        meta = {"mode": "fwd", "date": "d", "cpu": "c", "threads": 1, "torch": "t",
                "tiers": {"fp32": "avx2"}, "cap_isa": cap, "torch_cpu_capability": capability,
                "peak": None}
        path = tmp_path / "r.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}))
        heading = report.render([str(path)]).splitlines()[0]
        if title:
            assert title in heading, heading
        else:
            assert "AVX2" not in heading, heading


def test_visible_pairs_matches_a_mask_count():
    import torch
    for L, S in ((7, 7), (5, 9), (9, 5), (1, 4)):
        mask = torch.ones(L, S, dtype=torch.bool).tril()
        assert bench_sdpa.visible_pairs(L, S, True) == int(mask.sum())
        assert bench_sdpa.visible_pairs(L, S, False) == L * S


def test_peak_is_the_best_of_its_probes(monkeypatch):
    """Every peak bench/peak.py reports (FMA per variant, vdpbf16ps, read) is the best of its
    probes, not the last: one probe beside a busy neighbour read half the bf16 peak."""
    import peak
    readings = iter([100.0, 50.0, 80.0, 120.0, 30.0, 60.0, 90.0, 10.0, 70.0, 95.0])
    calls = []
    monkeypatch.setattr(peak, "_binary", lambda variant: variant)
    monkeypatch.setattr(peak, "runnable_variants", lambda: ["sse2", "avx2"])
    monkeypatch.setattr(peak, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(peak, "_run", lambda exe, what, *a: calls.append((exe, what)) or
                        next(readings))
    res = peak.measure(threads=2, tries=2)
    assert res["fma_gflops"] == {"sse2": 100.0, "avx2": 120.0}
    assert (res["fma_peak_isa"], res["fma_peak_gflops"]) == ("avx2", 120.0)
    assert res["bf16_dot_gflops"] == 60.0 and res["read_gbs"] == 90.0
    assert calls[-2:] == [("avx2", "read")] * 2  # the read probe runs the fastest FMA variant's


@pytest.mark.parametrize("mode", ["fwd", "train", "decode"])
def test_bench_tiny_run(tmp_path, mode):
    cmd = [sys.executable, os.path.join(BENCH, "bench_sdpa.py"), "--mode", mode, "--shapes",
           "tiny", "--repeats", "2", "--providers", "flashsdpa,torch_flash,torch_math",
           "--out-dir", str(tmp_path), "--peak-read-mib", "64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "vs torch_flash" in res.stdout
    cases = len(bench_sdpa.TINY_DECODE if mode == "decode" else bench_sdpa.TINY_SUITE) * (
        1 if mode == "decode" else 2) * 2  # shapes x causal x (fp32, bf16)
    assert assert_progress_per_case(res, cases)[-1].startswith(f"[{cases}/{cases}] {mode} ")
    data = json.loads((tmp_path / f"{mode}.json").read_text())
    pk = data["meta"]["peak"]
    assert pk["fma_peak_gflops"] > 0
    import peak
    if peak.has_bf16_dot():
        # vdpbf16ps does two products per fp32 lane: about twice the FMA rate on Zen 4, but
        # half of it on the Xeons that run it at one instruction per two cycles (measured on an
        # Emerald Rapids VM: 171 against 348 GFLOP/s), so the check is only that the probe ran
        # and counted 64 FLOP an instruction, not a ratio.
        assert pk["bf16_dot_gflops"] > 0.3 * pk["fma_peak_gflops"], pk
        if mode != "decode":
            bf16_dot = data["meta"]["tiers"]["bf16"] in bench_sdpa.BF16_DOT_TIERS
            for r in data["rows"]:
                rate = (pk["bf16_dot_gflops"] if r["dtype"] == "bfloat16" and bf16_dot
                        else pk["fma_peak_gflops"])
                assert abs(r["frac_peak"] - r["GFLOP/s"] / rate) < 1e-9, r
    else:
        assert pk["bf16_dot_gflops"] is None
    if mode == "decode":  # each round's GB/s against the probe taken right after it
        import statistics
        probes = data["meta"]["read_probes_gbs"]
        cases = list(dict.fromkeys((r["B"], r["Hq"], r["S"], r["dtype"]) for r in data["rows"]))
        assert len(probes) == len(cases) and all(len(c) == 2 for c in probes)  # --repeats 2
        for r in data["rows"]:
            c = cases.index((r["B"], r["Hq"], r["S"], r["dtype"]))
            assert len(r["round_gbs"]) == 2
            # GB/s is the bytes over the median time: within the rounds' range
            assert min(r["round_gbs"]) * (1 - 1e-9) <= r["GB/s"] <= max(r["round_gbs"]) * (1 + 1e-9)
            want = statistics.median(g / p for g, p in zip(r["round_gbs"], probes[c]))
            assert abs(r["frac_peak"] - want) < 1e-9, r
            # the roofline: each round's probe, or the compute peak over 2 Hq/Hkv FLOPs per
            # element read, the lower; never above the probe, so frac_roof >= frac_peak
            es = 4 if r["dtype"] == "float32" else 2
            assert r["flop_per_byte"] == pytest.approx(2 * r["Hq"] / r["Hkv"] / es)
            compute = bench_sdpa.peak_for(pk, getattr(torch, r["dtype"])) / r["flop_per_byte"]
            roof = [min(p, compute) for p in probes[c]]
            assert r["roof_gbs"] == pytest.approx(statistics.median(roof))
            assert r["frac_roof"] == pytest.approx(
                statistics.median(g / x for g, x in zip(r["round_gbs"], roof)))
            assert r["frac_roof"] >= r["frac_peak"] * (1 - 1e-9)
    assert data["meta"]["cpu"] and data["meta"]["threads"] >= 1
    providers = {r["provider"] for r in data["rows"]}
    assert providers == {"flashsdpa", "torch_flash", "torch_math"}
    assert all(r["ms"] > 0 for r in data["rows"])
    assert (tmp_path / f"{mode}.csv").exists()

    text = rendered_readme(tmp_path, tmp_path / f"{mode}.json",
                           "intro\n<!-- bench:begin -->\nold\n<!-- bench:end -->\nrest\n")
    assert "old" not in text and "rest" in text and "| shape" in text
    assert ("% roofline" in text) == (mode == "decode")


@pytest.mark.parametrize("mode", ["fwd", "train"])
def test_bench_triton_provider_under_interpreter(tmp_path, mode):
    """The GPU bench's providers (flashsdpa's Triton kernels against PyTorch's own choice), run on
    CPU tensors through the Triton interpreter: checks the script, not the speed."""
    pytest.importorskip("triton")
    cmd = [sys.executable, os.path.join(BENCH, "bench_sdpa.py"), "--mode", mode, "--shapes",
           "1x2x32x16", "--repeats", "1", "--providers", "triton,torch", "--dtypes", "fp16",
           "--out-dir", str(tmp_path), "--no-peak"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0, res.stderr
    assert "triton vs torch" in res.stdout
    rows = json.loads((tmp_path / f"{mode}.json").read_text())["rows"]
    assert {r["provider"] for r in rows} == {"triton", "torch"}
    assert all(r["speedup_vs_torch"] > 0 for r in rows if r["provider"] == "triton")


def test_tune_triton_under_interpreter(tmp_path):
    """bench/tune_triton.py's sweep (the launch configurations set per call through the
    kernels' override variables) on CPU tensors through the Triton interpreter: the script, not
    the speed; a malformed configuration is an error naming its variable."""
    pytest.importorskip("triton")
    out = tmp_path / "tune.json"
    cmd = [sys.executable, os.path.join(BENCH, "tune_triton.py"), "--device", "cpu", "--shape",
           "1x2x40x16", "--dtype", "fp32", "--repeats", "1", "--mode", "train", "--causal",
           "--fwd", ";BLOCK_M=16,BLOCK_N=16", "--bwd", "BLOCK_M=16,BLOCK_N=32", "--out", str(out)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["rows"]] == [
        "fwd[default] bwd[BLOCK_M=16,BLOCK_N=32]",
        "fwd[BLOCK_M=16,BLOCK_N=16] bwd[BLOCK_M=16,BLOCK_N=32]"]
    assert all(r["ms"] > 0 for r in data["rows"]) and data["best"] in res.stdout
    res = subprocess.run(cmd[:-6] + ["--fwd", "BLOCK_M=24", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode != 0 and "FLASHSDPA_TRITON_FWD: BLOCK_M must be a power of two" in \
        res.stderr


def test_bench_gpu_device_needs_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_sdpa.py"), "--device",
                          "cuda", "--shapes", "tiny", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "no such device" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--dtypes", "fp32,float64"], "--dtypes: unknown dtype 'float64'; choose from fp32, bf16, "
                                   "fp16 or torch's names (float32, bfloat16, float16"),
    (["--shapes", "1x2x3"], "--shapes: '1x2x3' is not BxH[/Hkv]xLxD"),
    (["--shapes", "1x3/2x8x8"], "H a multiple of Hkv"),
    (["--shapes", "0x2x8x8"], "sizes must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--cap-isa", "avx512"], "--cap-isa: invalid choice: 'avx512'"),
])
def test_bench_bad_arguments_name_the_argument(tmp_path, args, message):
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_sdpa.py"), *args,
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())  # failed before any timing or output


def test_bench_cap_isa_holds_both_libraries(tmp_path):
    """--cap-isa avx2: the run's PyTorch dispatches at AVX2 and flashsdpa runs its avx2 tier
    (the script ran itself again under the caps), and the results say so."""
    import torch
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("an x86 host with AVX2")
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_sdpa.py"), "--cap-isa",
                          "avx2", "--shapes", "tiny", "--repeats", "1", "--dtypes", "fp32",
                          "--causal", "no", "--no-peak", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "fwd.json").read_text())["meta"]
    assert meta["cap_isa"] == "avx2" and meta["torch_cpu_capability"] == "AVX2", meta
    assert set(meta["tiers"].values()) == {"avx2"}, meta["tiers"]
    assert "--cap-isa avx2: PyTorch's CPU capability AVX2" in res.stdout
    text = rendered_readme(tmp_path, tmp_path / "fwd.json")
    assert "#### Forward, PyTorch and flashsdpa both held to AVX2" in text


def test_bench_paths_runs_every_path(tmp_path):
    """bench_paths.py times each special path on its named case against the path forced off;
    the plan takes every path on this host's tiers that it has code for."""
    out = tmp_path / "paths.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_paths.py"), "--repeats",
                          "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert_progress_per_case(res, len(rows))
    sys.path.insert(0, BENCH)
    import bench_paths
    assert [r["path"] for r in rows] == list(bench_paths.PATHS)
    from flashsdpa import _C
    tier_paths = {t["name"]: t["paths"] for t in _C.tiers()}
    cpu_has = {"fp16_pv": _C.cpu_features()["avx512_fp16"],  # (paths needing more than the tier)
               "e4m3_fast": not _C.cpu_features()["denormal_assists"]}
    for r in rows:
        field = bench_paths.policy_field(r["path"])
        needs_trait = {"transposed": "transposed", "fused_exp": "fused_exp", "fp16_pv": "fp16_pv",
                       "fused_rows": "fused_bwd_rows", "fused_sdp": "bwd_sdp",
                       "e4m3_fast": "e4m3_fast",
                       "near_pf": "near_pf", "pv_whole": "pv_whole"}.get(field)
        assert r["plan_takes_it"] == (needs_trait is None or (
            needs_trait in tier_paths[r["tier"]] and cpu_has.get(field, True))), r
        assert r["on_ms"] > 0 and r["off_ms"] > 0


def test_bench_paths_bad_path_names_the_argument(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_paths.py"), "--paths",
                          "nope", "--out", str(tmp_path / "x.json")], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and "--paths: unknown path 'nope'" in res.stderr
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_paths.py"), "--repeats",
                          "0", "--out", str(tmp_path / "x.json")], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and "--repeats must be >= 1" in res.stderr


def test_bench_paths_default_rounds(tmp_path):
    """Without --repeats (as `make bench` runs it) each case takes its default rounds."""
    sys.path.insert(0, BENCH)
    import bench_paths
    out = tmp_path / "paths.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "bench_paths.py"), "--paths",
                          "whole_q", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["path"] == "whole_q" and row["repeats"] == bench_paths.REPEATS, row


def tiny_rows(tmp_path, name, *args):
    """bench/bench_<name>.py --tiny run in a subprocess: (its JSON path, its rows)."""
    out = tmp_path / f"{name}.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, f"bench_{name}.py"), "--tiny",
                          *args, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert_progress_per_case(res, len(rows))
    return out, rows


def test_bench_variants_tiny_run(tmp_path):
    """bench_variants.py (also bench_sdpa.py --mode variants): every case and mode, its peers
    checked against flashsdpa's output before timing, and its table through report.py."""
    out, rows = tiny_rows(tmp_path, "variants", "--repeats", "1", "--dtypes", "fp32")
    import bench_variants
    assert [(r["case"], r["mode"]) for r in rows] == [
        (c, m) for c in bench_variants.CASES for m in ("fwd", "train")]
    ran = {(r["case"], r["mode"]): set(r["ms"]) for r in rows}
    assert ran["window", "fwd"] == {"flashsdpa", "flashsdpa plain", "torch_flash+mask", "flex",
                                    "eager"}
    assert ran["alibi", "train"] == {"flashsdpa", "flashsdpa plain", "torch_flash+mask", "eager"}
    assert ran["sinks", "fwd"] == {"flashsdpa", "flashsdpa plain", "eager"}
    for r in rows:
        assert all(t > 0 for t in r["ms"].values())
        if r["mode"] == "fwd":  # every peer that ran agreed with flashsdpa
            assert set(r["max_abs_diff"]) == set(r["ms"]) & set(bench_variants.PEERS)
            assert all(d <= 1e-4 for d in r["max_abs_diff"].values()), r
    assert "| window: window_size=[64, 0]" in rendered_readme(tmp_path, out)


def test_bench_serving_tiny_run(tmp_path):
    """bench_serving.py (also bench_sdpa.py --mode serving): every case, its providers checked
    against flashsdpa's output before timing, decode rows against the read probe, its table."""
    out, rows = tiny_rows(tmp_path, "serving", "--repeats", "2", "--dtypes", "bf16",
                          "--peak-read-mib", "64")
    import bench_serving
    assert [r["case"] for r in rows] == list(bench_serving.CASES)
    for r in rows:
        assert all(t > 0 for t in r["ms"].values())
        assert all(d <= 4e-2 for d in r["max_abs_diff"].values()), r
        if r["case"].startswith("decode"):
            assert len(r["read_probes_gbs"]) == 2 and set(r["frac_read"]) == {
                "flashsdpa", "flashsdpa paged", "flashsdpa fp8", "flashsdpa paged fp8"}
    assert set(rows[-1]["ms"]) == {"flashsdpa", "loop", "torch (padded)"}
    assert "| decode-batch:" in rendered_readme(tmp_path, out)


def test_bench_hf_tiny_run(tmp_path):
    """bench_hf.py (also bench_sdpa.py --mode hf): every family and case, the providers each
    model accepts, logits checked against fp32 eager first, its table and plot."""
    pytest.importorskip("transformers")
    out, rows = tiny_rows(tmp_path, "hf", "--repeats", "1", "--dtypes", "fp32,bf16")
    import bench_hf
    assert [(r["family"], r["dtype"], r["case"]) for r in rows] == [
        (f, d, c) for f in bench_hf.FAMILIES for d in ("float32", "bfloat16")
        for c in bench_hf.CASES]
    for r in rows:
        assert all(t > 0 for t in r["ms"].values())
        sdpa = r["family"] in ("llama", "mistral")  # transformers refuses sdpa for the others
        peers = {"eager", "sdpa"} if sdpa else {"eager"}
        if r["case"] == "train":
            peers = {f"{p} padded" for p in peers | {bench_hf.FUSED}}
        assert set(r["speedup"]) == peers, r
    assert (tmp_path / "hf.png").stat().st_size > 0
    assert "| gemma2 (" in rendered_readme(tmp_path, out)


def test_report_plots_speedup_and_peak(tmp_path):
    """report.py --plots draws a speedup and a %-of-peak PNG from bench_sdpa rows and a speedup
    PNG from a `speedup` dict (serving / variants), links each under its table, and by default
    writes them next to the first results file."""
    pytest.importorskip("matplotlib")
    row = {"mode": "fwd", "B": 1, "Hq": 4, "Hkv": 4, "Lq": 64, "S": 64, "D": 32,
           "dtype": "float32", "causal": False, "ms": 1.0, "ms_p20": 0.9, "ms_p80": 1.1,
           "GFLOP/s": 10.0, "TFLOP/s": 0.01}
    rows = [dict(row, provider="flashsdpa", speedup_vs_torch_flash=1.5, frac_peak=0.8),
            dict(row, provider="torch_flash", speedup_vs_torch_flash=1.0, frac_peak=0.5)]
    meta = {"mode": "fwd", "date": "today", "cpu": "Test CPU", "threads": 2, "torch": "x",
            "flashsdpa": "x", "tiers": {}, "peak": None}
    fwd = tmp_path / "fwd.json"
    fwd.write_text(json.dumps({"meta": meta, "rows": rows}))
    with open(os.path.join(BENCH, "results", "variants.json")) as f:
        variants = json.load(f)  # its table needs every field of a real row
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"meta": variants["meta"], "rows": variants["rows"][:2]}))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    import report
    report.main([str(fwd), str(serving), "--readme", str(readme)])
    text = readme.read_text()
    for name in ("fwd_speedup", "fwd_peak", "serving_speedup"):
        png = tmp_path / f"{name}.png"
        assert png.stat().st_size > 1000, name
        assert f"]({name}.png)" in text


def test_phase_profile_tiny_run(tmp_path):
    """bench/phase_profile.py: a row per native tier, dtype it implements, shape and causal
    setting, with step shares that sum to 1 and GEMM rates from the step clocks."""
    out = tmp_path / "phases.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "phase_profile.py"), "--shapes",
                          "1x2x128x32", "--calls", "1", "--no-peak", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    from flashsdpa import _C
    want = {(t["name"], dt) for t in _C.tiers() if t["built"] and t["cpu_ok"] and
            t["name"] != "portable" for dt in ("fp32", "bf16")
            if {"fp32": "float32", "bf16": "bfloat16"}[dt] in t["dtypes"]}
    assert {(r["tier"], r["dtype"]) for r in rows} == want and len(rows) == 2 * len(want)
    for r in rows:
        shares = [r[f"{s}_share"] for s in ("pack", "scores", "softmax", "pv", "other")]
        assert all(x >= 0 for x in shares) and abs(sum(shares) - 1) < 1e-6, r
        assert r["scores_gflops"] > 0 and r["pv_gflops"] > 0
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "phase_profile.py"), "--tiers",
                          "nonesuch", "--no-peak"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--tiers" in bad.stderr


def test_tile_probe_tiny_run(tmp_path):
    """bench/tile_probe.py: per native tier and K, the plain GEMM, and the fused-exponential S
    GEMM at each degree the forward uses (fp32-operand tiers: 6 and 3; bf16-operand: 3; none
    without fused exponentials), each timed, with what the exponentials add."""
    out = tmp_path / "tiles.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "tile_probe.py"), "--k", "32,64",
                          "--m", "24", "--n", "64", "--reps", "2", "--calls", "1", "--no-peak",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    from flashsdpa import _C
    native = [t for t in _C.tiers() if t["built"] and t["cpu_ok"] and t["name"] != "portable"]
    want = set()
    for t in native:
        degrees = [0]
        if "fused_exp" in t["paths"]:
            degrees += [3] if t["bf16_operands"] else [6, 3]
        want |= {(t["name"], "gemm_exp" if d else "gemm", d, k) for d in degrees for k in (32, 64)}
    assert {(r["tier"], r["kernel"], r["degree"], r["k"]) for r in rows} == want
    assert len(rows) == len(want)
    for r in rows:
        assert r["ns"] > 0 and r["gflops"] > 0, r
        assert (r["exp_adds"] is None) == (r["kernel"] == "gemm"), r
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "tile_probe.py"), "--tiers",
                          "nonesuch", "--no-peak"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--tiers" in bad.stderr


def test_phase_profile_train_tiny_run(tmp_path):
    """bench/phase_profile.py --train: the backward's steps (bwd_*_ns clocks) per native tier,
    dtype, shape and causal setting, shares summing to 1, every step timed, a rate per GEMM
    step."""
    out = tmp_path / "bwd_phases.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "phase_profile.py"), "--train",
                          "--shapes", "1x2x128x32", "--calls", "1", "--no-peak", "--json",
                          str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    from flashsdpa import _C
    want = {(t["name"], dt) for t in _C.tiers() if t["built"] and t["cpu_ok"] and
            t["name"] != "portable" for dt in ("fp32", "bf16")
            if {"fp32": "float32", "bf16": "bfloat16"}[dt] in t["dtypes"]}
    assert data["mode"] == "train"
    assert {(r["tier"], r["dtype"]) for r in data["rows"]} == want
    assert len(data["rows"]) == 2 * len(want)
    sdp = {t["name"] for t in _C.tiers() if "bwd_sdp" in t["paths"]}
    for r in data["rows"]:
        # (S and dP in one micro-tile: both GEMMs' time under s, dp untimed)
        assert r["s_with_dp"] == (r["tier"] in sdp), r
        shares = {s: r[f"{s}_share"] for s in ("pack", "s", "dp", "dkdv", "dq", "rows")}
        assert abs(sum(shares.values()) + r["other_share"] - 1) < 1e-6, r
        assert all(x > 0 for s, x in shares.items() if s != "dp"), r
        assert (shares["dp"] == 0) == r["s_with_dp"], r
        assert all(r[f"{g}_gflops"] > 0 for g in ("s", "dkdv", "dq")), r
        assert (r["dp_gflops"] is None) == r["s_with_dp"], r
    assert "backward phase profile" in res.stdout
    # --render prints the file's table again: the run's own table, line for line
    again = subprocess.run([sys.executable, os.path.join(BENCH, "phase_profile.py"), "--render",
                            str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout == res.stdout


def test_phase_profile_decode_tiny_run(tmp_path):
    """bench/phase_profile.py --decode: a row per native tier, dtype (a float8 cache on every
    tier) and shape, with the decode step shares (decode_*_ns clocks) summing to 1, every
    step timed, and the K + V read rate."""
    out = tmp_path / "decode_phases.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "phase_profile.py"), "--decode",
                          "1x8x2x512x64", "--dtypes", "fp32,bf16,fp8", "--calls", "1",
                          "--no-peak", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    from flashsdpa import _C
    native = [t for t in _C.tiers() if t["built"] and t["cpu_ok"] and t["name"] != "portable"]
    want = {(t["name"], dt) for t in native for dt in ("fp32", "bf16", "fp8")
            if dt == "fp8" and "bfloat16" in t["dtypes"]
            or {"fp32": "float32", "bf16": "bfloat16", "fp8": "-"}[dt] in t["dtypes"]}
    assert {(r["tier"], r["dtype"]) for r in rows} == want and len(rows) == len(want)
    for r in rows:
        shares = [r[f"{s}_share"] for s in ("qk", "softmax", "pv", "other")]
        assert all(x > 0 for x in shares[:3]) and abs(sum(shares) - 1) < 1e-6, r
        assert r["read_gbs"] > 0
