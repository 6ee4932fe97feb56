"""Differential fuzzer of the attention variants: random combinations of sliding windows (either
side), causal, top-left or bottom-right alignment, softcap, ALiBi (per head or per batch and
head), sinks and masks (bool, float, with rows at -1e9 or finfo.min), with GQA, Lq != Lk,
Dv != D, strided views and every dtype, forward and every gradient (the sinks' too), on the CPU
kernels and (--triton) the Triton kernels, each against the fp64 reference of
../shared/api-variants-serving.md (test_variants.reference) under fuzz_sdpa's verdict: the
suite's rule, the baseline error being the same formulas in the inputs' dtype, with dq and dk's
atol term scaled by the products that cancel in dS (fuzz_sdpa.cancelling_terms: a row that sees
one key has dS = 0 exactly, and no summation order reaches that floor reliably).

    python tests/fuzz_variants.py --cases 2000 --seed 0            # `make fuzz-variants`
    python tests/fuzz_variants.py --triton --cases 500             # the Triton kernels too
    python tests/fuzz_variants.py --case 1234                      # one case again, printed
    python tests/fuzz_variants.py --emulated amx --cases 300       # an emulated tier's build

PyTorch has no kernel for most of these, so there is no "PyTorch raises" verdict: every drawn
call is valid, and an exception is a failure. A crash kills the process: run it in a subprocess
(tests/test_fuzz.py does) and rerun the case printed last with --case.
"""
import random
import sys

import torch

from conftest import make_qkv
import fuzz_sdpa
import test_variants

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw(seed):
    """One case: (q, k, v, kw, dtype, bottom_right, grad, entry), kw test_variants' keywords."""
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = r.choice(DTYPES)
    B, Hkv = r.choice([1, 1, 2, 3]), r.choice([1, 2, 3])
    Hq = Hkv * r.choice([1, 1, 2, 4])
    Lq, Lk = r.choice([1, 2, 5, 17, 33, 64, 70, 130]), r.choice([1, 3, 16, 31, 64, 100, 200])
    D = r.choice([8, 16, 33, 64, 80])
    Dv = D if r.random() < 0.8 else r.choice([8, 24])
    layout = r.choice(["contiguous", "contiguous", "blhd", "padded"])
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout=layout, seed=seed)
    kw = {}
    bottom_right = r.random() < 0.4
    if r.random() < 0.35:
        kw["causal"] = True
    if r.random() < 0.5:
        kw["window"] = (r.choice([-1, 0, 1, 7, 40]), r.choice([-1, 0, 3, 40]))
    if r.random() < 0.3:
        kw["softcap"] = r.choice([0.5, 2.0, 30.0])
    if r.random() < 0.3:
        kw["alibi"] = torch.rand(*((B, Hq) if r.random() < 0.5 else (Hq,)), generator=g) * 0.5
    if r.random() < 0.3:
        kw["sinks"] = torch.randn(Hq, generator=g) * 2
    form = r.choice(["none", "none", "bool", "float"])
    if form != "none":
        shape = r.choice([(Lq, Lk), (B, 1, 1, Lk), (B, Hq, Lq, Lk), (1, Hq, 1, Lk)])
        if form == "bool":
            mask = torch.rand(shape, generator=g) < 0.8
        else:
            mask = torch.randn(shape, generator=g)
            if r.random() < 0.4 and mask.shape[-2] > 1:  # rows at one large value
                big = r.choice([-1e9, -3e4, torch.finfo(torch.float32).min])
                mask[..., r.randrange(mask.shape[-2]), :] = big
            if r.random() < 0.5:
                mask = mask.to(dtype)
        kw["mask"] = mask
    grad = r.random() < 0.7
    entry = "sdpa" if not bottom_right and r.random() < 0.5 else "op"
    return q, k, v, kw, dtype, bottom_right, grad, entry


def describe(case):
    q, k, v, kw, dtype, bottom_right, grad, entry = case
    parts = [f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}",
             str(dtype).replace("torch.", ""), entry]
    for key, val in kw.items():
        if isinstance(val, torch.Tensor):
            val = f"{str(val.dtype).replace('torch.', '')}{tuple(val.shape)}"
        parts.append(f"{key}={val}")
    if bottom_right:
        parts.append("bottom_right")
    if grad:
        parts.append("grad")
    return " ".join(parts)


def _op_kwargs(kw, bottom_right):
    left, right = kw.get("window", (-1, -1))
    return dict(window_left=left, window_right=right, bottom_right=bottom_right,
                softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"),
                sinks=kw.get("sinks"))


def cpu_run(entry, bottom_right):
    """The CPU kernels through the public sdpa (top-left) or the flash_attn_fwd op."""
    def run(q, k, v, kw):
        if entry == "sdpa":
            return test_variants.ours_sdpa(q, k, v, kw)
        return torch.ops.flashsdpa.flash_attn_fwd(q, k, v, kw.get("mask"), 0.0,
                                                  kw.get("causal", False),
                                                  **_op_kwargs(kw, bottom_right))[0]
    return run


def triton_run(bottom_right):
    """The Triton kernels (the GPU when there is one, else the interpreter)."""
    from flashsdpa import _triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def run(q, k, v, kw):
        ops = _op_kwargs(kw, bottom_right)
        ops = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in ops.items()}
        mask = kw.get("mask")
        return _triton.scaled_dot_product_attention(
            q.to(dev), k.to(dev), v.to(dev), attn_mask=None if mask is None else mask.to(dev),
            is_causal=kw.get("causal", False), **ops).cpu()
    return run


TRITON = False  # --triton: the Triton kernels are checked too


def _results(fn, q, k, v, kw, dtype, grad):
    """(out, [dq, dk, dv, dsinks or None]) of fn(q, k, v, kw) on copies of the inputs cast to
    dtype (the sinks stay float32), from one fixed random gradient."""
    leaves = [t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v)]
    sinks = kw.get("sinks")
    s_leaf = sinks.detach().clone().requires_grad_(grad) if sinks is not None else None
    out = fn(*leaves, dict(kw, sinks=s_leaf))
    if not grad:
        return out.detach(), None
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(go)
    return out.detach(), [t.grad for t in leaves] + [None if s_leaf is None else s_leaf.grad]


def _sink_floor(q, k, v, kw, bottom_right):
    """What the sinks' gradient, -sum_i P(sink)_i delta_i with delta_i = sum_d dO O, carries of
    the output's rounding to the inputs' dtype (delta is taken from the rounded output, as in
    FA2): per head sum_i P(sink)_i sum_d |dO O|, the largest head's (fp64, from the reference's
    logsumexp and the fixed gradient _results uses)."""
    out, lse = test_variants.reference(q.double(), k.double(), v.double(),
                                       bottom_right=bottom_right, **kw)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype).double()
    p_sink = (kw["sinks"].double().view(1, -1, 1) - lse).exp()
    return (p_sink * (go * out).abs().sum(-1)).sum((0, 2)).max().item()


def check(case):
    """'' when the case passes on every path, else what failed."""
    q, k, v, kw, dtype, bottom_right, grad, entry = case

    def formulas(q, k, v, kw):
        return test_variants.reference(q, k, v, bottom_right=bottom_right, dtype=q.dtype,
                                       **kw)[0]

    ref = _results(formulas, q, k, v, kw, torch.float64, grad)
    base = _results(formulas, q, k, v, kw, dtype, grad)
    terms = fuzz_sdpa.cancelling_terms(dict(q=q, k=k, v=v, scale=None))
    sink_floor = _sink_floor(q, k, v, kw, bottom_right) if grad and "sinks" in kw else 1.0
    paths = [("cpu", cpu_run(entry, bottom_right))]
    if TRITON:
        paths.append(("triton", triton_run(bottom_right)))
    for name, run in paths:
        try:
            ours = _results(run, q, k, v, kw, dtype, grad)
        except Exception as e:  # noqa: BLE001  (every drawn call is valid)
            return f"{name}: raised {type(e).__name__}: {e}"
        why = verdict(name, ours, base, ref, dtype, terms, sink_floor)
        if why:
            return why
    return ""


def verdict(name, ours, base, ref, dtype, terms, sink_floor):
    """fuzz_sdpa's verdict on ours = (out, [dq, dk, dv, dsinks] or None) against the same
    formulas in dtype (base) and in fp64 (ref): dq and dk with the atol term over the cancelling
    terms, dsinks in float32 with it over sink_floor (_sink_floor). (fuzz_varlen's too.)"""
    why = fuzz_sdpa.compare(f"{name} out", ours[0], base[0], ref[0], dtype)
    if why or ours[1] is None or ref[1] is None:
        return why
    for t, a, b, r in zip(("q", "k", "v", "sinks"), ours[1], base[1], ref[1]):
        if r is None:
            continue
        if a is None:
            return f"{name}: no gradient for {t}"
        dt = torch.float32 if t == "sinks" else dtype
        mag = sink_floor if t == "sinks" else terms if t in ("q", "k") else 1.0
        why = fuzz_sdpa.compare(f"{name} d{t}", a.to(dt), b.to(dt), r, dtype, mag)
        if why:
            return why
    return ""


def lse_verdict(name, lse, want, tol):
    """A logsumexp against the reference's: -inf on the same rows (those that see no key and
    have no sink), elsewhere within tol (relative to its largest magnitude, at least 1).
    (fuzz_kvcache's and fuzz_varlen's.)"""
    seen = torch.isfinite(want)
    if not torch.equal(seen, torch.isfinite(lse)):
        return f"{name} lse: finite where the reference's is not, or the other way"
    err = (lse.double()[seen] - want[seen]).abs()
    if err.numel() and err.max() > tol * max(1.0, want[seen].abs().max().item()):
        return f"{name} lse: error {err.max().item():.3g}"
    return ""


def run_case(seed):
    return check(draw(seed))


def main(argv=None):
    return fuzz_sdpa.main_of(sys.modules[__name__], argv, "triton", "emulated")


if __name__ == "__main__":
    sys.exit(main())
