"""Tensor-parallel-ready linear layers and their weight loaders.

Each parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it is
given the *full* checkpoint tensor and copies the slice that belongs to this layer's
``tp_rank`` of ``tp_size``. With tp_size > 1 the row-parallel layer all-reduces its
partial sums through pagoda.distributed (the identity in a group of one).

- ColumnParallelLinear: output dim split across ranks (no gather; the next layer is
  row-parallel).
- MergedColumnParallelLinear: several column-parallel outputs in one matmul (gate_up).
- QKVParallelLinear: q, k, v in one matmul, split by heads; shard ids "q", "k", "v".
- RowParallelLinear: input dim split; the partial sums are all-reduced, then the
  (replicated) bias is added once.

How the weight is stored and multiplied is the layer's ``quant_method``
(pagoda.model.quant: unquantized by default, set before materialising by
``set_quant_method``). Each layer only says which slice of a checkpoint tensor is its
own (``shard_plan``); ``load_sharded`` applies that to whatever parameters the method
made (a float weight, FP8 weights and their scales, packed blocks).

A layer's input is a float tensor, or an ``Fp8Activation`` (rows already quantized per
token by the kernel that produced them) where its method asked for one
(``takes_fp8_input(rows)``): forward hands that to the method's ``apply_fp8``. The
column-parallel qkv / gate_up layers get the whole (replicated) activation, the
row-parallel down_proj its rank's shard: per-token scales over the local shard, what
the method would compute from the float shard itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce, tp_rank, tp_world_size
from pagoda.model.quant.base import (
    OUTPUT_VECTOR_DIMS,
    REPLICATED_DIMS,
    Fp8Activation,
    LinearMethod,
    ShardDims,
    ShardPlan,
    load_sharded,
    set_shard_dims,
)
from pagoda.model.quant.unquantized import UNQUANTIZED

ShardId = int | str | None
# What a linear layer multiplies: a float activation, or one quantized by its producer.
LinearInput = torch.Tensor | Fp8Activation


class LayerWeightLoader:
    """A parameter's ``weight_loader`` that calls its layer's method through a weak
    reference: a bound method would make param -> layer -> param a reference cycle, and
    a dropped model's (GPU) memory would then wait for the garbage collector."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = weakref.ref(layer)

    def __call__(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("the layer owning this parameter no longer exists")
        layer.weight_loader(param, loaded_weight, shard_id)


def check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")


def check_tp_group(layer: str, rank: int, size: int) -> None:
    """Raises unless this process joined the group the layer was built for: without it
    the collectives would be the identity and the layer's output silently a partial."""
    if tp_world_size() != size or tp_rank() != rank:
        raise RuntimeError(
            f"{layer} was built for tp rank {rank} of {size}, but this process "
            f"is rank {tp_rank()} of {tp_world_size()}: call "
            f"pagoda.distributed.parallel_state.init_distributed first"
        )


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) after checking shapes match exactly (copy_ would broadcast)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not match "
            f"parameter shape {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
) -> None:
    """For replicated parameters (norms): copy the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter takes no shard_id, got {shard_id!r}")
    copy_checked(param.data, loaded_weight, "replicated parameter")


def materialize_module(
    module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None
) -> None:
    """Replaces every meta-device parameter and buffer of module with uninitialised
    storage on device (floating parameters cast to dtype when given).

    Unlike Module.to_empty, this keeps the attributes a parameter carries (its
    weight_loader) and keeps tied parameters tied: each distinct tensor is replaced
    once and the replacement is reused wherever the original was registered. A
    parameter marked ``param.keep_dtype = True`` keeps its own dtype (e.g. a float32
    router whose choices must not depend on the model's dtype).
    """
    replaced: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                cast = (
                    dtype is not None
                    and param.is_floating_point()
                    and not getattr(param, "keep_dtype", False)
                )
                want = dtype if cast else param.dtype
                new = nn.Parameter(
                    torch.empty_like(param, device=device, dtype=want),
                    requires_grad=param.requires_grad,
                )
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device=device)


class LinearBase(nn.Module):
    """Holds its quant method's weight parameters (unquantized: weight [out_per_rank,
    in_per_rank]) and an optional float bias [out_per_rank]."""

    # The dims a column layer's bias follows (a row layer's bias is replicated).
    bias_dims: ShardDims = OUTPUT_VECTOR_DIMS

    def __init__(
        self,
        in_per_rank: int,
        out_per_rank: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        num_shards: int = 1,
    ) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_per_rank, self.out_per_rank, self.num_shards = in_per_rank, out_per_rank, num_shards
        # The Triton GEMV's routing table on this layer's device (a GemvConfig, set by
        # the model runner's KernelConfigs; None: GemvConfig.for_device at each call).
        self.gemv_config = None
        # The CPU block kernels' variant (a CpuBlocksConfig, set by the model runner's
        # KernelConfigs; None: its defaults), for block methods (quant/cpu_int.py).
        self.cpu_blocks_config = None
        self._method_params: list[str] = []
        self.set_quant_method(UNQUANTIZED)
        if bias:
            self.register_weight(
                "bias", torch.empty(out_per_rank), self.bias_dims, from_method=False
            )
        else:
            self.register_parameter("bias", None)

    def register_weight(
        self,
        name: str,
        tensor: torch.Tensor,
        dims: ShardDims,
        keep_dtype: bool = False,
        from_method: bool = True,
    ) -> nn.Parameter:
        """Registers a parameter the checkpoint fills through this layer's loader."""
        param = set_shard_dims(nn.Parameter(tensor, requires_grad=False), dims)
        param.weight_loader = LayerWeightLoader(self)
        if keep_dtype:
            param.keep_dtype = True
        self.register_parameter(name, param)
        if from_method:
            self._method_params.append(name)
        return param

    def set_quant_method(self, method: LinearMethod) -> None:
        """Replaces the weight parameters with method's (before materialising: the old
        ones must not have been loaded yet)."""
        for name in self._method_params:
            delattr(self, name)
        self._method_params = []
        self.quant_method = method
        method.create_weights(self, self.in_per_rank, self.out_per_rank, self.num_shards)

    def shard_plan(self, shard_id: ShardId) -> ShardPlan:
        """Which part of the checkpoint tensor for shard_id this rank loads."""
        raise NotImplementedError

    def shard_sizes(self) -> list[int]:
        """This rank's output rows of each merged checkpoint tensor, in order."""
        return [self.out_per_rank]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        load_sharded(
            param,
            loaded_weight,
            self.shard_plan(shard_id),
            f"{type(self).__name__}" + ("" if shard_id is None else f" shard {shard_id}"),
        )

    def takes_fp8_input(self, num_rows: int) -> bool:
        """Whether forward wants its input for num_rows rows as an Fp8Activation (the
        method's choice; see pagoda.model.quant.base)."""
        return self.quant_method.takes_fp8_input(self, num_rows)

    def _multiply(self, x: LinearInput, bias) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return self.quant_method.apply_fp8(self, x, bias)  # refuses unless it takes them
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self._multiply(x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        check_tp(tp_rank, tp_size)
        super().__init__(
            input_size, divide(output_size, tp_size, "output_size"), bias, tp_rank, tp_size
        )

    def shard_plan(self, shard_id: ShardId) -> ShardPlan:
        if shard_id is not None:
            raise ValueError(f"ColumnParallelLinear takes no shard_id, got {shard_id!r}")
        rows = self.out_per_rank
        return ShardPlan(out=(self.tp_rank * rows, rows, 0))


class MergedColumnParallelLinear(LinearBase):
    """Outputs output_sizes[0], output_sizes[1], ... stacked; shard_id indexes them."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        check_tp(tp_rank, tp_size)
        self.output_sizes = list(output_sizes)
        self.rank_sizes = [divide(s, tp_size, "output size") for s in self.output_sizes]
        super().__init__(
            input_size,
            sum(self.rank_sizes),
            bias,
            tp_rank,
            tp_size,
            num_shards=len(self.output_sizes),
        )

    def shard_plan(self, shard_id: ShardId) -> ShardPlan:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear needs shard_id in "
                f"0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = self.rank_sizes[shard_id]
        offset = sum(self.rank_sizes[:shard_id])
        return ShardPlan(out=(self.tp_rank * size, size, offset), shard_index=shard_id)

    def shard_sizes(self) -> list[int]:
        return list(self.rank_sizes)

    def forward_silu_and_mul(self, x: LinearInput, act: nn.Module) -> torch.Tensor:
        """act(self(x)) for a bias-free [gate, up] pair, act being SiluAndMul: through
        the quant method's fused step where it has one for x (the FP8 GEMV at one
        row), else the linear and then act."""
        if (
            self.bias is None
            and len(self.rank_sizes) == 2
            and self.rank_sizes[0] == self.rank_sizes[1]
            and not isinstance(x, Fp8Activation)
        ):
            fused = self.quant_method.apply_silu_and_mul(self, x)
            if fused is not None:
                return fused
        return act(self(x))


class QKVParallelLinear(LinearBase):
    """q, k, v projections in one matmul. Heads split across ranks; when there are
    fewer kv heads than ranks, each kv head is replicated on tp_size/num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        check_tp(tp_rank, tp_size)
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_kv_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            divide(tp_size, num_kv_heads, "tp_size over num_kv_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size, self.q_size + 2 * self.kv_size, bias, tp_rank, tp_size, num_shards=3
        )

    def shard_plan(self, shard_id: ShardId) -> ShardPlan:
        kv_start = self.kv_head_start * self.head_dim
        if shard_id == "q":
            return ShardPlan(out=(self.tp_rank * self.q_size, self.q_size, 0), shard_index=0)
        if shard_id == "k":
            return ShardPlan(out=(kv_start, self.kv_size, self.q_size), shard_index=1)
        if shard_id == "v":
            return ShardPlan(
                out=(kv_start, self.kv_size, self.q_size + self.kv_size), shard_index=2
            )
        raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]


class RowParallelLinear(LinearBase):
    """Input dim split across ranks: x is this rank's shard of the input (the output of
    a column-parallel layer, or of this rank's attention heads); each rank's partial
    product is all-reduced, and the bias, replicated, is added once, after the reduce.
    reduce_results=False returns the partial product (no bias allowed): the caller sums
    it with other partials in one all-reduce (an MoE's shared and routed experts)."""

    bias_dims = REPLICATED_DIMS

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
    ) -> None:
        check_tp(tp_rank, tp_size)
        if bias and not reduce_results:
            raise ValueError(
                "RowParallelLinear without reduce_results cannot add a bias "
                "(it would be added once per rank)"
            )
        self.reduce_results = reduce_results
        super().__init__(
            divide(input_size, tp_size, "input_size"), output_size, bias, tp_rank, tp_size
        )

    def shard_plan(self, shard_id: ShardId) -> ShardPlan:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard_id, got {shard_id!r}")
        cols = self.in_per_rank
        return ShardPlan(inp=(self.tp_rank * cols, cols))

    def forward(self, x: LinearInput) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:  # no collective, bias fused
            return self._multiply(x, self.bias)
        check_tp_group("RowParallelLinear", self.tp_rank, self.tp_size)
        out = tp_all_reduce(self._multiply(x, None))
        if self.bias is not None:
            out += self.bias  # added to the sum, not to each partial (that would add it N times)
        return out
