"""Data-parallel training with flashsdpa enabled: DDP and FSDP2 (fully_shard) over gloo, two
processes on loopback, get the gradients of one process training on the whole batch.

Each rank is a subprocess running tests/dist_worker.py (its log in the test's tmp_path); the
reference runs here, with flashsdpa enabled too, so the comparison isolates the distribution:
DDP's all-reduce, FSDP2's sharding, all-gathers and reduce-scatters around flashsdpa's kernels.
"""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import dist_worker
import flashsdpa

WORLD_SIZE = 2
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
RANKS_TIMEOUT_S = 180  # all ranks together; gloo's own timeout (60 s) ends a stuck collective

# fp32. The ranks and the reference run the same operations on the same numbers except for the
# order of the batch sums: a weight gradient sums over the 256 token rows of the whole batch in
# one GEMM in the reference, over each rank's 128 and then across ranks (gloo) in the runs, and
# the second step starts from parameters that differ by that rounding. That is a few fp32 ulps
# of the largest gradient; 1e-5 of it leaves room and still fails a gradient that is not
# averaged (2x), one rank's alone, or a step that lost the attention's gradient.
REL_TOL = 1e-5

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode, out_dir):
    """Runs the ranks to completion or the timeout (then kills them) -> [(returncode, log)]."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback, whatever the host name resolves to
    logs = [out_dir / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, "--mode", mode, "--rank", str(rank),
                 "--world-size", str(WORLD_SIZE), "--port", str(port), "--out", str(out_dir)],
                stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def run_ranks(mode, out_dir):
    """Each rank's saved results; a free port taken by someone else in between is retried."""
    for attempt in range(2):
        done = launch(mode, out_dir)
        if all(rc == 0 for rc, _ in done):
            return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]
        if attempt == 0 and any("address already in use" in log.lower() for _, log in done):
            continue
        break
    pytest.fail("\n".join(
        f"rank {r}: " + (f"killed after {RANKS_TIMEOUT_S} s" if rc == -9 else f"exit code {rc}")
        + f"\n{log[-3000:]}" for r, (rc, log) in enumerate(done) if rc != 0))


@pytest.fixture(scope="module")
def reference():
    """One process, the whole batch, flashsdpa enabled: each step's gradients and the final
    parameters."""
    with flashsdpa.enabled():
        model = dist_worker.build()
        params = dict(model.named_parameters())
        grads = dist_worker.train(model, dist_worker.global_batch(), params)
    return grads, {name: p.detach() for name, p in params.items()}


def assert_close(what, got, want):
    for name, ref in want.items():
        scale = ref.abs().max().item()
        err = (got[name] - ref).abs().max().item()
        assert err <= REL_TOL * scale, (f"{what} {name}: max |diff| {err:.3g} > {REL_TOL:g} x "
                                        f"max |reference| {scale:.3g}")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_gradients_equal_single_process(mode, reference, tmp_path):
    ranks = run_ranks(mode, tmp_path)
    ref_grads, ref_params = reference
    for rank, res in enumerate(ranks):
        # flashsdpa's kernels served the ranks' attention, forward and backward
        assert res["counts"]["fwd_tiles"] > 0 and res["counts"]["bwd_tiles"] > 0, (
            f"rank {rank} ran no flashsdpa kernel: {res['counts']}")
        for step, (got, want) in enumerate(zip(res["grads"], ref_grads)):
            assert_close(f"rank {rank} step {step} gradient of", got, want)
        assert_close(f"rank {rank} final", res["params"], ref_params)
        # every rank took the same steps
        for name, p in res["params"].items():
            assert torch.equal(p, ranks[0]["params"][name]), f"ranks 0 and {rank} differ: {name}"
