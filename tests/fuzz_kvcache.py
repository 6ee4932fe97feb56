"""Differential fuzzer of flash_attn_with_kvcache on the CPU kernels (and, --triton, the Triton
split-KV kernel: on the GPU when there is one, else under the interpreter): random batches of
sequences with their own cached lengths (empty ones too), contiguous or paged caches (block
sizes from 1 to 256, tables in any order, spare blocks and unused rows NaN), bf16 / fp16 / fp32
or float8_e4m3fn caches (scalar or per-kv-head scales), the in-place append of new keys /
values, decode / speculative / chunked-prefill query counts, GQA, Dv != D and every variant
(bottom-right causal, windows, softcap, ALiBi, sinks). Each call against the fp64 reference over
the sequence's keys (dequantised; the appended ones as the append quantises them), under
fuzz_sdpa's verdict with the same formulas in q's dtype as the baseline; its logsumexp close to
the reference's; and the caches after the call equal to the caches before with exactly the new
slots written (bit for bit).

    python tests/fuzz_kvcache.py --cases 2000 --seed 0            # `make fuzz-kvcache`
    python tests/fuzz_kvcache.py --case 1234                      # one case again, printed
    python tests/fuzz_kvcache.py --triton --cases 300             # the Triton kernel too
    python tests/fuzz_kvcache.py --emulated avx512_bf16 --cases 300

Every drawn call is valid: an exception is a failure. A crash kills the process: run it in a
subprocess (tests/test_fuzz.py does) and rerun the case printed last with --case.
"""
import random
import sys

import torch

import flashsdpa
import fuzz_sdpa
import fuzz_variants
import test_kvcache
from test_kvcache import dequantize, paged, quantize
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw(seed):
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = r.choice(DTYPES)
    fp8 = r.random() < 0.25
    B, Hkv = r.choice([1, 1, 2, 3, 4]), r.choice([1, 2, 3])
    Hq = Hkv * r.choice([1, 1, 2, 4, 8])
    D = r.choice([16, 32, 64, 80, 128])
    Dv = D if r.random() < 0.8 else r.choice([16, 24, 64])
    lq = r.choice([1, 1, 1, 2, 4, 7, 16, 17, 40])
    n_new = lq if r.random() < 0.6 else 0
    lcache = r.choice([1, 17, 64, 150, 300, 1100])
    lcache = max(lcache, n_new + 1)
    seqlens = [r.randrange(0, lcache - n_new + 1) if r.random() < 0.8 else lcache - n_new
               for _ in range(B)]
    q = torch.randn(B, lq, Hq, D, generator=g).to(dtype)
    kc = torch.randn(B, lcache, Hkv, D, generator=g) * r.choice([1.0, 3.0])
    vc = torch.randn(B, lcache, Hkv, Dv, generator=g)
    scales = None
    if fp8:
        per_head = r.random() < 0.5
        scales = []
        for cache in (kc, vc):
            amax = cache.abs().amax(dim=(0, 1, 3)) / 448
            scales.append(amax if per_head else amax.max().reshape(1))
        kc, vc = quantize(kc, scales[0]), quantize(vc, scales[1])
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    # rows past each sequence's keys: NaN (never read)
    for b, n in enumerate(seqlens):
        if not fp8:
            kc[b, n:] = float("nan")
            vc[b, n:] = float("nan")
    k_new = torch.randn(B, n_new, Hkv, D, generator=g).to(dtype) if n_new else None
    v_new = torch.randn(B, n_new, Hkv, Dv, generator=g).to(dtype) if n_new else None
    kw = {}
    if r.random() < 0.6:
        kw["causal"] = True
    if r.random() < 0.3:
        kw["window"] = (r.choice([-1, 0, 5, 60, 500]), r.choice([-1, 0, 3]))
    if r.random() < 0.25:
        kw["softcap"] = r.choice([1.0, 5.0, 30.0])
    if r.random() < 0.25:
        kw["alibi"] = torch.rand(*((B, Hq) if r.random() < 0.5 else (Hq,)), generator=g) * 0.3
    if r.random() < 0.25:
        kw["sinks"] = torch.randn(Hq, generator=g) * 2
    block = r.choice([None, None, 1, 3, 5, 16, 32, 64, 256])
    return dict(q=q, kc=kc, vc=vc, k_new=k_new, v_new=v_new, seqlens=seqlens, kw=kw,
                block=block, scales=scales, dtype=dtype, table_seed=seed + 1)


def describe(c):
    kc, q = c["kc"], c["q"]
    parts = [f"q{tuple(q.shape)} cache{tuple(kc.shape)} v{tuple(c['vc'].shape)[-1]}",
             str(c["dtype"]).replace("torch.", ""), f"seqlens={c['seqlens']}"]
    if c["scales"] is not None:
        parts.append(f"e4m3 scales{tuple(c['scales'][0].shape)}")
    if c["k_new"] is not None:
        parts.append(f"append {c['k_new'].shape[1]}")
    if c["block"]:
        parts.append(f"paged {c['block']}")
    for key, val in c["kw"].items():
        if isinstance(val, torch.Tensor):
            val = f"{tuple(val.shape)}"
        parts.append(f"{key}={val}")
    return " ".join(parts)


def expected(c, dtype):
    """Per sequence: (out, lse) of the reference over its keys (cached then new; float8 ones
    dequantised, the new ones as the append quantises them), in `dtype`."""
    kc, vc, kn, vn = c["kc"], c["vc"], c["k_new"], c["v_new"]
    if c["scales"] is not None:
        ks, vs = c["scales"]
        kc, vc = dequantize(kc, ks), dequantize(vc, vs)
        if kn is not None:
            kn, vn = dequantize(quantize(kn, ks), ks), dequantize(quantize(vn, vs), vs)
    return test_kvcache.expected(c["q"], kc, vc, kn, vn, c["kw"], dtype, c["seqlens"])


def cpu_run(c, kc, vc, table):
    """flash_attn_with_kvcache on the CPU kernels -> (out, lse); the caches written in place."""
    kw, scales = c["kw"], c["scales"]
    return flashsdpa.flash_attn_with_kvcache(
        c["q"], kc, vc, c["k_new"], c["v_new"], torch.tensor(c["seqlens"], dtype=torch.int32),
        table, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
        k_scale=None if scales is None else scales[0],
        v_scale=None if scales is None else scales[1], return_lse=True)


def triton_run(c, kc, vc, table):
    """The same call on the Triton split-KV kernel: flashsdpa.flash_attn_with_kvcache on the GPU
    when there is one (the caches copied there and back), else its GPU entry on CPU tensors
    under the interpreter, deciding as it does for GPU tensors (test_triton's CPU stand-in)."""
    from flashsdpa import _C, _gpu
    kw, scales = c["kw"], c["scales"]
    left, right = kw.get("window", (-1, -1))
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    opts = dict(causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0),
                alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
                k_scale=None if scales is None else scales[0],
                v_scale=None if scales is None else scales[1])
    if torch.cuda.is_available():
        on = lambda t: None if t is None else t.cuda()  # noqa: E731
        kg, vg = on(kc), on(vc)
        out, lse = flashsdpa.flash_attn_with_kvcache(
            on(c["q"]), kg, vg, on(c["k_new"]), on(c["v_new"]), on(seqlens), on(table),
            window_size=(left, right), return_lse=True,
            **{n: on(t) if isinstance(t, torch.Tensor) else t for n, t in opts.items()})
        kc.copy_(kg.cpu())
        vc.copy_(vg.cpu())
        return out.cpu(), lse.cpu()
    real = _gpu.decide

    def as_on_gpu(*args, **kwargs):
        d = real(*args, **kwargs)
        if d["backend"] == "cpu" and not d["reasons"]["triton"]:
            d["backend"] = "triton"
        return d

    _gpu.decide = as_on_gpu
    _C.set_overrideable_route("cpu")  # (the CPU taken as a Triton device: test_triton's stand-in)
    try:
        return _gpu.flash_attn_with_kvcache(c["q"], kc, vc, c["k_new"], c["v_new"], seqlens,
                                            table, window_left=left, window_right=right, **opts)
    finally:
        _C.set_overrideable_route("")
        _gpu.decide = real


TRITON = False  # --triton: the Triton kernels are checked too


def check(c):
    """'' when the case passes on every path, else what failed."""
    dtype, scales = c["dtype"], c["scales"]
    want, want_lse = expected(c, torch.float64)
    base, _ = expected(c, dtype)
    paths = [("cpu", cpu_run)] + ([("triton", triton_run)] if TRITON else [])
    for name, run in paths:
        kc, vc, table = c["kc"].clone(), c["vc"].clone(), None
        if c["block"]:
            (kc, table), (vc, _) = paged(kc, c["block"], c["table_seed"]), \
                paged(vc, c["block"], c["table_seed"])
        before = (kc.clone(), vc.clone())
        try:
            out, lse = run(c, kc, vc, table)
        except Exception as e:  # noqa: BLE001  (every drawn call is valid)
            return f"{name}: raised {type(e).__name__}: {e}"
        why = fuzz_sdpa.compare(f"{name} out", out, base.to(out.dtype), want, dtype) or \
            fuzz_variants.lse_verdict(name, lse, want_lse, 1e-4 if dtype == torch.float32 and
                                      scales is None else 3e-2) or \
            appended_exactly(c, before, (kc, vc), table)  # exactly the new slots written
        if why:
            return f"{name}: {why}" if why.startswith("append") else why
    return ""


def appended_exactly(c, before, after, table):
    """'' when each cache after the call is the cache before with exactly the new rows (float8
    ones quantised) written where the append puts them (test_kvcache.appended), byte for byte."""
    for side, (old, new) in enumerate(zip(before, after)):
        fresh = c["k_new"] if side == 0 else c["v_new"]
        want = old
        if fresh is not None:
            if c["scales"] is not None:
                fresh = quantize(fresh, c["scales"][side])
            want = test_kvcache.appended(old, fresh, table, c["block"], c["seqlens"])
        if not torch.equal(new.view(torch.uint8), want.view(torch.uint8)):
            return f"append: {'kv'[side]}_cache differs from the expected bytes"
    return ""


def run_case(seed):
    return check(draw(seed))


def main(argv=None):
    return fuzz_sdpa.main_of(sys.modules[__name__], argv, "triton", "emulated")


if __name__ == "__main__":
    sys.exit(main())
