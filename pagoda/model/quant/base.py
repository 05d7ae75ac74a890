"""The quantization seam: how one linear layer stores, loads, shards and multiplies.

A ``QuantConfig`` (chosen by ``--quantization`` or by a checkpoint's own
``quantization_config``) hands each linear layer a ``LinearMethod``. The method
registers the layer's weight parameters (``create_weights``), turns what was loaded
into the layout its kernel wants (``process_weights_after_loading``: online
quantization of a float checkpoint, repacking of file blocks), and multiplies
(``apply``). Layers keep what is the same for every method: which slice of a
checkpoint tensor belongs to this tensor-parallel rank, the all-reduce, the bias.

A FusedMoE layer (stacked experts) takes a ``MoEMethod`` from ``moe_method`` instead:
its weights are not linear layers of their own, and its kernels apply the scales.

Sharding is generic: every parameter a method creates says, in its ``ShardDims``,
which of its dims follow the layer's output rows and input columns, and how many
logical rows/columns one stored index covers (a 128x128 block scale covers 128 of
each; GGUF blocks cover 32 input columns). The layer's loader computes a ``ShardPlan``
in logical units once per shard and ``load_sharded`` applies it to any parameter.

A method may also take its input already quantized: ``takes_fp8_input(layer, rows)``
says that, for this many rows, it wants an ``Fp8Activation`` (per-token FP8 rows and
their scales) rather than the float activation, so that the kernel producing the
activation (an RMSNorm, the SiLU-and-mul) quantizes it on the way out
(pagoda.kernels.fp8.fused_quant); ``apply_fp8`` then multiplies it. Every other method
refuses such an input with a clear error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardDims:
    """How a parameter's dims map onto its layer's logical [output, input] weight.

    output_dim/input_dim: the dim that follows the output rows / input columns, or None
    (the parameter is the same on every rank along that axis, e.g. a per-channel scale
    of a row-parallel layer has no input dim). output_block/input_block: logical rows or
    columns per stored index. per_shard: a [num_shards] vector holding one value per
    merged shard (per-tensor scales of q/k/v or gate/up); the loader writes the shard's
    scalar at its index.
    """

    output_dim: int | None = None
    input_dim: int | None = None
    output_block: int = 1
    input_block: int = 1
    per_shard: bool = False


# A weight [out, in]; a column layer's bias [out]; a replicated tensor.
WEIGHT_DIMS = ShardDims(output_dim=0, input_dim=1)
OUTPUT_VECTOR_DIMS = ShardDims(output_dim=0)
REPLICATED_DIMS = ShardDims()


def set_shard_dims(param: nn.Parameter, dims: ShardDims) -> nn.Parameter:
    param.shard_dims = dims
    return param


def shard_dims_of(param: nn.Parameter) -> ShardDims:
    dims = getattr(param, "shard_dims", None)
    if dims is None:
        raise ValueError("parameter has no shard_dims: its linear method must set them")
    return dims


# Pagoda's merged layers and the checkpoint layers each one holds, in order.
MERGED_CHECKPOINT_LAYERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_layers(prefix: str) -> list[str]:
    """The checkpoint's module names behind the layer named prefix
    ('model.layers.0.self_attn.qkv_proj' -> its q_proj, k_proj, v_proj)."""
    head, _, last = prefix.rpartition(".")
    return [
        f"{head}.{part}" if head else part for part in MERGED_CHECKPOINT_LAYERS.get(last, (last,))
    ]


def replace_parameter(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swaps a loaded parameter for its processed form (never loaded again); the old
    storage is freed once nothing else holds it."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


@dataclass(frozen=True)
class ShardPlan:
    """Which part of one checkpoint tensor this rank loads, in logical units.

    out: (first source row, number of rows, first destination row) or None (all rows,
    as for a row-parallel layer); inp: (first source column, number of columns) or None;
    shard_index: the merged shard (0 for an unmerged layer), for per-shard parameters.
    """

    out: tuple[int, int, int] | None = None
    inp: tuple[int, int] | None = None
    shard_index: int = 0


def _narrow_blocks(
    tensor: torch.Tensor, dim: int, start: int, size: int, block: int, what: str
) -> torch.Tensor:
    if start % block != 0:
        raise ValueError(f"{what}: shard starts at {start}, not on a block of {block}")
    first, count = start // block, -(-size // block)
    if first + count > tensor.shape[dim]:
        raise ValueError(
            f"{what}: checkpoint shape {tuple(tensor.shape)} has no "
            f"[{first}, {first + count}) along dim {dim}"
        )
    return tensor.narrow(dim, first, count)


def load_sharded(param: nn.Parameter, loaded: torch.Tensor, plan: ShardPlan, what: str) -> None:
    """Copies this rank's part of the checkpoint tensor ``loaded`` into ``param``."""
    dims = shard_dims_of(param)
    dst, src = param.data, loaded
    if dims.per_shard:
        if src.numel() != 1:
            raise ValueError(
                f"{what}: a per-tensor value must hold one element, got shape {tuple(src.shape)}"
            )
        dst = dst.narrow(0, plan.shard_index, 1)
        src = src.reshape(1)
    else:
        if plan.out is not None and dims.output_dim is not None:
            start, size, offset = plan.out
            src = _narrow_blocks(src, dims.output_dim, start, size, dims.output_block, what)
            dst = _narrow_blocks(dst, dims.output_dim, offset, size, dims.output_block, what)
        if plan.inp is not None and dims.input_dim is not None:
            start, size = plan.inp
            src = _narrow_blocks(src, dims.input_dim, start, size, dims.input_block, what)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not match "
            f"parameter shape {tuple(dst.shape)}"
        )
    if dst.dtype != src.dtype and not (dst.is_floating_point() and src.is_floating_point()):
        raise ValueError(
            f"{what}: checkpoint dtype {src.dtype} cannot be stored in a {dst.dtype} parameter"
        )
    with torch.no_grad():
        dst.copy_(src)


@dataclass(frozen=True, slots=True)
class Fp8Activation:
    """An activation quantized per token as FP8, what a W8A8 linear multiplies:
    data [M, K] float8_e4m3fn and scale [M, 1] float32 (row m ~= data[m] * scale[m]),
    exactly what fp8_quant.per_token_quant_fp8 returns for the float activation;
    dtype: that float activation's dtype (the linear's output dtype)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        m = self.data.shape[0] if self.data.dim() == 2 else -1
        if self.data.dtype != torch.float8_e4m3fn or m < 0:
            raise ValueError(
                f"Fp8Activation data must be a [M, K] float8_e4m3fn tensor, got "
                f"{tuple(self.data.shape)} {self.data.dtype}"
            )
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (m, 1):
            raise ValueError(
                f"Fp8Activation scale must be [{m}, 1] float32, got "
                f"{tuple(self.scale.shape)} {self.scale.dtype}"
            )

    @property
    def shape(self) -> torch.Size:
        """The activation's shape [M, K] (as the float tensor's)."""
        return self.data.shape

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @classmethod
    def quantize(cls, x: torch.Tensor) -> Fp8Activation:
        """x [..., K] quantized per token by per_token_quant_fp8 (the unfused path: what
        an FP8 linear does to its float input)."""
        from pagoda.kernels.fp8.quant import per_token_quant_fp8  # imports triton

        data, scale = per_token_quant_fp8(x.reshape(-1, x.shape[-1]))
        return cls(data, scale, x.dtype)


def module_takes_fp8_input(module: nn.Module, num_rows: int) -> bool:
    """Whether module (a linear layer, or a block that starts with one) wants its input
    as an Fp8Activation for num_rows rows; False for modules that never do."""
    ask = getattr(module, "takes_fp8_input", None)
    return ask is not None and ask(num_rows)


class LinearMethod(ABC):
    """How one linear layer's weight is stored and multiplied. One instance may serve
    many layers: per-layer state lives on the layer (its parameters and buffers)."""

    name: str = "?"

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        """Registers the layer's weight parameters (not the bias) on the meta device,
        each with ``shard_dims`` and ``weight_loader = LayerWeightLoader(layer)``; a
        parameter whose dtype is not the model's sets ``keep_dtype = True``.
        num_shards: how many checkpoint tensors are merged into this layer (q/k/v: 3)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns the loaded parameters into the layout apply() wants (default: as is)."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, in_per_rank] -> [M, out_per_rank] (+ bias), in x's dtype."""

    def takes_fp8_input(self, layer: nn.Module, num_rows: int) -> bool:
        """Whether, for num_rows rows, this method wants its input already quantized per
        token (an Fp8Activation for apply_fp8) rather than the float tensor: only where
        it would quantize the activation exactly so itself. Default: never."""
        return False

    def apply_fp8(
        self, layer: nn.Module, x: Fp8Activation, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """An Fp8Activation [M, in_per_rank] -> [M, out_per_rank] (+ bias) in x.dtype,
        equal to apply() on the float activation it quantizes. The default refuses: a
        method that does not quantize its input that way cannot take one."""
        raise ValueError(
            f"the {self.name} linear method takes no pre-quantized FP8 "
            f"activation (its takes_fp8_input is False); pass the float "
            f"activation"
        )

    def weight_format(self, layer: nn.Module) -> str:
        """How this layer's weight is stored, for the start-up log ('Q4_1', 'float32',
        'fp8 (channel)'); default: the method's name."""
        return self.name

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a bias-free [gate | up] layer, [M, out_per_rank / 2], where
        the method computes it in one step (a fused kernel); None (the default, and for
        inputs the fused kernel does not take) makes the caller run apply() and the
        activation apart."""
        return None


class QuantConfig(ABC):
    """One quantization scheme: which layers it covers and the method of each."""

    name: str = "?"

    @abstractmethod
    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        """The method for the linear layer named prefix (e.g.
        'model.layers.0.self_attn.qkv_proj'); None keeps it unquantized."""

    def moe_method(self, prefix: str, layer: nn.Module) -> MoEMethod | None:
        """The method for the FusedMoE layer named prefix ('model.layers.3.mlp.experts');
        None keeps its experts in float. The default refuses: a scheme that quantizes
        no experts cannot serve an MoE model's checkpoint as it means to."""
        raise ValueError(
            f"{self.name} quantization of MoE experts is not supported; serve the "
            f"model unquantized or with fp8"
        )

    def lm_head_method(self) -> LinearMethod | None:
        """The method for the LM head, or None (unquantized). It must quantize from the
        float weight after loading (the head may share its weight with the embedding)."""
        return None

    def with_quantized_lm_head(self) -> QuantConfig:
        """This scheme with its LM head quantized too (--quantize-lm-head); the default
        refuses: only FP8 offers it."""
        raise ValueError(
            f"--quantize-lm-head is an FP8 option; the {self.name} scheme "
            f"keeps its own LM head choice"
        )

    def check_device(self, device: torch.device) -> None:
        """Raises ValueError when this scheme cannot run on device."""

    def check_model_dtype(self, dtype: torch.dtype) -> None:
        """Raises ValueError when the activations' dtype does not suit this scheme."""

    def describe(self) -> str:
        return self.name


class MoEMethod(ABC):
    """How a FusedMoE layer's stacked experts (w13_weight [E, 2I, H], w2_weight [E, H, I])
    are stored: what replaces the float parameters before materialising
    (``create_weights``), what loading leaves to do (``process_weights_after_loading``)
    and the scales the kernels apply (``scales``).

    block: the rows and columns one scale covers (None: one scale per output row);
    scale_name: the checkpoint's name of a weight's scale ("weight_scale_inv",
    "weight_scale"), or None where the checkpoint holds float weights."""

    name: str = "?"
    block: tuple[int, int] | None = None
    scale_name: str | None = None

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Registers or replaces the layer's expert parameters (on the meta device)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns the loaded weights into what scales() describes (default: as is)."""

    @abstractmethod
    def scales(self, layer: nn.Module):
        """The layer's ExpertScales (pagoda.kernels.moe.reference) for the kernels."""

    def weight_format(self, layer: nn.Module) -> str:
        """How the experts are stored, for the start-up log."""
        return self.name
