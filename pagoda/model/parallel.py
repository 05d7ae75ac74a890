"""TensorParallel: a model rank's place in its tensor-parallel group, and which model
shapes a group of a given size can split.

Models are built per rank: every sharded layer (QKV and gate/up column-parallel, o_proj
and down row-parallel, vocab-parallel embedding and LM head) takes its share from
this, and its weight loaders copy only that share out of each full checkpoint tensor.
The engine threads it from ParallelConfig through the executor and the worker to the
model's constructor. `check_tensor_parallel(arch, tp_size)` says, before any process
or weight exists, whether arch splits over tp_size ranks (build_model checks it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.model.arch_config import ArchConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # MoE layers: experts kept whole and split across the ranks, instead of every
    # expert's intermediate split (ParallelConfig.enable_expert_parallel).
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"need 0 <= tp rank < tp size, got rank {self.rank}, size {self.size}")


SINGLE_RANK = TensorParallel()


def check_tensor_parallel(arch: ArchConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError, naming the model's numbers, unless arch splits over tp_size ranks:
    query heads and intermediate columns divide evenly; KV heads either divide evenly or
    each is replicated on tp_size / num_kv_heads ranks (tp_size a multiple of them); an
    MoE's experts (expert_parallel) or each expert's intermediate (else) divide evenly.
    The vocabulary needs nothing: its last shard is padded. expert_parallel is refused
    for a model without experts."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    if expert_parallel and arch.moe is None:
        raise ValueError(
            f"enable_expert_parallel is set but {arch.architecture} has no "
            f"experts (it applies to mixture-of-experts models only)"
        )
    if tp_size == 1:
        return
    problems = _moe_problems(arch, tp_size, expert_parallel)
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(
            f"num_key_value_heads ({kv_heads}) is neither a multiple nor a "
            f"divisor of it (each KV head is kept whole, on a whole number of ranks)"
        )
    if arch.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({arch.intermediate_size}) is not divisible by it")
    if problems:
        raise ValueError(
            f"{arch.architecture} cannot be split over tensor_parallel_size "
            f"{tp_size}: "
            + "; ".join(problems)
            + f". Valid sizes for this model: {valid_tp_sizes(arch, expert_parallel=expert_parallel)}"
        )


def _moe_problems(arch: ArchConfig, tp_size: int, expert_parallel: bool) -> list[str]:
    moe = arch.moe
    if moe is None:
        return []
    if expert_parallel:
        if moe.num_experts % tp_size:
            return [f"its {moe.num_experts} experts do not split over it (expert parallel)"]
        return []
    problems = []
    if moe.moe_intermediate_size % tp_size:
        problems.append(
            f"moe_intermediate_size ({moe.moe_intermediate_size}) is not divisible "
            f"by it (enable_expert_parallel keeps experts whole)"
        )
    if moe.shared_intermediate_size % tp_size:
        problems.append(
            f"the shared experts' intermediate size "
            f"({moe.shared_intermediate_size}) is not divisible by it"
        )
    return problems


def valid_tp_sizes(arch: ArchConfig, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    """The tensor-parallel sizes up to limit that arch splits over."""
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    return [
        n
        for n in range(1, limit + 1)
        if heads % n == 0
        and arch.intermediate_size % n == 0
        and (kv_heads % n == 0 or n % kv_heads == 0)
        and not _moe_problems(arch, n, expert_parallel)
    ]
