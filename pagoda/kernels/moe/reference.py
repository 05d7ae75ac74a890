"""The torch reference of the fused MoE computation (no Triton): the golden one the
Triton kernel is tested against, and the path the engine takes on the CPU.

``fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)``: for every token and
each of its k choices, ``down(silu(gate(x)) * up(x)) * weight``, summed over the k
choices. Loops over the experts that have tokens (a host sync per layer: fine on the
CPU, and the reason the GPU takes the kernel).

FP8 experts (W8A16): w13 / w2 in float8_e4m3fn with ``ExpertScales``, 128x128 block
scales (``weight_scale_inv``, DeepSeek-V3 and Qwen3 FP8 releases) or one scale per
output row (compressed-tensors "channel"). The reference dequantizes each used expert
to the activation's dtype and runs the float computation; the kernels read the FP8
tiles and scale them in registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertScales:
    """The float32 scales of FP8 expert weights.

    block (bn, bk): w13_scale [E, 2 * ceil(I / bn), ceil(H / bk)] (the gate's row blocks,
    then the up's: each half is blocked on its own, so an I that is no multiple of bn
    leaves a partial last block in each) and w2_scale [E, ceil(H / bn), ceil(I / bk)].
    block None (per output channel): w13_scale [E, 2I, 1], w2_scale [E, H, 1].
    weight ~= fp8 weight * its block's (or row's) scale."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None = (128, 128)

    def row_block(self) -> int:
        """Weight rows one scale row covers (1 per channel)."""
        return 1 if self.block is None else self.block[0]

    def col_block(self) -> int:
        """Weight columns one scale column covers (128 per channel: any value works, the
        kernels read its one column with a stride of 0)."""
        return 128 if self.block is None else self.block[1]

    def up_offset(self, inter: int) -> int:
        """The first scale row of the up half in w13_scale for an intermediate of inter."""
        return -(-inter // self.row_block())

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Raises ValueError unless the scales fit FP8 weights w13 [E, 2I, H], w2 [E, H, I]."""
        if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"scaled experts need float8_e4m3fn weights, got {w13.dtype} / {w2.dtype}"
            )
        e, two_i, h = w13.shape
        inter, bn, bk = two_i // 2, self.row_block(), self.col_block()
        if self.block is None:
            want13, want2 = (e, two_i, 1), (e, h, 1)
        else:
            want13 = (e, 2 * self.up_offset(inter), -(-h // bk))
            want2 = (e, -(-h // bn), -(-inter // bk))
        for name, t, want in (("w13", self.w13_scale, want13), ("w2", self.w2_scale, want2)):
            if tuple(t.shape) != want or t.dtype != torch.float32:
                raise ValueError(
                    f"{name} scale must be float32 {want}, got {t.dtype} {tuple(t.shape)}"
                )


def dequantize_rows(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    """One expert's FP8 weight [N, K] and its scale ([ceil(N/bn), ceil(K/bk)], or [N, 1]
    per channel) -> float32 [N, K]."""
    if block is None:
        return w.float() * scale.float()
    bn, bk = block
    n, k = w.shape
    full = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w.float() * full


def dequantize_expert(
    w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales, expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert's (w13 [2I, H], w2 [H, I]) dequantized to float32."""
    inter = w13.shape[1] // 2
    up = scales.up_offset(inter)
    s13 = scales.w13_scale[expert]
    gate = dequantize_rows(w13[expert, :inter], s13[:up], scales.block)
    upw = dequantize_rows(w13[expert, inter:], s13[up:], scales.block)
    return torch.cat((gate, upw)), dequantize_rows(
        w2[expert], scales.w2_scale[expert], scales.block
    )


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
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights
    [T, k] (float32), topk_ids [T, k] (int; -1: an expert held by another rank, which
    contributes nothing here) -> [T, H] in hidden's dtype, accumulated in float32.
    linear(x, w) computes each expert's products (the CPU path passes the model's
    column-blocked matmul, which equals F.linear bit for bit). scales: FP8 weights'
    scales; each used expert is dequantized to hidden's dtype first."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    if scales is not None:
        scales.check(w13, w2)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        x = hidden.index_select(0, tokens)
        w_in, w_out = w13[expert], w2[expert]
        if scales is not None:
            w_in, w_out = (w.to(hidden.dtype) for w in dequantize_expert(w13, w2, scales, expert))
        gate, up = linear(x, w_in).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w_out)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
