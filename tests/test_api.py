"""Public API surface: enable/disable/enabled, explain, cpu_isa and FLASHSDPA_CPU_ISA, the
`python -m flashsdpa` report, fallbacks, and feature detection through fake CPUID words."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import flashsdpa
from flashsdpa import _C, _isa, _testing
from conftest import make_qkv, reference_sdpa

# ---- fake CPUID / XCR0 words: feature detection and the tier choice on other CPUs --------------
ECX_FMA, ECX_OSXSAVE, ECX_AVX, ECX_F16C = 1 << 12, 1 << 27, 1 << 28, 1 << 29
EBX_AVX2, EBX_512F, EBX_512DQ, EBX_512BW, EBX_512VL = 1 << 5, 1 << 16, 1 << 17, 1 << 30, 1 << 31
ECX_VBMI = 1 << 1  # (leaf 7)
EDX_AMX_BF16, EDX_AMX_TILE = 1 << 22, 1 << 24
INTEL, AMD = 0x756e6547, 0x68747541  # vendor_ebx: "Genu", "Auth"
EAX_512BF16 = 1 << 5
XCR0_AVX, XCR0_512, XCR0_AMX = 0b110, 0b11100000, (1 << 17) | (1 << 18)
HASWELL = dict(leaf1_ecx=ECX_FMA | ECX_OSXSAVE | ECX_AVX | ECX_F16C, leaf7_ebx=EBX_AVX2,
               xcr0=0b111)
SKX = dict(HASWELL, leaf7_ebx=EBX_AVX2 | EBX_512F | EBX_512DQ | EBX_512BW | EBX_512VL,
           xcr0=0b111 | XCR0_512)
SPR = dict(SKX, leaf7_edx=EDX_AMX_BF16 | EDX_AMX_TILE, leaf7_1_eax=EAX_512BF16,
           xcr0=0b111 | XCR0_512 | XCR0_AMX)


def test_enable_disable_enabled_nesting():
    assert not flashsdpa.is_enabled()
    flashsdpa.enable()
    flashsdpa.enable()  # idempotent
    assert flashsdpa.is_enabled()
    flashsdpa.disable()
    flashsdpa.disable()
    assert not flashsdpa.is_enabled()
    with flashsdpa.enabled():
        assert flashsdpa.is_enabled()
        with flashsdpa.enabled(False):
            assert not flashsdpa.is_enabled()
        assert flashsdpa.is_enabled()
    assert not flashsdpa.is_enabled()
    with pytest.raises(KeyError):
        with flashsdpa.enabled():
            raise KeyError("boom")
    assert not flashsdpa.is_enabled(), "state restored after an exception"


def test_enable_from_threads():
    def toggle():
        for _ in range(200):
            flashsdpa.enable()
            flashsdpa.disable()

    threads = [threading.Thread(target=toggle) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not flashsdpa.is_enabled()


def test_explain_names_tier_and_path():
    q, k, v = make_qkv(1, 8, 2, 16, 16, 16, dtype=torch.bfloat16)
    text = flashsdpa.explain(q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.1)
    tier = flashsdpa.cpu_isa(torch.bfloat16)
    assert f"tier '{tier}'" in text
    # the dtype path the tier runs: bf16 dot products (avx512_bf16, amx) or widened operands
    bf16_dot = tier in ("avx512_bf16", "amx")
    assert ("bfloat16 operands into fp32 dot products" in text) == bf16_dot, text
    assert ("bfloat16 widened to fp32" in text) == (not bf16_dot), text
    with _isa.cap("portable"):
        assert "bfloat16 widened to fp32" in flashsdpa.explain(q, k, v, enable_gqa=True)
    assert {t["name"] for t in _C.tiers() if t["bf16_operands"]} <= {"avx512_bf16", "amx"}
    assert all(t["bf16_operands"] for t in _C.tiers()
               if t["built"] and t["name"] in ("avx512_bf16", "amx"))
    assert "group 4" in text and "causal" in text and "dropout" in text


@pytest.mark.parametrize("case,reason", [
    ("float64", "dtype torch.float64"),
    ("5-D", "ranks query 5-D"),
    ("mask grad", "attn_mask requires grad"),
    ("dropout 1", "dropout_p == 1"),
])
def test_fallbacks_are_explained_and_correct(case, reason):
    q, k, v = make_qkv(1, 2, 2, 6, 9, 8)
    kwargs = {}
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "5-D":
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    elif case == "mask grad":
        kwargs["attn_mask"] = torch.zeros(6, 9, requires_grad=True)
    else:
        kwargs["dropout_p"] = 1.0
    text = flashsdpa.explain(q, k, v, **kwargs)
    assert "declines" in text and reason in text and "runs instead" in text, text
    out = flashsdpa.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected)
    if case == "mask grad":
        out.sum().backward()
        assert kwargs["attn_mask"].grad is not None


def test_cpu_isa_is_a_runnable_built_tier():
    names = {t["name"]: t for t in _C.tiers()}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        t = names[flashsdpa.cpu_isa(dt)]
        assert t["built"] and t["cpu_ok"]


def test_bf16_tier_only_where_its_dot_product_is_fast():
    """bfloat16 runs on avx512_bf16 where vdpbf16ps outruns fp32 FMAs (AMD), on the avx512 tier
    on Intel cores (where it does not), unless FLASHSDPA_CPU_ISA names avx512_bf16."""
    f = _C.cpu_features()
    names = {t["name"]: t for t in _C.tiers()}
    if not (f["avx512_bf16"] and names["avx512_bf16"]["built"] and names["avx512_bf16"]["cpu_ok"]):
        pytest.skip("this CPU or build has no avx512_bf16 tier")
    chosen = flashsdpa.cpu_isa(torch.bfloat16)
    if chosen != "amx":
        assert chosen == ("avx512" if f["bf16_dot_slow"] else "avx512_bf16")
        # ... but a bf16 cache's decode with one or two query rows per kv head (MHA) keeps it
        for hkv, want in ((8, "avx512_bf16"), (2, chosen)):
            q = torch.randn(1, 1, 8, 64).bfloat16()
            kv = torch.randn(1, 300, hkv, 64).bfloat16()
            flashsdpa.flash_attn_with_kvcache(q, kv, kv)
            assert _C.testing.last_policy()["tier"] == want, hkv
    with _isa.cap("avx512_bf16"):
        assert flashsdpa.cpu_isa(torch.bfloat16) == "avx512_bf16"
    assert flashsdpa.cpu_isa(torch.float32) != "avx512_bf16"


@pytest.mark.parametrize("vendor,slow", [(INTEL, True), (AMD, False), (0, False)],
                         ids=["GenuineIntel", "AuthenticAMD", "unknown"])
def test_bf16_dot_slow_from_the_vendor(vendor, slow):
    f = _testing.decode_features(dict(SPR, vendor_ebx=vendor))
    assert f["bf16_dot_slow"] == slow
    assert "avx512_bf16" in f["runnable_tiers"]  # still runnable: only the preference changes


@pytest.mark.parametrize("vendor,assists", [(INTEL, True), (AMD, False), (0, False)],
                         ids=["GenuineIntel", "AuthenticAMD", "unknown"])
def test_denormal_assists_from_the_vendor(vendor, assists):
    """Intel cores take microcode assists on denormal operands: the plan keeps the avx2 tier's
    exact float8 widening there (the fast one makes e4m3's subnormals denormals)."""
    assert _testing.decode_features(dict(SPR, vendor_ebx=vendor))["denormal_assists"] == assists


@pytest.mark.parametrize("vendor", [INTEL, AMD], ids=["GenuineIntel", "AuthenticAMD"])
def test_decode_calls_on_amx_hosts_follow_the_bf16_dot_rule(vendor):
    """The amx tier's decode kernels are avx512_bf16's (its tiles take no short queries): where
    vdpbf16ps is slow (Intel), a decode call over a bf16 or float8 cache takes the avx512 tier
    as it would without AMX, a bf16 cache's light decode keeps amx, and prefill keeps amx."""
    if not {"avx512", "avx512_bf16", "amx"} <= {t["name"] for t in _C.tiers() if t["built"]}:
        pytest.skip("the build holds no avx512 / amx tiers to choose (FLASHSDPA_TIERS: "
                    "make sanitize builds the tiers this CPU runs)")
    raw = dict(SPR, vendor_ebx=vendor, leaf7_ecx=ECX_VBMI)
    slow = vendor == INTEL
    assert _testing.choose_isa(raw, "bfloat16", False, "none") == "amx"
    assert _testing.choose_isa(raw, "bfloat16", False, "light") == "amx"
    for kv_e4m3 in (False, True):
        assert _testing.choose_isa(raw, "bfloat16", kv_e4m3, "decode") == (
            "avx512" if slow else "amx")
    assert _testing.choose_isa(raw, "bfloat16", True, "light") == ("avx512" if slow else "amx")
    # the same rule as the avx512_bf16 tier's on a CPU without AMX
    no_amx = dict(raw, leaf7_edx=0)
    assert _testing.choose_isa(no_amx, "bfloat16", False, "decode") == (
        "avx512" if slow else "avx512_bf16")
    assert _testing.choose_isa(no_amx, "bfloat16", False, "light") == "avx512_bf16"
    assert _testing.choose_isa(raw, "float32", False, "decode") == "avx512"
    with pytest.raises(ValueError, match="call"):
        _testing.choose_isa(raw, "bfloat16", False, "prefill")


def _run_python(code, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_env_cap_portable():
    res = _run_python("import flashsdpa, torch; print(flashsdpa.cpu_isa(torch.float32))",
                      {"FLASHSDPA_CPU_ISA": "portable"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "portable"


def test_env_cap_unknown_is_a_clear_error():
    res = _run_python("import flashsdpa", {"FLASHSDPA_CPU_ISA": "sse9"})
    assert res.returncode != 0
    assert "FLASHSDPA_CPU_ISA='sse9' is not a tier" in res.stderr
    assert "Segmentation" not in res.stderr


def test_env_cap_unsupported_tier_is_a_clear_error():
    missing = [t["name"] for t in _C.tiers() if not t["cpu_ok"]]
    if not missing:
        pytest.skip("this CPU runs every tier, so no tier is unsupported here")
    res = _run_python("import flashsdpa", {"FLASHSDPA_CPU_ISA": missing[0]})
    assert res.returncode != 0
    assert f"FLASHSDPA_CPU_ISA={missing[0]}: this CPU/OS cannot run" in res.stderr


def test_unbuilt_source_tree_says_how_to_build(tmp_path):
    """Python run in a clone whose extension is not built: `import flashsdpa` is an ImportError
    that says so and how to build it (not the "circular import" Python reports for a missing
    submodule of a package being imported), and under FLASHSDPA_AUTOLOAD=1 `import torch` still
    works, warning that flashsdpa is left off."""
    import shutil
    pkg = os.path.dirname(flashsdpa.__file__)
    shutil.copytree(pkg, tmp_path / "flashsdpa",
                    ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    # torch's autoload entry point imports this module when it finds flashsdpa installed
    shutil.copy(os.path.join(os.path.dirname(pkg), "flashsdpa_autoload.py"), tmp_path)
    # -S: no site-packages .pth files, so no editable install's finder that would hand the copy
    # the checkout's built extension; torch is found where it is installed
    site = os.path.dirname(os.path.dirname(torch.__file__))
    prelude = f"import sys; sys.path[:0] = [{str(tmp_path)!r}]; sys.path.append({site!r}); "
    env = {k: v for k, v in os.environ.items() if k != "FLASHSDPA_AUTOLOAD"}
    res = subprocess.run([sys.executable, "-S", "-c", prelude + "import flashsdpa"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    want = (f"ImportError: flashsdpa's C++ extension (flashsdpa._C) is not built for this "
            f"Python in {tmp_path / 'flashsdpa'}: build it with `make build` in the source "
            "tree, or install flashsdpa with `pip install --no-build-isolation -e .`")
    assert want in res.stderr and "circular import" not in res.stderr, res.stderr

    code = prelude + "import torch; print('flashsdpa' in sys.modules)"
    res = subprocess.run([sys.executable, "-S", "-c", code], env=dict(env, FLASHSDPA_AUTOLOAD="1"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
    assert "FLASHSDPA_AUTOLOAD=1: flashsdpa is left off: " + want in res.stderr, res.stderr


def test_readme_logger_snippet_prints_fallback_reasons():
    """The README's snippet for the `flashsdpa` logger, run as written, prints a fallback's
    reason (a logger set to DEBUG without a handler anywhere prints nothing)."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    snippet = next(b for b in blocks if 'getLogger("flashsdpa")' in b)
    res = _run_python(snippet + "import torch, flashsdpa\n"
                      "q = torch.randn(1, 2, 8, 16, dtype=torch.float64)\n"
                      "flashsdpa.scaled_dot_product_attention(q, q, q)\n", {})
    assert res.returncode == 0, res.stderr
    assert "flashsdpa fallback to PyTorch: dtype torch.float64" in res.stderr, res.stderr


def test_module_report():
    res = subprocess.run([sys.executable, "-m", "flashsdpa"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for fragment in ("flashsdpa", "torch", "CPU:", "selected per dtype", "Triton:", "XPU:"):
        assert fragment in res.stdout
    assert "import triton" not in res.stderr


def test_import_does_not_import_triton():
    res = _run_python("import sys, flashsdpa; print('triton' in sys.modules)", {})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("raw,expected", [
    ({}, ["portable"]),
    (HASWELL, ["portable", "avx2"]),
    (dict(HASWELL, xcr0=0b11), ["portable"]),                    # OS does not save YMM
    (dict(HASWELL, leaf1_ecx=HASWELL["leaf1_ecx"] & ~ECX_OSXSAVE), ["portable"]),
    (dict(HASWELL, leaf1_ecx=HASWELL["leaf1_ecx"] & ~ECX_FMA), ["portable"]),
    (SKX, ["portable", "avx2", "avx512"]),
    (dict(SKX, xcr0=0b111), ["portable", "avx2"]),                # OS does not save ZMM
    (dict(SKX, leaf7_1_eax=EAX_512BF16), ["portable", "avx2", "avx512", "avx512_bf16"]),
    (SPR, ["portable", "avx2", "avx512", "avx512_bf16", "amx"]),
    (dict(SPR, xcr0=SKX["xcr0"]), ["portable", "avx2", "avx512", "avx512_bf16"]),  # no tile state
])
def test_decode_fake_cpuid(raw, expected):
    assert _testing.decode_features(raw)["runnable_tiers"] == expected


@pytest.mark.parametrize("l2_kib,block", [(0, 128), (256, 32), (512, 64), (1024, 128), (2048, 128)])
def test_decode_block_bytes_from_l2(l2_kib, block):
    """The decode block is an eighth of the L2 the CPU reports, within 32-128 KiB (1 MiB of L2
    assumed when it reports none)."""
    f = _testing.decode_features(dict(SPR, l2_kib=l2_kib))
    assert f["l2_bytes"] == l2_kib * 1024 and f["decode_block_bytes"] == block * 1024


@pytest.mark.parametrize("l1d_kib,sub", [(0, 8), (8, 4), (32, 8), (48, 12), (64, 16)])
def test_decode_sub_bytes_from_l1d(l1d_kib, sub):
    """The decode sub-block (caches laid out (.., L, Hkv, D)) is a quarter of the L1d the CPU
    reports, at least 4 KiB (32 KiB of L1d assumed when it reports none)."""
    f = _testing.decode_features(dict(SPR, l1d_kib=l1d_kib))
    assert f["l1d_bytes"] == l1d_kib * 1024 and f["decode_sub_bytes"] == sub * 1024


def test_decode_non_x86_is_portable_only():
    assert _testing.decode_features(SPR, is_x86=False)["runnable_tiers"] == ["portable"]


def test_direct_api_matches_reference_smoke():
    q, k, v = make_qkv(1, 2, 2, 10, 12, 8)
    torch.testing.assert_close(flashsdpa.scaled_dot_product_attention(q, k, v),
                               reference_sdpa(q, k, v).float(), atol=1e-5, rtol=1e-5)


def test_package_has_no_import_cycle():
    """flashsdpa's modules import each other without a cycle (each helper has one home)."""
    import ast
    import pathlib
    pkg = pathlib.Path(flashsdpa.__file__).parent
    graph = {}
    for path in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[path.stem] = {d for d in deps if (pkg / f"{d}.py").exists()}
    state = {}

    def visit(m, stack):
        assert state.get(m) != "open", f"import cycle: {' -> '.join(stack + [m])}"
        if state.get(m) == "done":
            return
        state[m] = "open"
        for d in graph[m]:
            visit(d, stack + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])
