"""Test and tuning hooks (not public API): context managers over flashsdpa._C.testing.

    with policy(prepack=0, fwd_bq=64): ...   # force parts of the kernel policy (csrc/plan.h)
    last_policy()                            # the policy of this thread's last CPU call
    with counting() as counts: ...; counts() # fast paths taken inside the kernels
    with emulated("avx512"): ...             # the SIMDe build of a tier
    with poisoned(): ...                     # outputs and scratch start as NaN
Every context restores what it found on exit. Policy fields: decode, transposed, prepack,
fused_exp, whole_q, fused_bwd, fused_rows, fused_sdp, fp16_pv, e4m3_fast, near_pf, pv_whole
(1 on, 0 off, -1 the plan's choice) and fwd_bq, fwd_bk, bwd_bq, bwd_bk (block sizes, 0 the
plan's choice).
"""
import contextlib

from . import _C
from ._common import swapped

_T = _C.testing
decode_features = _T.decode_features
choose_isa = _T.choose_isa  # (raw CPUID words, dtype, kv_e4m3, call): the tier chosen there
dropout_keep_mask = _T.dropout_keep_mask
exp2_row_sum = _T.exp2_row_sum
softcap_row = _T.softcap_row
item_queue_sequence = _T.item_queue_sequence  # driver.cpp ItemQueue: next(t) for t in callers
item_queue_drain = _T.item_queue_drain  # every queue thread at once: each one's items
last_policy = _T.last_policy
set_policy = _T.set_policy  # a dict of policy fields, replacing what is forced ({}: nothing)


def policy(**fields):
    """Parts of the kernel policy forced inside the block (on top of what is already forced)."""
    return swapped(_T.policy, _T.set_policy, dict(_T.policy(), **fields))


@contextlib.contextmanager
def counting():
    """Counts the fast paths the kernels take inside the block (from zero), and times the
    prefill forward's steps (fwd_*_ns, summed over threads); yields a function that returns
    the counts so far (a dict)."""
    with swapped(lambda: False, _T.set_path_counting, True):
        yield _T.path_counts


def emulated(tier):
    """The SIMDe-emulated build of `tier` runs the dtypes it implements inside the block."""
    return swapped(_T.emulated_tier, lambda t: _T.set_emulated_tier(t or ""), tier)


def poisoned(on=True):
    """Every output and scratch buffer of the CPU kernels starts as NaN inside the block."""
    return swapped(_T.debug_poison, _T.set_debug_poison, on)
