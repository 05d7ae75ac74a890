"""TensorParallel: a model rank's place in its tensor-parallel group.

Models are built per rank: every sharded layer (QKV and gate/up column-parallel, o_proj
and down row-parallel, vocab-parallel embedding and LM head) takes its share from
this, and its weight loaders copy only that share out of each full checkpoint tensor.
The engine threads it from ParallelConfig through the executor and the worker to the
model's constructor; tensor_parallel_size is 1 until the collectives exist.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"need 0 <= tp rank < tp size, got rank {self.rank}, size {self.size}")


SINGLE_RANK = TensorParallel()
