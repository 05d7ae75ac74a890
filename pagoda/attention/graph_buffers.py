"""The attention metadata a CUDA graph reads: tensors at fixed addresses, sized for the
largest captured batch, with the capture-time view of them and the copy of a real batch
into them before a replay. Shared by the Triton backends (standard and MLA), which
differ only in what they plan from this metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionMetadata


@dataclass
class GraphBuffers:
    """Metadata tensors at fixed addresses, sized for the largest captured batch."""

    block_size: int
    query_start_loc: torch.Tensor  # int32 [max_batch_size + 1]
    seq_lens: torch.Tensor  # int32 [max_batch_size]
    block_tables: torch.Tensor  # int32 [max_batch_size, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [max(max_batch_size, max mixed-graph rows)]

    @property
    def max_batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_rows(self) -> int:
        return self.slot_mapping.shape[0]


def allocate_graph_buffers(
    max_batch_size: int, max_blocks_per_req: int, block_size: int, device, max_num_tokens: int = 0
) -> dict:
    """GraphBuffers' fields, allocated (a dict, so a subclass can add its own)."""
    if max_batch_size < 1 or max_blocks_per_req < 1 or block_size < 1:
        raise ValueError(
            f"max_batch_size ({max_batch_size}), max_blocks_per_req "
            f"({max_blocks_per_req}) and block_size ({block_size}) must be >= 1"
        )
    rows = max(max_batch_size, max_num_tokens)
    return dict(
        block_size=block_size,
        query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(max_batch_size, dtype=torch.int32, device=device),
        block_tables=torch.zeros(
            max_batch_size, max_blocks_per_req, dtype=torch.int32, device=device
        ),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
    )


def checked_graph_buffers(
    graph: GraphBuffers | None, batch_size: int, num_tokens: int | None = None
) -> GraphBuffers:
    """graph, once the graph shape (batch_size requests; num_tokens rows for a mixed
    graph, None for a decode graph) is known to fit it."""
    if graph is None:
        raise RuntimeError("call init_cuda_graph_state() before capturing or replaying")
    if not 1 <= batch_size <= graph.max_batch_size:
        raise ValueError(f"batch_size {batch_size} is outside [1, {graph.max_batch_size}]")
    if num_tokens is not None and not batch_size <= num_tokens <= graph.max_rows:
        raise ValueError(f"num_tokens {num_tokens} is outside [batch_size, {graph.max_rows}]")
    return graph


def capture_metadata(
    g: GraphBuffers, batch_size: int, num_tokens: int | None = None
) -> AttentionMetadata:
    """The metadata over the persistent buffers for a graph of this shape: capture-time
    values only (no host copies). Decode graph (num_tokens None): one query row per
    request; mixed graph: num_tokens rows over batch_size requests."""
    rows = batch_size if num_tokens is None else num_tokens
    return AttentionMetadata(
        num_reqs=batch_size,
        num_actual_tokens=rows,
        query_start_loc=g.query_start_loc[: batch_size + 1],
        seq_lens=g.seq_lens[:batch_size],
        block_tables=g.block_tables[:batch_size],
        slot_mapping=g.slot_mapping[:rows],
        max_query_len=1 if num_tokens is None else num_tokens,
        max_seq_len=1,  # not used to size launches: there are no host copies
        block_size=g.block_size,
    )


def copy_batch_into_graph(
    g: GraphBuffers, metadata: AttentionMetadata, batch_size: int, num_tokens: int | None = None
) -> None:
    """Copies a real batch (num_reqs <= batch_size; decode-only for a decode graph, at
    most num_tokens rows for a mixed one) into the buffers."""
    n = metadata.num_reqs
    rows = batch_size if num_tokens is None else num_tokens
    if num_tokens is None and metadata.max_query_len > 1:
        raise ValueError(
            f"decode graphs serve decode-only batches; max_query_len is {metadata.max_query_len}"
        )
    if n > batch_size or metadata.num_actual_tokens > rows:
        raise ValueError(
            f"batch of {n} requests / {metadata.num_actual_tokens} tokens does not "
            f"fit the graph of batch_size {batch_size} / {rows} rows"
        )
    if metadata.block_size != g.block_size:
        raise ValueError(
            f"batch has block_size {metadata.block_size}, the graph buffers {g.block_size}"
        )
    width = metadata.block_tables.shape[1]
    if width > g.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {width} columns, graph buffers hold "
            f"{g.block_tables.shape[1]} (max_blocks_per_req)"
        )
    g.query_start_loc[: n + 1].copy_(metadata.query_start_loc[: n + 1], non_blocking=True)
    # Padding requests: query length 0, so every kernel skips them.
    g.query_start_loc[n + 1 : batch_size + 1].fill_(metadata.num_actual_tokens)
    g.seq_lens[:n].copy_(metadata.seq_lens[:n], non_blocking=True)
    g.seq_lens[n:batch_size].fill_(0)
    g.block_tables[:n, :width].copy_(metadata.block_tables[:n], non_blocking=True)
    real = min(metadata.slot_mapping.shape[0], rows)
    g.slot_mapping[:real].copy_(metadata.slot_mapping[:real], non_blocking=True)
    g.slot_mapping[real:rows].fill_(-1)
