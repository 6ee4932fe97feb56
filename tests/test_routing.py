"""Transparent routing: after flashsdpa.enable(), torch.nn.functional.scaled_dot_product_attention
(and the modules built on it) runs flashsdpa's kernels, forward and backward, in eager mode,
under torch.compile (with and without cpp_wrapper) and under autocast; disable() and
sdpa_kernel(MATH) leave no trace of flashsdpa."""
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashsdpa
from conftest import assert_within_rule, make_qkv, reference_sdpa


@pytest.fixture(autouse=True)
def routing_off_after():
    yield
    flashsdpa.disable()
    torch._inductor.config.cpp_wrapper = False


def flash_ranges(fn):
    """Names of flashsdpa profiler ranges recorded while fn() runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("flashsdpa::")}


FWD_RANGES = ("flashsdpa::cpu_forward", "flashsdpa::cpu_decode_split")  # prefill, decode


def has_fwd_and_bwd(names):
    return any(n.startswith(FWD_RANGES) for n in names) and \
        any(n.startswith(("flashsdpa::cpu_bwd_fused", "flashsdpa::cpu_bwd_dq")) for n in names)


# ---- a small hand-written GPT block --------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, key_padding):  # key_padding: (B, S) bool, True = real token
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D) views of (B, L, H, D)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = causal & key_padding[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, C))
        return x + self.mlp(self.ln2(x))


def _batch(B=2, L=24, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, dim, generator=g)
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, L - 5:] = False
    return x, pad


def _run_block(model, x, pad):
    model.zero_grad()
    xi = x.clone().requires_grad_()
    out = model(xi, pad)
    out.square().mean().backward()
    return out.detach(), [xi.grad] + [p.grad.clone() for p in model.parameters()]


def _compare(ours, theirs, ref, dtype, what):
    for i, (a, b, r) in enumerate(zip(ours, theirs, ref)):
        assert_within_rule(a, b, r, dtype, f"{what} tensor {i}")


def _block_and_fp64_reference():
    """A seeded training-mode Block, its batch, and an fp64 copy's output and gradients."""
    torch.manual_seed(0)
    model = Block().train()
    x, pad = _batch()
    ref_model = Block().double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref_out, ref_grads = _run_block(ref_model, x.double(), pad)
    return model, x, pad, ref_out, ref_grads


@pytest.mark.parametrize("mode", ["eager", "compile", "compile-cpp-wrapper"])
def test_gpt_block_matches_pytorch(mode):
    model, x, pad, ref_out, ref_grads = _block_and_fp64_reference()

    def compiled_model():
        if mode == "eager":
            return model
        torch._dynamo.reset()
        torch._inductor.config.cpp_wrapper = mode == "compile-cpp-wrapper"
        return torch.compile(model, fullgraph=True)

    flashsdpa.disable()
    torch_out, torch_grads = _run_block(compiled_model(), x, pad)
    flashsdpa.enable()
    m = compiled_model()
    ours_out, ours_grads = _run_block(m, x, pad)  # compiles (for the compiled modes)
    names = flash_ranges(lambda: _run_block(m, x, pad))
    assert has_fwd_and_bwd(names), names
    _compare([ours_out] + ours_grads, [torch_out] + torch_grads, [ref_out] + ref_grads,
             torch.float32, f"GPT block {mode}")


@pytest.mark.parametrize("mode", ["eager", "compile", "compile-cpp-wrapper"])
def test_gpt_block_with_dropout_trains(mode):
    torch.manual_seed(0)
    model = Block(dropout=0.1).train()
    x, pad = _batch(B=4, L=32)
    target = torch.randn_like(x)
    flashsdpa.enable()
    step_model = model
    if mode != "eager":
        torch._dynamo.reset()
        torch._inductor.config.cpp_wrapper = mode == "compile-cpp-wrapper"
        step_model = torch.compile(model, fullgraph=True)
        step_model(x, pad).sum().backward()  # compile outside the profiled call
    names = flash_ranges(lambda: step_model(x, pad).sum().backward())
    assert has_fwd_and_bwd(names), names
    assert "flashsdpa::flash_attn_fwd" in names  # the fused-dropout path (PyTorch: math)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.mse_loss(step_model(x, pad), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_gpt_block_under_autocast_bf16(mode):
    """Under autocast(bf16) the block's attention runs flashsdpa's bf16 kernels, forward and
    backward, and outputs / gradients stay within the error rule against PyTorch's own run."""
    model, x, pad, ref_out, ref_grads = _block_and_fp64_reference()

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _run_block(m, x, pad)

    def maybe_compiled():
        if mode == "eager":
            return model
        torch._dynamo.reset()
        return torch.compile(model, fullgraph=True)

    flashsdpa.disable()
    torch_out, torch_grads = run(maybe_compiled())
    flashsdpa.enable()
    m = maybe_compiled()
    ours_out, ours_grads = run(m)
    names = flash_ranges(lambda: run(m))
    assert has_fwd_and_bwd(names), names
    assert any("bf16" in n for n in names), names
    _compare([ours_out.float()] + ours_grads, [torch_out.float()] + torch_grads,
             [ref_out] + ref_grads, torch.bfloat16, f"GPT block autocast {mode}")


def test_routed_dropout_keep_rate():
    """With enable(), F.sdpa dropout keeps 1 - p of the probabilities (V = identity rows make
    the output the dropped-out probability matrix itself)."""
    flashsdpa.enable()
    L = S = 256
    q = torch.zeros(1, 8, L, 16)
    k = torch.zeros(1, 8, S, 16)  # uniform attention: p_ij = 1/S
    v = torch.eye(S).expand(1, 8, S, S).contiguous()
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    kept = (out > 0).double().mean().item()
    n = out.numel()
    assert abs(kept - 0.7) < 5 * (0.3 * 0.7 / n) ** 0.5
    torch.testing.assert_close(out[out > 0], torch.full_like(out[out > 0], 1 / (S * 0.7)))


def test_transformer_encoder_layer_uses_flashsdpa():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
    x = torch.randn(2, 20, 64)
    flashsdpa.enable()
    names = flash_ranges(lambda: layer(x).sum().backward())
    assert has_fwd_and_bwd(names), names
    layer.eval()  # dropout off: outputs match PyTorch's
    flashsdpa.disable()
    ref = layer(x, is_causal=False)
    flashsdpa.enable()
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    dec = nn.TransformerDecoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    names = flash_ranges(lambda: dec(x, x).sum().backward())
    assert has_fwd_and_bwd(names), names


def test_multihead_attention_training_uses_flashsdpa():
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 12, 64)
    flashsdpa.enable()
    names = flash_ranges(lambda: mha(x, x, x, need_weights=False)[0].sum().backward())
    assert has_fwd_and_bwd(names), names


def test_sdpa_kernel_math_and_disable_leave_no_trace():
    q, k, v = make_qkv(2, 4, 4, 32, 32, 16, requires_grad=True)
    flashsdpa.enable()
    with sdpa_kernel(SDPBackend.MATH):
        assert not flash_ranges(lambda: F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.1).sum().backward())
    flashsdpa.disable()
    assert not flash_ranges(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert not flash_ranges(lambda: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.1).sum().backward())


def test_disable_restores_pytorch_exactly():
    q, k, v = make_qkv(2, 4, 4, 40, 40, 16)
    before = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    flashsdpa.enable()
    flashsdpa.disable()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_routed_calls_match_pytorch(dtype):
    """What PyTorch sends to its fused kernel (masks, GQA, permuted layouts) and what it sends
    to math that flashsdpa fuses (3-D inputs, Dv != D) give results within the error rule."""
    g = torch.Generator().manual_seed(0)
    cases = [
        (make_qkv(2, 8, 2, 33, 47, 32, dtype=dtype, layout="blhd"),
         dict(enable_gqa=True, is_causal=True)),
        (make_qkv(2, 4, 4, 33, 47, 32, dtype=dtype),
         dict(attn_mask=torch.rand(2, 1, 1, 47, generator=g) < 0.8)),
        (make_qkv(1, 2, 2, 20, 30, 24, Dv=12, dtype=dtype), {}),
        ([t[:, 0] for t in make_qkv(3, 1, 1, 21, 29, 16, dtype=dtype)], {}),
    ]
    flashsdpa.enable()
    for (q, k, v), kw in cases:
        if "attn_mask" in kw:
            kw["attn_mask"][..., 0] = True
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        names = flash_ranges(lambda: F.scaled_dot_product_attention(*leaves, **kw).sum()
                             .backward())
        assert has_fwd_and_bwd(names), (kw, names)
        out = F.scaled_dot_product_attention(*[t.detach() for t in leaves], **kw)
        with flashsdpa.enabled(False):
            theirs = F.scaled_dot_product_attention(q, k, v, **kw)
        kw_ref = {key: val for key, val in kw.items() if key != "enable_gqa"}
        ref = reference_sdpa(q, k, v, **kw_ref)
        assert_within_rule(out, theirs, ref, dtype, f"routed {tuple(q.shape)}")


def test_autocast_bf16_routes_to_bf16_kernel():
    q, k, v = make_qkv(2, 4, 4, 32, 32, 16, requires_grad=True)
    flashsdpa.enable()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        names = flash_ranges(lambda: F.scaled_dot_product_attention(q, k, v).float().sum()
                             .backward())
    assert any("bf16" in n for n in names if n.startswith("flashsdpa::cpu_forward")), names
    assert has_fwd_and_bwd(names)


@pytest.mark.parametrize("entry", ["F.sdpa", "direct"])
def test_dynamic_shapes_compile_once(entry):
    import torch._dynamo.utils as dynamo_utils
    flashsdpa.enable()
    torch._dynamo.reset()
    fn = F.scaled_dot_product_attention if entry == "F.sdpa" \
        else flashsdpa.scaled_dot_product_attention
    compiled = torch.compile(lambda q, k, v: fn(q, k, v, is_causal=True), fullgraph=True,
                             dynamic=True)
    dynamo_utils.counters.clear()
    for L in (40, 56, 88):
        q, k, v = make_qkv(2, 4, 4, L, L, 32, requires_grad=True)
        compiled(q, k, v).sum().backward()
        names = flash_ranges(lambda: compiled(q, k, v).sum().backward())
        assert has_fwd_and_bwd(names), names
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1


def test_graph_compiled_before_enable_follows_the_switch():
    """The compiled graph calls aten::_scaled_dot_product_flash_attention_for_cpu through the
    dispatcher, so enable()/disable() apply to it without a recompile."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                             fullgraph=True)
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16)
    compiled(q, k, v)
    flashsdpa.enable()
    assert any(n.startswith(FWD_RANGES) for n in flash_ranges(
        lambda: compiled(q, k, v)))
    flashsdpa.disable()
    assert not flash_ranges(lambda: compiled(q, k, v))


def test_fallback_reasons_logged_once(caplog):
    from flashsdpa import _C
    _C.reset_fallback_notes()
    flashsdpa.enable()
    q, k, v = make_qkv(1, 2, 2, 8, 8, 8)
    q5, k5, v5 = q[None], k[None], v[None]  # 5-D: PyTorch's math path, flashsdpa declines
    with caplog.at_level(logging.DEBUG, logger="flashsdpa"):
        for _ in range(3):
            F.scaled_dot_product_attention(q5, k5, v5)
    msgs = [r.getMessage() for r in caplog.records if "ranks query 5-D" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_enable_disable_threads_and_idempotence():
    import threading
    errors = []

    def worker():
        try:
            for _ in range(50):
                flashsdpa.enable()
                flashsdpa.enable()
                q, k, v = make_qkv(1, 2, 2, 8, 8, 8)
                F.scaled_dot_product_attention(q, k, v)
                flashsdpa.disable()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert not flashsdpa.is_enabled()


@pytest.mark.parametrize("value,expected", [("1", "True"), ("", "False")])
def test_autoload(value, expected):
    env = dict(os.environ, FLASHSDPA_AUTOLOAD=value)
    code = ("import torch, sys; print('flashsdpa' in sys.modules and "
            "sys.modules['flashsdpa'].is_enabled())")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected


def test_autoload_when_flashsdpa_is_imported_before_torch():
    """`import flashsdpa` imports torch, whose autoload hook then finds flashsdpa half-imported:
    the package enables itself once its import completes."""
    env = dict(os.environ, FLASHSDPA_AUTOLOAD="1")
    code = "import flashsdpa; print(flashsdpa.is_enabled())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"


def autoload_run(cap):
    """`import torch` with FLASHSDPA_AUTOLOAD=1 and FLASHSDPA_CPU_ISA=cap in a fresh process,
    then an explicit `import flashsdpa`: (the process, and what it printed: whether flashsdpa
    was imported and enabled by torch's import, whether the C++ routing switch is on, and the
    explicit import's error or the fp32 tier)."""
    code = ("import sys, torch\n"
            "m, c = sys.modules.get('flashsdpa'), sys.modules.get('flashsdpa._C')\n"
            "print(m is not None, m is not None and m.is_enabled(),\n"
            "      c is not None and c.routing_enabled())\n"
            "try:\n"
            "    import flashsdpa\n"
            "    print(flashsdpa.cpu_isa())\n"
            "except Exception as e:\n"
            "    print(type(e).__name__)\n")
    env = dict(os.environ, FLASHSDPA_AUTOLOAD="1", FLASHSDPA_CPU_ISA=cap)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res, res.stdout.split()


def unrunnable_tiers():
    return [t["name"] for t in flashsdpa._C.tiers() if not t["cpu_ok"]]


@pytest.mark.parametrize("bad", ["bogus", "unrunnable"])
def test_autoload_with_a_bad_cpu_isa_warns_and_leaves_flashsdpa_off(bad):
    """A bad FLASHSDPA_CPU_ISA under FLASHSDPA_AUTOLOAD=1 does not break `import torch`: a
    warning names the variable and the values it takes, flashsdpa stays off (not imported, the
    routing switch off), and an explicit `import flashsdpa` raises the error as without
    autoload."""
    if bad == "unrunnable":
        if not unrunnable_tiers():
            pytest.skip("this CPU runs every tier, so no tier is unsupported here")
        cap = unrunnable_tiers()[0]
        message = f"RuntimeError: FLASHSDPA_CPU_ISA={cap}: this CPU/OS cannot run"
        values = "this CPU runs " + ", ".join(
            t["name"] for t in flashsdpa._C.tiers() if t["built"] and t["cpu_ok"])
        error = "RuntimeError"
    else:
        cap, error = bad, "ValueError"
        message = "ValueError: FLASHSDPA_CPU_ISA='bogus' is not a tier"
        values = "use one of " + ", ".join(t["name"] for t in flashsdpa._C.tiers())
    res, printed = autoload_run(cap)
    assert "RuntimeWarning: FLASHSDPA_AUTOLOAD=1: flashsdpa is left off: " + message \
        in res.stderr and values in res.stderr, res.stderr
    assert printed == ["False", "False", "False", error], res.stdout


def test_autoload_with_a_valid_cpu_isa_enables_flashsdpa_at_that_tier():
    res, printed = autoload_run("portable")
    assert printed == ["True", "True", "True", "portable"], res.stdout
    assert "Warning" not in res.stderr, res.stderr


def test_compile_after_disable_is_pytorch_again():
    """The routing state is part of the compile cache key: a graph traced while enabled (holding
    flashsdpa's op) is never reused once disabled, even from Inductor's on-disk caches."""
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, requires_grad=True)

    def fresh():
        torch._dynamo.reset()
        c = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
                          fullgraph=True)
        c(q, k, v).sum().backward()
        return c

    flashsdpa.enable()
    c = fresh()
    assert has_fwd_and_bwd(flash_ranges(lambda: c(q, k, v).sum().backward()))
    flashsdpa.disable()
    c = fresh()
    assert not flash_ranges(lambda: c(q, k, v).sum().backward())


def test_compile_cache_key_carries_the_op_schemas_and_fake_kernels(tmp_path, monkeypatch):
    """Inductor caches are keyed by our ops' schemas and by the sources of their fake kernels:
    code compiled against another build's schemas (it would call the ops with the wrong
    arguments) or outputs (an entry traced when softmax_stats held 2 floats a row asserted the
    old size after it went to 3, with the same schema) is never reused."""
    import glob
    import hashlib
    import shutil
    import torch.compiler.config as compiler_config
    from flashsdpa import _ops
    defined = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("flashsdpa::") and not n.startswith("flashsdpa::triton_")}
    assert set(_ops.NATIVE_OPS) == defined, "every op the extension defines keys the caches"
    package = os.path.dirname(_ops.__file__)
    with_fakes = {os.path.basename(f) for f in glob.glob(os.path.join(package, "*.py"))
                  if "register_fake" in open(f).read()}
    assert with_fakes == set(_ops.FAKE_SOURCES), "every module with fake kernels keys the caches"
    digest = hashlib.sha1("\n".join(str(getattr(torch.ops.flashsdpa, n).default._schema)
                                    for n in _ops.NATIVE_OPS).encode())
    for name in _ops.FAKE_SOURCES:
        digest.update(open(os.path.join(package, name), "rb").read())
    tag = "flashsdpa-ops-" + digest.hexdigest()[:12]
    assert tag == _ops.compile_cache_tag()
    assert tag in compiler_config.cache_key_tag.split(",")
    # a fake kernel edited (a copy of the package's sources), schemas unchanged: another key
    for name in _ops.FAKE_SOURCES:
        shutil.copy(os.path.join(package, name), tmp_path / name)
    with open(tmp_path / "_triton.py", "a") as f:
        f.write("\n# an output resized\n")
    monkeypatch.setattr(_ops, "__file__", str(tmp_path / "_ops.py"))
    assert _ops.compile_cache_tag() != tag
