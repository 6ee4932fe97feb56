"""Greedy generation with a KV cache on flashsdpa's serving API (flash_attn_with_kvcache).

Each layer of the model (tiny_transformer.py) keeps its keys and values in a preallocated cache;
one flash_attn_with_kvcache call per layer appends the new tokens' keys / values in place and
attends over the whole cache: the prompt in one call (prefill), then one token per call (the
split-KV decode path). The model is first trained for a few seconds on rows that repeat a random
pattern of 8 tokens, so that a prompt of two repetitions has an answer to check: generation
should continue the pattern. The same tokens are then generated without a cache, recomputing
the whole sequence at each step through F.scaled_dot_product_attention under
flashsdpa.enable(), which must give the same tokens.

    python examples/inference.py
    python examples/inference.py --train-steps 0      # random weights: only the equality holds
"""
import argparse
import time

import torch

import flashsdpa
from tiny_transformer import PERIOD, Config, KVCache, TinyTransformer, lm_loss, \
    repeated_patterns


@torch.no_grad()
def generate(model, prompt, new_tokens, use_cache):
    """Greedy continuation of prompt [B, Lp] by new_tokens tokens -> [B, Lp + new_tokens]."""
    tokens = prompt
    cache = KVCache(model.cfg, prompt.shape[0]) if use_cache else None
    for _ in range(new_tokens):
        # with a cache only the tokens it has not seen go in: the prompt, then the last token
        logits = model(tokens[:, cache.length:] if use_cache else tokens, cache)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-steps", type=int, default=40,
                    help="training steps (8 rows each) before generating")
    ap.add_argument("--batch", type=int, default=4, help="prompts generated together")
    args = ap.parse_args()

    flashsdpa.enable()
    torch.manual_seed(0)
    cfg = Config()
    model = TinyTransformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for _ in range(args.train_steps):
        rows = repeated_patterns(8, cfg.max_len + 1, cfg.vocab, generator=data)
        loss = lm_loss(model, rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if args.train_steps:
        print(f"trained {args.train_steps} steps in {time.perf_counter() - t0:.1f} s, "
              f"last loss {loss.item():.3f}")
    model.eval()

    # prompts: two repetitions of a new random pattern; generation fills the positions the
    # model was trained on
    prompt = repeated_patterns(args.batch, 2 * PERIOD, cfg.vocab,
                               generator=torch.Generator().manual_seed(123))
    new_tokens = cfg.max_len - prompt.shape[1]
    seconds, out = {}, {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        out[use_cache] = generate(model, prompt, new_tokens, use_cache)
        seconds[use_cache] = time.perf_counter() - t0

    generated = out[True][:, prompt.shape[1]:]
    expected = prompt[:, :PERIOD].repeat(1, new_tokens // PERIOD)
    print(f"{args.batch} prompts of {prompt.shape[1]} tokens, {new_tokens} new tokens each: "
          f"KV cache {seconds[True]:.2f} s, recomputing without a cache {seconds[False]:.2f} s")
    print(f"generated tokens that continue the pattern: "
          f"{(generated == expected).float().mean().item():.0%}")
    print(f"tokens equal with and without the cache: {torch.equal(out[True], out[False])}")
    print("prompt 0:", prompt[0].tolist())
    print("new tokens of prompt 0:", generated[0].tolist())


if __name__ == "__main__":
    main()
