"""The torch reference of the fused MoE computation (no Triton): the golden one the
Triton kernel is tested against, and the path the engine takes on the CPU.

``fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)``: for every token and
each of its k choices, ``down(silu(gate(x)) * up(x)) * weight``, summed over the k
choices. Loops over the experts that have tokens (a host sync per layer: fine on the
CPU, and the reason the GPU takes the kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_moe_shapes(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Raises ValueError unless the operands of a fused MoE agree."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden_size or two_inter % 2:
        raise ValueError(f"w13 must be [E, 2*I, {hidden_size}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(
            f"w2 must be [{num_experts}, {hidden_size}, {two_inter // 2}], got {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [{num_tokens}, k]"
        )


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Linear = F.linear,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights
    [T, k] (float32), topk_ids [T, k] (int; -1: an expert held by another rank, which
    contributes nothing here) -> [T, H] in hidden's dtype, accumulated in float32.
    linear(x, w) computes each expert's products (the CPU path passes the model's
    column-blocked matmul, which equals F.linear bit for bit)."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        x = hidden.index_select(0, tokens)
        gate, up = linear(x, w13[expert]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
