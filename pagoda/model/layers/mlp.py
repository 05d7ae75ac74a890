"""LlamaMLP: the dense gated feed-forward block, down(silu(gate(x)) * up(x)), with gate
and up as one column-parallel projection. Llama, Qwen and DeepSeek's dense layers use it."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagoda.model.parallel import TensorParallel


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size,
            [arch.intermediate_size, arch.intermediate_size],
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        self.down_proj = RowParallelLinear(
            arch.intermediate_size, arch.hidden_size, bias=False, tp_rank=tp.rank, tp_size=tp.size
        )
        self.act = SiluAndMul()

    def takes_fp8_input(self, num_rows: int) -> bool:
        """Whether forward wants x as an Fp8Activation (its gate_up_proj's choice)."""
        return self.gate_up_proj.takes_fp8_input(num_rows)

    def forward(self, x) -> torch.Tensor:
        """x [T, hidden] (a tensor, or an Fp8Activation where takes_fp8_input) -> [T,
        hidden]. The activation is quantized on its way to down_proj where that asks for
        it; otherwise gate_up's fused SiLU step (the one-row FP8 GEMV) may run."""
        if self.down_proj.takes_fp8_input(x.shape[0]):
            return self.down_proj(self.act(self.gate_up_proj(x), fp8_out=True))
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, self.act))
