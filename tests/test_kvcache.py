"""Attention over a KV cache (flashsdpa.flash_attn_with_kvcache): contiguous and paged caches
(block sizes from 1 up, block tables in any order), per-sequence lengths, the in-place append
of new keys / values (exactly those slots), decode / speculative / chunked-prefill query counts
with bottom-right causal alignment and every variant, on every native and emulated tier,
against the fp64 reference over each sequence's keys; the checks, fake kernel and compile."""
import math

import pytest
import torch

import flashsdpa
from flashsdpa import _C, _testing
from conftest import DTYPE_IDS, assert_within_rule
from test_variants import assert_kernel_ran, reference
from flashsdpa._isa import cap

B, HQ, HKV, D, DV, LCACHE = 3, 4, 2, 32, 24, 150
SEQLENS = [37, 0, 101]  # tokens already cached per sequence (the second starts empty)


def make_cache(dtype, lq, n_new, seed=0, **variant):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, lq, HQ, D, generator=g).to(dtype)
    k_cache = torch.randn(B, LCACHE, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(B, LCACHE, HKV, DV, generator=g).to(dtype)
    k_new = torch.randn(B, n_new, HKV, D, generator=g).to(dtype) if n_new else None
    v_new = torch.randn(B, n_new, HKV, DV, generator=g).to(dtype) if n_new else None
    kw = dict(variant)
    if kw.get("alibi") == "BH":
        kw["alibi"] = torch.rand(B, HQ, generator=g) * 0.5
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(HQ, generator=g)
    return q, k_cache, v_cache, k_new, v_new, kw


def paged(cache, block_size, seed=1):
    """The same cache (B, Lcache, ...) as blocks of block_size rows in a shuffled pool with three
    spare blocks, every row no block of the cache fills NaN (0x7f bytes in float8):
    (pool, block_table). (Also fuzz_kvcache's.)"""
    B, L = cache.shape[:2]
    per_seq = -(-L // block_size)
    n_blocks = B * per_seq + 3
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    table = order[:B * per_seq].view(B, per_seq).to(torch.int32)
    pool = torch.full((n_blocks, block_size) + cache.shape[2:], float("nan"), dtype=cache.dtype)
    for b in range(B):
        for i in range(per_seq):
            rows = cache[b, i * block_size:(i + 1) * block_size]
            pool[table[b, i], :rows.shape[0]] = rows
    return pool, table


def unpage(pool, table):
    return torch.stack([pool[table[b].long()].flatten(0, 1)[:LCACHE] for b in range(B)])


def call(q, k_cache, v_cache, k_new, v_new, kw, block_table=None, seqlens=SEQLENS):
    return flashsdpa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, torch.tensor(seqlens, dtype=torch.int32),
        block_table, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
        return_lse=True)


def expected(q, k_cache, v_cache, k_new, v_new, kw, dtype, seqlens=SEQLENS):
    """Per sequence: the reference over its cached keys then the new ones, in `dtype`."""
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        keys, vals = k_cache[b, :n], v_cache[b, :n]
        if k_new is not None:
            keys, vals = torch.cat([keys, k_new[b]]), torch.cat([vals, v_new[b]])
        kw_b = dict(kw)
        if kw.get("alibi") is not None and kw["alibi"].dim() == 2:
            kw_b["alibi"] = kw["alibi"][b]
        o, lse = reference(q[b:b + 1].transpose(1, 2), keys[None].transpose(1, 2),
                           vals[None].transpose(1, 2), bottom_right=True, dtype=dtype, **kw_b)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


VARIANTS = {
    "causal": dict(causal=True),
    "window-softcap": dict(causal=True, window=(40, 0), softcap=2.0),
    "alibi-sinks": dict(alibi="BH", sinks=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [1, 4, 40])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kvcache_against_reference(tier, variant, block_size, lq, dtype):
    q, kc, vc, kn, vn, kw = make_cache(dtype, lq, lq, **VARIANTS[variant])
    want, want_lse = expected(q, kc, vc, kn, vn, kw, torch.float64)
    base, _ = expected(q, kc, vc, kn, vn, kw, dtype)
    table = None
    if block_size:
        (kc, table), (vc, _) = paged(kc, block_size), paged(vc, block_size)
    with _testing.counting() as counts:
        out, lse = call(q, kc, vc, kn, vn, kw, table)
        assert_kernel_ran(counts, tier, dtype)
        assert (counts()["decode_blocks"] > 0) == (lq <= 16)
    assert_out_lse(out, lse, base, want, want_lse, dtype, f"{tier} {variant} {block_size} lq={lq}")


def assert_out_lse(out, lse, base, want, want_lse, dtype, what):
    """out within the error rule of the fp64 reference (base: PyTorch's computation in dtype),
    lse close to the reference's."""
    assert_within_rule(out, base, want, dtype, what)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2 if dtype != torch.float32
                               else 1e-5, rtol=1e-3)


@pytest.mark.parametrize("block_size", [1, 7, 16, 48, 64, 256])
def test_kvcache_any_block_size(block_size):
    """Any block size, pages crossing the decode blocks at every offset: as the contiguous cache
    on the decode path (pages of 16k keys read in place, others copied a block at a time) and
    the prefill path (gathered)."""
    for lq in (2, 30):
        q, kc, vc, kn, vn, kw = make_cache(torch.float32, lq, 3, sinks=True, causal=True)
        ref, _ = call(q, kc.clone(), vc.clone(), kn, vn, kw)
        (kp, table), (vp, _) = paged(kc, block_size), paged(vc, block_size)
        with _testing.counting() as counts:
            out, _ = call(q, kp, vp, kn, vn, kw, table)
            assert (counts()["decode_blocks"] > 0) == (lq <= 16)
            assert (counts()["decode_gathered_blocks"] > 0) == (lq <= 16 and block_size % 16 != 0)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=f"block_size {block_size}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["fp32", "bf16", "e4m3"])
@pytest.mark.parametrize("block_size", [16, 48, 1024])
def test_kvcache_paged_in_place_is_the_contiguous_computation(tier, block_size, dtype):
    """A long cache read in place page by page, over many decode blocks whose prefetch targets
    lie in other pages (48 keys a page against blocks of 16k keys): bit for bit the contiguous
    cache's result, on every tier (the runs only change where the rows are read from). Both
    take each block's Q.K a sub-block at a time across the 8 kv heads (several sub-blocks a
    block; 1500 keys: the float8 cache's last block ends in a short one), and its P V so too or,
    where the plan says (pv_whole), per head over the block: both the same way."""
    g = torch.Generator().manual_seed(3)
    n_keys, hkv, d = 1500, 8, 128
    qdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(1, 1, 4 * hkv, d, generator=g).to(qdt)
    kc, vc = (torch.randn(1, n_keys, hkv, d, generator=g).to(dtype) for _ in range(2))
    scales = dict(k_scale=0.5, v_scale=0.25) if dtype == torch.float8_e4m3fn else {}
    per = -(-n_keys // block_size)
    order = torch.randperm(per + 2, generator=g)
    table = order[:per].view(1, per).to(torch.int32)
    pools = []
    for c in (kc, vc):
        pool = torch.zeros((per + 2, block_size, hkv, d), dtype=dtype)
        for i in range(per):
            rows = c[0, i * block_size:(i + 1) * block_size]
            pool[table[0, i], :rows.shape[0]] = rows
        pools.append(pool)
    seqlens = torch.tensor([n_keys], dtype=torch.int32)
    with _testing.counting() as counts:
        want = flashsdpa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **scales)
        assert counts()["decode_sub_blocks"] > counts()["decode_blocks"] > 1
    with _testing.counting() as counts:
        got = flashsdpa.flash_attn_with_kvcache(q, *pools, cache_seqlens=seqlens,
                                                block_table=table, **scales)
        assert counts()["decode_blocks"] > 1 and counts()["decode_gathered_blocks"] == 0
        assert counts()["decode_sub_blocks"] > counts()["decode_blocks"]
    assert torch.equal(got, want), f"{tier} block_size {block_size}: {(got - want).abs().max()}"


@pytest.mark.parametrize("block_size", [None, 5])
def test_kvcache_append_writes_exactly_the_new_slots(block_size):
    q, kc, vc, kn, vn, kw = make_cache(torch.bfloat16, 4, 6, causal=True)
    table = None
    if block_size:
        (kc, table), (vc, _) = paged(kc, block_size), paged(vc, block_size)
    before_k, before_v = kc.clone(), vc.clone()
    call(q, kc, vc, kn, vn, kw, table)
    # bit-exact, spare blocks' NaN included
    assert torch.equal(kc.view(torch.int16), appended(before_k, kn, table, block_size).view(torch.int16))
    assert torch.equal(vc.view(torch.int16), appended(before_v, vn, table, block_size).view(torch.int16))


def appended(cache, new, table, block_size, seqlens=SEQLENS):
    """cache with the rows of `new` (B, n, ...) written where the append puts them: after each
    sequence's `seqlens` tokens, through the block table when paged."""
    want = cache.clone()
    for b, n in enumerate(seqlens):
        for t in range(new.shape[1]):
            pos = n + t
            if table is None:
                want[b, pos] = new[b, t]
            else:
                want[table[b, pos // block_size], pos % block_size] = new[b, t]
    return want


def test_kvcache_without_new_tokens_and_whole_cache():
    """No k / v: attention over cache_seqlens keys; no cache_seqlens: over the whole cache."""
    q, kc, vc, _, _, kw = make_cache(torch.float32, 1, 0)
    out = flashsdpa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    ref = flashsdpa.flash_attn_func(q, kc[:, :5], vc[:, :5])
    torch.testing.assert_close(out, ref)
    out = flashsdpa.flash_attn_with_kvcache(q, kc, vc)
    torch.testing.assert_close(out, flashsdpa.flash_attn_func(q, kc, vc))


def test_kvcache_empty_sequence_rows():
    """A sequence with nothing cached and nothing appended: out 0, lse -inf (or the sink)."""
    q, kc, vc, _, _, _ = make_cache(torch.float32, 2, 0)
    seqlens = torch.tensor([3, 0, 9], dtype=torch.int32)
    out, lse = flashsdpa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                 return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    sinks = torch.tensor([0.5, 1.0, -1.0, 2.0])
    _, lse = flashsdpa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, sinks=sinks,
                                               return_lse=True)
    assert torch.equal(lse[1], sinks.view(4, 1).expand(4, 2))


def _bad(name):
    q, kc, vc, kn, vn, _ = make_cache(torch.float32, 1, 2)
    seq = torch.tensor(SEQLENS, dtype=torch.int32)
    (kp, table), (vp, _) = paged(kc, 16), paged(vc, 16)
    cases = {
        "seqlens beyond": ((q, kc, vc, kn, vn, torch.tensor([37, 0, 149], dtype=torch.int32)),
                           "cache_seqlens[2] = 149 plus the 2 new tokens must fit the cache (150"),
        "seqlens int64": ((q, kc, vc, kn, vn, seq.long()), "cache_seqlens must be an int32"),
        "no seqlens": ((q, kc, vc, kn, vn, None), "cache_seqlens is needed to append"),
        "k without v": ((q, kc, vc, kn, None, seq), "k and v must be given together"),
        "cache batch": ((q, kc[:2], vc[:2], kn, vn, seq), "k_cache must have q's batch size"),
        "cache dtype": ((q, kc.double(), vc.double(), kn, vn, seq),
                        "k_cache and v_cache must both have q's dtype"),
        "block out of range": ((q, kp, vp, kn, vn, seq, table.masked_fill(table == table[2, 3],
                                                                           999)),
                               "block_table[2, 3] = 999 is not a block of k_cache"),
        "table shape": ((q, kp, vp, kn, vn, seq, table[:2]), "block_table must be an int32"),
        "k shape": ((q, kc, vc, kn[:, :, :1], vn, seq), "k must be (batch, new tokens, kv heads"),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["seqlens beyond", "seqlens int64", "no seqlens", "k without v",
                                  "cache batch", "cache dtype", "block out of range",
                                  "table shape", "k shape"])
def test_kvcache_bad_arguments_name_the_argument(name):
    args, message = _bad(name)
    before = [a.clone() for a in args[1:3]]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        flashsdpa.flash_attn_with_kvcache(*args)
    for a, b in zip(args[1:3], before):  # nothing appended before the error
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


# ---- float8_e4m3fn caches ---------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


def quantize(x, scale):
    """What the append stores: round-to-nearest(x / scale), saturated to +-448 (scale: one
    element or one per kv head, x's dim -2)."""
    return (x.float() / scale.view(-1, 1)).clamp(-448, 448).to(E4M3)


def dequantize(x8, scale, dtype=torch.float64):
    return (x8.to(dtype) * scale.to(dtype).view(-1, 1))


def make_e4m3_cache(dtype, lq, per_head, **variant):
    """make_cache's tensors with a float8 cache quantised from them (values near each kv head's
    range, a few in e4m3's subnormal range) and its scales."""
    q, kc, vc, kn, vn, kw = make_cache(dtype, lq, lq, **variant)
    kc, vc = kc.float() * 3, vc.float() * 3
    kc[:, ::7, :, ::5] *= 1e-3  # e4m3 subnormals (below 2^-6 after the scale)
    scales = []
    for cache in (kc, vc):
        amax = cache.abs().amax(dim=(0, 1, 3)) / 448  # per kv head
        scales.append(amax if per_head else amax.max().reshape(()))
    return q, quantize(kc, scales[0]), quantize(vc, scales[1]), kn, vn, kw, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lq", [1, 4, 40])
@pytest.mark.parametrize("layout", ["contiguous-scalar", "paged16-per-head"])
@pytest.mark.parametrize("variant", ["causal", "alibi-sinks"])
def test_kvcache_e4m3_against_reference(tier, variant, layout, lq, dtype):
    """float8 caches against the fp64 reference over the dequantised values (the new keys /
    values as the append quantises them): short queries on the decode path, which widens the
    bytes in registers; longer chunks over keys dequantised to q's dtype first."""
    per_head = layout.endswith("per-head")
    q, kc, vc, kn, vn, kw, (ks, vs) = make_e4m3_cache(dtype, lq, per_head, **VARIANTS[variant])
    kn_q, vn_q = dequantize(quantize(kn, ks), ks), dequantize(quantize(vn, vs), vs)
    kc_d, vc_d = dequantize(kc, ks), dequantize(vc, vs)
    want, want_lse = expected(q, kc_d, vc_d, kn_q, vn_q, kw, torch.float64)
    base, _ = expected(q, kc_d.to(dtype), vc_d.to(dtype), kn_q.to(dtype), vn_q.to(dtype), kw, dtype)
    table = None
    if layout.startswith("paged"):
        (kc, table), (vc, _) = paged(kc, 16), paged(vc, 16)
    with _testing.counting() as counts:
        out, lse = flashsdpa.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, torch.tensor(SEQLENS, dtype=torch.int32), table,
            causal=kw.get("causal", False), alibi_slopes=kw.get("alibi"), sinks=kw.get("sinks"),
            k_scale=ks, v_scale=vs, return_lse=True)
        assert_kernel_ran(counts, tier, dtype)
        assert (counts()["decode_blocks"] > 0) == (lq <= 16)
    assert_out_lse(out, lse, base, want, want_lse, dtype, f"{tier} e4m3 {variant} {layout} lq={lq}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", [(32, 8, 1, 128, 128), (12, 2, 1, 64, 200), (4, 4, 2, 96, 72)],
                         ids=["gqa4-d128", "gqa6-dv200", "mha-lq2-dv72"])
def test_kvcache_e4m3_pv_in_fp16(tier, shape, dtype):
    """bf16 / fp16 queries over a float8 cache: P V in fp16 (AVX512-FP16; counted) where the plan
    takes it, the fp32 P V otherwise (forced off, fp32 queries, tiers or CPUs without it): both
    within the error rule of the fp64 reference over the dequantised cache. Long caches (runs of
    16 keys, chunks of 256, ragged ends), groups of 1 to 6 rows, every dims pass (128, 64, the
    rest)."""
    Hq, Hkv, lq, D, Dv = shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, lq, Hq, D, generator=g).to(dtype)
    kc, vc = torch.randn(2, 1100, Hkv, D, generator=g), torch.randn(2, 1100, Hkv, Dv, generator=g)
    ks, vs = (c.abs().amax(dim=(0, 1, 3)) / 448 for c in (kc, vc))
    k8, v8 = quantize(kc, ks), quantize(vc, vs)
    kd, vd = dequantize(k8, ks), dequantize(v8, vs)
    lens = [1100, 701]
    want, base = [], []
    for b, n in enumerate(lens):
        args = (q[b:b + 1].transpose(1, 2), kd[b:b + 1, :n].transpose(1, 2),
                vd[b:b + 1, :n].transpose(1, 2))
        want.append(reference(*args, dtype=torch.float64)[0].transpose(1, 2))
        base.append(reference(*(a.to(dtype) for a in args), dtype=dtype)[0].transpose(1, 2))
    want, base = torch.cat(want), torch.cat(base)
    for on in (1, 0):
        with _testing.policy(fp16_pv=on), _testing.counting() as counts:
            out = flashsdpa.flash_attn_with_kvcache(
                q, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32), k_scale=ks,
                v_scale=vs)
            assert_kernel_ran(counts, tier, dtype)
            ran = counts()["decode_fp16_pv_blocks"] > 0
            assert ran == _testing.last_policy()["fp16_pv"]
        if dtype == torch.float32 or not on:
            assert not ran
        elif tier == "avx512" and _C.cpu_features()["avx512_fp16"]:
            assert ran, "the plan did not take P V in fp16 where it should"
        assert_within_rule(out, base, want, dtype, f"{tier} {shape} fp16_pv={on} (ran: {ran})")


FAST_E4M3_CASES = {  # case -> (D, Dv, which path: fast, its NaN patch, the exact items)
    "fast": (128, 128, "fast"), "d96": (96, 64, "fast"), "nan": (128, 128, "patched"),
    "paged-nan": (128, 128, "patched"),
    "dims": (128, 72, "exact"), "large-q": (64, 64, "exact"), "daz": (128, 128, "exact"),
    "off": (128, 128, "exact")}


@pytest.mark.parametrize("case", FAST_E4M3_CASES)
def test_kvcache_e4m3_fast_widening(case):
    """The avx2 tier's float8 decode (Avx2E4m3Ops: bytes widened without F16C, exact, to the
    values x 2^-120, that unit folded into q and P) where it may run, counted per block; the
    items it may not take on its exact widening, counted: dims not multiples of 16, the path
    forced off and CPUs with denormal assists (the plan), |q| x 2^120 beyond fp32, MXCSR.DAZ on the thread (its subnormals are
    denormals; every V byte one here);
    NaN bytes, which it reads as numbers, set after its kernels where they are (counted). Each
    against the fp64 reference over the dequantised cache, NaN exactly where it has NaN; the
    fast widening bit for bit equal to the exact one (the units only move powers of 2)."""
    if not _C.cpu_features().get("avx2"):
        pytest.skip("the avx2 tier needs AVX2")
    D, Dv, path = FAST_E4M3_CASES[case]
    assists = _C.cpu_features()["denormal_assists"]  # (Intel: the plan keeps the exact one)
    if assists:
        path = "exact"
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, L, lens = 8, 2, 700, [700, 333]
    q = torch.randn(2, 1, Hq, D, generator=g)
    kc, vc = torch.randn(2, L, Hkv, D, generator=g), torch.randn(2, L, Hkv, Dv, generator=g)
    kc[:, ::5, :, ::3] *= 1e-3  # e4m3 subnormals among the values
    ks, vs = (c.abs().amax(dim=(0, 1, 3)) / 448 for c in (kc, vc))
    k8, v8 = quantize(kc, ks), quantize(vc, vs)
    u8 = torch.uint8
    if case.endswith("nan"):  # a K row of kv head 1 (its rows' every score NaN), a V element
        k8.view(u8)[0, 17, 1, 5] = 0xFF
        v8.view(u8)[1, 40, 0, 7] = 0x7F
    if case == "large-q":  # |q| x scale x log2(e) x k_scale x 2^120 past 2^126
        q = q * 1e5
    if case == "daz":  # every V byte subnormal: read as 0 under DAZ by the fast widening
        v8 = (torch.randint(1, 8, v8.shape, generator=g, dtype=u8)
              | (torch.randint(0, 2, v8.shape, generator=g, dtype=u8) << 7)).view(E4M3)
    kd, vd = dequantize(k8, ks), dequantize(v8, vs)
    table = None
    if case.startswith("paged"):  # blocks of 16 keys in a shuffled pool, read through the table
        order = torch.randperm(2 * 44, generator=g).view(2, 44)
        pad = lambda c: torch.cat([c, c[:, :4]], 1).view(2 * 44, 16, *c.shape[2:])  # noqa: E731
        k8, v8 = (torch.empty_like(pad(c).view(torch.uint8)).index_copy_(
            0, order.flatten(), pad(c).view(torch.uint8)).view(E4M3) for c in (k8, v8))
        table = order.to(torch.int32)
    want, base = [], []
    for b, n in enumerate(lens):
        args = (q[b:b + 1].transpose(1, 2), kd[b:b + 1, :n].transpose(1, 2),
                vd[b:b + 1, :n].transpose(1, 2))
        want.append(reference(*args, dtype=torch.float64)[0].transpose(1, 2))
        base.append(reference(*args, dtype=torch.float32)[0].transpose(1, 2))
    want, base = torch.cat(want), torch.cat(base)
    threads = torch.get_num_threads()
    daz = False
    try:
        if case == "daz":  # on the calling thread, which runs the items with one thread
            torch.set_num_threads(1)
            daz = torch.set_flush_denormal(True)
            if not daz:
                pytest.skip("this CPU cannot set DAZ")
        forced = {"e4m3_fast": 0} if case == "off" else {}
        with cap("avx2"), _testing.policy(**forced), _testing.counting() as counts:
            out = flashsdpa.flash_attn_with_kvcache(
                q, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                block_table=table, k_scale=ks, v_scale=vs)
            c = counts()
            chosen = _testing.last_policy()
    finally:
        if daz:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert chosen["tier"] == "avx2"
    assert chosen["e4m3_fast"] == (case not in ("dims", "off") and not assists)
    assert c["decode_blocks"] > 0
    if path != "exact":
        with cap("avx2"), _testing.policy(e4m3_fast=0):
            exact = flashsdpa.flash_attn_with_kvcache(
                q, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                block_table=table, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, exact, atol=0, rtol=0, equal_nan=True)
    if path == "exact":
        assert c["decode_e4m3_exact_items"] > 0 and c["decode_e4m3_fast_blocks"] == 0
    else:
        assert c["decode_e4m3_fast_blocks"] == c["decode_blocks"]
        assert c["decode_e4m3_exact_items"] == 0
        assert (c["decode_e4m3_nan_patched"] > 0) == (path == "patched")
    nan = want.isnan()  # (the reference's rows with a NaN score are 0, not NaN: set below)
    if case.endswith("nan"):  # kv head 1's rows of sequence 0; dim 7 of kv head 0's of sequence 1
        group = Hq // Hkv
        assert nan[1, :, :group, 7].all() and nan.sum() == group
        nan[0, :, group:] = True
    assert torch.equal(out.isnan(), nan), f"{case}: NaN where PyTorch has none, or not"
    assert_within_rule(out.masked_fill(nan, 0), base.masked_fill(nan, 0), want.masked_fill(nan, 0),
                       torch.float32, f"fast e4m3 widening: {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_kvcache_e4m3_widening_is_exact_for_every_byte(tier, dtype):
    """One key whose value row holds all 256 bytes: the output is that row, widened and scaled
    exactly as PyTorch converts float8_e4m3fn (the two NaN bytes give NaN), with fp32 queries
    (widened to fp32) and bf16 ones (the bf16 tiers' byte tables)."""
    v8 = torch.arange(256, dtype=torch.uint8).view(E4M3).view(1, 1, 1, 256)
    k8 = torch.zeros(1, 1, 1, 16, dtype=E4M3)
    q = torch.randn(1, 1, 1, 16).to(dtype)
    for v_scale in (1.0, 0.37):
        with _testing.counting() as counts:
            out = flashsdpa.flash_attn_with_kvcache(q, k8, v8, k_scale=2.0, v_scale=v_scale)
            assert_kernel_ran(counts, tier, dtype)
        want = (v8.float() * torch.tensor(v_scale)).to(dtype)
        torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)
    # K: each score is q . k exactly, which the lse of a single key is
    k8 = torch.arange(128, dtype=torch.uint8).view(E4M3).view(128, 1, 1, 1)  # every magnitude
    q = torch.ones(128, 1, 1, 1, dtype=dtype)
    _, lse = flashsdpa.flash_attn_with_kvcache(q, k8, torch.zeros(128, 1, 1, 4, dtype=E4M3),
                                               k_scale=0.5, return_lse=True, softmax_scale=1.0)
    want = (k8.float() * 0.5).view(128, 1, 1)
    finite = want.isfinite()  # (lse passes through log2 units: rounding, not widening error)
    torch.testing.assert_close(lse[finite], want[finite], atol=1e-30, rtol=1e-6)
    # K again through a group of 16 rows (4 query heads x 4 queries on one kv head; the avx2 tier
    # widens such groups of 4 keys once for all rows) with 16 dims: row r's query is one-hot on
    # dim r, and each sequence's 4 keys are copies of one row of bytes, so that row r's lse is
    # that row's byte at dim r (x k_scale) + ln 4. Every byte but the two NaN ones, whose row's
    # every score is NaN (0 x NaN): rows 7 and 15 of the 256 bytes, left out.
    rows = torch.arange(256, dtype=torch.uint8).view(16, 16)[[i for i in range(16) if i % 8 != 7]]
    k8 = rows.view(E4M3).view(14, 1, 1, 16).expand(14, 4, 1, 16).contiguous()
    q = torch.eye(16, dtype=dtype).view(1, 4, 4, 16).transpose(1, 2).expand(14, 4, 4, 16)
    _, lse = flashsdpa.flash_attn_with_kvcache(q, k8, torch.zeros(14, 4, 1, 4, dtype=E4M3),
                                               k_scale=0.5, return_lse=True, softmax_scale=1.0)
    want = (rows.view(E4M3).double() * 0.5).view(14, 4, 4) + math.log(4)  # (b, head h, query i)
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("block_size", [None, 5])
def test_kvcache_e4m3_append_stores_the_quantised_values(block_size):
    """k / v appended to a float8 cache: exactly those slots, round-to-nearest(value / scale)
    saturated to +-448 (values far out of range included), every other byte untouched."""
    q, kc, vc, kn, vn, _, (ks, vs) = make_e4m3_cache(torch.bfloat16, 4, per_head=True)
    kn = kn.clone()
    kn[0, 0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturates to 448, -448
    table = None
    if block_size:
        (kc, table), (vc, _) = paged(kc, block_size), paged(vc, block_size)
    before_k, before_v = kc.clone(), vc.clone()
    flashsdpa.flash_attn_with_kvcache(q, kc, vc, kn, vn, torch.tensor(SEQLENS, dtype=torch.int32),
                                      table, causal=True, k_scale=ks, v_scale=vs)
    kq, vq = quantize(kn, ks).view(torch.uint8), quantize(vn, vs).view(torch.uint8)
    assert kq[0, 0, 0, :2].tolist() == [0x7E, 0xFE]
    u8 = torch.uint8
    assert torch.equal(kc.view(u8), appended(before_k.view(u8), kq, table, block_size))
    assert torch.equal(vc.view(u8), appended(before_v.view(u8), vq, table, block_size))


def test_kvcache_e4m3_nan_in_a_visible_key_gives_nan():
    """A NaN byte among a sequence's visible keys reaches that sequence's rows (of its kv head),
    as it would through the dequantised reference; keys beyond cache_seqlens are never read."""
    q, kc, vc, _, _, _ = make_cache(torch.float32, 1, 0)
    kc8, vc8 = quantize(kc, torch.tensor(0.05)), quantize(vc, torch.tensor(0.05))
    nan = torch.tensor(0x7F, dtype=torch.uint8).view(E4M3)
    kc8[0, 10, 1, 3] = nan  # visible for sequence 0 (37 keys)
    kc8[2, 120, :, :] = nan  # beyond sequence 2's 101 keys
    out = flashsdpa.flash_attn_with_kvcache(q, kc8, vc8, cache_seqlens=torch.tensor(
        SEQLENS, dtype=torch.int32), k_scale=0.05, v_scale=0.05)
    group = HQ // HKV
    assert out[0, :, group:].isnan().all() and not out[0, :, :group].isnan().any()
    assert not out[2].isnan().any()


def test_kvcache_e4m3_bad_scales_name_the_argument():
    q, kc, vc, kn, vn, _, (ks, vs) = make_e4m3_cache(torch.float32, 1, per_head=True)
    seq = torch.tensor(SEQLENS, dtype=torch.int32)
    cases = [
        (dict(k_scale=torch.ones(HKV + 1)), "k_scale must be a float32 CPU tensor with one "
                                            "element or one per kv head"),
        (dict(v_scale=torch.ones(HKV, dtype=torch.float64)), "v_scale must be a float32"),
        (dict(k_scale=torch.ones(1, HKV)), "k_scale must be a float32"),
    ]
    for kwargs, message in cases:
        before = kc.clone()
        with pytest.raises(ValueError, match=message):
            flashsdpa.flash_attn_with_kvcache(q, kc, vc, kn, vn, seq, **kwargs)
        assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))  # nothing written
    qf, kf, vf, _, _, _ = make_cache(torch.float32, 1, 0)
    with pytest.raises(ValueError, match="k_scale is for float8_e4m3fn caches only"):
        flashsdpa.flash_attn_with_kvcache(qf, kf, vf, k_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="k_cache and v_cache must both have q's dtype"):
        flashsdpa.flash_attn_with_kvcache(q, kc, vc.float(), cache_seqlens=seq)
    with pytest.raises(ValueError, match="k and v must have q's dtype"):
        flashsdpa.flash_attn_with_kvcache(q, kc, vc, kn.double(), vn.double(), seq)


def test_kvcache_opcheck():
    q, kc, vc, kn, vn, kw = make_cache(torch.float32, 2, 2, alibi="BH", sinks=True)
    seq = torch.tensor(SEQLENS, dtype=torch.int32)
    (kp, table), (vp, _) = paged(kc.nan_to_num(), 16), paged(vc.nan_to_num(), 16)
    kp, vp = kp.nan_to_num(), vp.nan_to_num()
    for args in ((q, kc, vc, kn, vn, seq, None), (q, kp, vp, kn, vn, seq, table)):
        torch.library.opcheck(torch.ops.flashsdpa.flash_attn_with_kvcache.default, args,
                              dict(causal=True, window_left=20, alibi_slopes=kw["alibi"],
                                   sinks=kw["sinks"]))
    q, kc8, vc8, kn, vn, _, (ks, vs) = make_e4m3_cache(torch.bfloat16, 1, per_head=True)
    # (test_schema compares the outputs with ops PyTorch lacks for float8 tensors)
    torch.library.opcheck(torch.ops.flashsdpa.flash_attn_with_kvcache.default,
                          (q, kc8, vc8, kn, vn, seq, None), dict(k_scale=ks, v_scale=vs),
                          test_utils=("test_faketensor", "test_autograd_registration"))


def test_kvcache_compile_keeps_the_append():
    """Under torch.compile(fullgraph=True) the call is one node and the cache mutation is kept:
    the compiled step leaves the same cache and output as the eager one."""
    import torch._dynamo.testing
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(q, kc, vc, kn, vn, seq):
        return flashsdpa.flash_attn_with_kvcache(q, kc, vc, kn, vn, seq, causal=True)

    cstep = torch.compile(step, backend=cnt, fullgraph=True)
    q, kc, vc, kn, vn, _ = make_cache(torch.float32, 1, 1)
    seq = torch.tensor(SEQLENS, dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = cstep(q, kc, vc, kn, vn, seq)
    ref = step(q, kc2, vc2, kn, vn, seq)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    ops = [n.target for n in cnt.graphs[-1].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashsdpa.flash_attn_with_kvcache.default in ops, ops
