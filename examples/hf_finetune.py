"""Fine-tuning a Hugging Face model on CPU with flashsdpa: packed sequences, no padding.

DataCollatorWithFlattening concatenates a batch of sequences of different lengths into one row
and passes their boundaries (cu_seq_lens_* / position_ids); attn_implementation="fused_attention"
runs flashsdpa's variable-length kernel over them, forward and backward, so no FLOP is spent on
padding and no token attends across sequences. Runs offline in seconds on a small random-weight
model; for a real checkpoint only the model line changes:

    model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b",
                                                 attn_implementation="fused_attention")

    python examples/hf_finetune.py                    # Gemma 2 style: window + softcap
    python examples/hf_finetune.py --family gptoss    # sinks are trained too
"""
import argparse
import time

import torch
from transformers import DataCollatorWithFlattening

import flashsdpa.hf
from tiny_models import FAMILIES, build


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="gemma2")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    name = flashsdpa.hf.register()
    model = build(args.family, name)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    # a toy dataset: sequences of 16-200 tokens (a real one comes from a tokenizer)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    data = [{"input_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
            for n in torch.randint(16, 200, (8 * args.steps,), generator=gen)]
    for step in range(args.steps):
        batch = collate(data[8 * step: 8 * step + 8], return_tensors="pt")
        t0 = time.perf_counter()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: {batch['input_ids'].shape[1]} tokens packed, loss {loss.item():.3f}, "
              f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
