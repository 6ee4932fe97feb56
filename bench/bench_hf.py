"""Hugging Face transformers models end to end, side by side in one process: attn_implementation
"fused_attention" (flashsdpa.hf) against transformers' "eager" and "sdpa" (where the model
supports it: Gemma 2 and gpt-oss do not), on small but real configurations of Llama, Mistral,
Gemma 2 and gpt-oss with random weights (4 layers, hidden 512, 8 heads of 64; the families'
own features: GQA, sliding windows, softcap, sinks, mixture of experts).

Cases, per family and dtype (interleaved medians):
    prefill   one 2048-token prompt, the last position's logits (as generate() computes them)
    decode    16 tokens after a 2048-token prompt, one at a time with the dynamic cache (each
              sample starts from a copy of the prompt's cache, ~2% of its time): tokens/s
    train     one training step (forward + backward) on 8 sequences of 64-512 tokens: packed
              (DataCollatorWithFlattening) for flashsdpa, padded to the longest for every
              provider ("fused_attention padded" shows the kernels' part without packing)
Before timing, every provider's logits are checked against eager attention's in fp32.
Results: bench/out/hf.json and hf.png beside it (speedups over eager and sdpa), or where --out
says (`make bench-all`: bench/results/, whose plot the README shows).

    python bench/bench_hf.py                      # every family and case, fp32
    python bench/bench_hf.py --families llama --cases prefill --dtypes fp32,bf16
    python bench/bench_sdpa.py --mode hf          # the same, from the main bench
"""
import argparse
import copy
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sdpa import (DTYPE_ALIASES, Progress, add_run_args, apply_run_args,  # noqa: E402
                        geomean, host_meta, save_json, time_case)
from plotting import pyplot  # noqa: E402

import flashsdpa.hf  # noqa: E402

FUSED = flashsdpa.hf.DEFAULT_NAME  # registered by main() (rendering needs no transformers)
SIZE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=64,
            vocab_size=8192, max_position_embeddings=4096)
# family -> (config class name, its own settings, what they exercise)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, intermediate_size=1408),
              "GQA 8/2"),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, intermediate_size=1408,
                                      sliding_window=1024), "GQA 8/2, window 1024"),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=4, intermediate_size=1408,
                                    sliding_window=1024, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=64),
               "GQA 8/4, window 1024 every other layer, softcap 50"),
    "gptoss": ("GptOssConfig", dict(num_key_value_heads=2, intermediate_size=512,
                                    sliding_window=128, num_local_experts=8,
                                    num_experts_per_tok=2),
               "GQA 8/2, window 128 every other layer, sinks, 8 experts top-2"),
}
CASES = ["prefill", "decode", "train"]
PROMPT, DECODE_STEPS = 2048, 16
TRAIN_LENGTHS = [512, 64, 300, 128, 450, 96, 256, 200]  # 8 sequences of 64-512 tokens
DEFAULT_REPEATS = 3


def build(family, dtype, tiny):
    import transformers
    cls, own, _ = FAMILIES[family]
    size = dict(SIZE, num_hidden_layers=2, hidden_size=64, head_dim=16, vocab_size=256) \
        if tiny else SIZE
    own = dict(own, intermediate_size=96) if tiny else own
    extra = {"experts_implementation": "eager"} if family == "gptoss" else {}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**size, **own), attn_implementation="eager", dtype=dtype,
        **extra)
    return model.eval()


def providers(model):
    """The attention implementations this model accepts, in table order."""
    out = [FUSED, "eager"]
    try:
        model.set_attn_implementation("sdpa")
        out.append("sdpa")
    except ValueError:  # transformers refuses sdpa for this architecture
        pass
    return out


def tokens(shape, vocab, seed):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def prefill_steps(model, impls, prompt):
    ids = tokens((1, prompt), model.config.vocab_size, 1)

    def step(impl):
        def run():
            model.set_attn_implementation(impl)
            with torch.no_grad():
                return model(ids, logits_to_keep=1).logits
        return run
    return {impl: step(impl) for impl in impls}


def decode_steps(model, impls, prompt, steps):
    from transformers import DynamicCache
    ids = tokens((1, prompt), model.config.vocab_size, 2)
    caches = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        caches[impl] = cache

    def step(impl):
        def run():
            model.set_attn_implementation(impl)
            cache = copy.deepcopy(caches[impl])
            nxt = ids[:, -1:]
            with torch.no_grad():
                for _ in range(steps):
                    logits = model(nxt, cache=cache, use_cache=True).logits
                    nxt = logits[:, -1:].argmax(-1)
        return run
    return {impl: step(impl) for impl in impls}


def train_batches(vocab, lengths):
    from transformers import DataCollatorWithFlattening
    feats = [{"input_ids": tokens((n,), vocab, 10 + i).tolist()} for i, n in enumerate(lengths)]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats, return_tensors="pt")
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor(feats[i]["input_ids"])
        mask[i, :n] = 1
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return packed, padded


def train_steps(model, impls, lengths):
    packed, padded = train_batches(model.config.vocab_size, lengths)

    def step(impl, batch):
        def run():
            model.set_attn_implementation(impl)
            model.train()
            model.zero_grad(set_to_none=True)
            model(**batch, use_cache=False).loss.backward()
            model.eval()
        return run
    out = {FUSED: step(FUSED, packed)}
    out.update({f"{impl} padded": step(impl, padded) for impl in impls})
    return out


def check_agreement(family, model, impls, dtype, tiny):
    """Each provider's logits on a 512-token prompt against eager attention's in fp32: within
    1e-3 for fp32 models; in bf16 / fp16 within twice eager's own error in that dtype (the
    test suite's rule: a mixture of experts can route a token differently after any rounding,
    so single logits may move by much). Returns the errors."""
    ref_model = model if dtype == torch.float32 else build(family, torch.float32, tiny)
    ids = tokens((1, 64 if tiny else 512), model.config.vocab_size, 3)
    ref_model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = ref_model(ids).logits.double()
        errs = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            errs[impl] = (model(ids).logits.double() - ref).abs().max().item()
    if dtype == torch.float32:
        bad = {p: e for p, e in errs.items() if not e <= 1e-3}
    else:
        bound = 2 * errs["eager"] + 2.0 ** -7 * max(1.0, ref.abs().max().item())
        bad = {p: e for p, e in errs.items() if not e <= bound}
    if bad:
        raise SystemExit(f"{family} {dtype}: logits off the fp32 eager reference beyond the "
                         f"bound: {bad} (all: {errs})")
    return errs


def run_family(family, dtype, cases, repeats, tiny, progress):
    model = build(family, dtype, tiny)
    impls = providers(model)
    prompt = 64 if tiny else PROMPT
    lengths = [max(2, n // 16) for n in TRAIN_LENGTHS] if tiny else TRAIN_LENGTHS
    errs = check_agreement(family, model, impls, dtype, tiny)
    rows = []
    for case in cases:
        if case == "prefill":
            steps = prefill_steps(model, impls, prompt)
        elif case == "decode":
            steps = decode_steps(model, impls, prompt, DECODE_STEPS)
        else:
            steps = train_steps(model, impls, lengths)
        samples = time_case(steps, repeats, target_s=0.0)
        ms = {p: statistics.median(s) * 1e3 for p, s in samples.items()}
        row = {"family": family, "what": FAMILIES[family][2], "case": case, "prompt": prompt,
               "dtype": str(dtype).replace("torch.", ""), "ms": ms, "logits_err_vs_fp32_eager": errs,
               "speedup": {p: ms[p] / ms[FUSED] for p in ms if p != FUSED}}
        if case == "decode":
            row["tokens_per_s"] = {p: DECODE_STEPS / (t * 1e-3) for p, t in ms.items()}
        elif case == "prefill":
            row["tokens_per_s"] = {p: prompt / (t * 1e-3) for p, t in ms.items()}
        rows.append(row)
        progress.case_done(f"{family} {row['dtype']} {case}: {FUSED} {ms[FUSED]:.1f} ms; "
                           + ", ".join(f"{p} {x:.2f}x" for p, x in row["speedup"].items()))
    return rows


def markdown(meta, rows):
    lines = [f"hf | {meta['cpu']} | {meta['threads']} threads | torch {meta['torch']} | "
             f"transformers {meta.get('transformers', '?')}", "",
             f"| model | case | dtype | {FUSED} ms | others ms ({FUSED}'s speedup) |",
             "|---|---|---|---|---|"]
    for r in rows:
        what = {"prefill": f"prefill {r['prompt']} tokens",
                "decode": f"decode {DECODE_STEPS} tokens after {r['prompt']}",
                "train": "train step, 8 sequences (packed)"}
        others = "; ".join(f"{p} {r['ms'][p]:.1f} ({r['speedup'][p]:.2f}x)" for p in r["ms"]
                           if p != FUSED)
        tps = f" ({r['tokens_per_s'][FUSED]:.0f} tok/s)" if "tokens_per_s" in r else ""
        lines.append(f"| {r['family']} ({r['what']}) | {what[r['case']]} | {r['dtype']} | "
                     f"{r['ms'][FUSED]:.1f}{tps} | {others} |")
    lines.append("")
    for p in sorted({p for r in rows for p in r["speedup"]}):
        xs = [r["speedup"][p] for r in rows if p in r["speedup"]]
        lines.append(f"{FUSED} over {p}: geomean {geomean(xs):.2f}x, range "
                     f"{min(xs):.2f}-{max(xs):.2f}x ({len(xs)} cases)")
    return "\n".join(lines)


def plot(rows, path):
    """Speedup of fused_attention over each other provider: one panel per case, a group of bars
    per model and dtype (PNG). The training step's peers run the padded batch."""
    plt = pyplot()
    if plt is None:
        return None
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.8 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        sel = [r for r in rows if r["case"] == case]
        peers = sorted({p.replace(" padded", "") for r in sel for p in r["speedup"]},
                       key=lambda p: (p != "eager", p))
        width = 0.8 / len(peers)
        for i, peer in enumerate(peers):
            xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(sel))]
            ys = [r["speedup"].get(peer, r["speedup"].get(f"{peer} padded", 0)) for r in sel]
            label = f"over {peer}" + (" (padded batch)" if case == "train" else "")
            ax.bar(xs, ys, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sel)),
                      [f"{r['family']}\n{DTYPE_ALIASES.get(r['dtype'], r['dtype'])}" for r in sel],
                      fontsize=7)
        ax.set_title({"prefill": "prefill", "decode": "decode tokens/s",
                      "train": "training step (packed)"}[case], fontsize=9)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel(f"{FUSED} speedup (x)")
    fig.suptitle("Hugging Face models on CPU: flashsdpa's fused_attention against eager / sdpa",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--cases", default=",".join(CASES))
    add_run_args(ap, "hf.json", f"rounds per case (default {DEFAULT_REPEATS})")
    ap.set_defaults(dtypes="fp32")
    args = ap.parse_args(argv)
    dtypes, families, cases = apply_run_args(ap, args, family=(args.families, FAMILIES),
                                             case=(args.cases, CASES))
    import transformers
    flashsdpa.hf.register(FUSED)
    meta = dict(host_meta("hf"), transformers=transformers.__version__)
    rows = []
    progress = Progress(len(families) * len(dtypes) * len(cases))
    for family in families:
        for dtype in dtypes:
            rows += run_family(family, dtype, cases, args.repeats or DEFAULT_REPEATS, args.tiny,
                               progress)
    print(markdown(meta, rows))
    print(f"\nresults: {save_json(args.out, meta, rows)}")
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
