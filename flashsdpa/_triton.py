"""The Triton path: flash attention for xpu (and cuda) tensors, forward and backward.

Launchers for the kernels in kernels/ (installed as flashsdpa.kernels), the autograd function
behind the direct API, and the kernels registered on the XPU dispatch key by enable() (see
flashsdpa/_routing.py). Triton is imported only when a kernel is first launched: importing
flashsdpa, or using it on CPU, never needs Triton or a GPU.

Under TRITON_INTERPRET=1 the same launchers run the kernels on CPU tensors (the tests): one small
block configuration; bf16 dots are computed from operands widened to fp32 (the interpreter's bf16
arithmetic works on raw bits) and bf16 results are written in fp32 and rounded by PyTorch (its
fp32 -> bf16 cast truncates).
"""
import importlib.util
import math
import threading

import torch

from .kernels.configs import MAX_SPLITS, interpreting, next_pow2  # (configs imports no Triton)

LOG2E = 1.4426950408889634


def available():
    """Whether Triton is installed (the kernels still need a GPU, or the interpreter)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None (import blocked)
        return False


# ---- launch helpers -----------------------------------------------------------------------------

# Tests set this: every buffer the launchers allocate starts as NaN, so an element a kernel does
# not write (or a padding column it reads) shows up in the result.
POISON = False


def _poisoned(t):
    return t.fill_(float("nan")) if POISON and t.is_floating_point() else t


_kernels = None
# Triton keeps its allocator in a ContextVar, so each thread starts with none: autograd runs a
# GPU backward on its own device thread, and user code may launch from any thread. Set per thread.
_allocator_tls = threading.local()


def _load_kernels(device):
    """Import Triton and the kernels on first use; give Triton a scratch allocator for device-side
    tensor descriptors on a real GPU (once per thread). -> (forward, backward, configs); the
    KV-cache kernel's module is attention_kvcache."""
    global _kernels
    if _kernels is None:
        from .kernels import attention_bwd, attention_fwd, attention_kvcache, configs
        _kernels = (attention_fwd, attention_bwd, configs, attention_kvcache)
    if device.type != "cpu" and getattr(_allocator_tls, "device_type", None) != device.type:
        import triton

        def alloc(size, alignment, stream, _dev=device.type):
            return torch.empty(size, dtype=torch.int8, device=_dev)

        triton.set_allocator(alloc)
        _allocator_tls.device_type = device.type
    return _kernels


def _descriptor_ready(t):
    """A 4-D tensor a per-(batch, head) 2-D descriptor can read: unit last stride, 16-byte
    aligned base and batch/head strides (of the dims that index), and a 16-byte aligned row
    stride, the descriptor's own, even over a single row."""
    es = t.element_size()
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    if t.data_ptr() % 16 or (t.shape[2] > 1 and t.stride(2) == 0):
        return False
    if t.shape[2] >= 1 and (t.stride(2) * es) % 16:
        return False
    return all(t.shape[d] <= 1 or (t.stride(d) * es) % 16 == 0 for d in range(2))


def _for_descriptor(t):
    """t itself when descriptor-ready, else a copy whose rows are padded to 16 bytes (a view of
    the same shape): O(size of t), only for odd head dims or unaligned views."""
    if _descriptor_ready(t):
        return t
    d = t.shape[-1]
    per16 = 16 // t.element_size()
    buf = _poisoned(t.new_empty(t.shape[:-1] + ((d + per16 - 1) // per16 * per16,)))
    view = buf[..., :d]
    view.copy_(t)
    return view


def to_4d(query, key, value, attn_mask=None):
    """3-D (N, L, E) inputs as (N, 1, L, E) (a 3-D mask likewise), a 4-D key/value batch of 1
    broadcast to the query's: the C++ side's to_4d (csrc/routing.h), in Python so that
    torch.compile traces it on the Triton path."""
    if query.dim() == 3:
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        return query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), attn_mask
    b = query.shape[0]
    if key.shape[0] != b:
        key = key.expand(b, -1, -1, -1)
    if value.shape[0] != b:
        value = value.expand(b, -1, -1, -1)
    return query, key, value, attn_mask


def as_4d(t):
    """An output-shaped tensor of a 3-D call, viewed as to_4d views the inputs."""
    return t if t is None or t.dim() == 4 else t.unsqueeze(1)


def _mask_4d(attn_mask, b, hq, lq, lk):
    """The mask as a broadcast (zero-stride) 4-D view, plus its kind; never copied (bool is
    reinterpreted as uint8)."""
    if attn_mask is None:
        return None, False
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    m = m.expand(b, hq, lq, lk)
    is_bool = m.dtype == torch.bool
    if is_bool:
        m = m.view(torch.uint8)
    return m, is_bool


def _stride4(t):
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype):
    return interpreting() and dtype == torch.bfloat16


def _result_dtype(dtype):
    """The dtype a kernel writes: fp32 under the interpreter for bf16 (rounded by PyTorch)."""
    return torch.float32 if _upcast(dtype) else dtype


def alloc_like_query(query, shape, dtype=None):
    """An output laid out like `query` (PyTorch's rule for the fused SDPA ops)."""
    dtype = dtype or query.dtype
    if tuple(query.shape) == tuple(shape):
        return _poisoned(torch.empty_like(query, dtype=dtype))
    order = sorted(range(query.dim()), key=lambda i: query.stride(i), reverse=True)
    strides = [0] * len(shape)
    stride = 1
    for i in reversed(order):
        strides[i] = stride
        stride *= shape[i]
    return _poisoned(torch.empty_strided(shape, strides, dtype=dtype, device=query.device))


def _kernel_target(t):
    """The buffer a kernel writes for the result `t`: `t` itself when its last dim has unit
    stride and it has the dtype the kernel writes (_result_dtype), else a contiguous buffer that
    _finish copies back."""
    dtype = _result_dtype(t.dtype)
    if t.dtype == dtype and (t.shape[-1] <= 1 or t.stride(-1) == 1):
        return t
    return _poisoned(torch.empty(t.shape, dtype=dtype, device=t.device))


class Variants:
    """The attention variants of one call (../shared/api-variants-serving.md), as the kernels
    take them: the band of keys each row sees (kernels/common.py: i + diag_lo <= j <= i +
    diag_hi, each side only when bounded), softcap, ALiBi slopes and sinks. window: (left,
    right), -1 unbounded; right is 0 under causal; diag = Lk - Lq under bottom_right, else 0."""

    def __init__(self, lq, lk, is_causal=False, window=(-1, -1), bottom_right=False, softcap=0.0,
                 alibi=None, sinks=None, device=None):
        left, right = int(window[0]), int(window[1])
        right = 0 if is_causal else right
        self.diag = lk - lq if bottom_right else 0
        self.has_lo, self.has_hi = left >= 0, right >= 0
        self.diag_lo = self.diag - left if self.has_lo else 0
        self.diag_hi = self.diag + right if self.has_hi else 0
        self.softcap = float(softcap)
        self.alibi = None if alibi is None else alibi.to(device, torch.float32)
        self.sinks = None if sinks is None else sinks.to(device, torch.float32).contiguous()

    def scalars(self):
        """(diag_lo, diag_hi, diag) the kernels take after the sizes."""
        return self.diag_lo, self.diag_hi, self.diag

    def alibi_strides(self):
        """(batch, head) strides of the slopes, (H,) broadcast over the batch."""
        if self.alibi is None:
            return 0, 0
        return (0, self.alibi.stride(0)) if self.alibi.dim() == 1 else tuple(self.alibi.stride())

    def cap_scales(self, scale):
        """(cap_in, cap_out) of scaled_scores: scale / cap and cap * log2(e)."""
        if not self.softcap:
            return 0.0, 0.0
        return float(scale) / self.softcap, self.softcap * LOG2E


def _op_variants(query, key, is_causal, window_left, window_right, bottom_right, softcap,
                 alibi_slopes, sinks, packed=False):
    """The Variants of an op call's arguments (the forward and backward ops take the same). A
    packed call's band is relative to each sequence's bottom-right diagonal (the kernels add
    lk - lq per sequence: common.sequence), so it is built for lq = lk."""
    lq, lk = (0, 0) if packed else (query.shape[2], key.shape[2])
    return Variants(lq, lk, is_causal, (window_left, window_right), bottom_right, softcap,
                    alibi_slopes, sinks, query.device)


class Packed:
    """A packed (varlen) call as the launchers take it: the (1, H, total, D) views' sequences
    (cu_seqlens int32 on the tensors' device, validated by the caller) and the longest ones,
    which size the grids."""

    def __init__(self, cu_q, cu_k, max_q, max_k):
        self.cu_q, self.cu_k = cu_q, cu_k
        self.max_q, self.max_k = int(max_q), int(max_k)
        self.count = cu_q.numel() - 1


def _packing(query, lk, packed):
    """(sequences, grid rows, grid keys, the kernels' (Lq, Lk), CuQ, CuK) of a launch: a batched
    call's batch and lengths, or a packed call's sequences, longest lengths and (total_q,
    max_seqlen_k), the sizes dropout indices run over (common.dropout_row0)."""
    b, _, lq, _ = query.shape
    if packed is None:
        return b, lq, lk, (lq, lk), query, query
    return (packed.count, packed.max_q, packed.max_k, (lq, packed.max_k), packed.cu_q,
            packed.cu_k)


def _constexprs(mask, mask_bool, var, dropout_p, dtype, d, dv, packed, mask_shift):
    """The compile-time arguments the forward and both backward kernels share."""
    return dict(HAS_MASK=mask is not None, MASK_BOOL=mask_bool, MASK_SHIFT=mask_shift,
                HAS_LO=var.has_lo,
                HAS_HI=var.has_hi, SOFTCAP=bool(var.softcap), HAS_ALIBI=var.alibi is not None,
                DROPOUT=dropout_p > 0, UPCAST=_upcast(dtype), PRECISION=_precision(dtype),
                VARLEN=packed is not None, BLOCK_D=next_pow2(max(16, d)),
                BLOCK_DV=next_pow2(max(16, dv)))


def _finish(buf, dest):
    """Copy a kernel's result into its destination when they differ (layout or dtype)."""
    if buf is not dest:
        dest.copy_(buf)
    return dest


def new_rng_state():
    """(seed, offset) of a dropout keep-mask, drawn from PyTorch's default CPU generator so
    torch.manual_seed makes runs reproducible without a device sync."""
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    return seed, 0


# ---- forward / backward -------------------------------------------------------------------------

def shifts_mask(attn_mask):
    """Whether the kernels add this mask relative to each row's shift (kernels/common.py,
    mask_row_shift): float masks."""
    return attn_mask is not None and attn_mask.dtype != torch.bool


def forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            rng=(0, 0), out=None, var=None, lse_empty=0.0, packed=None):
    """4-D (B, Hq, Lq, D) x (B, Hkv, Lk, D) x (B, Hkv, Lk, Dv) -> (out, lse[B, Hq, Lq] fp32,
    shift). shift: with a float mask (shifts_mask), each row's [B, Hq, Lq, 2] fp32 (M, m): its
    mask shift and the log2-domain max its lse is relative to (kernels/attention_fwd.py; the
    backward takes both, full_lse the rows' logsumexp); else None.

    Hq must be a multiple of Hkv (GQA). `out` may be given (any layout). var: the call's
    Variants (None: plain, causal from is_causal); lse_empty: the lse of a row that sees no key
    and has no sink (0, or -inf for flash-attn's API). packed: a Packed call (B = 1, the rows
    the sequences' concatenation; no mask)."""
    b, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[1], key.shape[2], value.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if var is None:
        var = Variants(lq, lk, is_causal)
    if out is None:
        out = alloc_like_query(query, (b, hq, lq, dv))
    lse = _poisoned(torch.empty((b, hq, lq), dtype=torch.float32, device=query.device))
    shift = _poisoned(lse.new_empty((b, hq, lq, 2))) if shifts_mask(attn_mask) else None
    if shift is not None and (out.numel() == 0 or lq == 0 or lk == 0):
        shift.zero_()  # (the early returns below: no key seen, no shift)
    if out.numel() == 0 or lq == 0:
        lse.zero_()
        return out, lse, shift
    if lk == 0:
        out.zero_()
        if var.sinks is not None:  # the sink alone: lse = sink
            lse.copy_(var.sinks.view(1, hq, 1).expand(b, hq, lq))
        else:
            lse.fill_(lse_empty)
        return out, lse, shift
    fwd, _, configs, _ = _load_kernels(query.device)
    q, k, v = (_for_descriptor(t) for t in (query, key, value))
    mask, mask_bool = _mask_4d(attn_mask, b, hq, lq, lk)
    buf = _kernel_target(out)
    blocks, opts = configs.forward_config(max(d, dv))
    seqs, rows, _, sizes, cu_q, cu_k = _packing(query, lk, packed)
    grid = (triton_cdiv(rows, blocks["BLOCK_M"]), seqs * hq)
    fwd.attn_fwd_kernel[grid](
        q, k, v, mask if mask is not None else q, buf, lse, shift if shift is not None else lse,
        var.alibi if var.alibi is not None else lse, var.sinks if var.sinks is not None else lse,
        cu_q, cu_k, *_stride4(q), *_stride4(k), *_stride4(v), *_stride4(buf),
        *(mask.stride() if mask is not None else (0, 0, 0, 0)), *_stride4(lse),
        *var.alibi_strides(), hq, hkv, *sizes, d, dv, *var.scalars(),
        float(scale) * LOG2E, *var.cap_scales(scale), float(lse_empty), float(dropout_p),
        int(rng[0]), int(rng[1]), HAS_SINKS=var.sinks is not None,
        **_constexprs(mask, mask_bool, var, dropout_p, query.dtype, d, dv, packed,
                      shift is not None), **blocks, **opts)
    return _finish(buf, out), lse, shift


def full_lse(lse, shift):
    """The rows' logsumexp from forward's (lse, shift): lse + ln(2) m + M."""
    if shift is None or shift.numel() == 0:
        return lse
    return lse + shift[..., 1] * math.log(2) + shift[..., 0]


def backward(grad_out, query, key, value, out, lse, attn_mask=None, dropout_p=0.0,
             is_causal=False, scale=None, rng=(0, 0), var=None, packed=None, shift=None):
    """Gradients (dq, dk, dv, dsinks), each laid out like its input (torch.empty_like); dsinks
    None without sinks. var, packed: the forward's; shift: its mask shifts, lse then relative
    to them (forward); None: lse is the logsumexp and the mask enters unshifted (aten's
    autograd keeps only the logsumexp)."""
    b, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[1], key.shape[2], value.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if var is None:
        var = Variants(lq, lk, is_causal)
    dq, dk, dvv = (_poisoned(torch.empty_like(t)) for t in (query, key, value))
    delta = (out.float() * grad_out.float()).sum(-1).contiguous()     # [B, Hq, Lq]
    # rows that see no key: lse -inf (flash-attn's API) is taken as 0, where their P is 0;
    # contiguous like delta, whose strides the kernels read it with
    lse = lse.float().masked_fill(torch.isneginf(lse), 0.0).contiguous()
    if shift is not None:
        shift = shift.contiguous()
    # d sink_h = -sum over the rows of head h of P(sink) * delta, P(sink) = exp(sink - lse)
    # (with a shift, 2^(((sink - M) log2(e) - m) - lse log2(e)), the forward's rounding of the
    # sink's score)
    dsinks = None
    if var.sinks is not None:
        sink = var.sinks.view(1, hq, 1)
        if shift is None:
            p_sink = torch.exp(sink - lse)
        else:
            p_sink = torch.exp2(((sink - shift[..., 0]) * LOG2E - shift[..., 1]) - lse * LOG2E)
        dsinks = -(p_sink * delta).sum((0, 2))
    if lq == 0 or lk == 0 or b * hq == 0:
        return dq.zero_(), dk.zero_(), dvv.zero_(), dsinks
    _, bwd, configs, _ = _load_kernels(query.device)
    q, k, v, do = (_for_descriptor(t) for t in (query, key, value, grad_out))
    mask, mask_bool = _mask_4d(attn_mask, b, hq, lq, lk)
    dq_buf, dk_buf, dv_buf = _kernel_target(dq), _kernel_target(dk), _kernel_target(dvv)
    common = _constexprs(mask, mask_bool, var, dropout_p, query.dtype, d, dv, packed,
                         shift is not None)
    seqs, rows, keys, sizes, cu_q, cu_k = _packing(query, lk, packed)
    mstrides = mask.stride() if mask is not None else (0, 0, 0, 0)
    args_in = (cu_q, cu_k, *_stride4(q), *_stride4(k), *_stride4(v), *_stride4(do), *mstrides,
               *_stride4(lse), *var.alibi_strides())
    scalars = (hq, hkv, *sizes, d, dv, *var.scalars(), float(scale) * LOG2E,
               *var.cap_scales(scale), float(scale), float(dropout_p), int(rng[0]), int(rng[1]))
    (kv_blocks, kv_opts), (q_blocks, q_opts) = configs.backward_config(max(d, dv))
    mask_arg = mask if mask is not None else q
    alibi = var.alibi if var.alibi is not None else lse
    shift_arg = shift if shift is not None else lse
    bwd.attn_bwd_dkdv_kernel[(triton_cdiv(keys, kv_blocks["BLOCK_N"]), seqs * hkv)](
        q, k, v, mask_arg, do, lse, delta, shift_arg, dk_buf, dv_buf, alibi, *args_in,
        *_stride4(dk_buf), *_stride4(dv_buf), *scalars, **common, **kv_blocks, **kv_opts)
    bwd.attn_bwd_dq_kernel[(triton_cdiv(rows, q_blocks["BLOCK_M"]), seqs * hq)](
        q, k, v, mask_arg, do, lse, delta, shift_arg, dq_buf, alibi, *args_in,
        *_stride4(dq_buf), *scalars, **common, **q_blocks, **q_opts)
    return _finish(dq_buf, dq), _finish(dk_buf, dk), _finish(dv_buf, dvv), dsinks


def dropout_keep_mask(seed, offset, batch, heads, lq, lk, dropout_p, device="cpu"):
    """The bool keep-mask [B, H, Lq, Lk] the kernels apply for this (seed, offset) (tests only)."""
    fwd = _load_kernels(torch.device(device))[0]
    keep = torch.empty((batch, heads, lq, lk), dtype=torch.uint8, device=device)
    fwd.dropout_mask_kernel[(triton_cdiv(lq, 32), batch * heads)](
        keep, lq, lk, float(dropout_p), int(seed), int(offset), BLOCK_M=32, BLOCK_N=32)
    return keep.bool()


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ---- attention over a KV cache (flash_attn_with_kvcache) ----------------------------------------

def _multiprocessors(device):
    """The device's compute units (SMs, Xe cores), which the split-KV grid is sized to fill."""
    props = getattr(torch, device.type).get_device_properties(device)
    for name in ("multi_processor_count", "gpu_subslice_count", "max_compute_units"):
        if getattr(props, name, 0):
            return int(getattr(props, name))
    return 64


def _kv_splits(device, programs, max_lk, block_n, splits=None):
    """(chunk, splits): keys per split (whole BLOCK_N tiles) and the split count, so that the
    grid holds ~4 programs per compute unit when the batch x kv heads x row tiles alone do not
    (decode: a few programs per sequence otherwise). Under the interpreter two tiles a split, so
    that small test shapes combine several. splits: a count asked for instead (tests)."""
    tiles = max(1, triton_cdiv(max_lk, block_n))
    if splits is not None:
        per = triton_cdiv(tiles, max(1, int(splits)))
    elif device.type == "cpu":  # the interpreter
        per = 2
    else:
        want = triton_cdiv(4 * _multiprocessors(device), max(1, programs))
        per = triton_cdiv(tiles, max(1, min(want, tiles)))
    # at most MAX_SPLITS: the combine kernel holds a row's splits x Dv in registers
    per = max(per, triton_cdiv(tiles, MAX_SPLITS))
    return per * block_n, triton_cdiv(tiles, per)


def kvcache_forward(q, k_cache, v_cache, block_table, seqlens, max_lk, var, scale=None,
                    k_scale=None, v_scale=None, splits=None):
    """Attention of q (B, Lq, Hq, D) over a KV cache: contiguous (B, Lcache, Hkv, D[v]) or paged
    (num_blocks, page, Hkv, D[v]) with block_table int32 (B, max_blocks); seqlens int32 (B,):
    each sequence's keys, the first seqlens[b] of its cache, the queries the last Lq of them;
    max_lk their maximum (a host int). var: Variants built for lq = lk (the band relative to
    each sequence's bottom-right diagonal). float8_e4m3fn caches: k_scale / v_scale float32 (1,)
    or (Hkv,). Everything on q's device, unit stride in the last dims. splits: the split-KV
    count (None: _kv_splits; tests). -> (out (B, Lq, Hq, Dv) in q's dtype, lse (B, Hq, Lq) fp32,
    -inf where a row sees no key and has no sink)."""
    b, lq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    group = hq // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    _, _, configs, kv = _load_kernels(q.device)
    blocks, opts = configs.kvcache_config(max(d, dv), group * lq)
    m_tiles = triton_cdiv(group * lq, blocks["BLOCK_M"])
    chunk, n_splits = _kv_splits(q.device, b * hkv * m_tiles, max_lk, blocks["BLOCK_N"],
                                 splits)
    out_p = _poisoned(torch.empty((b, hq, lq, n_splits, dv), dtype=torch.float32,
                                  device=q.device))
    lse_p = _poisoned(torch.empty((b, hq, lq, n_splits), dtype=torch.float32, device=q.device))
    if out_p.numel():
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        kc, vc = (c.view(torch.uint8) if fp8 else c for c in (k_cache, v_cache))
        paged = block_table is not None
        dummy = lse_p
        kv.attn_kvcache_kernel[(n_splits, b * hkv, m_tiles)](
            q, kc, vc, block_table if paged else seqlens, seqlens, out_p, lse_p,
            var.alibi if var.alibi is not None else dummy,
            k_scale if fp8 else dummy, v_scale if fp8 else dummy,
            q.stride(0), q.stride(1), q.stride(2), *kc.stride()[:3], *vc.stride()[:3],
            block_table.stride(0) if paged else 0, *out_p.stride()[:4], *lse_p.stride()[:3],
            *var.alibi_strides(), hq, hkv, lq, d, dv, k_cache.shape[1] if paged else 1, chunk,
            *var.scalars()[:2], float(scale) * LOG2E, *var.cap_scales(scale),
            PAGED=paged, FP8=fp8, SCALE_PER_HEAD=int(fp8 and k_scale.numel() > 1),
            HAS_LO=var.has_lo, HAS_HI=var.has_hi, SOFTCAP=bool(var.softcap),
            HAS_ALIBI=var.alibi is not None, UPCAST=_upcast(q.dtype),
            PRECISION=_precision(q.dtype), BLOCK_D=next_pow2(max(16, d)),
            BLOCK_DV=next_pow2(max(16, dv)), **blocks, **opts)
    # the splits' combination, with the sinks as one more term of each row's softmax
    out = _poisoned(torch.empty((b, lq, hq, dv), dtype=_result_dtype(q.dtype), device=q.device))
    lse = _poisoned(torch.empty((b, hq, lq), dtype=torch.float32, device=q.device))
    if out.numel():  # (Dv >= 1: the callers' checks)
        rows = b * hq * lq
        blocks = configs.combine_config(rows, n_splits, dv)
        kv.attn_kvcache_combine_kernel[(triton_cdiv(rows, blocks["BLOCK_R"]),)](
            out_p, lse_p, var.sinks if var.sinks is not None else lse_p, out, lse,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            hq, lq, n_splits, dv, rows, HAS_SINKS=var.sinks is not None, **blocks)
    return out.to(q.dtype), lse


# ---- ops + autograd (the direct API) --------------------------------------------------------------
# Custom ops, so torch.compile treats each kernel launch as one opaque node (with the fake kernels
# below) instead of tracing into the launchers; the dropout seed is drawn inside the forward op at
# run time, so compiled graphs draw a fresh keep-mask per call.
from typing import Optional  # noqa: E402


@torch.library.custom_op("flashsdpa::triton_attn_fwd", mutates_args=())
def _fwd_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
            scale: Optional[float], window_left: int = -1, window_right: int = -1,
            bottom_right: bool = False, softcap: float = 0.0,
            alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            lse_neg_inf: bool = False, cu_seqlens_q: Optional[torch.Tensor] = None,
            cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
            max_seqlen_k: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, rng state, mask shift). With a float mask the rows' (B, Hq, Lq, 2) shifts and
    lse relative to them (forward; full_lse), else an empty shift and the logsumexp. With
    cu_seqlens_q / _k (int32, on the tensors' device, checked by the caller) a packed call:
    (1, H, total, D) views of flash_attn_varlen_func's tensors, each sequence bottom-right
    aligned (its semantics), no mask."""
    rng = new_rng_state() if dropout_p > 0 else (0, 0)
    packed = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    var = _op_variants(query, key, is_causal, window_left, window_right, bottom_right, softcap,
                       alibi_slopes, sinks, packed is not None)
    out, lse, shift = forward(query, key, value, attn_mask, dropout_p, is_causal, scale, rng,
                              var=var, lse_empty=-math.inf if lse_neg_inf else 0.0,
                              packed=packed)
    if shift is None:
        shift = lse.new_empty(0)
    return out, lse, torch.tensor(rng, dtype=torch.int64), shift


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return None if cu_seqlens_q is None else Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    max_seqlen_k)


@_fwd_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left=-1, window_right=-1,
      bottom_right=False, softcap=0.0, alibi_slopes=None, sinks=None, lse_neg_inf=False,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    b, hq, lq = query.shape[:3]
    out = alloc_like_query(query, (b, hq, lq, value.shape[3]))
    lse = query.new_empty((b, hq, lq), dtype=torch.float32)
    shift = lse.new_empty((b, hq, lq, 2) if shifts_mask(attn_mask) else 0)
    return out, lse, torch.empty(2, dtype=torch.int64), shift


@torch.library.custom_op("flashsdpa::triton_attn_bwd", mutates_args=())
def _bwd_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, rng_state: torch.Tensor,
            attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
            scale: Optional[float], window_left: int = -1, window_right: int = -1,
            bottom_right: bool = False, softcap: float = 0.0,
            alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
            cu_seqlens_q: Optional[torch.Tensor] = None,
            cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
            max_seqlen_k: int = 0, mask_shift: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty without sinks (an op returns no None). mask_shift:
    the forward op's (lse relative to it), None or empty without."""
    rng = tuple(int(x) for x in rng_state.tolist())
    packed = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    var = _op_variants(query, key, is_causal, window_left, window_right, bottom_right, softcap,
                       alibi_slopes, sinks, packed is not None)
    shift = mask_shift if mask_shift is not None and mask_shift.numel() else None
    dq, dk, dv, dsinks = backward(grad_out, query, key, value, out, lse, attn_mask, dropout_p,
                                  is_causal, scale, rng, var, packed, shift)
    if dsinks is None:
        dsinks = lse.new_empty(0)
    return dq, dk, dv, dsinks


@_bwd_op.register_fake
def _(grad_out, query, key, value, out, lse, rng_state, attn_mask, dropout_p, is_causal, scale,
      window_left=-1, window_right=-1, bottom_right=False, softcap=0.0, alibi_slopes=None,
      sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
      mask_shift=None):
    dsinks = lse.new_empty(0) if sinks is None else torch.empty_like(sinks, dtype=torch.float32)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dsinks


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale = inputs[:7]
    variants = inputs[7:13]  # window_left .. sinks (lse_neg_inf is the forward's only)
    out, lse, rng_state, shift = output
    ctx.save_for_backward(query, key, value, out, lse, rng_state, shift)
    ctx.mask, ctx.args, ctx.variants = attn_mask, (dropout_p, is_causal, scale), variants
    ctx.packing = inputs[14:18]  # cu_seqlens_q .. max_seqlen_k
    ctx.mark_non_differentiable(lse, rng_state, shift)


def _backward_rule(ctx, grad_out, _grad_lse, _grad_rng, _grad_shift):
    query, key, value, out, lse, rng_state, shift = ctx.saved_tensors
    dq, dk, dv, dsinks = _bwd_op(grad_out, query, key, value, out, lse, rng_state, ctx.mask,
                                 *ctx.args, *ctx.variants, *ctx.packing, mask_shift=shift)
    sinks = ctx.variants[-1]
    dsinks = dsinks.to(sinks.dtype) if sinks is not None else None
    # one gradient per op argument: query, key, value, then None up to sinks' and after it
    return (dq, dk, dv, *(None,) * 9, dsinks, *(None,) * 5)


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, **variants):
    """SDPA on the Triton kernels (validated arguments; 3-D or 4-D). variants: the ops' variant
    keywords (window_left, window_right, softcap, alibi_slopes, sinks; top-left aligned, as
    flashsdpa.scaled_dot_product_attention). Differentiable in query, key, value and sinks."""
    # a broadcast key/value batch is expanded: autograd sums its gradient
    q, k, v, mask = to_4d(query, key, value, attn_mask)
    out = _fwd_op(q, k, v, mask, float(dropout_p), bool(is_causal),
                  None if scale is None else float(scale), **variants)[0]
    return out.squeeze(1) if query.dim() == 3 else out


def flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **variants):
    """flash_attn_func on the Triton kernels (validated arguments; variants as in
    scaled_dot_product_attention): (B, L, H, D) layout, bottom-right alignment -> (out
    (B, Lq, H, Dv), lse (B, H, Lq), -inf where a row sees no key and has no sink)."""
    out, lse, _, _ = _fwd_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                          float(dropout_p), bool(causal),
                          None if softmax_scale is None else float(softmax_scale),
                          bottom_right=True, lse_neg_inf=True, **variants)
    return out.transpose(1, 2), lse


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p=0.0, softmax_scale=None, causal=False, **variants):
    """flash_attn_varlen_func on the Triton kernels, one launch per kernel for the whole batch
    (validated arguments; cu_seqlens int32 on q's device; variants as in
    scaled_dot_product_attention): q (total_q, H, D), k / v (total_k, Hkv, D[v]) -> (out
    (total_q, H, Dv), lse (H, total_q), -inf where a row sees no key and has no sink)."""
    out, lse, _, _ = _fwd_op(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), None,
                          float(dropout_p), bool(causal),
                          None if softmax_scale is None else float(softmax_scale),
                          bottom_right=True, lse_neg_inf=True, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                          max_seqlen_k=int(max_seqlen_k), **variants)
    return out[0].transpose(0, 1), lse[0]
