"""Differential fuzzer of flash_attn_varlen_func: random packed batches (1 to 9 sequences of 0 to
300 queries and keys, self or cross attention, empty sequences and sequences without keys
included) with GQA, Dv != D, every dtype and every variant (bottom-right causal, windows,
softcap, ALiBi per head or per sequence and head, sinks), forward, logsumexp and every gradient,
on the CPU kernels and (--triton) the Triton kernels' packed launch, against the fp64 reference
on each sequence alone (test_varlen.per_sequence_reference) under fuzz_variants' verdict.

    python tests/fuzz_varlen.py --cases 2000 --seed 0            # `make fuzz-varlen`
    python tests/fuzz_varlen.py --triton --cases 300             # the Triton kernels too
    python tests/fuzz_varlen.py --case 1234                      # one case again, printed
"""
import random
import sys

import torch

import flashsdpa
import fuzz_sdpa
import fuzz_variants
from test_varlen import cu, per_sequence_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw(seed):
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = r.choice(DTYPES)
    n = r.choice([1, 2, 3, 5, 9])
    lens_q = [r.choice([0, 1, 3, 17, 40, 64, 130, 300]) for _ in range(n)]
    lens_k = lens_q if r.random() < 0.6 else [r.choice([0, 1, 5, 33, 100, 257]) for _ in range(n)]
    Hkv = r.choice([1, 2, 3])
    Hq = Hkv * r.choice([1, 2, 4])
    D = r.choice([8, 16, 33, 64, 80])
    Dv = D if r.random() < 0.8 else r.choice([8, 24])
    q = torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), Hkv, Dv, generator=g).to(dtype)
    kw = {}
    if r.random() < 0.5:
        kw["causal"] = True
    if r.random() < 0.35:
        kw["window"] = (r.choice([-1, 0, 4, 50]), r.choice([-1, 0, 2, 50]))
    if r.random() < 0.3:
        kw["softcap"] = r.choice([0.5, 3.0, 30.0])
    if r.random() < 0.3:
        kw["alibi"] = torch.rand(*((n, Hq) if r.random() < 0.5 else (Hq,)), generator=g) * 0.5
    if r.random() < 0.3:
        kw["sinks"] = torch.randn(Hq, generator=g) * 2
    return dict(q=q, k=k, v=v, cu_q=cu(lens_q), cu_k=cu(lens_k), kw=kw, dtype=dtype,
                grad=r.random() < 0.7)


def describe(c):
    lens = lambda t: (t[1:] - t[:-1]).tolist()  # noqa: E731
    parts = [f"lens_q={lens(c['cu_q'])} lens_k={lens(c['cu_k'])}",
             f"H={c['q'].shape[1]}/{c['k'].shape[1]} D={c['q'].shape[2]} Dv={c['v'].shape[2]}",
             str(c["dtype"]).replace("torch.", "")]
    for key, val in c["kw"].items():
        parts.append(f"{key}={tuple(val.shape) if isinstance(val, torch.Tensor) else val}")
    if c["grad"]:
        parts.append("grad")
    return " ".join(parts)


def _variant_args(kw):
    return dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"),
                sinks=kw.get("sinks"))


def cpu_run(q, k, v, cu_q, cu_k, kw):
    lq, lk = (int((c[1:] - c[:-1]).max()) for c in (cu_q, cu_k))
    return flashsdpa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, lq, lk, return_lse=True,
                                            **_variant_args(kw))


def triton_run(q, k, v, cu_q, cu_k, kw):
    from flashsdpa import _triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lq, lk = (int((c[1:] - c[:-1]).max()) for c in (cu_q, cu_k))
    left, right = kw.get("window", (-1, -1))
    extra = dict(window_left=left, window_right=right, softcap=kw.get("softcap", 0.0),
                 alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"))
    extra = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in extra.items()}
    out, lse = _triton.flash_attn_varlen(q.to(dev), k.to(dev), v.to(dev), cu_q.to(dev),
                                         cu_k.to(dev), lq, lk, causal=kw.get("causal", False),
                                         **extra)
    return out.cpu(), lse.cpu()


TRITON = False


def _results(run, c, dtype, grad):
    """(out, lse, [dq, dk, dv, dsinks or None]) from one fixed random gradient."""
    leaves = [c[t].detach().to(dtype).requires_grad_(grad) for t in "qkv"]
    sinks = c["kw"].get("sinks")
    s_leaf = sinks.detach().clone().requires_grad_(grad) if sinks is not None else None
    out, lse = run(*leaves, c["cu_q"], c["cu_k"], dict(c["kw"], sinks=s_leaf))
    if not grad or out.numel() == 0:
        return out.detach(), lse.detach(), None
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(go)
    grads = [t.grad for t in leaves] + [None if s_leaf is None else s_leaf.grad]
    return out.detach(), lse.detach(), grads


def check(c):
    dtype, grad = c["dtype"], c["grad"]

    def formulas(q, k, v, cu_q, cu_k, kw):
        return per_sequence_reference(q, k, v, cu_q, cu_k, kw, dtype=q.dtype)

    ref = _results(formulas, c, torch.float64, grad)
    base = _results(formulas, c, dtype, grad)
    terms = fuzz_sdpa.cancelling_terms(dict(q=c["q"], k=c["k"], v=c["v"], scale=None))
    sink_floor = _sink_floor(c, ref[0], ref[1]) if grad and "sinks" in c["kw"] else 1.0
    paths = [("cpu", cpu_run)] + ([("triton", triton_run)] if TRITON else [])
    for name, run in paths:
        try:
            out, lse, grads = _results(run, c, dtype, grad)
        except Exception as e:  # noqa: BLE001  (every drawn call is valid)
            return f"{name}: raised {type(e).__name__}: {e}"
        why = fuzz_variants.verdict(name, (out, grads), (base[0], base[2]), (ref[0], ref[2]),
                                    dtype, terms, sink_floor) or \
            fuzz_variants.lse_verdict(name, lse, ref[1], 1e-4 if dtype == torch.float32 else 3e-2)
        if why:
            return why
    return ""


def _sink_floor(c, out, lse):
    """fuzz_variants._sink_floor for a packed batch: per head sum_i P(sink)_i sum_d |dO O|."""
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(
        c["dtype"]).double()
    p_sink = (c["kw"]["sinks"].double().view(-1, 1) - lse).exp()  # (H, total_q)
    return (p_sink * (go * out).abs().sum(-1).t()).sum(1).max().item()


def run_case(seed):
    return check(draw(seed))


def main(argv=None):
    return fuzz_sdpa.main_of(sys.modules[__name__], argv, "triton", "emulated")


if __name__ == "__main__":
    sys.exit(main())
