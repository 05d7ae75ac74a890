"""Paged caches for the DeepSeek Sparse Attention kernel tests: requests of given lengths
in scattered blocks of one cache, with NaN in every slot no request uses (a kernel that
reads past a context or an unselected slot poisons its output)."""

from __future__ import annotations

import torch


class PagedCase:
    """seq_lens[r] tokens of request r in a cache [num_blocks, block_size, width]; the
    block table (int32, scattered blocks, padded with block 0); `cache` holds random
    values everywhere, `cache_nan` NaN in the unused slots."""

    def __init__(self, seq_lens, block_size, width, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.block_size = list(seq_lens), block_size
        needed = [max(1, -(-s // block_size)) for s in seq_lens]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        tables = []
        for seq_len, n in zip(seq_lens, needed):
            table = [order.pop() for _ in range(n)]
            for pos in range(seq_len):
                used[table[pos // block_size], pos % block_size] = True
            tables.append(table + [0] * (max(needed) - n))
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.cache = (torch.randn(num_blocks, block_size, width, generator=gen) * 0.5).to(dtype)
        self.cache_nan = self.cache.clone()
        self.cache_nan[~used] = float("nan")
        self.gen = gen

    def token(self, req: int, pos: int) -> torch.Tensor:
        """The cached entry of request req's token pos."""
        return self.cache[self.tables[req, pos // self.block_size], pos % self.block_size]

    def randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(dtype)
