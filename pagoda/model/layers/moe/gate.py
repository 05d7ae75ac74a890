"""MoEGate: the router linear [num_experts, hidden] -> router logits, replicated on
every tensor-parallel rank (each rank routes every token itself, so no collective).

``fp32=True`` keeps the weight in float32 whatever the model's dtype and computes the
logits in float32, as transformers' DeepSeek routers do (sigmoid / grouped choices are
sensitive to rounding); Qwen3-MoE's router runs in the model's dtype.

MoE blocks call it through pagoda.model.layers.moe.routing.route, which on CUDA at
decode sizes computes the logits and the routing in one kernel (the gate then only
lends its weight and keeps that kernel's per-layer scratch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.layers.linear import default_weight_loader


class MoEGate(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, fp32: bool = False) -> None:
        super().__init__()
        self.fp32 = fp32
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32 if fp32 else None),
            requires_grad=False,
        )
        self.weight.weight_loader = default_weight_loader
        self.weight.keep_dtype = fp32
        # The fused router kernel's per-layer scratch and counter (routing.route makes
        # it on the first CUDA call; a plain attribute: no state_dict entry, and
        # materialize() would leave a buffer's counter uninitialised).
        self.router_scratch = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> router logits [T, E] (float32 when fp32, else hidden's dtype)."""
        if self.fp32:
            return F.linear(hidden.float(), self.weight)
        return F.linear(hidden, self.weight)
