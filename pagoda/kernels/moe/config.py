"""MoEKernelConfig: the fused-MoE kernels' tiles on one device (the MoE family's config).

Two paths (pagoda.kernels.moe.fused_moe): up to `gemv_max_pairs` (token, choice) pairs
the decode GEMVs of fused_moe_decode (gate/up with its SiLU epilogue, then down with
the sum over the choices), else the expert sort and two grouped GEMMs, whose tiles
depend on the rows each expert sees (`grouped_tiers`, a table as SGLang keeps its
fused-MoE configs). The tiles are data keyed by device capability (MOE_CONFIGS); a
device not listed takes Hopper's. FusedMoE receives its config from the model runner;
the kernels' entry points take it as an argument (default: `for_device`). Importing
this module imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.launch.capability import cuda_capability

# The widest intermediate row the down GEMV reads in one chunk (DownTiles.block_k None):
# 768 -> one 1024-wide load per choice, 1408 -> 2048; wider rows in chunks of 256.
DOWN_ONE_CHUNK_MAX = 2048


@dataclass(frozen=True)
class GateUpTiles:
    """The decode gate/up GEMV: block_n intermediate columns a program, block_k hidden
    columns a step, and its launch options."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


@dataclass(frozen=True)
class DownTiles:
    """The decode down GEMV: block_n hidden columns a program, block_k intermediate
    columns a step (None: the whole row in one chunk up to DOWN_ONE_CHUNK_MAX, else 256),
    num_warps, and loop_stages choices' weight rows in flight."""

    block_n: int
    block_k: int | None
    num_warps: int
    loop_stages: int

    def launch(self, inter: int) -> dict:
        """The kernel's constexprs and launch options for an intermediate size of inter."""
        block_k = self.block_k
        if block_k is None:
            block_k = (1 << (inter - 1).bit_length()) if inter <= DOWN_ONE_CHUNK_MAX else 256
        return dict(
            BLOCK_N=self.block_n,
            BLOCK_K=block_k,
            num_warps=self.num_warps,
            LOOP_STAGES=self.loop_stages,
            ONE_CHUNK=block_k >= inter,
        )


@dataclass(frozen=True)
class GroupedGemmTiles:
    """One grouped GEMM's tiles and launch options; b_tma: the B tiles by tensor
    descriptor (Hopper's TMA) where the weight allows it."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    b_tma: bool = False

    def launch(self) -> dict:
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            GROUP_M=self.group_m,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            B_TMA=self.b_tma,
        )


@dataclass(frozen=True)
class GroupedTier:
    """The grouped GEMMs' tiles for up to max_rows_per_expert expected rows an expert
    (None: any number), for 2-byte and for float32 operands."""

    max_rows_per_expert: float | None
    gate_up_16bit: GroupedGemmTiles
    down_16bit: GroupedGemmTiles
    gate_up_fp32: GroupedGemmTiles
    down_fp32: GroupedGemmTiles


@dataclass(frozen=True)
class MoEKernelConfig:
    """gemv_max_pairs: the most (token, choice) pairs the decode GEMVs take (a batch-1
    step has top-k of them); gate_up / down / narrow_down: their tiles, narrow_down for
    intermediate rows of at most narrow_down_max; grouped_tiers: the grouped GEMMs'
    tiles by rows an expert, first tier that holds them."""

    gemv_max_pairs: int
    gate_up: GateUpTiles
    down: DownTiles
    narrow_down: DownTiles
    narrow_down_max: int
    grouped_tiers: tuple[GroupedTier, ...]

    @classmethod
    def for_device(cls, device: torch.device) -> MoEKernelConfig:
        """for_capability of device's compute capability on CUDA; Hopper's tiles on the
        CPU, whose interpreter runs the GPU's tiles."""
        device = torch.device(device)
        return cls.for_capability(cuda_capability(device) if device.type == "cuda" else HOPPER)

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> MoEKernelConfig:
        """MOE_CONFIGS' entry for a CUDA compute capability (Hopper's for one not listed)."""
        return MOE_CONFIGS.get(tuple(capability), MOE_CONFIGS[HOPPER])

    def down_tiles(self, inter: int) -> DownTiles:
        """The down GEMV's tiles for an intermediate size of inter."""
        return self.narrow_down if inter <= self.narrow_down_max else self.down

    def grouped_tiles(
        self, num_pairs: int, num_experts: int, element_size: int, gemm: str
    ) -> GroupedGemmTiles:
        """The tiles of one grouped GEMM ("gate_up" or "down") by the expected rows per
        expert; BLOCK_M is the same for both (the expert sort pads to it)."""
        if gemm not in ("gate_up", "down"):
            raise ValueError(f"gemm must be 'gate_up' or 'down', got {gemm!r}")
        rows_per_expert = num_pairs / max(num_experts, 1)
        for tier in self.grouped_tiers:
            if tier.max_rows_per_expert is None or rows_per_expert <= tier.max_rows_per_expert:
                if element_size <= 2:
                    return tier.gate_up_16bit if gemm == "gate_up" else tier.down_16bit
                return tier.gate_up_fp32 if gemm == "gate_up" else tier.down_fp32
        raise ValueError(f"no grouped GEMM tier holds {rows_per_expert} rows an expert")


HOPPER = (9, 0)


def _tier(max_rows, gate_up_16bit, down_16bit=None, gate_up_fp32=None, down_fp32=None):
    """A GroupedTier whose missing entries repeat gate_up_16bit (resp. its float32 one)."""
    gate_up_fp32 = gate_up_fp32 or gate_up_16bit
    return GroupedTier(
        max_rows,
        gate_up_16bit,
        down_16bit or gate_up_16bit,
        gate_up_fp32,
        down_fp32 or gate_up_fp32,
    )


# Measured on Hopper (H100, H200); other devices take these too (unmeasured).
MOE_CONFIGS: dict[tuple[int, int], MoEKernelConfig] = {
    HOPPER: MoEKernelConfig(
        # Batch-1 decode has top-k pairs (8 for Qwen3-30B-A3B, 6 for DeepSeek-V2-Lite);
        # past 16 pairs an expert's weights would be read once a pair.
        gemv_max_pairs=16,
        # The fastest of the batch-1 kernel sweep's tiles on the H200 for both the
        # Qwen3-30B-A3B (I = 768) and DeepSeek-V2-Lite (I = 1408) layers
        # (docs/performance.md, "Measured reasons: MoE"): at batch 1 on the Qwen3
        # shape, gate/up runs k * I / 8 = 768 programs.
        gate_up=GateUpTiles(block_n=8, block_k=128, num_warps=8, num_stages=2),
        down=DownTiles(block_n=4, block_k=None, num_warps=2, loop_stages=3),
        # Rows of at most 1024 (Qwen3-30B-A3B's 768): four columns of one warp a program
        # (512 programs at batch 1 for hidden 2048), six of the k choices' weight rows
        # in flight: the fastest down kernel in the batch-1 step of the ones A/B-measured
        # in one engine on the H200: Qwen3 batch 1 2.583 -> 2.501 ms (docs/performance.md,
        # "Measured reasons: MoE").
        narrow_down=DownTiles(block_n=4, block_k=None, num_warps=1, loop_stages=6),
        narrow_down_max=1024,
        # By rows an expert: small blocks where each expert sees a few rows (the
        # weights' bytes dominate), large ones with TMA B tiles for prefill, as the
        # grouped-GEMM sweep measured best on the H200. Depths, stages and TMA are for
        # 2-byte operands: float32 takes fewer stages and pointer loads, so that the A
        # and B tiles stay inside Hopper's 227 KiB of shared memory.
        grouped_tiers=(
            _tier(
                128,
                GroupedGemmTiles(32, 128, 128, 1, 4, 3),
                gate_up_fp32=GroupedGemmTiles(32, 128, 64, 1, 4, 3),
            ),
            _tier(512, GroupedGemmTiles(64, 128, 64, 8, 4, 3)),
            _tier(
                None,
                GroupedGemmTiles(128, 128, 64, 8, 8, 4, b_tma=True),
                GroupedGemmTiles(128, 256, 64, 8, 8, 3, b_tma=True),
                GroupedGemmTiles(128, 128, 64, 8, 8, 3),
                GroupedGemmTiles(128, 128, 64, 8, 8, 3),
            ),
        ),
    ),
}
