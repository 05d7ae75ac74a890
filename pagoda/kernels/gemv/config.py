"""GemvConfig: which decode-sized linear layers take the Triton GEMV, with which tiles
(the GEMV family's config).

A table keyed by (N, K, rows bucket) -> GemvTiles, where the rows bucket is M rounded up
to a power of two (1, 2, 4, 8, 16: the decode graphs' and eager steps' row buckets,
pagoda.worker.shape_buckets). An entry means: on that device, in a CUDA graph, those
tiles beat torch F.linear (cuBLAS) at that shape; `gemv.maybe_gemv` routes only the
shapes listed (N, K are the per-rank weight shape, so a tensor-parallel layer has its
own entries). The tables are data keyed by device capability (GEMV_TABLES); a device
not listed takes Hopper's. The linear layers receive their config from the model
runner. Importing this module imports no triton.

The FP8 weights' one-row kernel (pagoda.kernels.fp8.w8a16) picks its tiles by a rule of
the shape (w8a16_config), not from this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagoda.kernels.launch.capability import cuda_capability


@dataclass(frozen=True)
class GemvTiles:
    """block_n output columns a program, block_k columns a K step (powers of two),
    split_k K splits (>= 1), loop_stages K steps of loads in flight, num_warps, and dot:
    tl.dot on 16 padded rows rather than FMA (needs block_n >= 16)."""

    block_n: int
    block_k: int
    split_k: int
    loop_stages: int
    num_warps: int
    dot: bool = False


def rows_bucket(m: int) -> int:
    """M rounded up to a power of two: the table's row key."""
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


@dataclass(frozen=True)
class GemvConfig:
    """table: (N, K, rows bucket) -> the tiles of a shape routed to the Triton GEMV."""

    table: Mapping[tuple[int, int, int], GemvTiles] = field(default_factory=dict)

    @classmethod
    def for_device(cls, device: torch.device) -> GemvConfig:
        """for_capability of device's compute capability on CUDA; Hopper's table on the
        CPU, where the tests run the kernel interpreted."""
        device = torch.device(device)
        return cls.for_capability(cuda_capability(device) if device.type == "cuda" else HOPPER)

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> GemvConfig:
        """GEMV_TABLES' table for a CUDA compute capability (Hopper's for one not listed)."""
        return _CONFIGS.get(tuple(capability), _CONFIGS[HOPPER])

    def lookup(self, n: int, k: int, m: int) -> GemvTiles | None:
        """The tiles for an [m, k] x [n, k] product, or None (F.linear keeps it)."""
        return self.table.get((n, k, rows_bucket(m)))


HOPPER = (9, 0)


def _tiles(block_n, block_k, split_k, loop_stages, dot=False):
    return GemvTiles(block_n, block_k, split_k, loop_stages, num_warps=4, dot=dot)


# Batch 1 of the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (the GEMV sweep at one row,
# cold weights; cuBLAS -> this kernel), and Llama-3.1-8B's at 1 and 8 rows (8 rows: a
# speculative verify step of up to 7 drafts), measured on the H200. Shapes and row
# buckets not listed (Llama's gate_up at any rows, its qkv at 8) measured within 3% of
# cuBLAS: cuBLAS keeps them (docs/performance.md, "Measured reasons: GEMV and FP8
# weights"). Other devices take these too (unmeasured).
GEMV_TABLES: dict[tuple[int, int], dict[tuple[int, int, int], GemvTiles]] = {
    HOPPER: {
        (2048, 4096, 1): _tiles(4, 512, 1, 4),  # Qwen3-30B-A3B o_proj, 8.57 -> 6.35 us
        (5120, 2048, 1): _tiles(8, 256, 1, 4),  # Qwen3-30B-A3B qkv_proj, 8.00 -> 6.97 us
        (2048, 2048, 1): _tiles(4, 512, 1, 3),  # DeepSeek-V2-Lite o_proj, 6.07 -> 4.37 us
        (3072, 2048, 1): _tiles(4, 512, 1, 3),  # DeepSeek-V2-Lite q_proj, 6.49 -> 5.31 us
        # DeepSeek-V2-Lite kv_a_proj_with_mqa, 6.02 -> 2.90 us
        (576, 2048, 1): _tiles(4, 1024, 1, 3),
        # DeepSeek-V2-Lite shared experts' gate/up, 8.32 -> 7.50 us, and down, 7.84 -> 5.17
        (5632, 2048, 1): _tiles(16, 256, 1, 4),
        (2048, 2816, 1): _tiles(4, 512, 1, 4),
        (6144, 4096, 1): _tiles(8, 256, 1, 4),  # Llama-3.1-8B qkv_proj, 15.63 -> 14.00 us
        # Llama-3.1-8B o_proj, 1 row 13.21 -> 10.39 us, 8 rows 13.16 -> 11.64 us
        (4096, 4096, 1): _tiles(4, 512, 1, 4),
        (4096, 4096, 8): _tiles(64, 128, 4, 3, dot=True),
        # Llama-3.1-8B down_proj, 1 row 31.93 -> 28.89 us, 8 rows 32.43 -> 31.07 us
        (4096, 14336, 1): _tiles(4, 512, 1, 3),
        (4096, 14336, 8): _tiles(32, 128, 4, 3, dot=True),
    },
}
_CONFIGS = {capability: GemvConfig(table) for capability, table in GEMV_TABLES.items()}
