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


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("forced", [None, 0], ids=["plan", "off"])
def test_transposed_scores(tier, forced, causal):
    """fp32 without mask / dropout / variant (causal or not): the transposed-score forward where
    the tier has it."""
    q, k, v = make_qkv(2, 3, 3, 150, 300, 64)  # several kv blocks, a ragged q block
    overrides = {} if forced is None else {"transposed": forced}
    with _testing.policy(**overrides):
        names = profiled_events(lambda: check_forward_backward(
            q, k, v, torch.float32, f"{tier} transposed={forced}", backward=False,
            is_causal=causal))
        ran = _testing.last_policy()["transposed"]
        expected = forced is None and "transposed" in ran_paths()
    assert ran == expected
    assert any(n.startswith("flashsdpa::cpu_forward_transposed") for n in names) == expected


def test_transposed_scores_only_on_short_q_blocks(tier):
    """The plan takes the transposed scores on q blocks of up to 256 rows: lengths that may
    take a whole-q block of more (256 < Lq <= 512) take the row path at any thread count;
    forcing it on such a block still runs it, and gives the row path's output up to
    rounding."""
    for threads in (1, 2):  # 3 heads: a whole-q block on 1 thread, not on 2
        with num_threads(threads):
            for lq, short in ((256, True), (300, False), (1024, True)):  # (1024: blocks of 192)
                q, k, v = make_qkv(1, 3, 3, lq, lq, 32)
                with _testing.policy():
                    flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
                    pol = _testing.last_policy()
                assert pol["whole_q"] == (lq <= 512 and threads == 1), (lq, pol)
                assert pol["transposed"] == (short and "transposed" in ran_paths()), (lq, pol)
    q, k, v = make_qkv(1, 2, 2, 300, 300, 32)
    with num_threads(2):  # (2 heads: a whole-q block of 300 rows)
        outs = {}
        for forced in (1, 0):
            with _testing.policy(transposed=forced):
                outs[forced] = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
                assert _testing.last_policy()["transposed"] == bool(
                    forced and "transposed" in ran_paths())
    torch.testing.assert_close(outs[1], outs[0])


def assert_paths_close(fused, two_pass):
    """A fused path against the row passes it replaces: the same sums, rounded apart. The bf16
    tiers round P (and dS) to bf16 for the GEMMs after it, from values computed in another
    order in each (the forward's exponentials relative to the earlier blocks' max, not the
    row's; the backward's scale applied in one fma, not a product then a difference): apart by
    up to an ulp of bf16 at the tensor's scale. 16-bit inputs' fused exponentials take the
    degree-3 polynomial (kExp2DegreeP, 7.5e-5 relative) where the row passes take the full one:
    fp16 outputs apart by up to an ulp of fp16."""
    tol = {}
    if fused.dtype == torch.bfloat16:
        tol = dict(rtol=1.6e-2, atol=2.0 ** -8 * float(two_pass.abs().max()))
    elif fused.dtype == torch.float16:
        tol = dict(rtol=2.0e-3, atol=2.0 ** -11 * float(two_pass.abs().max()))
    torch.testing.assert_close(fused, two_pass, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("transposed", [1, 0], ids=["transposed", "rows"])
def test_fused_exponentials_count_blocks(tier, transposed, dtype):
    """The fused exponentials run on the blocks every row sees whole (counted by the kernels),
    and turning them off changes nothing beyond rounding (16-bit inputs: P's polynomial of
    degree 3 there, kExp2DegreeP)."""
    q, k, v = make_qkv(1, 2, 2, 200, 600, 32, dtype=dtype)
    outs = {}
    for fused in (1, 0):
        with _testing.policy(fused_exp=fused, transposed=transposed), _testing.counting() as n:
            outs[fused] = check_forward_backward(q, k, v, dtype, f"{tier} fused={fused}",
                                                 backward=False)
            blocks = n()["fused_exp_blocks"]
            can = "fused_exp" in ran_paths()
        assert (blocks > 0) == bool(fused and can), (fused, blocks)
    assert_paths_close(outs[1], outs[0])



@pytest.mark.parametrize("dims", [(64, 64), (64, 40)], ids=["d64", "dv40"])
@pytest.mark.parametrize("forced", [None, 0], ids=["plan", "off"])
def test_e4m3_fast_widening(tier, forced, dims):
    """Decode over a float8 cache: the tier's fast widening where it has one and the plan takes
    it (dims in multiples of 16, a CPU without denormal assists), counted by the kernels, bit for bit what the exact widening
    gives (its units only move powers of 2)."""
    D, Dv = dims
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, D, generator=g)
    k8 = (torch.randn(2, 300, 2, D, generator=g) * 50).to(torch.float8_e4m3fn)
    v8 = (torch.randn(2, 300, 2, Dv, generator=g) * 50).to(torch.float8_e4m3fn)
    outs = {}
    for f in (forced, 0):
        with _testing.policy(**({} if f is None else {"e4m3_fast": f})), \
                _testing.counting() as n:
            outs[f] = flashsdpa.flash_attn_with_kvcache(q, k8, v8, k_scale=0.02, v_scale=0.03)
            ran, counts = _testing.last_policy()["e4m3_fast"], n()
            expected = (f is None and "e4m3_fast" in ran_paths() and D % 16 == 0 and Dv % 16 == 0
                        and not _C.cpu_features()["denormal_assists"])
        assert counts["decode_blocks"] > 0 and ran == expected
        assert (counts["decode_e4m3_fast_blocks"] > 0) == expected
    torch.testing.assert_close(outs[forced], outs[0], atol=0, rtol=0)

def kvcache_case(cache, g, dtype=torch.bfloat16):
    """A decode call over flash-attn's caches: q (2, 1, 8, 64) over 700 keys of 2 kv heads,
    (B, L, Hkv, D) in memory ("keys-major"), (B, Hkv, L, D) ("heads-major"), paged in pages of
    16 or 5 keys ("paged", "small-pages", block tables out of order) or float8 ("float8"):
    flash_attn_with_kvcache's arguments (q, k_cache, v_cache, keywords)."""
    B, L, Hkv, D = 2, 700, 2, 64
    q = torch.randn(B, 1, 8, D, generator=g).to(dtype)
    dt = torch.float8_e4m3fn if cache == "float8" else dtype
    k, v = (torch.randn(B, L, Hkv, D, generator=g).to(dt) for _ in range(2))
    kw = dict(k_scale=0.5, v_scale=0.5) if cache == "float8" else {}
    if cache == "heads-major":  # (B, Hkv, L, D) in memory
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    if cache in ("paged", "small-pages"):
        bs = 16 if cache == "paged" else 5
        order = torch.randperm(B * -(-L // bs), generator=g)
        table = order.view(B, -1).to(torch.int32)
        pools = []
        for x in (k, v):
            pool = torch.zeros((table.numel(), bs, Hkv, D), dtype=x.dtype)
            for b in range(B):
                for i in range(table.shape[1]):
                    rows = x[b, i * bs:(i + 1) * bs]
                    pool[table[b, i], :rows.shape[0]] = rows
            pools.append(pool)
        k, v = pools
        kw["block_table"] = table
    kw["cache_seqlens"] = torch.full((B,), L, dtype=torch.int32)
    return q, k, v, kw


def assert_same_to_bf16_rounding(a, b):
    """Two bf16 results of the same sums in another order: one unit in the last place apart at
    most, plus what the fp32 sums' own difference leaves on outputs that cancel to near 0."""
    a, b = a.float(), b.float()
    bound = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 1e-6
    assert bool(((a - b).abs() <= bound).all()), ((a - b).abs() - bound).max()


@pytest.mark.parametrize("cache", ["heads-major", "keys-major", "paged", "small-pages", "float8"])
def test_near_prefetch(tier, cache):
    """Decode's near prefetches (a sub-block ahead, non-temporal: KernelPolicy::near_pf) where
    the tier's trait has them and the cache is not float8, counted per block (not on blocks
    copied from small pages, which the copy prefetches). Prefetches never change a sum: bit for
    bit the block-ahead ones' output, but where items take every kv head of keys read in place
    ((B, L, Hkv, D), paged or not): there near prefetching holds no block in L2 and a block is
    one head's share of keys (FlashDecode::block_keys), longer than the block-ahead ones (fewer
    blocks), so the online softmax runs in another order and the outputs agree to their rounding
    (assert_same_to_bf16_rounding)."""
    q, k, v, kw = kvcache_case(cache, torch.Generator().manual_seed(5))
    outs, blocks = {}, {}
    for forced in (None, 0):
        with _testing.policy(**({} if forced is None else {"near_pf": forced})), \
                _testing.counting() as n:
            outs[forced] = flashsdpa.flash_attn_with_kvcache(q, k, v, **kw)
            ran, c = _testing.last_policy()["near_pf"], n()
        expected = forced is None and "near_pf" in ran_paths() and cache != "float8"
        assert c["decode_blocks"] > 0 and ran == expected, (ran, c)
        assert (c["decode_near_pf_blocks"] > 0) == (expected and cache != "small-pages"), c
        assert c["decode_near_pf_blocks"] + c["decode_gathered_blocks"] <= c["decode_blocks"]
        blocks[forced] = c["decode_blocks"]
    longer = "near_pf" in ran_paths() and cache in ("keys-major", "paged")
    assert (blocks[None] < blocks[0]) == longer, blocks
    if not longer:
        torch.testing.assert_close(outs[None], outs[0], atol=0, rtol=0)
    else:
        assert_same_to_bf16_rounding(outs[None], outs[0])


def test_near_blocks_hold_scores(tier):
    """Near prefetching's longer blocks for items taking every kv head (FlashDecode::block_keys)
    stop where the block's scores, every head's rows, would outgrow the block's share of L2:
    16 queries a head (128 rows a kv head here) take more, shorter blocks than one query over
    the same cache, and both give what the block-ahead prefetches' blocks give, to the output's
    rounding."""
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(1, 1024, 8, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    blocks = {}
    for lq in (1, 16):
        q = torch.randn(1, lq, 64, 64, generator=g).to(torch.bfloat16)
        outs = {}
        for forced in (None, 0):
            with _testing.policy(**({} if forced is None else {"near_pf": forced})), \
                    _testing.counting() as n:
                outs[forced] = flashsdpa.flash_attn_with_kvcache(q, k, v, causal=True)
                if forced is None:
                    near = _testing.last_policy()["near_pf"]
                    blocks[lq] = n()["decode_blocks"]
        assert_same_to_bf16_rounding(outs[None], outs[0])
    assert (blocks[16] > blocks[1]) == (near and "near_pf" in ran_paths()), (blocks, near)


@pytest.mark.parametrize("cache", ["heads-major", "keys-major", "paged", "small-pages", "float8",
                                   "keys-major-fp32"])
def test_whole_block_pv(tier, cache):
    """Items taking every kv head of a (B, L, Hkv, D) cache: P V per head over the whole block
    (KernelPolicy::pv_whole) where the tier's trait wants it and prefetches run a block ahead,
    counted per block with sub-blocks (several a block here: each asserted); a (B, Hkv, L, D)
    cache's items take one head and no sub-blocks. The same sums in the same order: bit for bit
    the sub-block order's output."""
    dtype = torch.float32 if cache.endswith("fp32") else torch.bfloat16
    q, k, v, kw = kvcache_case(cache.replace("-fp32", ""), torch.Generator().manual_seed(6), dtype)
    outs = {}
    for forced in (None, 0):
        with _testing.policy(**({} if forced is None else {"pv_whole": forced})), \
                _testing.counting() as n:
            outs[forced] = flashsdpa.flash_attn_with_kvcache(q, k, v, **kw)
            pol, c = _testing.last_policy(), n()
        expected = forced is None and "pv_whole" in ran_paths() and not pol["near_pf"]
        assert c["decode_blocks"] > 0 and pol["pv_whole"] == expected, (pol, c)
        all_heads = cache != "heads-major"
        assert (c["decode_sub_blocks"] > c["decode_blocks"]) == all_heads, c
        assert c["decode_pv_whole_blocks"] == (c["decode_blocks"] if expected and all_heads
                                               else 0), c
    torch.testing.assert_close(outs[None], outs[0], atol=0, rtol=0)


# name -> (Lq, Lk, flash_attn_func keywords): blocks a band's edge crosses, several kv blocks
# of whole panels (D = 32: bk = 256), ragged q blocks
BAND_CASES = {
    "causal": (515, 515, dict(causal=True)),
    "causal-bottom-right": (300, 812, dict(causal=True)),
    "causal-bottom-right-empty-rows": (600, 260, dict(causal=True)),  # rows < 340 see nothing
    "window": (520, 520, dict(window_size=(100, 40))),
    "window-causal": (640, 640, dict(causal=True, window_size=(300, 0))),
}


@pytest.mark.parametrize("dtype, transposed", [(torch.float32, 1), (torch.float32, 0),
                                               (torch.bfloat16, 0)],
                         ids=["fp32-transposed", "fp32-rows", "bf16-rows"])
@pytest.mark.parametrize("case", list(BAND_CASES))
def test_fused_exponentials_on_band_blocks(tier, case, dtype, transposed):
    """The fused exponentials also run on the kv blocks a band's edge crosses (causal diagonal,
    bottom-right, windows; counted by the kernels), in the row and (fp32) the transposed-score
    path, within the rule against the fp64 reference, and equal to the two-pass path up to
    rounding."""
    from test_variants import check  # the variants' checks against their fp64 reference
    lq, lk, kw = BAND_CASES[case]
    q, k, v = make_qkv(1, 2, 2, lq, lk, 32, dtype=dtype)
    run = lambda q, k, v, _kw: flashsdpa.flash_attn_func(  # noqa: E731
        *(t.transpose(1, 2) for t in (q, k, v)), **kw).transpose(1, 2)
    ref_kw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))
    outs = {}
    for fused in (1, 0):
        with _testing.policy(fused_exp=fused, transposed=transposed), _testing.counting() as n:
            outs[fused] = check(q, k, v, ref_kw, dtype, f"{tier} {case} fused={fused}", run=run,
                                bottom_right=True, backward=False)
            c = n()
            can = "fused_exp" in ran_paths()
            assert _testing.last_policy()["transposed"] == bool(
                transposed and "transposed" in ran_paths())
        assert (c["fused_exp_band_blocks"] > 0) == bool(fused and can), (fused, c)
        assert c["fused_exp_band_blocks"] <= c["fused_exp_blocks"]
    assert_paths_close(outs[1], outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["full"] + list(BAND_CASES))
def test_backward_fused_rows(tier, case, dtype):
    """The backward makes P and dS per S / dP GEMM tile (every tier but AMX:
    fused_bwd_rows; counted by the kernels), on the tiles a band's edge crosses too; gradients
    within the rule against the fp64 reference, and equal to the per-row path's up to
    rounding."""
    from test_variants import check
    lq, lk, kw = BAND_CASES.get(case, (300, 512, {}))
    q, k, v = make_qkv(1, 2, 2, lq, lk, 32, dtype=dtype)
    run = lambda q, k, v, _kw: flashsdpa.flash_attn_func(  # noqa: E731
        *(t.transpose(1, 2) for t in (q, k, v)), **kw).transpose(1, 2)
    ref_kw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))
    grads = {}
    for fused in (1, 0):
        with _testing.policy(fused_rows=fused), _testing.counting() as n:
            check(q, k, v, ref_kw, dtype, f"{tier} {case} fused_rows={fused}", run=run,
                  bottom_right=True)
            c = n()
            can = "fused_bwd_rows" in ran_paths()
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves, {})
            grads[fused] = torch.autograd.grad(out, leaves, torch.ones_like(out))
        assert (c["bwd_fused_tiles"] > 0) == bool(fused and can), (fused, c)
        assert c["bwd_fused_tiles"] <= c["bwd_tiles"]
    for a, b in zip(grads[1], grads[0]):
        assert_paths_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [0.0, -0.3], ids=["zero", "negative"])
@pytest.mark.parametrize("dv", [16, 24], ids=["dv=d", "dv!=d"])
def test_backward_fused_rows_scale_sign(tier, dtype, scale, dv):
    """The fused backward rows with a scale of 0 or below 0 on a causal tile whose band leaves
    columns unseen (5 queries, 64 keys: keys 5.. seen by none): P off the band is 0, not the
    exponential of the -inf a band fill would give (-inf * 0 = NaN, -inf * -0.3 = +inf), with
    S and dP in one micro-tile (D == Dv, bwd_sdp tiers) and in two passes (D != Dv); every
    output and scratch buffer starting as NaN."""
    q, k, v = make_qkv(1, 1, 1, 5, 64, 16, Dv=dv, dtype=dtype)
    with _testing.poisoned(), _testing.counting() as n:
        check_forward_backward(q, k, v, dtype, f"{tier} scale={scale} dv={dv}", is_causal=True,
                               scale=scale)
        c = n()
    can = "fused_bwd_rows" in ran_paths() and _testing.last_policy()["fused_rows"]
    assert (c["bwd_fused_tiles"] > 0) == can, c


# name -> (Hq, Hkv, Lq, Lk, D, Dv, flash_attn_func / SDPA keywords) for the sdp tiles: ragged
# row groups (an odd last group pairs its row with zeros), GQA, bands, and a Dv != D call
# that keeps the two GEMMs
SDP_CASES = dict({"full": (2, 2, 301, 512, 32, 32, {}), "gqa-d64": (4, 2, 97, 256, 64, 64, {}),
                  "dv": (2, 2, 130, 256, 64, 32, {})},
                 **{k: (2, 2, lq, lk, 32, 32, kw) for k, (lq, lk, kw) in BAND_CASES.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(SDP_CASES))
def test_backward_sdp_tiles(tier, case, dtype):
    """The backward on a tier with bwd_sdp: S and dP run in one micro-tile whose P and dS go
    from its registers into the dV, dK and dQ GEMMs' operands (counted by the kernels; not
    where Dv != D); gradients within the rule against the fp64 reference, and those of the two
    GEMM passes it replaces: bit for bit with fp32 operands, up to rounding with bf16 ones
    (whose P exponent is the forward's bf16 polynomial there); every output and scratch buffer
    starting as NaN."""
    from test_variants import check
    hq, hkv, lq, lk, d, dv, kw = SDP_CASES[case]
    q, k, v = make_qkv(1, hq, hkv, lq, lk, d, dtype=dtype)
    v = v[..., :dv].contiguous() if dv != d else v
    if dv != d:  # (flash_attn_func takes one head dim)
        run = lambda q, k, v, _kw: flashsdpa.scaled_dot_product_attention(  # noqa: E731
            q, k, v, enable_gqa=hq != hkv)
        ref_kw = {}
    else:
        run = lambda q, k, v, _kw: flashsdpa.flash_attn_func(  # noqa: E731
            *(t.transpose(1, 2) for t in (q, k, v)), **kw).transpose(1, 2)
        ref_kw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))
    grads = {}
    for on in (1, 0):
        with _testing.policy(fused_sdp=on), _testing.counting() as n, _testing.poisoned():
            if dv == d:
                check(q, k, v, ref_kw, dtype, f"{tier} {case} fused_sdp={on}", run=run,
                      bottom_right=True)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves, {})
            grads[on] = torch.autograd.grad(out, leaves, out.detach().cos())
            c = n()
            can = "bwd_sdp" in ran_paths() and _testing.last_policy()["fused_rows"]
            ran = _testing.last_policy()["tier"]
        assert (c["bwd_sdp_tiles"] > 0) == bool(on and can and dv == d), (on, c)
        assert c["bwd_sdp_tiles"] <= c["bwd_fused_tiles"] <= c["bwd_tiles"]
    for a, b in zip(grads[1], grads[0]):
        assert not a.isnan().any()
        if ran == "avx512_bf16":  # (bf16 operands, its own P exponent)
            assert_paths_close(a, b)
        else:
            assert torch.equal(a, b)


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


@pytest.mark.parametrize("case", ["transposed", "rows-prepack", "causal-bf16", "decode"])
def test_step_clocks_account_for_the_forward(tier, case):
    """The step clocks (counting on: nanoseconds summed over threads; bench/phase_profile.py):
    of the prefill forward (fwd_pack / scores / softmax / pv) and of decode (decode_qk /
    softmax / pv): every step of the path that ran is timed, the other kernel's steps not at
    all, and their sum fits in the call's wall time times the threads."""
    import time
    dtype = torch.bfloat16 if case == "causal-bf16" else torch.float32
    lq = 1 if case == "decode" else 300
    q, k, v = make_qkv(1, 4, 2 if case == "rows-prepack" else 4, lq, 600, 64, dtype=dtype)
    overrides = {"transposed": 1 if case == "transposed" else 0}
    steps = ("pack", "scores", "softmax", "pv")
    with _testing.policy(**overrides), _testing.counting() as counts:
        t0 = time.perf_counter_ns()
        torch.ops.flashsdpa.flash_attn_fwd(q, k, v, is_causal=case == "causal-bf16")
        wall = time.perf_counter_ns() - t0
        pol, c = _testing.last_policy(), counts()
    ns = {s: c[f"fwd_{s}_ns"] for s in steps}
    dec = {s: c[f"decode_{s}_ns"] for s in ("qk", "softmax", "pv")}
    assert sum(ns.values()) + sum(dec.values()) <= wall * torch.get_num_threads(), (ns, dec, wall)
    if case == "decode":
        assert pol["decode"] and not any(ns.values()), ns
        assert all(t > 0 for t in dec.values()), dec
    else:
        assert not any(dec.values()), dec
        assert pol["transposed"] == (case == "transposed" and "transposed" in ran_paths())
        packs = not pol["transposed"]  # (it reads K in place, and V: Dv a multiple of NR)
        assert all(ns[s] > 0 for s in steps if s != "pack") and (ns["pack"] > 0) == packs, ns


@pytest.mark.parametrize("fused_bwd", [1, 0], ids=["fused", "two-sweep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_clocks_account_for_the_backward(tier, fused_bwd, dtype):
    """The backward's step clocks (bwd_pack / s / dp / dkdv / dq / rows; bench/phase_profile.py
    --train), in both strategies: every step timed, no forward or decode step during the
    backward, and their sum within the call's wall time times the threads."""
    import time
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, dtype=dtype, requires_grad=True)
    with _testing.policy(fused_bwd=fused_bwd):
        o = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        do = torch.randn_like(o)
        with _testing.counting() as counts:
            t0 = time.perf_counter_ns()
            torch.autograd.grad(o, (q, k, v), do)
            wall = time.perf_counter_ns() - t0
            pol, c = _testing.last_policy(), counts()
    assert pol["fused_bwd"] == bool(fused_bwd), pol
    steps = {s: c[f"bwd_{s}_ns"] for s in ("pack", "s", "dp", "dkdv", "dq", "rows")}
    others = {n: t for n, t in c.items() if n.endswith("_ns") and not n.startswith("bwd_")}
    assert all(t > 0 for t in steps.values()), steps
    assert not any(others.values()), others
    assert sum(steps.values()) <= wall * torch.get_num_threads(), (steps, wall)
