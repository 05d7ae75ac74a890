"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of ceil(vocab / tp_size) rows;
the last range is zero-padded (and a rank past the end of a tiny vocabulary owns only
padding). With tp_size > 1 the embedding reads zeros for ids outside its range and
all-reduces, so every rank gets every token's row; the LM head computes the logits of
its rows and all-gathers them along the vocab dim, trimmed to vocab_size, so every rank
(the sampler on rank 0 included) sees the full [N, vocab] logits.

A quantization scheme may give the LM head a linear method
(``QuantConfig.lm_head_method``): after loading, the head's float weight (possibly
shared with the embedding, which keeps it) is handed to a private linear layer that
the method quantizes, and the head multiplies through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import tp_all_gather, tp_all_reduce
from pagoda.model.layers.linear import (
    ColumnParallelLinear,
    LayerWeightLoader,
    ShardId,
    check_tp,
    check_tp_group,
    copy_checked,
)
from pagoda.model.quant.cpu_kernels import rows_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows_per_rank = -(-num_embeddings // tp_size)
        # [vocab_start, vocab_end): the ids this rank owns (empty past a tiny vocab's end).
        self.vocab_start = min(tp_rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = LayerWeightLoader(self)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} "
                f"rows, expected vocab size {self.num_embeddings}"
            )
        owned = self.vocab_end - self.vocab_start
        copy_checked(
            param.data[:owned],
            loaded_weight[self.vocab_start : self.vocab_end],
            type(self).__name__,
        )
        with torch.no_grad():
            param.data[owned:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        check_tp_group(type(self).__name__, self.tp_rank, self.tp_size)
        # Masked, not indexed by the owned ids: the shapes stay those of input_ids and
        # nothing waits on the host, so a CUDA graph can capture it.
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight)
        rows.masked_fill_(~owned.unsqueeze(-1), 0)
        return tp_all_reduce(rows)  # exactly one rank contributes each row: a copy


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, dim] -> logits [N, vocab] (no bias)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        self.quant_method = None  # set before loading; applied by process_weights_after_loading
        self.quantized: ColumnParallelLinear | None = None

    def set_quant_method(self, method) -> None:
        self.quant_method = method

    def process_weights_after_loading(self) -> None:
        """Quantizes a copy of the loaded float weight with the head's method (the
        parameter itself stays: the embedding may share it)."""
        if self.quant_method is None:
            return
        rows, dim = self.weight.shape
        with torch.device("meta"):
            head = ColumnParallelLinear(dim, rows)
        head.set_quant_method(self.quant_method)
        for name, _param in list(head.named_parameters()):
            if name != "weight":
                raise ValueError(
                    f"the LM head's method {self.quant_method.name} must quantize "
                    f"from the float weight; it made a {name!r} parameter"
                )
        head.weight = nn.Parameter(self.weight.detach().clone(), requires_grad=False)
        self.quant_method.process_weights_after_loading(head)
        self.quantized = head

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(hidden)
        return rows_linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._local_logits(hidden)
        check_tp_group(type(self).__name__, self.tp_rank, self.tp_size)
        logits = tp_all_gather(self._local_logits(hidden), dim=-1)  # [N, size * rows]
        if logits.shape[-1] != self.num_embeddings:  # drop the last rank's padded rows
            logits = logits[:, : self.num_embeddings].contiguous()
        return logits
