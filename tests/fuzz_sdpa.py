"""Differential fuzzer: random F.scaled_dot_product_attention calls, flashsdpa (routed under
enable() and the direct API) against PyTorch without it, both measured against an fp64
reference.

    python tests/fuzz_sdpa.py --cases 10000 --seed 0      # `make fuzz`
    python tests/fuzz_sdpa.py --case 1234                 # one case again, printed
    python tests/fuzz_sdpa.py --triton --cases 300        # the Triton kernels too (`make
                                                          # fuzz-triton`; on CPU tensors under
                                                          # the interpreter without a GPU)

Each case draws shapes (zeros included), dtype, rank 3 or 4, GQA, batch broadcast, strided and
permuted views, a mask of any form and broadcast shape (bool, float of q's dtype or float32,
with -inf, finfo.min and huge values, fully masked rows), is_causal, scale, dropout, NaN / inf
in the inputs, and whether gradients are checked. Verdicts:
  - PyTorch raises: flashsdpa must raise too (any message);
  - flashsdpa raises where PyTorch does not: a failure ("unclear error");
  - where PyTorch's output (gradient) is finite, flashsdpa's must be finite and within the suite
    rule: |ours - ref| <= 2 |torch - ref| + atol * max(1, |ref|), ref the float64 math
    (math_reference), maxima over each tensor (for
    dq and dk the atol term scales with the products that cancel in their computation instead,
    cancelling_terms); where PyTorch's is NaN, flashsdpa may give 0 or NaN (README: rows with no
    visible key); dropout cases check shapes and finiteness only (different random streams),
    cases with NaN / inf inputs shapes only (PyTorch's own paths disagree on them), cases with
    large logits the bounds of large_logits unless --strict (a documented difference).
A crash kills the process: run it in a subprocess (tests/test_fuzz.py does) and rerun the case
printed last with --case.
"""
import argparse
import math
import random
import sys

import torch
import torch.nn.functional as F

import flashsdpa
from conftest import reference_sdpa

ATOL = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw(seed):
    """One case: a dict of the call's arguments (tensors built from the seed)."""
    r = random.Random(seed)
    dtype = r.choice(DTYPES)
    rank = r.choice([4, 4, 4, 3])
    B = r.choice([0, 1, 1, 2, 3])
    Hkv = r.choice([0, 1, 1, 2, 3]) if rank == 4 else 1
    gqa = rank == 4 and r.random() < 0.3
    Hq = Hkv * r.choice([1, 2, 4]) if gqa else Hkv
    L, S = r.choice([0, 1, 2, 5, 16, 17, 33, 64, 70]), r.choice([0, 1, 3, 16, 31, 64, 100])
    D = r.choice([1, 8, 16, 33, 64, 80])
    Dv = D if r.random() < 0.8 else r.choice([8, 24])
    g = torch.Generator().manual_seed(seed)

    def tensor(b, h, n, d):
        shape = (b, h, n, d) if rank == 4 else (b, n, d)
        layout = r.choice(["contiguous", "bhld-from-blhd", "sliced"])
        if layout == "bhld-from-blhd" and rank == 4:
            t = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
        elif layout == "sliced":
            t = torch.randn(*shape[:-1], d + 3, generator=g)[..., 1:d + 1]
        else:
            t = torch.randn(*shape, generator=g)
        return (t * r.choice([1.0, 1.0, 0.1, 10.0])).to(dtype)

    bk = B if r.random() < 0.85 else (1 if B else 0)  # key / value batch broadcast
    if rank == 3:
        bk = B
    q, k, v = tensor(B, Hq, L, D), tensor(bk, Hkv, S, D), tensor(bk, Hkv, S, Dv)
    t = r.choice([q, k, v])
    if r.random() < 0.08 and t.numel():  # NaN / inf in an input (its first element)
        t[(0,) * t.dim()] = r.choice([float("nan"), float("inf")])
    mask, causal = None, False
    form = r.choice(["none", "none", "causal", "bool", "float", "float32"])
    if form == "causal":
        causal = True
    elif form != "none":
        full = (B, Hq, L, S) if rank == 4 else (B, L, S)
        shape = list(full)
        for i in range(len(shape) - 2):
            if r.random() < 0.5:
                shape[i] = 1
        if r.random() < 0.3:
            shape = shape[-2:]
        if form == "bool":
            mask = torch.rand(*shape, generator=g) < r.choice([0.5, 0.9, 1.0])
            if r.random() < 0.3 and mask.numel():
                mask[..., 0, :] = False  # a fully masked row
        else:
            mdt = dtype if form == "float" else torch.float32
            mask = torch.randn(*shape, generator=g).to(mdt)
            fill = r.choice([float("-inf"), torch.finfo(mdt).min, -1e9, -1e4])
            fill = max(fill, torch.finfo(mdt).min) if fill != float("-inf") else fill
            if mask.numel():
                mask = mask.masked_fill(torch.rand(*shape, generator=g) < 0.3, fill)
                if r.random() < 0.3:
                    mask[..., 0, :] = fill
    scale = r.choice([None, None, 0.0, 0.5, -0.3, 2.0, 1e-3])
    dropout = r.choice([0.0] * 8 + [0.3, 1.0])
    grad = r.random() < 0.35 and dropout == 0.0
    return dict(q=q, k=k, v=v, attn_mask=mask, is_causal=causal, scale=scale,
                dropout_p=dropout, enable_gqa=gqa, grad=grad, dtype=dtype)


def describe(c):
    parts = [f"q{tuple(c['q'].shape)} k{tuple(c['k'].shape)} v{tuple(c['v'].shape)}",
             str(c["dtype"]).replace("torch.", "")]
    if c["attn_mask"] is not None:
        m = c["attn_mask"]
        parts.append(f"mask {str(m.dtype).replace('torch.', '')}{tuple(m.shape)}")
    for key in ("is_causal", "enable_gqa", "grad"):
        if c[key]:
            parts.append(key)
    for key in ("scale", "dropout_p"):
        if c[key]:
            parts.append(f"{key}={c[key]}")
    return " ".join(parts)


def call(fn, c, dtype=None):
    """(output, grads) of fn on the case (inputs cast to dtype when given)."""
    def prep(t):
        t = t if dtype is None else t.to(dtype)
        return t.detach().requires_grad_(c["grad"])
    q, k, v = prep(c["q"]), prep(c["k"]), prep(c["v"])
    mask = c["attn_mask"]
    if mask is not None and dtype is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    out = fn(q, k, v, attn_mask=mask, dropout_p=c["dropout_p"], is_causal=c["is_causal"],
             scale=c["scale"], enable_gqa=c["enable_gqa"])
    grads = None
    if c["grad"] and out.numel():
        # grad_output of magnitude 1 (as the suite's backward tests), the same for every call
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), go, allow_unused=True)
    return out.detach(), grads


def math_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """The reference, by explicit math (conftest.reference_sdpa; called in float64): not
    F.sdpa, whose float64 calls take PyTorch's fused CPU kernel, which recomputes P from the
    logsumexp too (a row at finfo.min on every key gets P = 1 per key there)."""
    return reference_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def routed(*args, **kw):
    with flashsdpa.enabled():
        return F.scaled_dot_product_attention(*args, **kw)


def triton_sdpa(q, k, v, **kw):
    """The Triton kernels (flashsdpa/_triton.py) on the case: on the GPU when there is one, else
    on CPU tensors under the interpreter (TRITON_INTERPRET=1, set by main). Called only where
    PyTorch accepts the call (the launchers take validated arguments)."""
    from flashsdpa import _triton
    dev = "cuda" if torch.cuda.is_available() else "xpu" if _xpu() else "cpu"
    mask = kw.pop("attn_mask")
    on = [t.to(dev) if t is not None else None for t in (q, k, v, mask)]
    return _triton.scaled_dot_product_attention(*on[:3], attn_mask=on[3], **kw).cpu()


def _xpu():
    return hasattr(torch, "xpu") and torch.xpu.is_available()


TRITON = False  # --triton: the Triton kernels are checked too


def compare(name, ours, torch_out, ref, dtype, mag=1.0):
    """'' when ours passes against PyTorch's own result, else why not. mag: the magnitude the
    atol term scales with besides the result's own."""
    if ours.shape != torch_out.shape:
        return f"{name}: shape {tuple(ours.shape)} != PyTorch's {tuple(torch_out.shape)}"
    if ours.dtype != torch_out.dtype:
        return f"{name}: dtype {ours.dtype} != PyTorch's {torch_out.dtype}"
    finite = torch.isfinite(torch_out) & torch.isfinite(ref)
    if not finite.any():
        return ""
    o, t, rf = ours.double()[finite], torch_out.double()[finite], ref[finite]
    if not torch.isfinite(o).all():
        return f"{name}: non-finite where PyTorch's output is finite"
    err, terr = (o - rf).abs().max().item(), (t - rf).abs().max().item()
    bound = 2 * terr + ATOL[dtype] * max(1.0, mag, rf.abs().max().item())
    return "" if err <= bound else f"{name}: error {err:.3g} > bound {bound:.3g} (PyTorch {terr:.3g})"


def cancelling_terms(c):
    """The size of the products that cancel in dS = P (dP - rowsum(dO o O)), times what dq / dk
    multiply dS by: |scale| max|dO| max|V| sqrt(Dv) max(|Q|, |K|). dq and dk can be a residue
    of that cancellation (exactly 0 in exact arithmetic, e.g. a row that sees one key), whose
    rounding floor scales with these terms, not with the gradient; no summation order reaches it
    reliably (PyTorch's residue is sometimes 0 by luck of its order)."""
    q, k, v = (t.double().nan_to_num(0, 0, 0) for t in (c["q"], c["k"], c["v"]))
    if not (q.numel() and k.numel() and v.numel()):
        return 1.0
    scale = abs(c["scale"]) if c["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    do = 4.0  # |dO| of the fixed standard-normal grad_output, generously
    return scale * do * v.abs().max().item() * math.sqrt(v.shape[-1]) * \
        max(q.abs().max().item(), k.abs().max().item())


def score_bound(c):
    """max |scale * q_i . k_j| by Cauchy-Schwarz (row norms), 0 without rows."""
    q, k = c["q"].double(), c["k"].double()
    if not (q.numel() and k.numel()):
        return 0.0
    scale = abs(c["scale"]) if c["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    return scale * q.norm(dim=-1).max().item() * k.norm(dim=-1).max().item()


def large_logits(c, limit=100.0):
    """A known gap (README, "Where results differ"): flashsdpa works in the log2 domain (scores
    times scale * log2(e)), one more rounding of each score than PyTorch's natural-domain
    softmax, which exp() amplifies once scores are large (|score| can pass `limit`): outputs and
    gradients are then held to the suite's rule with its atol term scaled by that floor
    (max|score| * max|V|). --strict: the plain rule (4 of 10,000 seeded cases exceed it, all
    outputs, errors up to 6.1x PyTorch's own, 2.4x the rule's bound). Large float-mask values
    are no gap: rows at one large value are shifted (exact), and keys far below a row's largest
    weigh nothing."""
    return score_bound(c) > limit


STRICT = False  # --strict: large_logits cases' gradients are checked too


def run_case(seed):
    """'' when case `seed` passes, else what failed."""
    return check(draw(seed))


def check(c):
    """'' when the case c (draw) passes, else what failed."""
    try:
        want = call(F.scaled_dot_product_attention, c)
    except Exception:
        try:
            call(routed, c)
        except Exception:
            return ""  # (the direct API may accept more: it broadcasts what F.sdpa does)
        return "routed: no error where PyTorch raises"
    # NaN / inf inputs: PyTorch's own paths disagree on what they give (its fused kernel 0 for a
    # NaN query row, its math path NaN): no crash and PyTorch's shapes. Dropout: its own random
    # stream: shapes and finiteness.
    finite_inputs = all(torch.isfinite(c[t]).all() for t in "qkv")
    ref = call(math_reference, c, torch.float64) \
        if finite_inputs and c["dropout_p"] == 0.0 else None
    if ref is not None:  # the bounds of large_logits, unless --strict
        gap = large_logits(c) and not STRICT
        floor = score_bound(c) * c["v"].double().abs().max().item() \
            if gap and c["v"].numel() else 1.0
        terms = cancelling_terms(c) if want[1] is not None else 1.0
    paths = [("routed", routed), ("direct", flashsdpa.scaled_dot_product_attention)]
    if TRITON:
        paths.append(("triton", triton_sdpa))
    for name, fn in paths:
        try:
            got = call(fn, c)
        except Exception as e:
            return f"{name}: raised where PyTorch does not: {type(e).__name__}: {e}"
        if got[0].shape != want[0].shape:
            return f"{name}: shape {tuple(got[0].shape)} != {tuple(want[0].shape)}"
        if not finite_inputs:
            continue
        if ref is None:
            if torch.isfinite(want[0]).all() and not torch.isfinite(got[0]).all():
                return f"{name}: non-finite output with dropout"
            continue
        why = compare(f"{name} out", got[0], want[0], ref[0], c["dtype"], mag=floor)
        if why:
            return why
        if want[1] is None:
            continue
        for t, (g, w, rg) in zip("qkv", zip(got[1], want[1], ref[1])):
            if w is None or rg is None:
                continue
            if g is None:
                return f"{name}: no gradient for {t}"
            why = compare(f"{name} d{t}", g, w, rg, c["dtype"],
                          floor * (terms if t != "v" else 1.0))
            if why:
                return why
    return ""


# ---- the fuzzers' command line and loop (this one's and fuzz_variants / _kvcache / _varlen's) ---
_FLAGS = {
    "strict": dict(action="store_true",
                   help="the suite's rule also where logits are large (large_logits)"),
    "triton": dict(action="store_true",
                   help="check the Triton kernels too (under the interpreter without a GPU)"),
    "emulated": dict(default=None, metavar="TIER",
                     help="the CPU kernels through this tier's SIMDe-emulated build"),
}


def parse_args(doc, argv, *flags):
    """--cases / --seed / --case and the given flags (_FLAGS). --triton without a GPU sets
    TRITON_INTERPRET=1 (read when Triton is first imported)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0, help="first case's seed")
    ap.add_argument("--case", type=int, default=None, help="run this one case, verbosely")
    for flag in flags:
        ap.add_argument(f"--{flag}", **_FLAGS[flag])
    args = ap.parse_args(argv)
    if getattr(args, "triton", False) and not (torch.cuda.is_available() or _xpu()):
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def run_seeds(args, draw, check, describe, count=None, poison=False):
    """Each case's verdict, check(draw(seed)), printed when it fails; the last line printed
    names the case a crash happened in (--case: the case described first). poison: the CPU
    kernels' outputs and scratch start as NaN (unwritten memory shows); args.emulated (when the
    fuzzer takes it): their emulated build. -> (cases, failures, sum of count(case))."""
    from flashsdpa import _testing
    seeds = [args.case] if args.case is not None else range(args.seed, args.seed + args.cases)
    failures = counted = 0
    with _testing.poisoned(poison), _testing.emulated(getattr(args, "emulated", None)):
        for seed in seeds:
            c = draw(seed)
            if args.case is not None:
                print(describe(c), flush=True)
            else:
                print(f"case {seed}", end="\r", flush=True)
            counted += count(c) if count else 0
            why = check(c)
            if why:
                failures += 1
                print(f"case {seed} FAILED: {describe(c)}: {why}", flush=True)
    return len(seeds), failures, counted


def main_of(module, argv, *flags):
    """The main of fuzz_variants / _kvcache / _varlen: their flags (a TRITON global set from
    --triton), run_seeds with the kernels' buffers poisoned, a summary line; the exit status."""
    args = parse_args(module.__doc__, argv, *flags)
    if "triton" in flags:
        module.TRITON = args.triton
    n, failures, _ = run_seeds(args, module.draw, module.check, module.describe, poison=True)
    print(f"\n{n} cases, {failures} failures", flush=True)
    return 1 if failures else 0


def main(argv=None):
    args = parse_args(__doc__, argv, "strict", "triton")
    global STRICT, TRITON
    STRICT, TRITON = args.strict, args.triton
    n, failures, gap = run_seeds(args, draw, check, describe, count=large_logits)
    print(f"\n{n} cases, {failures} failures ({gap} with large logits, "
          f"{'checked strictly' if STRICT else 'held to the looser bounds: --strict'})",
          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
