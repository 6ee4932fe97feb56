"""Shared test machinery: the fp64 reference, the one tolerance table, input builders, and the
per-tier parametrisation.

The error rule (flash-attention's): measured against an fp64 reference,
    max|ours - ref|  <=  2 * max|torch_same_dtype - ref|  +  ATOL[dtype] * max(1, max|ref|)
where torch_same_dtype is PyTorch's own SDPA on the same inputs in the same dtype.
"""
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

# The Triton tier's tests (test_triton.py) run on a GPU when one is present, else under the Triton
# interpreter on CPU tensors. Triton fixes the mode when it is first imported, so it is chosen
# here, before anything can import it.
if not ((hasattr(torch, "xpu") and torch.xpu.is_available()) or torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashsdpa
from flashsdpa import _C, _testing
from flashsdpa._common import swapped
from flashsdpa._isa import cap

# ---- the one tolerance table ---------------------------------------------------------------------
# A few units in the last place at magnitude 1: slack for cases where PyTorch's own error happens
# to be tiny. Everything else is the 2x-PyTorch rule.
ATOL = {
    torch.float32: 2.0 ** -20,   # ~1e-6
    torch.float16: 2.0 ** -10,   # 1 ulp at 1.0
    torch.bfloat16: 2.0 ** -7,   # 1 ulp at 1.0
    torch.float64: 2.0 ** -45,   # (the math fallback for float64 variants)
}
ERR_FACTOR = 2.0

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.float64: "fp64"}

def run_python(*lines, timeout=300):
    """The lines run in a fresh interpreter (what must not leak into the test process: import
    state, registrations, memory); its stdout, after checking it exited 0."""
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ---- tiers -----------------------------------------------------------------------------------------
RUNNABLE_TIERS = [t["name"] for t in _C.tiers() if t["built"] and t["cpu_ok"]]
# Tiers whose code the suite also runs through their SIMDe-emulated build (csrc/cpu/simde_emu.h),
# so that it is exercised on CPUs without the instructions. bf16-only tiers run the bf16 cases;
# for other dtypes the normal choice applies.
EMULATED_TIERS = [t["name"] for t in _C.tiers() if t["emulated"]]
_EMULATED_BUILT = {t["name"] for t in _C.tiers() if t["emulated_build"]}
STRICT = os.environ.get("FLASHSDPA_STRICT") == "1"  # .ci/run: what must run never skips


@pytest.fixture(params=RUNNABLE_TIERS + [f"emu-{t}" for t in EMULATED_TIERS])
def tier(request):
    """Runs the test once per CPU tier this host can execute, and once per emulated tier."""
    name = request.param
    if name.startswith("emu-"):
        real = name[len("emu-"):]
        if real not in _EMULATED_BUILT:
            msg = (f"no emulated build of the {real} tier: it needs SIMDe at build time "
                   "(Debian: apt-get install libsimde-dev; `make test` installs it)")
            if STRICT:  # CI: the tiers this CPU lacks run nowhere else
                pytest.fail(msg)
            pytest.skip(msg)
        with _testing.emulated(real):
            yield name
    else:
        with cap(name):
            yield name


# `make test` runs every case of every test, except where a case is slow and a product of
# parameters repeats what other cases already run; there it runs a covering subset:
# - on the emulated tiers (SIMDe executes them 5-20x slower, and the native tiers run the same test
#   bodies): per test function and tier, cases that together take every value of every parameter;
# - under the Triton interpreter (tests marked `interpreted`: test_triton.py without a GPU; every
#   case on a GPU): per test function, cases that together take every pair of values of any two
#   parameters (interactions such as a cache's block size with the query count).
# FLASHSDPA_TESTS=all (`make test-all`) runs every case.
ALL_TESTS = os.environ.get("FLASHSDPA_TESTS", "subset")
if ALL_TESTS not in ("subset", "all"):
    raise pytest.UsageError(f"FLASHSDPA_TESTS={ALL_TESTS!r}: expected 'subset' or 'all'")


def _params(item):
    return getattr(getattr(item, "callspec", None), "params", {})


def coverage_group(item):
    """(the set of cases an item's case belongs to, how many parameters' values each combination
    of that set's kept cases must cover), or None for a case that always runs."""
    tier = str(_params(item).get("tier", ""))
    if tier.startswith("emu-"):
        return (item.module.__name__, item.originalname, tier), 1
    if item.get_closest_marker("interpreted") is not None:
        return (item.module.__name__, item.originalname), 2
    return None


def covering_subset(items, group=coverage_group):
    """The items to keep: those group() gives None, and for each group the cases that together
    take every combination of `strength` (parameter, value) pairs its cases take (all parameters
    but the tier; every value when a test has fewer parameters than that). Greedy: the case that
    covers most combinations not yet covered first, ties to the earlier in collection order."""
    groups, keep = {}, set()
    for item in items:
        how = group(item)
        if how is None:
            keep.add(id(item))
            continue
        key, strength = how
        params = sorted((k, repr(v)) for k, v in _params(item).items() if k != "tier")
        combos = set(itertools.combinations(params, min(strength, len(params))))
        groups.setdefault(key, []).append((item, combos))
    for cases in groups.values():
        need = set().union(*(combos for _, combos in cases))
        while need:
            item, combos = max(cases, key=lambda case: len(case[1] & need))
            keep.add(id(item))
            need -= combos
    return [item for item in items if id(item) in keep]


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreted: the test runs its kernels under the Triton "
                            "interpreter (`make test` runs a pairwise subset of its cases)")


def pytest_collection_modifyitems(config, items):
    if ALL_TESTS == "all":
        return
    keep = covering_subset(items)
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
        items[:] = keep


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every output/scratch buffer starts as NaN, so an element a kernel does not write fails."""
    with _testing.poisoned():
        yield


# ---- reference -------------------------------------------------------------------------------------
def reference_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, keep=None,
                   dropout_p=0.0, dtype=torch.float64):
    """Attention computed in `dtype` (fp64 for the reference) with PyTorch ops. 4-D or 3-D
    inputs; GQA by repeating K/V; fully masked rows give 0 (as the fused kernels do);
    `keep` (bool, broadcastable to the scores) applies a given dropout keep-mask."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(dtype)
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    # fully masked rows -> 0, with gradients (0) rather than the NaN of a softmax over -inf
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
    if keep is not None:
        p = p * keep.to(dtype) / (1.0 - dropout_p)
    return p @ v


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_within_rule(ours, torch_same, ref, dtype, what):
    """ours vs fp64 ref within 2x PyTorch's own same-dtype error (+ ATOL); NaN fails."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if ours.numel() == 0:
        return
    assert not torch.isnan(ours).any(), \
        f"{what}: NaN at {torch.nonzero(torch.isnan(ours))[:5].tolist()} (unwritten memory?)"
    torch_same = torch.where(torch.isnan(torch_same), torch.zeros_like(torch_same), torch_same)
    err = max_err(ours, ref)
    err_torch = max_err(torch_same, ref)
    mag = max(1.0, ref.abs().max().item())
    tol = ERR_FACTOR * err_torch + ATOL[dtype] * mag
    if err > tol:
        diff = (ours.double() - ref.double()).abs()
        idx = tuple(torch.nonzero(diff == diff.max())[0].tolist())
        raise AssertionError(
            f"{what} ({DTYPE_IDS[dtype]}): max error {err:.3e} > tolerance {tol:.3e} "
            f"(torch's own error {err_torch:.3e}); worst at {idx}: ours "
            f"{ours[idx].item():.6g} vs ref {ref[idx].item():.6g}")


# ---- inputs ----------------------------------------------------------------------------------------
def make_tensor(shape, dtype, layout="contiguous", seed_gen=None, scale=1.0):
    """A (B, H, L, D) tensor in one of the layouts the kernels must honour:
    contiguous; "blhd": a (B, L, H, D) buffer viewed as (B, H, L, D);
    "padded": a view into a NaN-filled buffer with extra rows and columns, so any read outside
    the view poisons the result."""
    data = (torch.randn(shape, generator=seed_gen) * scale).to(dtype)
    if layout == "contiguous":
        return data.contiguous()
    if layout == "blhd":
        return data.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":
        B, H, L, D = shape
        buf = torch.full((B, H, L + 3, D + 5), float("nan"), dtype=dtype)
        buf[:, :, 1:L + 1, 2:D + 2] = data
        return buf[:, :, 1:L + 1, 2:D + 2]
    raise ValueError(layout)


def make_qkv(B, Hq, Hkv, L, S, D, Dv=None, dtype=torch.float32, layout="contiguous",
             requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = make_tensor((B, Hq, L, D), dtype, layout, g)
    k = make_tensor((B, Hkv, S, D), dtype, layout, g)
    v = make_tensor((B, Hkv, S, Dv), dtype, layout, g)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def torch_sdpa_same_dtype(q, k, v, **kw):
    """PyTorch's own result in the inputs' dtype (its default backend choice). PyTorch's math
    path refuses a mask together with is_causal, so that case passes the causal rule inside the
    mask."""
    mask = kw.get("attn_mask")
    if mask is not None and kw.get("is_causal"):
        L, S = q.shape[-2], k.shape[-2]
        tril = torch.ones(L, S, dtype=torch.bool).tril()
        if mask.dtype == torch.bool:
            mask = mask & tril
        else:
            mask = mask.masked_fill(~tril, float("-inf"))
        kw = dict(kw, attn_mask=mask, is_causal=False)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def num_threads(n):
    return swapped(torch.get_num_threads, torch.set_num_threads, n)


def check_forward_backward(q, k, v, dtype, what, backward=True, sdpa=None, device="cpu", **kw):
    """Runs flashsdpa fwd (+bwd) and PyTorch in the same dtype, checks both against fp64.

    `sdpa` replaces flashsdpa.scaled_dot_product_attention (same signature) and runs on tensors
    moved to `device`; PyTorch and the reference run on the CPU."""
    sdpa = sdpa or flashsdpa.scaled_dot_product_attention
    enable_gqa = kw.pop("enable_gqa", q.dim() == 4 and k.shape[1] != q.shape[1])
    leaves = [t.detach().clone().to(device).requires_grad_(backward) for t in (q, k, v)]
    mask = kw.get("attn_mask")
    kw_ours = dict(kw, attn_mask=mask.to(device)) if mask is not None else kw
    out = sdpa(*leaves, enable_gqa=enable_gqa, **kw_ours)
    ref_leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = reference_sdpa(*ref_leaves, **kw)
    torch_leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    torch_out = torch_sdpa_same_dtype(*torch_leaves, enable_gqa=enable_gqa, **kw)
    assert_within_rule(out.cpu(), torch_out, ref, dtype, what + " out")
    if not backward:
        return out
    g = torch.Generator().manual_seed(1234)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad.to(out.device))
    ref.backward(grad.double())
    torch_out.backward(grad)
    for name, ours, theirs, r in zip(("dq", "dk", "dv"), leaves, torch_leaves, ref_leaves):
        assert_within_rule(ours.grad.cpu(), theirs.grad, r.grad, dtype, f"{what} {name}")
    return out
