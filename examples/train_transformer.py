"""Training a small transformer with flashsdpa.enable(), in eager mode and under torch.compile.

The model (tiny_transformer.py) calls F.scaled_dot_product_attention(is_causal=True) as any
PyTorch model does; flashsdpa.enable() sends those calls, forward and backward, to flashsdpa's
kernels, also inside torch.compile'd graphs (they hold flashsdpa's ops). Each mode trains the same
model from the same seed on the same synthetic batches on flashsdpa's kernels and, as the
baseline, on PyTorch's, and prints both losses, the median time per step and the flashsdpa
kernels a profiled step ran. The data repeats a random pattern of 8 tokens per row: the loss
falls as the model learns to copy from 8 positions back, which only attention can do.

Under torch.compile the first step compiles the model's graphs (Inductor generates C++ and
compiles it: tens of seconds on 2 cores the first time, cached for later runs); the time per
step is the median of the later steps (on a machine shared with other work, it varies).

    python examples/train_transformer.py                   # eager, then torch.compile
    python examples/train_transformer.py --mode eager --steps 60
    python examples/train_transformer.py --mode eager --length 512 --steps 10  # attention-heavy
"""
import argparse
import statistics
import time

import torch

import flashsdpa
from tiny_transformer import Config, TinyTransformer, lm_loss, profiled, \
    repeated_patterns

LABELS = {False: "PyTorch", True: "flashsdpa"}


def train(compiled, flash, args):
    """Losses and seconds of each step of one run (the first step includes compilation), and
    the flashsdpa kernels that one more, profiled, step ran."""
    # a compiled function keeps the graph it was traced with (flashsdpa's ops or PyTorch's),
    # so each run traces afresh
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyTransformer(Config(layers=args.layers, max_len=args.length))
    step_model = torch.compile(model, backend=args.backend) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)

    def step():
        batch = repeated_patterns(args.batch, args.length + 1, model.cfg.vocab, generator=data)
        loss = lm_loss(step_model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses, seconds = [], []
    with flashsdpa.enabled(flash):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses.append(step())
            seconds.append(time.perf_counter() - t0)
        _, ops = profiled(step)
    return losses, seconds, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64, help="tokens per row")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend (aot_eager: traced graphs, no code generation)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="train on flashsdpa only (no run on PyTorch's kernels to compare with)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out of the timing)")

    kernels = [True] if args.no_baseline else [False, True]
    for mode in ["eager", "compile"] if args.mode == "both" else [args.mode]:
        runs = {flash: train(mode == "compile", flash, args) for flash in kernels}
        every = max(1, args.steps // 8)
        for step in sorted({*range(0, args.steps, every), args.steps - 1}):
            print(f"{mode} step {step}: loss " + ", ".join(
                f"{LABELS[flash]} {runs[flash][0][step]:.4f}" for flash in kernels))
        # the first step (warm-up, compilation) is left out of the time per step
        ms = {flash: 1e3 * statistics.median(runs[flash][1][1:]) for flash in kernels}
        line = ", ".join(f"{LABELS[flash]} {ms[flash]:.1f}" for flash in kernels)
        if not args.no_baseline:
            line += f" (flashsdpa {ms[False] / ms[True]:.2f}x)"
        first = ", ".join(f"{LABELS[flash]} {runs[flash][1][0]:.1f} s" for flash in kernels)
        print(f"{mode} ms per step (median of {args.steps - 1}): {line}; first step {first}")
        print(f"{mode} flashsdpa kernels in a step: {', '.join(runs[True][2]) or 'none'}")


if __name__ == "__main__":
    main()
