"""Text generation with a Hugging Face model on flashsdpa's kernels.

Runs offline in seconds: it builds a small Llama-style model from a config with random weights
(the tokens are gibberish; the point is the code path). For a real checkpoint the whole change
is the attn_implementation argument:

    model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B",
                                                 attn_implementation="fused_attention")

    python examples/hf_generate.py                     # Llama-style, dynamic cache
    python examples/hf_generate.py --family gemma2     # sliding window + softcap
    python examples/hf_generate.py --family gptoss --cache static
"""
import argparse
import time

import torch

import flashsdpa.hf
from tiny_models import FAMILIES, build


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    name = flashsdpa.hf.register()  # "fused_attention": call once, before building models
    model = build(args.family, name, getattr(torch, args.dtype)).eval()

    # a left-padded batch of two prompts, as a tokenizer with padding_side="left" gives
    prompts = torch.randint(3, model.config.vocab_size, (2, 48))
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :20] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.new_tokens,
                  do_sample=False)
    if args.cache == "static":
        kwargs["cache_implementation"] = "static"

    t0 = time.perf_counter()
    out = model.generate(prompts, **kwargs)
    dt = time.perf_counter() - t0
    model.set_attn_implementation("eager")
    same = torch.equal(out, model.generate(prompts, **kwargs))
    print(f"{args.family} ({args.dtype}, {args.cache} cache): {out.shape[1] - prompts.shape[1]} "
          f"new tokens for 2 prompts in {dt:.2f} s; tokens equal eager attention's: {same}")
    print("new tokens of prompt 0:", out[0, prompts.shape[1]:].tolist())


if __name__ == "__main__":
    main()
