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
"""

from __future__ import annotations

import weakref
from typing import Sequence, Union

import torch
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce, tp_rank, tp_world_size
from pagoda.model.layers.matmul import linear

ShardId = Union[int, str, None]


class LayerWeightLoader:
    """A parameter's ``weight_loader`` that calls its layer's method through a weak
    reference: a bound method would make param -> layer -> param a reference cycle, and
    a dropped model's (GPU) memory would then wait for the garbage collector."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = weakref.ref(layer)

    def __call__(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                 shard_id: ShardId = None) -> None:
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
        raise RuntimeError(f"{layer} was built for tp rank {rank} of {size}, but this process "
                           f"is rank {tp_rank()} of {tp_world_size()}: call "
                           f"pagoda.distributed.parallel_state.init_distributed first")


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) after checking shapes match exactly (copy_ would broadcast)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match "
                         f"parameter shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: ShardId = None) -> None:
    """For replicated parameters (norms): copy the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter takes no shard_id, got {shard_id!r}")
    copy_checked(param.data, loaded_weight, "replicated parameter")


def materialize_module(module: nn.Module, device: torch.device | str,
                       dtype: torch.dtype | None = None) -> None:
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
                cast = (dtype is not None and param.is_floating_point()
                        and not getattr(param, "keep_dtype", False))
                want = dtype if cast else param.dtype
                new = nn.Parameter(torch.empty_like(param, device=device, dtype=want),
                                   requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device=device)


class LinearBase(nn.Module):
    """Holds weight [out_per_rank, in_per_rank] and optional bias [out_per_rank]."""

    def __init__(self, in_per_rank: int, out_per_rank: int, bias: bool,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank), requires_grad=False)
        self.weight.weight_loader = LayerWeightLoader(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank), requires_grad=False)
            self.bias.weight_loader = LayerWeightLoader(self)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        check_tp(tp_rank, tp_size)
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias,
                         tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"ColumnParallelLinear takes no shard_id, got {shard_id!r}")
        rows = param.shape[0]
        copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * rows, rows),
                     "ColumnParallelLinear")


class MergedColumnParallelLinear(LinearBase):
    """Outputs output_sizes[0], output_sizes[1], ... stacked; shard_id indexes them."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        check_tp(tp_rank, tp_size)
        self.output_sizes = list(output_sizes)
        self.rank_sizes = [divide(s, tp_size, "output size") for s in self.output_sizes]
        super().__init__(input_size, sum(self.rank_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in "
                             f"0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.rank_sizes[shard_id]
        offset = sum(self.rank_sizes[:shard_id])
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), src,
                     f"MergedColumnParallelLinear shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """q, k, v projections in one matmul. Heads split across ranks; when there are
    fewer kv heads than ranks, each kv head is replicated on tp_size/num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
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
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id == "q":
            offset, size, src_start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            src_start = self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            src_start = self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        src = loaded_weight.narrow(0, src_start, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"QKVParallelLinear shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Input dim split across ranks: x is this rank's shard of the input (the output of
    a column-parallel layer, or of this rank's attention heads); each rank's partial
    product is all-reduced, and the bias, replicated, is added once, after the reduce.
    reduce_results=False returns the partial product (no bias allowed): the caller sums
    it with other partials in one all-reduce (an MoE's shared and routed experts)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, reduce_results: bool = True) -> None:
        check_tp(tp_rank, tp_size)
        if bias and not reduce_results:
            raise ValueError("RowParallelLinear without reduce_results cannot add a bias "
                             "(it would be added once per rank)")
        self.reduce_results = reduce_results
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias,
                         tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard_id, got {shard_id!r}")
        if param.dim() == 1:  # bias: replicated
            copy_checked(param.data, loaded_weight, "RowParallelLinear bias")
            return
        cols = param.shape[1]
        copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * cols, cols),
                     "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:  # no collective, bias fused
            return linear(x, self.weight, self.bias)
        check_tp_group("RowParallelLinear", self.tp_rank, self.tp_size)
        out = tp_all_reduce(linear(x, self.weight))
        if self.bias is not None:
            out += self.bias  # added to the sum, not to each partial (that would add it N times)
        return out
