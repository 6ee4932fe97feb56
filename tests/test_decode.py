"""The split-KV short-query (decode) path: q_len 1..16 against long KV caches, GQA folded into
the rows, padded cache views read in place, LSE right for the backward, splits merged by LSE."""
import pytest
import torch

import flashsdpa
from flashsdpa import _testing
from conftest import (DTYPE_IDS, DTYPES, assert_within_rule, check_forward_backward, make_qkv,
                      num_threads, reference_sdpa)


@pytest.fixture
def decode_path():
    with _testing.policy(decode=1):
        yield


def decode_ran(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.name.startswith("flashsdpa::cpu_decode_split") for e in prof.events())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [1, 2, 4, 8, 16])
def test_decode_q_lens(tier, lq, dtype):
    q, k, v = make_qkv(2, 8, 2, lq, 1000, 64, dtype=dtype)
    g = torch.Generator().manual_seed(lq)
    pad = torch.rand(2, 1, 1, 1000, generator=g) < 0.9
    pad[..., 0] = True
    assert decode_ran(lambda: flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    check_forward_backward(q, k, v, dtype, f"{tier} decode lq={lq}", attn_mask=pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group,lq,D", [(3, 1, 20), (3, 2, 20), (7, 1, 36), (5, 2, 8), (1, 3, 13),
                                         (1, 1, 160), (1, 2, 130), (4, 1, 100), (5, 1, 200)])
def test_decode_row_groups(tier, group, lq, dtype, D):
    """Folded row counts M = group * lq that leave every remainder of the 4-row Q.K kernel and
    of the P.V kernels' row groups (AVX2: pairs for fp32 / bf16, 6 for fp16 / float8; AVX-512:
    6), with head dims that end in a partial vector or take every pass width of the P.V kernels
    (128 / 64 / 32 / 16 dims, then the rest). 701 keys: the last block has an odd key count
    (the bf16 P.V kernel takes keys in pairs)."""
    q, k, v = make_qkv(1, 2 * group, 2, lq, 701, D, dtype=dtype, seed=group * 10 + lq)
    assert decode_ran(lambda: flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    check_forward_backward(q, k, v, dtype, f"{tier} decode M={group * lq} D={D}",
                           backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group,D", [(1, 128), (4, 64), (6, 96)])
@pytest.mark.parametrize("S", [257, 701])
def test_decode_last_key_weighs(tier, decode_path, group, D, S, dtype):
    """The last key of an odd-sized last block (the bf16 P.V kernel pairs keys) carries a large
    share of every row's weight (a float mask favours it), so dropping or mis-pairing it
    cannot hide inside the tolerance."""
    q, k, v = make_qkv(1, 2 * group, 2, 1, S, D, dtype=dtype, seed=S + D)
    mask = torch.full((1, 1, 1, S), -5.0)
    mask[..., -1] = 0.0
    check_forward_backward(q, k, v, dtype, f"{tier} last key S={S} M={group} D={D}",
                           attn_mask=mask, enable_gqa=True, backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group,D", [(16, 256), (12, 264), (5, 520), (2, 2056)])
def test_decode_many_rows_wide_heads(tier, decode_path, group, D, dtype):
    """Row counts beyond what the avx2 trait's bf16 Q.K puts in its chunk order at once (2048
    floats of q: 8 rows of D 256, 7 of 264, 3 of 520, none of 2056, which reads q as it is),
    so that the later rows read the block's K again; 16-dim chunks and a tail of 8 dims. The
    S = 301 keys end on a group of one key in Q.K and P.V."""
    q, k, v = make_qkv(1, 2 * group, 2, 1, 301, D, dtype=dtype, seed=group + D)
    assert decode_ran(lambda: flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    check_forward_backward(q, k, v, dtype, f"{tier} decode M={group} D={D}", enable_gqa=True,
                           backward=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
def test_padded_cache_views(tier, decode_path, layout, dtype):
    """A KV cache allocated for S_max positions, used up to `used`: read through its strides."""
    B, H, Hkv, D, S_max, used = 2, 8, 4, 48, 1500, 777
    g = torch.Generator().manual_seed(0)
    if layout == "BSHD":
        kc = torch.full((B, S_max, Hkv, D), float("nan")).to(dtype)
        vc = torch.full((B, S_max, Hkv, D), float("nan")).to(dtype)
        kc[:, :used] = torch.randn(B, used, Hkv, D, generator=g).to(dtype)
        vc[:, :used] = torch.randn(B, used, Hkv, D, generator=g).to(dtype)
        k, v = kc[:, :used].transpose(1, 2), vc[:, :used].transpose(1, 2)
    else:
        kc = torch.full((B, Hkv, S_max, D), float("nan")).to(dtype)
        vc = torch.full((B, Hkv, S_max, D), float("nan")).to(dtype)
        kc[:, :, :used] = torch.randn(B, Hkv, used, D, generator=g).to(dtype)
        vc[:, :, :used] = torch.randn(B, Hkv, used, D, generator=g).to(dtype)
        k, v = kc[:, :, :used], vc[:, :, :used]
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    check_forward_backward(q, k, v, dtype, f"{tier} cache {layout}", enable_gqa=True,
                           backward=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_matches_prefill_path_and_lse(tier, causal):
    q, k, v = make_qkv(1, 4, 4, 5, 2000, 32)
    mask = torch.randn(5, 2000)
    outs = {}
    for mode in ("always", "never"):
        with _testing.policy(decode=int(mode == "always")):
            outs[mode] = torch.ops.flashsdpa.flash_attn_fwd(q, k, v, mask, 0.0, causal)
            assert _testing.last_policy()["decode"] == (mode == "always")
    torch.testing.assert_close(outs["always"][0], outs["never"][0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(outs["always"][1], outs["never"][1], atol=2e-6, rtol=1e-5)


def test_masked_splits_and_rows(tier, decode_path):
    """Whole splits masked out, and a row with nothing visible at all (out 0, no NaN)."""
    q, k, v = make_qkv(1, 2, 2, 3, 3000, 16)
    mask = torch.zeros(3, 3000, dtype=torch.bool)
    mask[0, 2900:] = True       # only the last split is visible to row 0
    mask[1, :10] = True         # only the first
    out = flashsdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # row 2: nothing
    ref = reference_sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert_within_rule(out, torch.nan_to_num(ref.float()), ref, torch.float32, "masked splits")


def test_decode_deterministic_across_threads(tier, decode_path):
    q, k, v = make_qkv(2, 8, 2, 1, 5000, 64, dtype=torch.bfloat16)
    with num_threads(1):
        a = flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with num_threads(2):
        b = flashsdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.equal(a, b)


def test_dropout_takes_prefill_path(tier):
    q, k, v = make_qkv(1, 2, 2, 1, 300, 16)
    assert not decode_ran(lambda: flashsdpa.scaled_dot_product_attention(q, k, v, dropout_p=0.2))
