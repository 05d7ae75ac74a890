"""Attention layer: hands q/k/v to the backend of the current forward context.

The layer owns no weights; it only knows its index (which KV cache tensor is its own)
and its head geometry. Backends take [T, heads, head_dim]; the model works in
[T, heads * head_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.forward_context import get_forward_context


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; also writes k/v into this layer's cache."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        out = ctx.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
