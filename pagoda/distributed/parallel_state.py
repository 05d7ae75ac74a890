"""The tensor-parallel group of this process, and the collectives layers call.

One process per rank (GPU); `init_distributed` joins the group through torch.distributed
(NCCL on CUDA, gloo on CPU). Until it is called, or with a group of one, the world is
this process alone and every collective is the identity, so a model built with
tp_size 1 runs with no group at all.

NVLink multicast (NVLS) must stay off in every process that joins a group: it can take
a shared host's GPUs out of service. `MULTICAST_OFF_ENV` holds the variables that keep
it off; `init_distributed` sets them before the first collective and refuses a value
that turns it on.

On CUDA, small all-reduces take a one-shot path over peer-mapped symmetric memory
(fast_all_reduce.py) unless `custom_all_reduce=False`; larger ones, and every all-reduce
on CPU, go through torch.distributed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pagoda.distributed.fast_all_reduce import SymmMemAllReduce

MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_world_size = 1
_rank = 0
_fast_all_reduce = None  # a SymmMemAllReduce once set up (CUDA, world > 1), else None


def keep_multicast_off(environ: dict | None = None) -> None:
    """Sets the variables that keep NVLink multicast off (in os.environ by default);
    raises if one is already set to turn it on."""
    env = os.environ if environ is None else environ
    for name, value in MULTICAST_OFF_ENV.items():
        if env.get(name, value) != value:
            raise RuntimeError(
                f"{name}={env[name]!r} would turn NVLink multicast on; Pagoda "
                f"requires {name}={value}"
            )
        env[name] = value


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    custom_all_reduce: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Joins the tensor-parallel group as `rank` of `world_size` (backend "nccl" or
    "gloo"; init_method e.g. "tcp://127.0.0.1:PORT"). With NCCL and custom_all_reduce,
    also sets up the one-shot path for small all-reduces of `dtype` (the model's)."""
    global _world_size, _rank, _fast_all_reduce
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got {rank}, {world_size}")
    keep_multicast_off()
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _world_size, _rank = world_size, rank
    if world_size > 1 and backend == "nccl" and custom_all_reduce:
        device = torch.device("cuda", torch.cuda.current_device())
        _fast_all_reduce = SymmMemAllReduce.create(dist.group.WORLD, device, dtype)


def destroy_distributed() -> None:
    global _world_size, _rank, _fast_all_reduce
    _fast_all_reduce = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _world_size, _rank = 1, 0


def tp_world_size() -> int:
    return _world_size


def tp_rank() -> int:
    return _rank


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the group (x itself for a group of one). Use the returned
    tensor: the NCCL path sums x in place, the one-shot path returns a new tensor."""
    if _world_size == 1:
        return x
    if _fast_all_reduce is not None and _fast_all_reduce.can_reduce(x):
        return _fast_all_reduce.all_reduce(x)
    dist.all_reduce(x)
    return x


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns);
# older torch (the GPU machines run 2.11) has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's x along dim, in rank order (x itself for a group of one).

    One collective into one flat buffer [world * x.shape[0], ...] (the "concatenated"
    output form, the one both gloo and NCCL accept), then the rank blocks are moved to
    dim. No host sync and shapes fixed by x's, so a CUDA graph can capture it.
    """
    if _world_size == 1:
        return x
    dim = dim % x.dim()
    flat = torch.empty((_world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(flat, x.contiguous())
    parts = flat.view(_world_size, *x.shape)
    if dim == 0:
        return flat
    # [world, d0, .., d_dim, ..] -> [d0, .., world, d_dim, ..] -> merge world into dim.
    shape = list(x.shape)
    shape[dim] *= _world_size
    return parts.movedim(0, dim).reshape(shape)
