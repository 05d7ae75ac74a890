"""LinearAttentionKernelConfig: the tiles of the gated delta-rule and causal conv1d
kernels on one device (the linear_attention family's config).

The layer that calls the kernels builds one (`for_device`) and passes its parts to the
wrappers; tests pass small variants (`dataclasses.replace`). The tiles are data keyed by
device capability (CONFIGS); a device not listed takes Hopper's. Importing this module
imports no triton.

Hopper's entry is compile-checked at the Qwen3-Next / Kimi-Linear head shape (Dk = Dv =
128, tools/compile_sm90.py's compiler): a prefill program with chunk 64 and 64 value
columns keeps too many [chunk, Dk] float32 tiles and spills tens of KB a thread; chunk
32 x 32 columns with 8 warps spills under 1 KB. None of the entries is timed yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.launch.capability import cuda_capability


def _power_of_two(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"{name} {value}: a power of two >= {least}")


@dataclass(frozen=True)
class DecodeTiles:
    """The recurrent step: block_v value columns of the [Dk, Dv] state a program."""

    block_v: int
    num_warps: int

    def __post_init__(self) -> None:
        _power_of_two("block_v", self.block_v, 16)


@dataclass(frozen=True)
class PrefillTiles:
    """The chunked prefill: chunk tokens a step (the size of the triangular system it
    inverts), block_v value columns a program (programs of one head repeat the chunk's
    key-side work, so fewer, wider tiles cost less work and more registers)."""

    chunk: int
    block_v: int
    num_warps: int

    def __post_init__(self) -> None:
        _power_of_two("chunk", self.chunk, 16)
        _power_of_two("block_v", self.block_v, 16)


@dataclass(frozen=True)
class ConvTiles:
    """The causal conv1d: block_t tokens x block_c channels a program step."""

    block_t: int
    block_c: int
    num_warps: int

    def __post_init__(self) -> None:
        _power_of_two("block_t", self.block_t, 1)
        _power_of_two("block_c", self.block_c, 16)


@dataclass(frozen=True)
class LinearAttentionKernelConfig:
    decode: DecodeTiles
    prefill: PrefillTiles
    conv: ConvTiles

    @classmethod
    def for_device(cls, device: torch.device) -> LinearAttentionKernelConfig:
        """for_capability of device's compute capability on CUDA; Hopper's tiles on the
        CPU, whose interpreter runs the GPU's tiles."""
        device = torch.device(device)
        return cls.for_capability(cuda_capability(device) if device.type == "cuda" else HOPPER)

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> LinearAttentionKernelConfig:
        """CONFIGS' entry for a CUDA compute capability (Hopper's for one not listed)."""
        return CONFIGS.get(tuple(capability), CONFIGS[HOPPER])


HOPPER = (9, 0)

CONFIGS: dict[tuple[int, int], LinearAttentionKernelConfig] = {
    HOPPER: LinearAttentionKernelConfig(
        decode=DecodeTiles(block_v=32, num_warps=4),
        prefill=PrefillTiles(chunk=32, block_v=32, num_warps=8),
        conv=ConvTiles(block_t=16, block_c=128, num_warps=4),
    ),
}
