"""A small decoder-only transformer in plain PyTorch, shared by the examples that train, serve,
distribute and export one (train_transformer.py, inference.py, ddp_train.py, export_aoti.py).

Training and full-sequence forwards call F.scaled_dot_product_attention(is_causal=True), which
flashsdpa.enable() routes to flashsdpa's kernels. Generation passes a KVCache: each layer then
calls flashsdpa.flash_attn_with_kvcache, which appends the new keys / values to the cache in
place and attends over everything cached so far.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashsdpa

PERIOD = 8  # tokens in each pattern of the synthetic data (repeated_patterns)


@dataclass
class Config:
    vocab: int = 32
    dim: int = 128
    heads: int = 4          # head_dim = dim // heads
    layers: int = 2
    max_len: int = 64       # positions (learned embeddings)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, cache=None, layer=0):
        # x: [B, L, dim] -> q, k, v: [B, L, H, Dh] (strided views of one projection)
        B, L, dim = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, dim // self.heads).unbind(2)
        if cache is None:
            # SDPA's layout is [B, H, L, Dh]; row i sees keys j <= i
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            y = y.transpose(1, 2)
        else:
            # flash-attn's layout [B, L, H, Dh]: k, v written at rows cache.length ..
            # cache.length + L of this layer's cache; the L queries are the last L positions
            # (bottom-right causal), so one call serves both the prompt and each new token
            y = flashsdpa.flash_attn_with_kvcache(q, cache.k[layer], cache.v[layer], k, v,
                                                  cache_seqlens=cache.length, causal=True)
        return self.out(y.reshape(B, L, dim))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x, cache=None, layer=0):
        x = x + self.attn(self.norm1(x), cache, layer)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx, cache=None):
        # idx: [B, L] token ids -> logits [B, L, vocab]; with a cache, idx continues the
        # cached sequences at position cache.length (the cache advances by L)
        start = 0 if cache is None else cache.length
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.head(self.norm(x))


class KVCache:
    """Keys and values of every layer, [layers, B, max_len, H, Dh] each, filled up to `length`
    (the same for every sequence of the batch)."""

    def __init__(self, cfg, batch, dtype=torch.float32):
        shape = (cfg.layers, batch, cfg.max_len, cfg.heads, cfg.dim // cfg.heads)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.length = 0


def repeated_patterns(batch, length, vocab, period=PERIOD, generator=None):
    """Synthetic language: each row repeats a random pattern of `period` tokens. Only attention
    can predict a token from the one `period` positions back, so the loss falls as the model
    learns to copy (from ln(vocab) towards ln(vocab) * period / length)."""
    pattern = torch.randint(vocab, (batch, period), generator=generator)
    return pattern.repeat(1, -(-length // period))[:, :length]


def lm_loss(model, idx):
    """Next-token cross-entropy over a batch of token rows."""
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def profiled(fn):
    """fn()'s result and the flashsdpa kernels that ran during it (each kernel entry is named in
    the profiler: flashsdpa::cpu_forward[tier,dtype], ...; none when PyTorch's kernels served)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sorted({e.name for e in prof.events() if e.name.startswith("flashsdpa::")})
