"""One rank of test_distributed.py's data-parallel runs, and the model and data that the test's
single-process reference shares with it.

    python tests/dist_worker.py --mode ddp|fsdp2 --rank R --world-size W --port P --out DIR

Joins a gloo process group on 127.0.0.1:P, enables flashsdpa, wraps the model in DDP or FSDP2
(fully_shard), trains STEPS SGD steps on this rank's rows of the global batch and saves to
DIR/rank{R}.pt each step's full (unsharded) gradients, the final parameters and flashsdpa's
kernel counters.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flashsdpa
from flashsdpa import _testing

VOCAB, DIM, HEADS, LAYERS = 32, 64, 4, 2
ROWS, LENGTH = 8, 33    # the global batch: rows of tokens (inputs are the first LENGTH - 1)
STEPS, LR = 2, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        # x: [B, L, DIM] -> q, k, v: [B, H, L, DIM / H]
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, L, DIM))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    torch.manual_seed(0)
    return Model()


def global_batch():
    return torch.randint(VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))


def loss_of(model, rows):
    """Mean next-token cross-entropy: with equal rows per rank, the mean over ranks of their
    gradients (what DDP and FSDP2 reduce to) is the gradient of the global batch's loss."""
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


def full(t):
    """A gradient or parameter as a plain tensor (FSDP2 holds shards: DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model, rows, params):
    """STEPS SGD steps of `model` (whose parameters are `params`, name -> parameter) on rows ->
    each step's gradients {name: tensor}."""
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    grads = []
    for _ in range(STEPS):
        loss_of(model, rows).backward()
        grads.append({name: full(p.grad).detach().clone() for name, p in params.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if ROWS % args.world_size:
        raise ValueError(f"{ROWS} rows do not split evenly over {args.world_size} ranks")

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    # a collective whose peer died fails after the timeout instead of waiting forever
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    flashsdpa.enable()

    model = build()
    params = dict(model.named_parameters())  # names before wrapping (DDP prefixes "module.")
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (args.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())  # now DTensors, sharded along dim 0
    share = ROWS // args.world_size
    rows = global_batch()[args.rank * share:(args.rank + 1) * share]

    with _testing.counting() as counts:
        grads = train(wrapped, rows, params)
        kernel_counts = counts()
    final = {name: full(p).detach().clone() for name, p in params.items()}
    torch.save({"grads": grads, "params": final, "counts": kernel_counts},
               os.path.join(args.out, f"rank{args.rank}.pt"))
    # (as examples/ddp_train.py: collectives done and the wrapper gone before the group)
    dist.barrier()
    del wrapped, model, params
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
