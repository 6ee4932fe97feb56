"""Hugging Face transformers backend: attn_implementation="fused_attention".

    import flashsdpa.hf
    flashsdpa.hf.register()                       # once, before loading a model
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fused_attention")

Serves causal LMs (Llama, Mistral, Gemma 2 / 3, gpt-oss, ...) on flashsdpa's kernels: sliding
windows, softcap, sinks (gpt-oss `s_aux`), GQA, left or right padding, packed sequences
(position_ids or cu_seq_lens, as DataCollatorWithFlattening gives), generate() with the dynamic
and static caches, and training (gradients for q, k, v and the sinks).

transformers is optional: importing flashsdpa (or this module) never imports it; register()
does, and raises ImportError naming the version it needs when it is missing or too old.

How a call is served (one decision, `attention_forward`):
- no padding: flash_attn_func on strided views of the (B, H, L, D) states; queries are the last
  positions of the keys (bottom-right), which is what the dynamic cache and the static cache
  (its keys cut at the mask's length) hold;
- packed sequences (cu_seq_lens_* given, or position_ids restarting within a batch of one):
  flash_attn_varlen_func over the packed rows;
- a 2-D padding mask with as many queries as keys (prefill, training): the valid rows are
  packed and flash_attn_varlen_func runs (no padding computed), then scattered back (padded
  rows give 0);
- otherwise (a padded batch decoding, a mask with holes, a 4-D mask the model or the user
  built): scaled_dot_product_attention with a boolean mask, the other variants as arguments.
"""
import importlib.metadata
import re

import torch

from ._api import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention

MIN_TRANSFORMERS = (4, 56)  # tested: 4.56.2, 4.57.6, 5.0.0, 5.24.0
DEFAULT_NAME = "fused_attention"


def _check_transformers():
    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"flashsdpa.hf needs transformers >= {need}: it is not installed "
                          f"(pip install 'transformers>={need}')") from None
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if parts < MIN_TRANSFORMERS:
        raise ImportError(f"flashsdpa.hf needs transformers >= {need}, found {version} "
                          f"(pip install -U 'transformers>={need}')")


def register(name=DEFAULT_NAME):
    """Register `name` as an attn_implementation of transformers (AttentionInterface for the
    attention, AttentionMaskInterface for the mask it needs) and return it.

    The name must contain neither "flash" (transformers would look for the flash-attn package)
    nor "sdpa" (transformers would apply its SDPA support check, which Gemma 2 and gpt-oss
    fail). Registering again (any name) is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"flashsdpa.hf.register: name must be a non-empty string, got {name!r}")
    lowered = name.lower()
    if "flash" in lowered or "sdpa" in lowered:
        raise ValueError(f"flashsdpa.hf.register: name must contain neither 'flash' nor 'sdpa' "
                         f"(transformers treats those names specially), got {name!r}")
    _check_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_mask(*args, use_vmap=False, **kwargs):
    """The mask transformers builds for this backend (its mask-interface signature, passed
    through as given: it changed between versions): None (no padding: causality and windows are
    arguments of the kernels) or the 2-D padding mask cut to the last kv_length keys, as for
    flash-attn; or, when the model combines the causal mask with mask functions of its own
    (use_vmap: e.g. bidirectional image tokens), transformers' own boolean 4-D mask."""
    from transformers import masking_utils
    if use_vmap:
        kwargs["allow_is_causal_skip"] = False
        return masking_utils.sdpa_mask(*args, use_vmap=True, **kwargs)
    return masking_utils.flash_attention_mask(*args, **kwargs)


def _packed_seqlens(position_ids, length):
    """cu_seqlens (int32) when position_ids (1, L) hold several sequences (a position that does
    not follow its predecessor starts one), else None."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 \
            or position_ids.shape[1] != length or length < 2:
        return None
    pos = position_ids[0]
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    zero = starts.new_zeros(1)
    end = starts.new_full((1,), length)
    return torch.cat([zero, starts, end]).to(torch.int32)


def _contiguous_runs(mask):
    """True when every row of the 2-D bool mask keeps one contiguous run of positions (left or
    right padding, or none): then packing the kept rows preserves each query's distance to its
    keys."""
    kept = mask.sum(1)
    idx = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, idx, mask.shape[1]).amin(1)
    last = torch.where(mask, idx, -1).amax(1)
    return bool(((kept == 0) | (last - first + 1 == kept)).all())


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query (B, H, Lq, D), key / value
    (B, Hkv, Lk, D[v]) -> (output (B, Lq, H, Dv), None). The attention weights are never
    materialised (output_attentions is not supported: use attn_implementation="eager")."""
    if kwargs.get("output_attentions"):
        raise ValueError("flashsdpa.hf: output_attentions=True needs the attention weights, "
                         "which fused attention never forms; use attn_implementation='eager'")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # transformers' windows: key kv visible from query q iff q - W < kv (and kv <= q if causal)
    left = int(sliding_window) - 1 if sliding_window else -1
    window = (left, 0 if causal else left)
    sinks = s_aux.float() if s_aux is not None else None
    variants = dict(softmax_scale=scaling, window_size=window, softcap=float(softcap or 0.0),
                    sinks=sinks)
    p = float(dropout)
    B, Lq = query.shape[0], query.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, L, H, D)

    if attention_mask is not None and attention_mask.dim() == 4:  # windows already inside it
        return _masked(query, key, value, attention_mask[..., :key.shape[2]], p, variants), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is None and key.shape[2] == Lq:
        cu_q = cu_k = _packed_seqlens(kwargs.get("position_ids"), Lq)
    if attention_mask is None and cu_q is not None and cu_k is not None:
        max_q = kwargs.get("max_length_q") or int((cu_q[1:] - cu_q[:-1]).max())
        max_k = kwargs.get("max_length_k") or int((cu_k[1:] - cu_k[:-1]).max())
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, p, causal=causal,
            **variants)
        return out.view(B, Lq, *out.shape[1:]), None

    if attention_mask is None:
        return flash_attn_func(q, k, v, p, causal=causal, **variants), None

    mask = attention_mask.bool()
    Lm = mask.shape[1]
    if key.shape[2] > Lm:  # a static cache: the slots past the mask hold no token yet
        key, value = key[:, :, :Lm], value[:, :, :Lm]
        k, v = key.transpose(1, 2), value.transpose(1, 2)
    if bool(mask.all()):
        return flash_attn_func(q, k, v, p, causal=causal, **variants), None
    if Lq == Lm and _contiguous_runs(mask):
        return _unpadded(q, k, v, mask, p, causal, variants), None
    # a padded batch decoding (or a mask with holes): the mask, bottom-right causality and the
    # window as one boolean mask (B, 1, Lq, Lm)
    i = torch.arange(Lq, device=mask.device).view(-1, 1) + (Lm - Lq)
    j = torch.arange(Lm, device=mask.device).view(1, -1)
    visible = mask[:, None, None, :].expand(B, 1, Lq, Lm)
    if causal:
        visible = visible & (j <= i)
    if left >= 0:
        visible = visible & (j >= i - left) & (j <= i + window[1])
    return _masked(query, key, value, visible, p, variants), None


def _masked(query, key, value, mask, p, variants):
    """SDPA layout with an explicit mask, which holds the causality and the window (the
    variants' window_size is not applied) -> (B, Lq, H, Dv)."""
    out = scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=p, scale=variants["softmax_scale"],
        enable_gqa=query.shape[1] != key.shape[1], softcap=variants["softcap"],
        sinks=variants["sinks"])
    return out.transpose(1, 2)


def _unpadded(q, k, v, mask, p, causal, variants):
    """Queries and keys are the same padded positions: pack the kept rows of every sequence,
    run the varlen kernel, put the rows back (padded rows 0)."""
    B, L = mask.shape
    rows = torch.nonzero(mask.reshape(-1)).flatten()
    seqlens = mask.sum(1, dtype=torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(seqlens, 0)
    max_len = int(seqlens.max())

    def pack(t):
        return t.reshape(B * L, *t.shape[2:]).index_select(0, rows)

    out = flash_attn_varlen_func(pack(q), pack(k), pack(v), cu, cu, max_len, max_len, p,
                                 causal=causal, **variants)
    full = out.new_zeros((B * L, *out.shape[1:]))
    full = full.index_copy(0, rows, out)
    return full.view(B, L, *out.shape[1:])
