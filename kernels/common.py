"""Triton helpers shared by the forward and backward attention kernels.

Scores are kept in the log2 domain: s = log2(e) * (scale * q.k + mask), so the softmax uses exp2.
Masks are read through their (broadcast, possibly zero) strides, never expanded in memory.
The dropout keep-mask comes from Triton's counter-based RNG (Philox) keyed by (seed, element
index), so the backward regenerates it exactly.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores and LSE move to the log2 domain


@triton.jit
def tile_desc(base, rows, cols, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A 2-D tensor descriptor over one (batch, head) slice [rows, cols] with unit column stride
    (the launcher guarantees a 16-byte aligned base and row stride). Loads outside [rows, cols]
    read as 0, which handles ragged sequence lengths and head dims below the block width."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[stride_r, 1],
                                     block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def load_block(desc, row, UPCAST: tl.constexpr):
    """Rows [row, row + BLOCK_R) of a descriptor; widened to fp32 when UPCAST (bf16 under the
    interpreter, whose bf16 arithmetic works on raw bits)."""
    tile = desc.load([row, 0])
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


# ---- visibility: which keys each query row sees (the CPU kernels' Visibility, csrc/cpu/) ----------
# Row i sees keys j < end(i), with end(i) = i + 1 under IS_CAUSAL (top-left, PyTorch's rule) and
# Lk otherwise. Every tile range below derives from `visible` and this end(i).

@triton.jit
def visible(offs_m, offs_n, IS_CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: row offs_m sees key offs_n (key range checks are the caller's)."""
    if IS_CAUSAL:
        ok = offs_n[None, :] <= offs_m[:, None]
    else:
        ok = (offs_n[None, :] >= 0) & (offs_m[:, None] >= 0)  # all true, the same [M, N] shape
    return ok


@triton.jit
def kv_bounds(start_m, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """For the q tile starting at row start_m: (end of the interior kv tiles - every key in range
    and visible to every row, so masked_scores may skip its checks -, end of the kv tiles to
    visit: end(last row of the tile))."""
    full_end = Lk // BLOCK_N * BLOCK_N
    hi = Lk
    if IS_CAUSAL:
        full_end = tl.minimum(full_end, (start_m + 1) // BLOCK_N * BLOCK_N)
        hi = tl.minimum(Lk, start_m + BLOCK_M)
    return full_end, hi


@triton.jit
def q_bounds(start_n, Lq, Lk, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """For the kv tile starting at key start_n: (first q tile with a row that sees one of its keys,
    first q tile from which every row sees all of them and no bound check is needed). The tiles
    in between need masked_scores' checks, all of them when the kv tile is ragged."""
    lo = 0
    mid = 0
    if IS_CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = (start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    mid = tl.minimum(tl.where(start_n + BLOCK_N > Lk, Lq, mid), Lq)
    return lo, mid


@triton.jit
def masked_scores(s, offs_m, offs_n, Lq, Lk, qk_scale, mask_ptr, stride_mm, stride_mn,
                  HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  CHECK: tl.constexpr):
    """log2-domain scores of a [BLOCK_M, BLOCK_N] tile; -inf where a key is not attended
    (outside the sequence, masked out, or above the top-left causal diagonal).

    CHECK=False is the fast path for interior tiles: the caller guarantees that every key of the
    tile is inside the sequence and visible to every row (left of the causal diagonal), so only
    a user mask applies (read with the rows bounded)."""
    s = s * qk_scale
    if CHECK:
        valid = (offs_n[None, :] < Lk) & (offs_m[:, None] < Lq) & visible(offs_m, offs_n,
                                                                           IS_CAUSAL)
    if HAS_MASK:
        ptrs = mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        if CHECK:
            mval = tl.load(ptrs, mask=valid, other=0)
        else:
            mval = tl.load(ptrs, mask=offs_m[:, None] < Lq, other=0)
        if MASK_BOOL:
            s = tl.where(mval != 0, s, float("-inf"))
        else:
            s = s + mval.to(tl.float32) * LOG2E
    if CHECK:
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def dropout_keep(seed, offset, bh, offs_m, offs_n, Lq, Lk, dropout_p):
    """Keep bits of a tile: element (bh, i, j) -> Philox(seed, offset + (bh*Lq + i)*Lk + j)."""
    idx = (bh * Lq + offs_m[:, None]).to(tl.int64) * Lk + offs_n[None, :] + offset
    return tl.rand(seed, idx) >= dropout_p
