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
import transformers

import flashsdpa.hf

CONFIGS = {  # small configurations of each family (random weights)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=64)),
    "gemma2": ("Gemma2Config", dict(sliding_window=64, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=64)),
    "gptoss": ("GptOssConfig", dict(sliding_window=64, num_local_experts=4,
                                    num_experts_per_tok=2)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=CONFIGS, default="llama")
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    name = flashsdpa.hf.register()  # "fused_attention": call once, before building models
    cls, own = CONFIGS[args.family]
    config = getattr(transformers, cls)(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, **own)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=name, dtype=getattr(torch, args.dtype)).eval()

    # a left-padded batch of two prompts, as a tokenizer with padding_side="left" gives
    prompts = torch.randint(3, config.vocab_size, (2, 48))
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
