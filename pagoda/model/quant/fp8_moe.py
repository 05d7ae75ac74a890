"""FP8 experts and MLA's kv_b_proj under the FP8 schemes.

Experts (FusedMoE's stacked w13 [E, 2I, H] and w2 [E, H, I]) run W8A16: FP8 weights
with float32 scales, activations in the model's dtype; the MoE kernels widen each
weight tile in registers and apply its scale (pagoda.kernels.moe, ExpertScales).
- ``Fp8CheckpointMoEMethod``: a checkpoint's FP8 experts as stored, 128x128 block scales
  (``weight_scale_inv``: DeepSeek-V3/R1, Qwen3 FP8) or one scale per output channel
  (compressed-tensors ``weight_scale`` [N, 1]). Scales live in buffers
  ``w13_<scale_name>`` / ``w2_<scale_name>`` filled through the weights' loader (shard id
  (expert, proj, scale_name)), so the loaders' completeness check covers them through the
  weight parameters' shard ids.
- ``Fp8OnlineMoEMethod`` (``--quantization fp8`` of a float MoE model): float experts
  loaded as usual, quantized after loading in 128x128 blocks, each expert's gate and up
  halves on their own (the checkpoint's layout).

``Fp8DequantLinearMethod``: MLA reads kv_b_proj's weight directly as its W_UK / W_UV
views (pagoda.model.layers.mla), which need a plain float weight: the checkpoint's FP8
weight and scales are loaded as the FP8 linear method loads them, then dequantized to
the model's dtype once (2 bytes an element instead of 1 for that one projection).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.moe.reference import ExpertScales, dequantize_rows
from pagoda.model.quant.base import LinearMethod, MoEMethod, replace_parameter
from pagoda.model.quant.unquantized import UNQUANTIZED

FP8_DTYPE = torch.float8_e4m3fn

# Online quantization's block: the one FP8 checkpoints use, so both take the same kernels.
ONLINE_BLOCK = (128, 128)


def scale_shapes(layer: nn.Module, block: tuple[int, int] | None):
    """(w13 scale shape, w2 scale shape) for this rank's experts (ExpertScales' layout)."""
    e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden_size
    if block is None:
        return (e, 2 * i, 1), (e, h, 1)
    bn, bk = block
    return (e, 2 * -(-i // bn), -(-h // bk)), (e, -(-h // bn), -(-i // bk))


def check_block_sharding(layer: nn.Module, block: tuple[int, int] | None) -> None:
    """Tensor-parallel experts split I: each rank's share must start on a whole block."""
    if block is None or layer.expert_parallel or layer.tp.size == 1:
        return
    i = layer.local_intermediate
    if i % block[0] or i % block[1]:
        raise ValueError(
            f"FP8 experts with {block[0]}x{block[1]} block scales: this rank's share of "
            f"moe_intermediate_size ({layer.intermediate_size} / {layer.tp.size} = {i}) "
            f"is no whole number of blocks; use a tensor_parallel_size that divides it "
            f"in multiples of {block[0]}, or --enable-expert-parallel (whole experts)"
        )


def _fp8_expert_param(layer: nn.Module, name: str) -> None:
    """Replaces a float expert parameter (meta) by an FP8 one of its shape, same loader."""
    old = getattr(layer, name)
    param = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), False)
    param.weight_loader = old.weight_loader
    param.keep_dtype = True
    setattr(layer, name, param)


class Fp8CheckpointMoEMethod(MoEMethod):
    """A checkpoint's FP8 experts: block is (bn, bk) for block scales named
    scale_name, None for per-channel ``weight_scale``."""

    def __init__(self, block: tuple[int, int] | None, scale_name: str) -> None:
        self.block, self.scale_name = block, scale_name
        self.name = "fp8 W8A16 " + ("(channel)" if block is None else f"({block[0]}x{block[1]})")

    def create_weights(self, layer: nn.Module) -> None:
        check_block_sharding(layer, self.block)
        for name in ("w13_weight", "w2_weight"):
            _fp8_expert_param(layer, name)
        s13, s2 = scale_shapes(layer, self.block)
        device = layer.w13_weight.device
        layer.register_buffer(f"w13_{self.scale_name}", torch.empty(s13, device=device))
        layer.register_buffer(f"w2_{self.scale_name}", torch.empty(s2, device=device))

    def scales(self, layer: nn.Module) -> ExpertScales:
        return ExpertScales(
            getattr(layer, f"w13_{self.scale_name}"),
            getattr(layer, f"w2_{self.scale_name}"),
            self.block,
        )


class Fp8OnlineMoEMethod(MoEMethod):
    """Float experts quantized after loading, ONLINE_BLOCK blocks."""

    name = f"fp8 W8A16 ({ONLINE_BLOCK[0]}x{ONLINE_BLOCK[1]}, online)"
    block = ONLINE_BLOCK

    def create_weights(self, layer: nn.Module) -> None:
        check_block_sharding(layer, self.block)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from pagoda.kernels.fp8.quant import quantize_weight_blockwise  # imports triton

        inter = layer.local_intermediate
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        q13 = torch.empty(w13.shape, dtype=FP8_DTYPE, device=w13.device)
        q2 = torch.empty(w2.shape, dtype=FP8_DTYPE, device=w2.device)
        s13_shape, s2_shape = scale_shapes(layer, self.block)
        s13 = torch.empty(s13_shape, device=w13.device)
        s2 = torch.empty(s2_shape, device=w2.device)
        up = s13_shape[1] // 2
        # One expert at a time: the float32 working copies stay one expert's size.
        for e in range(w13.shape[0]):
            q13[e, :inter], s13[e, :up] = quantize_weight_blockwise(w13[e, :inter], self.block)
            q13[e, inter:], s13[e, up:] = quantize_weight_blockwise(w13[e, inter:], self.block)
            q2[e], s2[e] = quantize_weight_blockwise(w2[e], self.block)
        replace_parameter(layer, "w13_weight", q13)
        replace_parameter(layer, "w2_weight", q2)
        layer.register_buffer("w13_weight_scale_inv", s13)
        layer.register_buffer("w2_weight_scale_inv", s2)

    def scales(self, layer: nn.Module) -> ExpertScales:
        return ExpertScales(layer.w13_weight_scale_inv, layer.w2_weight_scale_inv, self.block)


def checkpoint_moe_method(linear: LinearMethod) -> MoEMethod:
    """The experts' method matching an FP8 checkpoint's linear method
    (fp8.Fp8CheckpointLinearMethod); ValueError for the schemes the expert kernels do
    not take."""
    if linear.strategy == "block":
        return Fp8CheckpointMoEMethod(linear.block, linear.scale_name)
    if linear.strategy == "channel" and not linear.static_input:
        return Fp8CheckpointMoEMethod(None, linear.scale_name)
    raise ValueError(
        f"FP8 experts with {linear.name} weights are not supported: the MoE kernels "
        f"take 128x128 block scales or per-channel scales (dynamic activations)"
    )


class Fp8DequantLinearMethod(LinearMethod):
    """Loads like its FP8 checkpoint method, then keeps a plain float weight."""

    def __init__(self, checkpoint: LinearMethod, dtype: torch.dtype) -> None:
        """checkpoint: the scheme's fp8.Fp8CheckpointLinearMethod; dtype: the model's,
        which the dequantized weight takes."""
        if checkpoint.strategy == "tensor":
            raise ValueError(
                "MLA's kv_b_proj with per-tensor FP8 scales is not supported (block or "
                "channel scales)"
            )
        self.checkpoint, self.dtype = checkpoint, dtype
        self.name = f"{checkpoint.name}, dequantized at load"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        self.checkpoint.create_weights(layer, in_per_rank, out_per_rank, num_shards)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        name = self.checkpoint.scale_name
        scale = getattr(layer, name).data
        weight = dequantize_rows(layer.weight.data, scale, self.checkpoint.block)
        replace_parameter(layer, "weight", weight.to(self.dtype))
        delattr(layer, name)
        if self.checkpoint.static_input:
            delattr(layer, "input_scale")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return UNQUANTIZED.apply(layer, x, bias)

    def weight_format(self, layer: nn.Module) -> str:
        return str(layer.weight.dtype).removeprefix("torch.")
