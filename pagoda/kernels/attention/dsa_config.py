"""DSAKernelConfig: the DeepSeek Sparse Attention kernels' tiles on one device.

Three kernels: the lightning indexer's scores and their top-k (dsa_indexer.py) and
sparse latent attention over the selected entries (sparse_mla.py). The layer or backend that calls them builds
one config (`DSAKernelConfig.for_device`) and passes it in; tests and benchmarks pass
variants (`dataclasses.replace`). The tiles are data keyed by device capability
(DSA_CONFIGS); a device not listed takes Hopper's. Importing this module imports no
triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.attention.mla_config import HOPPER
from pagoda.kernels.launch.capability import cuda_capability


@dataclass(frozen=True)
class IndexerTiles:
    """The indexer kernel: a program scores tiles_per_program tiles of block_n tokens of
    one query row, every indexer head at once (tokens are the dot's M dimension)."""

    block_n: int
    tiles_per_program: int
    num_warps: int
    num_stages: int

    @property
    def tokens_per_program(self) -> int:
        return self.block_n * self.tiles_per_program

    def launch(self) -> dict:
        return dict(
            BLOCK_N=self.block_n,
            TILES=self.tiles_per_program,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


@dataclass(frozen=True)
class TopkTiles:
    """The indexer's top-k kernel: a program reads scores block tokens at a time (each
    radix pass and the final write). One program per row, or, when rows are fewer than
    the SMs' programs_per_sm programs, each row cut into at most max_segments segments
    of at least min_segment tokens (six launches instead of one)."""

    block: int
    num_warps: int
    min_segment: int = 16384
    max_segments: int = 32

    def __post_init__(self):
        # The kernel packs two per-tile counts into one int32 (16 bits each).
        if self.block & (self.block - 1) or not 16 <= self.block <= 32768:
            raise ValueError(f"block must be a power of two in [16, 32768], got {self.block}")
        if self.max_segments & (self.max_segments - 1):
            raise ValueError(f"max_segments must be a power of two, got {self.max_segments}")

    def segments(self, num_rows: int, width: int, num_sms: int, programs_per_sm: int) -> int:
        """Segments per row: 1 when the rows alone fill the GPU or are short."""
        by_length = -(-width // max(self.min_segment, self.block))
        by_occupancy = -(-programs_per_sm * num_sms // max(1, num_rows))
        return max(1, min(by_length, by_occupancy, self.max_segments))

    def launch(self) -> dict:
        return dict(BLOCK=self.block, num_warps=self.num_warps)


@dataclass(frozen=True)
class SparseMLATiles:
    """The sparse latent kernel: block_h query heads and block_n selected entries a step.
    Its accumulator is block_h x kv_lora_rank float32, its entry tile block_n x
    (kv_lora_rank + rope), as in the dense latent kernel."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class DSAKernelConfig:
    """The DSA kernels' tiles for 16-bit and float32 inputs, and how the sparse kernel
    splits its selected entries: no split holds fewer than min_split entries, and a
    launch aims at programs_per_sm programs per SM."""

    indexer_16bit: IndexerTiles
    indexer_fp32: IndexerTiles
    sparse_16bit: SparseMLATiles
    sparse_fp32: SparseMLATiles
    topk: TopkTiles = TopkTiles(block=2048, num_warps=8)
    min_split: int = 256
    programs_per_sm: int = 2
    max_splits: int = 64

    @classmethod
    def for_device(cls, device: torch.device) -> DSAKernelConfig:
        """for_capability of device's compute capability on CUDA; Hopper's tiles on the
        CPU, whose interpreter runs the GPU's tiles."""
        device = torch.device(device)
        return cls.for_capability(cuda_capability(device) if device.type == "cuda" else HOPPER)

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> DSAKernelConfig:
        """DSA_CONFIGS' entry for a CUDA compute capability (Hopper's for one not listed)."""
        return DSA_CONFIGS.get(tuple(capability), DSA_CONFIGS[HOPPER])

    def indexer_tiles(self, dtype: torch.dtype) -> IndexerTiles:
        return self.indexer_fp32 if dtype == torch.float32 else self.indexer_16bit

    def sparse_tiles(self, dtype: torch.dtype) -> SparseMLATiles:
        return self.sparse_fp32 if dtype == torch.float32 else self.sparse_16bit

    def sparse_splits(
        self, num_rows: int, num_heads: int, num_selected: int, num_sms: int, dtype: torch.dtype
    ) -> int:
        """Splits of each row's selected entries: enough programs to fill num_sms SMs
        programs_per_sm times over, none shorter than min_split, at most max_splits.
        Many rows (prefill, large batches) fill the GPU alone and get 1."""
        head_blocks = -(-num_heads // self.sparse_tiles(dtype).block_h)
        programs = max(1, num_rows * head_blocks)
        by_length = -(-num_selected // self.min_split)
        by_occupancy = -(-self.programs_per_sm * num_sms // programs)
        return max(1, min(by_length, by_occupancy, self.max_splits))


# Untuned: sized like the dense latent kernel (mla_config.py) and for the indexer's
# 64 heads x 128 dims (a 64 x 128 query tile and a 64 x 128 key tile per step: 32 KiB
# of 16-bit operands a stage); other devices take these too.
DSA_CONFIGS: dict[tuple[int, int], DSAKernelConfig] = {
    HOPPER: DSAKernelConfig(
        indexer_16bit=IndexerTiles(block_n=64, tiles_per_program=8, num_warps=4, num_stages=3),
        # float32 (IEEE dots on CUDA cores, for fidelity, not speed): smaller key tiles.
        indexer_fp32=IndexerTiles(block_n=32, tiles_per_program=8, num_warps=4, num_stages=1),
        sparse_16bit=SparseMLATiles(block_h=16, block_n=32, num_warps=4, num_stages=2),
        sparse_fp32=SparseMLATiles(block_h=16, block_n=16, num_warps=4, num_stages=1),
        topk=TopkTiles(block=2048, num_warps=8),
    ),
}
