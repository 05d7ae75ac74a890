"""FP8 (e4m3) weights on Hopper/Ada GPUs: ``--quantization fp8`` and FP8 checkpoints.

Three ways in, one storage: ``weight`` float8_e4m3fn [out, in] plus float32 scales.
- Online (``--quantization fp8`` on a float checkpoint or dummy weights): the layer
  loads its float weight as usual; after loading each output channel is scaled into
  e4m3's range (scale = amax / 448) and the float weight is dropped.
- Checkpoint, per channel or per tensor (compressed-tensors "channel"/"tensor"
  strategies; HF "fp8" without block sizes): ``weight`` and ``weight_scale`` are read as
  stored. Per-tensor scales of merged q/k/v or gate/up shards are spread into one
  per-channel vector after loading, so every layer multiplies the same way.
- Checkpoint, 128x128 block scales (DeepSeek-V3 style; HF "fp8" with
  ``weight_block_size``, where the scale is named ``weight_scale_inv``; compressed-tensors
  "block"): the block scales are kept and the block-scaled kernel multiplies.

Activations are quantized per token at run time (dynamic), or with the checkpoint's
static per-tensor ``input_scale`` (the largest of merged shards', as vLLM does).
Where a dynamic per-token method would quantize the activation itself (more than
W8A16_MAX_M rows, on CUDA), it asks for it already quantized (``takes_fp8_input``):
the RMSNorm or SiLU-and-mul producing it then writes the FP8 rows and scales directly
(pagoda.kernels.fp8.fused_quant, the same bytes), and ``apply_fp8`` runs the W8A8 GEMM
on them. Block-scaled and static-input methods quantize differently and never ask.
The matmuls themselves live in pagoda.kernels.fp8.linear. MoE experts and MLA's
kv_b_proj take the methods of pagoda.model.quant.fp8_moe (``moe_method``,
``linear_method``). On the CPU the engine
refuses FP8 (``check_device``); the methods' apply still runs there through the
kernels' torch references, which is how CI checks the layers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from pagoda.kernels.fp8 import linear as kernels
from pagoda.kernels.fp8.quant import FP8_DTYPE, dequantize_per_channel, quantize_weight_per_channel
from pagoda.model.quant.base import (
    OUTPUT_VECTOR_DIMS,
    WEIGHT_DIMS,
    Fp8Activation,
    LinearMethod,
    MoEMethod,
    QuantConfig,
    ShardDims,
    checkpoint_layers,
    replace_parameter,
)
from pagoda.model.quant.fp8_moe import (
    Fp8DequantLinearMethod,
    Fp8OnlineMoEMethod,
    checkpoint_moe_method,
)

FP8_MAX = 448.0
# Linear layers whose weight a model reads directly (MLA's kv_b_proj: W_UK / W_UV).
MLA_FLOAT_PROJECTIONS = ("self_attn.kv_b_proj",)
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have e4m3 tensor cores
# Devices where the per-token methods ask for their input pre-quantized (the fused
# producers run there). Tests add "cpu": the references (or the interpreter) then take
# the same path.
FP8_INPUT_DEVICES = ("cuda",)


def check_fp8_device(device: torch.device) -> None:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            "fp8 quantization runs on NVIDIA GPUs with FP8 tensor cores (compute "
            "capability 8.9+: Ada, Hopper); on the CPU use --quantization int8 "
            "or int4"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"fp8 quantization needs compute capability 8.9+ (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}"
        )


def check_fp8_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"fp8 quantization computes in bfloat16 or float16, not {dtype}: pass --dtype bfloat16"
        )


def spread_per_shard(values: torch.Tensor, shard_sizes: Sequence[int]) -> torch.Tensor:
    """[num_shards] per-tensor values -> [sum(shard_sizes)] one per output channel."""
    sizes = torch.tensor(list(shard_sizes), device=values.device)
    return torch.repeat_interleave(values.float(), sizes)


def linear_static_input(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """W8A8 with the checkpoint's per-tensor activation scale. Decode sizes take the
    W8A16 kernel like the dynamic scheme (the activation is not quantized there)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w_fp8.shape[0]
    if x2.is_cuda and m <= kernels.W8A16_MAX_M:
        return kernels.fp8_linear(x, w_fp8, w_scale, bias)
    x_fp8 = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    x_scale = input_scale.float().reshape(1, 1).expand(m, 1).contiguous()
    if kernels.scaled_mm_usable(x2, w_fp8, x.dtype):
        out = kernels.scaled_mm_linear(x_fp8, x_scale, w_fp8, w_scale, bias, x.dtype)
    elif x2.is_cuda:
        out = kernels.w8a8_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, x.dtype)
    else:  # the torch reference (CPU)
        out = (x_fp8.float() * x_scale) @ dequantize_per_channel(w_fp8, w_scale).t()
        out = (out if bias is None else out + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def per_token_input_wanted(layer: nn.Module, num_rows: int) -> bool:
    """Where fp8_linear would quantize its input per token (the W8A8 path: more than
    W8A16_MAX_M rows) on a device of FP8_INPUT_DEVICES."""
    return num_rows > kernels.W8A16_MAX_M and layer.weight.device.type in FP8_INPUT_DEVICES


def linear_fp8_input(
    x: Fp8Activation, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What fp8_linear computes after its per_token_quant_fp8 call (w8a8_linear), on an
    activation its producer quantized, so the result equals fp8_linear on the float
    activation. -> [M, N] in x.dtype."""
    n, k = w_fp8.shape
    if x.data.shape[1] != k or x.data.device != w_fp8.device:
        raise ValueError(
            f"an FP8 activation {tuple(x.data.shape)} on {x.data.device} "
            f"cannot multiply a [{n}, {k}] weight on {w_fp8.device}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    scale = w_scale.reshape(n).to(torch.float32).contiguous()  # as fp8_linear takes it
    return kernels.w8a8_linear(x.data, x.scale, w_fp8, scale, bias, x.dtype)


class Fp8OnlineLinearMethod(LinearMethod):
    """A float weight loaded as usual, quantized per output channel after loading."""

    name = "fp8"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = quantize_weight_per_channel(layer.weight.data)
        replace_parameter(layer, "weight", weight)
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return self.apply_fp8(layer, x, bias)
        return kernels.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def takes_fp8_input(self, layer: nn.Module, num_rows: int) -> bool:
        return per_token_input_wanted(layer, num_rows)

    def apply_fp8(
        self, layer: nn.Module, x: Fp8Activation, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_fp8_input(x, layer.weight, layer.weight_scale, bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return kernels.fp8_linear_silu_and_mul(x, layer.weight, layer.weight_scale)


class Fp8CheckpointLinearMethod(LinearMethod):
    """FP8 weights and scales as a checkpoint stores them.

    strategy: "channel" (weight_scale [out, 1]), "tensor" (one weight_scale per merged
    shard) or "block" (scale [ceil(out/bn), ceil(in/bk)] named scale_name).
    static_input: the checkpoint holds a per-tensor input_scale per shard.
    """

    def __init__(
        self,
        strategy: str,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
        static_input: bool = False,
    ) -> None:
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"unknown FP8 weight strategy {strategy!r}")
        if (strategy == "block") != (block is not None):
            raise ValueError("FP8 block scales need a block size, and only they do")
        if static_input and strategy == "block":
            raise ValueError("FP8 block-scaled weights take dynamic per-group activations only")
        self.strategy, self.block, self.scale_name = strategy, block, scale_name
        self.static_input = static_input
        self.name = f"fp8 ({strategy}{'' if block is None else f' {block[0]}x{block[1]}'})"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        layer.register_weight(
            "weight",
            torch.empty(out_per_rank, in_per_rank, dtype=FP8_DTYPE),
            WEIGHT_DIMS,
            keep_dtype=True,
        )
        if self.strategy == "channel":
            scale, dims = torch.empty(out_per_rank, 1), OUTPUT_VECTOR_DIMS
        elif self.strategy == "tensor":
            scale, dims = torch.empty(num_shards), ShardDims(per_shard=True)
        else:
            bn, bk = self.block
            scale = torch.empty(-(-out_per_rank // bn), -(-in_per_rank // bk))
            dims = ShardDims(output_dim=0, input_dim=1, output_block=bn, input_block=bk)
        layer.register_weight(self.scale_name, scale.float(), dims, keep_dtype=True)
        if self.static_input:
            layer.register_weight(
                "input_scale", torch.empty(num_shards), ShardDims(per_shard=True), keep_dtype=True
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scale_name).data
        if self.strategy == "channel":
            replace_parameter(layer, self.scale_name, scale.reshape(-1).float().contiguous())
        elif self.strategy == "tensor":
            replace_parameter(layer, self.scale_name, spread_per_shard(scale, layer.shard_sizes()))
        if self.static_input:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1).float())

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return self.apply_fp8(layer, x, bias)
        scale = getattr(layer, self.scale_name)
        if self.strategy == "block":
            return kernels.fp8_block_linear(x, layer.weight, scale, self.block, bias)
        if self.static_input:
            return linear_static_input(x, layer.weight, scale, layer.input_scale, bias)
        return kernels.fp8_linear(x, layer.weight, scale, bias)

    def _per_token(self) -> bool:
        """Whether activations are quantized per token (dynamic, per-channel weights)."""
        return self.strategy != "block" and not self.static_input

    def takes_fp8_input(self, layer: nn.Module, num_rows: int) -> bool:
        return self._per_token() and per_token_input_wanted(layer, num_rows)

    def apply_fp8(
        self, layer: nn.Module, x: Fp8Activation, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self._per_token():
            how = (
                "in groups of block columns"
                if self.strategy == "block"
                else "with the checkpoint's static input_scale"
            )
            raise ValueError(
                f"the {self.name} method quantizes its activation {how}, not "
                f"per token: it cannot take a per-token Fp8Activation"
            )
        return linear_fp8_input(x, layer.weight, getattr(layer, self.scale_name), bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        if self.strategy == "block":  # the gated kernel takes per-channel scales
            return None
        return kernels.fp8_linear_silu_and_mul(x, layer.weight, getattr(layer, self.scale_name))


class Fp8Config(QuantConfig):
    """FP8 for every linear layer except those the checkpoint leaves in float (ignored)."""

    def __init__(
        self,
        method: LinearMethod,
        ignored: Sequence[str] = (),
        name: str = "fp8",
        fp8_lm_head: bool = False,
    ) -> None:
        """fp8_lm_head: the LM head quantized per channel at load time as well (from
        its float weight; a checkpoint's FP8 scheme leaves it in float)."""
        self.method, self.ignored, self.name = method, tuple(ignored), name
        self.fp8_lm_head = fp8_lm_head
        # The model's dtype (check_model_dtype records it): what a weight that must stay
        # float (MLA's kv_b_proj) is dequantized to.
        self.model_dtype = torch.bfloat16

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(Fp8OnlineLinearMethod())

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(prefix, self.ignored):
            return None
        if prefix.endswith(MLA_FLOAT_PROJECTIONS):
            # MLA reads this weight directly (its W_UK / W_UV views): a checkpoint's FP8
            # weight is dequantized at load, a float one stays float.
            if not isinstance(self.method, Fp8CheckpointLinearMethod):
                return None
            return Fp8DequantLinearMethod(self.method, self.model_dtype)
        return self.method

    def moe_method(self, prefix: str, layer: nn.Module) -> MoEMethod | None:
        """FusedMoE experts: FP8 W8A16 (pagoda.model.quant.fp8_moe), or float where the
        checkpoint keeps the layer's experts unquantized."""
        if all(_matches(f"{prefix}.0.{proj}", self.ignored) for proj in ("gate_proj", "down_proj")):
            return None
        if isinstance(self.method, Fp8CheckpointLinearMethod):
            return checkpoint_moe_method(self.method)
        return Fp8OnlineMoEMethod()

    def lm_head_method(self) -> LinearMethod | None:
        return Fp8OnlineLinearMethod() if self.fp8_lm_head else None

    def with_quantized_lm_head(self) -> Fp8Config:
        return Fp8Config(self.method, self.ignored, self.name, fp8_lm_head=True)

    def check_device(self, device: torch.device) -> None:
        check_fp8_device(device)

    def check_model_dtype(self, dtype: torch.dtype) -> None:
        check_fp8_activation_dtype(dtype)
        self.model_dtype = dtype

    def describe(self) -> str:
        head = ", FP8 LM head" if self.fp8_lm_head else ""
        return f"{self.name}: {self.method.name}{head}"


def is_ignored(prefix: str, ignored: Sequence[str]) -> bool:
    """Whether the checkpoint keeps layer prefix in float. Entries are module names, or
    're:'-prefixed regular expressions (compressed-tensors); a merged layer must be
    all-ignored or not at all."""
    parts = checkpoint_layers(prefix)
    hits = [_matches(part, ignored) for part in parts]
    if any(hits) and not all(hits):
        raise ValueError(
            f"the checkpoint keeps only some of {', '.join(parts)} unquantized; "
            f"Pagoda multiplies them as one layer ({prefix}) and needs all or none"
        )
    return all(hits)


def _matches(name: str, ignored: Sequence[str]) -> bool:
    for entry in ignored:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False
