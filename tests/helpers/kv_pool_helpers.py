"""Test helpers: KV pools holding given full-attention caches, and one layer's attention
through a pool as the Attention layer runs it (store, then attend)."""

from __future__ import annotations

import torch

from pagoda.attention.kv_pool import KVCachePool
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig


def pool_holding(caches: list[torch.Tensor], layouts=None) -> KVCachePool:
    """A pool of full-attention layers that start as copies of caches
    ([2, num_blocks, block_size, num_kv_heads, head_dim] each, one shape)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = caches[0].shape
    spec = FullAttentionSpec(
        block_size, num_kv_heads, head_dim, str(caches[0].dtype).removeprefix("torch.")
    )
    pool = KVCachePool(KVCacheConfig(num_blocks, [spec] * len(caches)), caches[0].device, layouts)
    for dst, src in zip(pool.caches, caches):
        dst.copy_(src)
    return pool


def store_and_attend(backend, pool: KVCachePool, layer: int, q, k, v, common, plan=None, **kw):
    """One layer's attention: the pool stores k/v, the backend attends (plan: the step's
    backend metadata, built here when not given)."""
    pool.store(layer, common, k, v)
    plan = backend.build_metadata(common) if plan is None else plan
    return backend.forward(q, pool.cache(layer), plan, **kw)
