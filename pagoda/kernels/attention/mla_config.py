"""MLAKernelConfig: the MLA latent-decode and prefill kernels' tiles on one device.

The MLA Triton backend builds one at construction (`MLAKernelConfig.for_device`) and
passes it to `mla_decode.mla_decode` and `mla_prefill.mla_prefill_attention`; tests and
benchmarks pass variants (`dataclasses.replace`). The tiles are data keyed by device
capability (MLA_CONFIGS); a device not listed takes Hopper's. Importing this module
imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.launch.capability import cuda_capability


@dataclass(frozen=True)
class MLADecodeTiles:
    """The latent decode kernel: block_h query heads and block_n keys a program step.
    Its accumulator is block_h x kv_lora_rank float32 (16 x 512 at DeepSeek's shape)
    and its key tile block_n x kv_lora_rank: kept small so both fit on chip."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class MLAPrefillTiles:
    """The prefill kernel: block_m query rows x block_n keys a step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


@dataclass(frozen=True)
class MLAKernelConfig:
    """The MLA kernels' tiles for 16-bit and float32 inputs. prefill_*.block_m is also
    the granularity of the plan's prefill tile table, built before the layer's dtype is
    known: it must be the same for both dtypes."""

    decode_16bit: MLADecodeTiles
    decode_fp32: MLADecodeTiles
    prefill_16bit: MLAPrefillTiles
    prefill_fp32: MLAPrefillTiles

    def __post_init__(self) -> None:
        if self.prefill_16bit.block_m != self.prefill_fp32.block_m:
            raise ValueError(
                f"MLA prefill tiles need one block_m for every dtype, got "
                f"{self.prefill_16bit.block_m} and {self.prefill_fp32.block_m}"
            )

    @classmethod
    def for_device(cls, device: torch.device) -> MLAKernelConfig:
        """for_capability of device's compute capability on CUDA; Hopper's tiles on the
        CPU, whose interpreter runs the GPU's tiles."""
        device = torch.device(device)
        return cls.for_capability(cuda_capability(device) if device.type == "cuda" else HOPPER)

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> MLAKernelConfig:
        """MLA_CONFIGS' entry for a CUDA compute capability (Hopper's for one not listed)."""
        return MLA_CONFIGS.get(tuple(capability), MLA_CONFIGS[HOPPER])

    def decode_tiles(self, dtype: torch.dtype) -> MLADecodeTiles:
        return self.decode_fp32 if dtype == torch.float32 else self.decode_16bit

    def prefill_tiles(self, dtype: torch.dtype) -> MLAPrefillTiles:
        return self.prefill_fp32 if dtype == torch.float32 else self.prefill_16bit

    @property
    def prefill_tile_rows(self) -> int:
        """The prefill plan's tile rows (block_m, the same for every dtype)."""
        return self.prefill_16bit.block_m


HOPPER = (9, 0)
# Tuned on Hopper (H200); other devices take these too (unmeasured).
MLA_CONFIGS: dict[tuple[int, int], MLAKernelConfig] = {
    HOPPER: MLAKernelConfig(
        decode_16bit=MLADecodeTiles(block_h=16, block_n=32, num_warps=4, num_stages=2),
        # float32 (IEEE dots on CUDA cores, for fidelity, not speed): smaller key tiles.
        decode_fp32=MLADecodeTiles(block_h=16, block_n=16, num_warps=4, num_stages=1),
        # 128 query rows x 64 keys, 8 warps, 3 stages (per stage the K_nope, K_rope and V
        # tiles of DeepSeek's 128/64/128 widths take 40 KiB of shared memory).
        prefill_16bit=MLAPrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
        prefill_fp32=MLAPrefillTiles(block_m=128, block_n=16, num_warps=8, num_stages=1),
    ),
}
