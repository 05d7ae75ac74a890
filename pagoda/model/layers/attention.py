"""Attention layer: declares its KV cache spec, stores its k/v through the KV pool and
hands q to the backend of the current forward context.

The layer owns no weights; it only knows its index (which layer of the KV pool is its
own) and its head geometry. Backends take [T, heads, head_dim]; the model works in
[T, heads * head_dim]. ``kv_cache_specs(model, ...)`` collects every layer's spec,
ordered by layer index, for sizing and allocating the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.forward_context import get_forward_context
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer keeps per token: a key and a value per KV head, in dtype."""
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim,
                                 str(dtype).removeprefix("torch."))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; also writes k/v into this layer's cache."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        ctx.kv_pool.store(self.layer_idx, ctx.metadata.common,
                          k.view(num_tokens, self.num_kv_heads, self.head_dim),
                          v.view(num_tokens, self.num_kv_heads, self.head_dim))
        out = ctx.backend.forward(q.view(num_tokens, self.num_heads, self.head_dim),
                                  ctx.kv_pool.cache(self.layer_idx), ctx.metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def kv_cache_specs(model: nn.Module, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """Every attention layer's spec, index i for layer_idx i (0..n-1, each once)."""
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                    key=lambda m: m.layer_idx)
    indices = [layer.layer_idx for layer in layers]
    if indices != list(range(len(layers))):
        raise ValueError(f"attention layer indices must be 0..{len(layers) - 1}, each once; "
                         f"got {indices}")
    return [layer.get_kv_cache_spec(block_size, dtype) for layer in layers]
