"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of ceil(vocab / tp_size) rows;
the last range is zero-padded. With tp_size > 1 the embedding would mask out-of-range
ids and all-reduce, and the head would all-gather logits: not implemented yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.layers.linear import (LayerWeightLoader, ShardId, check_tp, copy_checked,
                                        tp_collective_unsupported)
from pagoda.model.layers.matmul import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = LayerWeightLoader(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} "
                             f"rows, expected vocab size {self.num_embeddings}")
        owned = self.vocab_end - self.vocab_start
        copy_checked(param.data[:owned], loaded_weight[self.vocab_start:self.vocab_end],
                     type(self).__name__)
        with torch.no_grad():
            param.data[owned:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            raise tp_collective_unsupported(type(self).__name__)
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, dim] -> logits [N, vocab] (no bias)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            raise tp_collective_unsupported(type(self).__name__)
        return linear(hidden, self.weight)
