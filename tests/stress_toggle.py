"""Stress: threads calling attention (routed F.sdpa forward and backward, the direct API, varlen,
a KV cache) while another thread toggles flashsdpa.enable() / disable() (and the enabled()
context) without pause. Every result is checked against PyTorch's, computed before the run; the
resident set size is sampled to show it stays flat (no growth per toggle).

    python tests/stress_toggle.py --seconds 300 --threads 8     # `make stress`
Exit status 1 when a call failed or gave a wrong result, or the RSS grew past --max-growth-mib
after the first fifth of the run; a crash kills the process (tests/test_stress.py runs it in a
subprocess)."""
import argparse
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F

import flashsdpa


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def cases():
    """(name, call, expected): calls whose results do not depend on the routing state beyond
    the error rule, each with PyTorch's result."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    out = []
    q, k, v = t(2, 4, 33, 32), t(2, 2, 40, 32), t(2, 2, 40, 32)
    mask = torch.rand(2, 1, 33, 40, generator=g) < 0.8
    mask[..., 0] = True
    for name, kw in (("plain", {}), ("causal", dict(is_causal=True)),
                     ("bool mask", dict(attn_mask=mask)), ("float mask", dict(
                         attn_mask=torch.where(mask, 0.0, torch.finfo().min)))):
        out.append((f"routed {name}", lambda kw=kw: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, **kw), F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, **kw)))
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    out.append(("routed bf16", lambda: F.scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, enable_gqa=True), F.scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, enable_gqa=True)))

    def grads():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        o.square().sum().backward()
        return torch.cat([x.grad.flatten() for x in leaves])
    out.append(("routed backward", grads, grads()))
    out.append(("direct", lambda: flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    qd = t(2, 4, 1, 32)
    out.append(("decode", lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True),
                F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)))
    lens = [5, 30, 1]
    cu = torch.tensor([0, 5, 35, 36], dtype=torch.int32)
    qv, kv_, vv = t(36, 4, 16), t(36, 2, 16), t(36, 2, 16)
    want = torch.cat([F.scaled_dot_product_attention(
        qv[a:b].transpose(0, 1)[None], kv_[a:b].transpose(0, 1)[None],
        vv[a:b].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    out.append(("varlen", lambda: flashsdpa.flash_attn_varlen_func(
        qv, kv_, vv, cu, cu, max(lens), max(lens), causal=True), want))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=4, help="calling threads (plus one toggling)")
    ap.add_argument("--max-growth-mib", type=float, default=32.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # many Python threads: keep each call on its own
    work = cases()
    stop = threading.Event()
    errors, calls, toggles = [], [0] * args.threads, [0]

    def caller(n):
        i = n
        while not stop.is_set():
            name, call, want = work[i % len(work)]
            i += 1
            try:
                with torch.no_grad() if name != "routed backward" else torch.enable_grad():
                    got = call()
                tol = 3e-2 if got.dtype == torch.bfloat16 else 2e-4
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    errors.append(f"{name}: max diff {(got.float() - want.float()).abs().max()}")
            except Exception as e:  # a failure is reported, the run goes on
                errors.append(f"{name}: {type(e).__name__}: {e}")
            calls[n] += 1

    def toggler():
        while not stop.is_set():
            flashsdpa.enable()
            flashsdpa.disable()
            with flashsdpa.enabled():
                pass
            toggles[0] += 1

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.threads)]
    threads.append(threading.Thread(target=toggler))
    t0 = time.time()
    samples = []
    for th in threads:
        th.start()
    while time.time() - t0 < args.seconds:
        time.sleep(min(1.0, args.seconds / 20))
        samples.append((time.time() - t0, rss_mib()))
    stop.set()
    for th in threads:
        th.join()
    flashsdpa.disable()
    settled = [r for s, r in samples if s >= args.seconds / 5] or [samples[-1][1]]
    growth = max(settled) - settled[0]
    print(f"{sum(calls)} calls in {args.threads} threads, {toggles[0]} toggle cycles, "
          f"{len(errors)} errors; RSS {settled[0]:.0f} -> {max(settled):.0f} MiB after warm-up "
          f"(growth {growth:.1f} MiB)")
    for e in errors[:10]:
        print("  ", e)
    return 1 if errors or growth > args.max_growth_mib else 0


if __name__ == "__main__":
    sys.exit(main())
