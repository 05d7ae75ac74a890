"""A paged-attention test case shared by the Triton attention tests (tests/kernels,
tests/worker): a batch of requests, its two KV pools (the reference's and the kernel's)
and its metadata, on the GPU when there is one."""

import torch

from helpers.kv_pool_helpers import pool_holding
from pagoda.attention.kv_pool import FullAttentionLayout
from pagoda.attention.metadata import build_attention_metadata
from pagoda.core.kv_cache_spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The reference stores with torch's index_copy, the case under test with the kernel.
TORCH_STORE = {FullAttentionSpec: FullAttentionLayout(use_triton=False)}
TRITON_STORE = {FullAttentionSpec: FullAttentionLayout(use_triton=True)}


class Case:
    """A batch of requests given as (tokens already cached, query length), its KV pools
    and metadata. pool_ref holds finite values everywhere (torch_ref reads whole
    blocks); pool_tri is the same with every slot no request uses set to NaN."""

    def __init__(
        self,
        shapes,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        pad_rows=0,
        spare_blocks=3,
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        needed = [-(-(ctx + qlen) // block_size) for ctx, qlen in shapes]
        num_blocks = sum(needed) + spare_blocks
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, used = [], torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for (ctx, qlen), n in zip(shapes, needed):
            table, order = order[:n], order[n:]
            self.tables.append(table)
            pos = torch.arange(ctx + qlen)
            used[torch.tensor(table)[pos // block_size], pos % block_size] = True
        self.used = used.to(DEVICE)
        qlens = [qlen for _, qlen in shapes]
        seqs = [ctx + qlen for ctx, qlen in shapes]
        rows = sum(qlens) + pad_rows
        self.md = build_attention_metadata(
            qlens, seqs, self.tables, block_size, DEVICE, pad_to=rows if pad_rows else None
        )

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

        self.q = rand(rows, num_heads, head_dim)
        self.k = rand(rows, num_kv_heads, head_dim)
        self.v = rand(rows, num_kv_heads, head_dim)
        cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
        self.pool_ref = pool_holding([cache], TORCH_STORE)
        cache[:, ~self.used] = float("nan")
        self.pool_tri = pool_holding([cache], TRITON_STORE)

    @property
    def cache_ref(self) -> torch.Tensor:
        return self.pool_ref.cache(0)

    @property
    def cache_tri(self) -> torch.Tensor:
        return self.pool_tri.cache(0)
