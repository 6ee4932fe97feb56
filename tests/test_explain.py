"""explain() prints the routing decision, and that decision is what runs: for a few hundred
random calls (shapes, dtypes, masks, dropout, GQA, 3-D inputs, autocast, tier caps, routing on
and off, sdpa_kernel contexts), the kernel explain() names for the direct API and for
F.scaled_dot_product_attention is the one the profiler then records, and no other runs."""
import contextlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashsdpa
from flashsdpa import _C
from flashsdpa._isa import cap

TIERS = [t["name"] for t in _C.tiers() if t["built"] and t["cpu_ok"]]
CONTEXTS = {
    "default": None,
    "math": [SDPBackend.MATH],
    "flash+math": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
}


def random_call(rng):
    """(args, kwargs, description) of one F.scaled_dot_product_attention call."""
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16,
                        torch.float64])
    b, hkv = rng.choice([1, 2]), rng.choice([1, 2])
    hq = hkv * rng.choice([1, 1, 2])
    lq = rng.choice([1, 3, 16, 17, 40])
    lk = rng.choice([1, 7, 40, 70])
    d = rng.choice([8, 16, 24])
    dv = d if rng.random() < 0.8 else d + 8
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g).to(dtype)
    if rng.random() < 0.2:  # a (B, L, H, D) buffer viewed as (B, H, L, D)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kw = {}
    mask_kind = rng.choice(["none", "none", "bool", "float", "keypad", "3d"])
    if mask_kind == "bool":
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) < 0.7
    elif mask_kind == "float":
        kw["attn_mask"] = torch.randn(lq, lk, generator=g).to(
            rng.choice([torch.float32, dtype]))
    elif mask_kind == "keypad":
        kw["attn_mask"] = torch.rand(b, 1, 1, lk, generator=g) < 0.8
    elif mask_kind == "3d":
        kw["attn_mask"] = torch.randn(hq, lq, lk, generator=g).to(dtype)
    if mask_kind in ("float", "3d") and rng.random() < 0.15:
        kw["attn_mask"].requires_grad_(True)
    if rng.random() < 0.3 and "attn_mask" not in kw:
        kw["is_causal"] = True
    if rng.random() < 0.2:
        kw["dropout_p"] = rng.choice([0.2, 1.0])
    if rng.random() < 0.3:
        kw["scale"] = 0.3
    if hq != hkv:
        kw["enable_gqa"] = True
    if rng.random() < 0.15 and hq == hkv == 1 and mask_kind != "keypad":  # 3-D inputs
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        if "attn_mask" in kw and kw["attn_mask"].dim() == 3:
            kw["attn_mask"] = kw["attn_mask"][:1].expand(b, -1, -1)
    return (q, k, v), kw


def verdicts(text):
    lines = dict(line.strip().split(": ", 1) for line in text.splitlines()
                 if line.strip().startswith(("kernel:", "F.scaled_dot_product_attention kernel:")))
    return lines.get("kernel"), lines.get("F.scaled_dot_product_attention kernel")


def profiled(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def assert_ran(verdict, names, what):
    ours = {n for n in names if n.startswith("flashsdpa::cpu_")}
    assert verdict in names, f"{what}: explain says {verdict}, profiler saw {sorted(names)}"
    if verdict.startswith("flashsdpa::"):
        assert all(n.startswith(verdict.split("[")[0]) or n.startswith(
            ("flashsdpa::cpu_pack_kv", "flashsdpa::cpu_decode_merge")) for n in ours), (what, ours)
    else:  # PyTorch's kernel, and none of flashsdpa's
        assert not ours, f"{what}: explain says {verdict} but flashsdpa ran {ours}"


@pytest.mark.parametrize("seed", range(6))
def test_explain_names_the_kernel_that_runs(seed):
    rng = random.Random(seed)
    for i in range(50):
        (q, k, v), kw = random_call(rng)
        routing = rng.random() < 0.5
        context = CONTEXTS[rng.choice(list(CONTEXTS))]
        tier = rng.choice(TIERS)
        autocast = rng.random() < 0.1 and q.dtype == torch.float32
        what = (f"seed {seed} call {i}: {tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)} "
                f"{q.dtype} {kw} routing={routing} ctx={context} tier={tier} autocast={autocast}")
        with contextlib.ExitStack() as stack:
            stack.enter_context(flashsdpa.enabled(routing))
            stack.enter_context(cap(tier))
            if context is not None:
                stack.enter_context(sdpa_kernel(context))
            if autocast:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            direct, routed = verdicts(flashsdpa.explain(q, k, v, **kw))
            assert direct and routed, what
            assert_ran(direct, profiled(lambda: flashsdpa.scaled_dot_product_attention(
                q, k, v, **kw)), what + " [direct]")
            assert_ran(routed, profiled(lambda: F.scaled_dot_product_attention(q, k, v, **kw)),
                       what + " [F.sdpa]")


def test_explain_invalid_call_names_no_kernel():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 7), torch.randn(1, 2, 5, 8)
    text = flashsdpa.explain(q, k, v)
    assert "invalid arguments" in text and "kernel:" not in text
    with pytest.raises(ValueError, match="key head_dim"):
        flashsdpa.scaled_dot_product_attention(q, k, v)
