"""Every special kernel path runs where the plan says it does, and gives what the plain path
gives. Each path is forced on and off through flashsdpa._testing.policy; that it ran is read
from the plan (last_policy), the profiler or the kernels' path counters, never assumed."""
import pytest
import torch

import flashsdpa
from flashsdpa import _C, _testing
from conftest import check_forward_backward, make_qkv, num_threads

PATHS = {t["name"]: t["paths"] for t in _C.tiers()}


def ran_paths():
    """The optional paths of the tier that ran this thread's last CPU call (for fp32 under a
    bf16-only tier, the best tier below it)."""
    return PATHS[_testing.last_policy()["tier"]]


def profiled_events(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("forced", [None, 0], ids=["plan", "off"])
def test_transposed_scores(tier, forced):
    """fp32, no mask / dropout / causal: the transposed-score forward where the tier has it."""
    q, k, v = make_qkv(2, 3, 3, 150, 300, 64)  # several kv blocks, a ragged q block
    overrides = {} if forced is None else {"transposed": forced}
    with _testing.policy(**overrides):
        names = profiled_events(lambda: check_forward_backward(
            q, k, v, torch.float32, f"{tier} transposed={forced}", backward=False))
        ran = _testing.last_policy()["transposed"]
        expected = forced is None and "transposed" in ran_paths()
    assert ran == expected
    assert any(n.startswith("flashsdpa::cpu_forward_transposed") for n in names) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transposed", [1, 0], ids=["transposed", "rows"])
def test_fused_exponentials_count_blocks(tier, transposed, dtype):
    """The fused exponentials run on the blocks every row sees whole (counted by the kernels),
    and turning them off changes nothing beyond rounding."""
    q, k, v = make_qkv(1, 2, 2, 200, 600, 32, dtype=dtype)
    outs = {}
    for fused in (1, 0):
        with _testing.policy(fused_exp=fused, transposed=transposed), _testing.counting() as n:
            outs[fused] = check_forward_backward(q, k, v, dtype, f"{tier} fused={fused}",
                                                 backward=False)
            blocks = n()["fused_exp_blocks"]
            can = "fused_exp" in ran_paths()
        assert (blocks > 0) == bool(fused and can), (fused, blocks)
    torch.testing.assert_close(outs[1], outs[0])  # the same sums, rounded apart


def test_fused_exponentials_skip_visibility_cut_blocks(tier):
    """Under causal only the blocks left of the diagonal fuse: fewer than without it."""
    q, k, v = make_qkv(1, 1, 1, 512, 512, 32)
    counts = {}
    for causal in (False, True):
        with _testing.policy(transposed=0), _testing.counting() as n:
            check_forward_backward(q, k, v, torch.float32, f"{tier} causal={causal}",
                                   backward=False, is_causal=causal)
            counts[causal] = n()["fused_exp_blocks"]
    if "fused_exp" in ran_paths():
        assert 0 < counts[True] < counts[False]
    else:
        assert counts == {False: 0, True: 0}


def test_whole_q_block(tier):
    """Short sequences take one q block per head when the items keep the threads busy; the
    output is bit-identical to the tier's q blocks."""
    q, k, v = make_qkv(2, 4, 4, 300, 300, 32)
    outs = {}
    with num_threads(2):
        for whole in (1, 0):
            with _testing.policy(whole_q=whole):
                outs[whole] = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
                pol = _testing.last_policy()
            assert pol["whole_q"] == bool(whole)
            assert (pol["bq"] >= 300) == bool(whole)
        with _testing.policy():
            flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert _testing.last_policy()["whole_q"]  # the plan's own choice for this shape
    assert torch.equal(outs[1], outs[0])
