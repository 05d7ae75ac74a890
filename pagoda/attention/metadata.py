"""Builds AttentionMetadata from per-request query and context lengths.

Used by the model runner every step and by tests that drive a model or a kernel
directly. Host-side arrays are built with plain Python / torch CPU ops, then copied to
the device once: through a fresh pinned copy each, or through the caller's `upload`
(the runner's reused pinned buffers, pagoda/worker/staging.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from pagoda.attention.backend import AttentionMetadata
from pagoda.kernels.launch.host_copy import tensor_to_device


def compute_slot_mapping(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> list[int]:
    """Slot (block_id * block_size + offset) of every query token, request after request."""
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
        if qlen == 1:  # decode: the common case, no inner loop
            pos = slen - 1
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            continue
        pos = slen - qlen
        while pos < slen:  # a run of slots per block, not a lookup per token
            block, offset = divmod(pos, block_size)
            take = min(block_size - offset, slen - pos)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + take))
            pos += take
    return slots


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    pad_to: int | None = None,
    max_blocks_per_req: int | None = None,
    device_block_tables: torch.Tensor | None = None,
    upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> AttentionMetadata:
    """Metadata for a flattened batch. pad_to adds padding rows (slot -1) at the end.
    device_block_tables: the block tables already on the device (the worker's
    persistent DeviceBlockTable), used instead of uploading block_tables.
    upload: host tensor -> its copy on `device`, queued without making the host wait
    (default: a fresh pinned copy on CUDA); the host tensors stay the caller's."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
        if not 0 < qlen <= slen:
            raise ValueError(f"need 0 < query_len <= seq_len, got {qlen}, {slen}")
        if len(table) * block_size < slen:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {slen} tokens")
    num_tokens = sum(query_lens)
    slots = compute_slot_mapping(query_lens, seq_lens, block_tables, block_size)
    if pad_to is not None:
        if pad_to < num_tokens:
            raise ValueError(f"pad_to ({pad_to}) < number of tokens ({num_tokens})")
        slots.extend([-1] * (pad_to - num_tokens))
    if device_block_tables is not None:
        if device_block_tables.shape[0] != len(block_tables):
            raise ValueError(
                f"device_block_tables has {device_block_tables.shape[0]} rows "
                f"for {len(block_tables)} requests"
            )
        tables = device_block_tables
    else:
        width = max(max_blocks_per_req or max((len(t) for t in block_tables), default=1), 1)
        # One tensor from padded rows: a per-row copy costs a torch call per request.
        tables = torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32
        ).reshape(len(block_tables), width)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq = torch.tensor(list(seq_lens), dtype=torch.int32)
    if upload is None:
        upload = lambda tensor: tensor_to_device(tensor, device)  # noqa: E731
    if device_block_tables is None:
        tables = upload(tables)
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        query_start_loc=upload(qsl),
        seq_lens=upload(seq),
        block_tables=tables,
        slot_mapping=upload(torch.tensor(slots, dtype=torch.int64)),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
