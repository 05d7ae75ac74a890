"""KernelConfigs: one device's kernel configs, one per kernel family, handed to the model
and its attention backend.

The model runner builds it once for its device (`KernelConfigs.for_device`) or takes
one at construction (benchmarks A/B named variants: benchmarks/harness/variants.py),
passes `decode` / `mla` to the attention backend it makes and `install`s the rest on
the model's layers: each linear layer keeps its GEMV table (`gemv_config`) and the CPU
block kernels' variant (`cpu_blocks_config`), each FusedMoE its MoE tiles
(`kernel_config`), and hands them to the kernels' wrappers. The
launch family's config (PDL) is a property of the device, looked up by the launches
themselves (pagoda.kernels.launch.config). Building one imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels.attention.decode_config import DecodeAttentionConfig
from pagoda.kernels.attention.mla_config import MLAKernelConfig
from pagoda.kernels.gemv.config import GemvConfig
from pagoda.kernels.launch.config import LaunchConfig
from pagoda.kernels.moe.config import MoEKernelConfig
from pagoda.model.layers.linear import LinearBase
from pagoda.model.layers.moe.fused_moe import FusedMoE
from pagoda.model.quant.cpu_kernels import CpuBlocksConfig


@dataclass(frozen=True)
class KernelConfigs:
    """decode: decode attention (with the FP8-KV decode); mla: MLA decode and prefill;
    gemv: the bf16 / fp16 GEMV's routing table; moe: the fused-MoE kernels; launch:
    programmatic dependent launch (informational: the device decides it); cpu_blocks:
    the CPU block kernels of the int8, int4 and gguf schemes (and the fused CPU decode
    step that follows them)."""

    decode: DecodeAttentionConfig
    mla: MLAKernelConfig
    gemv: GemvConfig
    moe: MoEKernelConfig
    launch: LaunchConfig
    cpu_blocks: CpuBlocksConfig

    @classmethod
    def for_device(cls, device: torch.device) -> KernelConfigs:
        """Every family's config for device (chosen by its compute capability)."""
        device = torch.device(device)
        return cls(
            decode=DecodeAttentionConfig.for_device(device),
            mla=MLAKernelConfig.for_device(device),
            gemv=GemvConfig.for_device(device),
            moe=MoEKernelConfig.for_device(device),
            launch=LaunchConfig.for_device(device),
            cpu_blocks=CpuBlocksConfig.for_device(device),
        )

    def install(self, model: nn.Module) -> None:
        """Gives model's layers their configs: every linear layer the GEMV table and
        the CPU block kernels' config, every FusedMoE the MoE tiles (attributes the
        layers pass to the kernels)."""
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.gemv_config = self.gemv
                module.cpu_blocks_config = self.cpu_blocks
            elif isinstance(module, FusedMoE):
                module.kernel_config = self.moe
