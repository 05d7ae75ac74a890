"""The default linear method: one float weight [out, in] in the model's dtype, multiplied
by ``pagoda.model.layers.matmul.linear`` (F.linear, split into column blocks on the CPU)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagoda.model.layers.matmul import linear
from pagoda.model.quant.base import WEIGHT_DIMS, LinearMethod


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int,
                       num_shards: int) -> None:
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
