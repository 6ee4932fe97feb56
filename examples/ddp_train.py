"""Data-parallel training with flashsdpa on CPUs: DDP over gloo, two processes on this machine.

Each process (a rank) enables flashsdpa, builds the same model (tiny_transformer.py) from the same
seed, and trains on its own batches; DDP averages the gradients across the ranks after each
backward (gloo's all-reduce), so every rank takes the same optimizer step and the parameters stay
identical, which the end of the run checks. The ranks meet on 127.0.0.1 at a free port; on a
cluster MASTER_ADDR / MASTER_PORT name rank 0's host and torchrun starts the processes.

    python examples/ddp_train.py
    python examples/ddp_train.py --world-size 4 --steps 30
"""
import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import flashsdpa
from tiny_transformer import Config, TinyTransformer, lm_loss, profiled, \
    repeated_patterns


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # a rank that dies leaves the others waiting in a collective: the timeout ends the wait
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    # the ranks share this machine's cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    flashsdpa.enable()

    torch.manual_seed(0)  # the same initial parameters on every rank (DDP also broadcasts them)
    cfg = Config()
    model = DDP(TinyTransformer(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own share of the data

    def step():
        batch = repeated_patterns(args.batch, cfg.max_len + 1, cfg.vocab, generator=data)
        loss = lm_loss(model, batch)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.steps):
        # rank 0's last step profiled: which attention kernels served it (only rank 0 prints
        # them; a profiler started in every spawned rank is one more thread to tear down at exit)
        if i == args.steps - 1 and rank == 0:
            loss, kernels = profiled(step)
        else:
            loss = step()
        per_rank = [torch.empty(()) for _ in range(world_size)]
        dist.all_gather(per_rank, loss)
        if rank == 0:
            print(f"step {i}: loss " + ", ".join(f"rank {r} {x.item():.4f}"
                                                 for r, x in enumerate(per_rank)), flush=True)

    # every rank took the same steps: the parameters must be bit-identical
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        same = all(torch.equal(gathered[0], g) for g in gathered)
        print(f"flashsdpa kernels in rank 0's last step: {', '.join(kernels) or 'none'}")
        print(f"parameters identical on all {world_size} ranks: {same}", flush=True)
    # Every rank done with its collectives, and the DDP wrapper (whose reducer holds gloo work)
    # gone, before the group is: a rank that exits while gloo still holds work can abort
    # ("terminate called without an active exception").
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="rows per rank and step")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    mp.spawn(worker, args=(args.world_size, free_port(), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
