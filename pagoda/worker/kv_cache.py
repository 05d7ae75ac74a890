"""KV cache tensors: sizing the pool from a byte budget and allocating one tensor per layer.

Layout (the attention contract): [2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for_budget(budget_bytes: int, per_block: int, block_size: int,
                          max_model_len: int) -> int:
    """Blocks that fit in the budget; at least enough for one full-length sequence."""
    num_blocks = budget_bytes // per_block
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget ({budget_bytes / 2**20:.1f} MiB) holds {num_blocks} blocks of "
            f"{block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
            f"needs ({needed}); raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
    return int(num_blocks)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    # Zeroed: a masked-out slot must never hold NaN/Inf, since 0 * NaN poisons a sum.
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]
