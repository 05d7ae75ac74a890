"""The grouped output projection of DeepSeek V4's attention.

V4's attention output is num_heads * head_dim wide (V4-Flash: 64 * 512 = 32768), too
wide for one dense projection to hidden. The heads are split into ``o_groups`` groups of
consecutive heads; each group's [heads_per_group * head_dim] slice is projected on its
own to ``o_lora_rank`` values (``o_a_proj``, a ``GroupedLinear``: a block-diagonal
weight), and the concatenated [o_groups * o_lora_rank] row is projected to hidden by one
dense row-parallel linear (``o_b_proj``).

``GroupedLinear`` stores the block-diagonal weight as Hugging Face does: [num_groups *
out_per_group, in_per_group], group g's rows at [g * out_per_group, (g + 1) *
out_per_group). Under tensor parallelism each rank holds whole groups (its heads are
num_heads / tp consecutive heads, so o_groups must divide by tp): rank r's rows are a
contiguous slice, and its [local_groups * o_lora_rank] output is exactly the input
columns o_b_proj's rank r holds. ``grouped_output_projection`` runs both.

Weights are unquantized floats: a quantized checkpoint's o_a_proj (V4-Flash ships FP8
128x128 blocks there) needs a grouped product in its linear method, which none has yet,
so ``set_quant_method`` refuses any other method by name.
"""

from __future__ import annotations

import torch

from pagoda.model.layers.linear import LinearBase, RowParallelLinear, check_tp, divide
from pagoda.model.quant.base import LinearMethod, ShardPlan
from pagoda.model.quant.unquantized import UNQUANTIZED


class GroupedLinear(LinearBase):
    """x [T, local_groups, in_per_group] -> [T, local_groups, out_per_group]: group g
    multiplied by its own [out_per_group, in_per_group] block."""

    def __init__(
        self,
        in_per_group: int,
        out_per_group: int,
        num_groups: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        check_tp(tp_rank, tp_size)
        self.num_groups, self.out_per_group = num_groups, out_per_group
        self.local_groups = divide(num_groups, tp_size, "o_groups")
        super().__init__(in_per_group, self.local_groups * out_per_group, False, tp_rank, tp_size)

    def set_quant_method(self, method: LinearMethod) -> None:
        if method is not UNQUANTIZED:
            raise ValueError(
                f"GroupedLinear (V4's o_a_proj) runs unquantized weights only; the "
                f"{method.name!r} linear method has no grouped product"
            )
        super().set_quant_method(method)

    def shard_plan(self, shard_id: object) -> ShardPlan:
        if shard_id is not None:
            raise ValueError(f"GroupedLinear takes no shard_id, got {shard_id!r}")
        rows = self.out_per_rank
        return ShardPlan(out=(self.tp_rank * rows, rows, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups, in_per_group = self.local_groups, self.in_per_rank
        if x.dim() != 3 or x.shape[1:] != (groups, in_per_group):
            raise ValueError(f"x must be [T, {groups}, {in_per_group}], got {tuple(x.shape)}")
        # [G, out, in] -> [G, in, out]: one batched product over the groups, tokens as rows.
        w = self.weight.view(groups, self.out_per_group, in_per_group).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def make_grouped_output_projection(
    num_heads: int,
    head_dim: int,
    o_groups: int,
    o_lora_rank: int,
    hidden_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    reduce_results: bool = True,
) -> tuple[GroupedLinear, RowParallelLinear]:
    """(o_a_proj, o_b_proj) of one V4 attention layer, this rank's share."""
    if num_heads % o_groups:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by o_groups ({o_groups})"
        )
    o_a = GroupedLinear(num_heads * head_dim // o_groups, o_lora_rank, o_groups, tp_rank, tp_size)
    o_b = RowParallelLinear(
        o_groups * o_lora_rank,
        hidden_size,
        bias=False,
        tp_rank=tp_rank,
        tp_size=tp_size,
        reduce_results=reduce_results,
    )
    return o_a, o_b


def grouped_output_projection(
    attn_out: torch.Tensor, o_a_proj: GroupedLinear, o_b_proj: RowParallelLinear
) -> torch.Tensor:
    """attn_out [T, local_heads * head_dim] (this rank's heads, in order) -> [T, hidden]."""
    grouped = attn_out.reshape(attn_out.shape[0], o_a_proj.local_groups, -1)
    return o_b_proj(o_a_proj(grouped).flatten(1))
