"""Test helpers for tensor parallelism on the CPU: process groups of a few gloo ranks that
always end (joined, or killed at a deadline), and a paged forward of a model that holds
its rank's share of the heads, driven as the model runner drives it.

The functions run in spawned children live here, in an importable module, because a
spawned process re-imports its target by module name.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model.layers.attention import Attention, kv_cache_specs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> None:
    """Runs fn(rank, *args) in world_size spawned processes and waits for all of them.

    A child that raises makes this raise (torch terminates the others); children still
    alive at the deadline (e.g. one waits in a collective for a peer that died) are
    killed, then this raises TimeoutError. No child outlives the call.
    """
    context = mp.spawn(fn, args=args, nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel children still running after {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def rank_heads(model) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of this rank's Attention layers."""
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    return attn.num_heads, attn.num_kv_heads, attn.head_dim


def paged_forward(
    model,
    steps: Sequence[dict[str, list[int]]],
    block_size: int = 4,
    num_blocks: int = 32,
    backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs each step (request -> its next tokens, all flattened into one forward) through
    a paged KV cache and the torch_ref backend with this rank's heads (or the backend
    given); returns every step's final hidden states and logits, concatenated in row
    order."""
    if backend is None:
        heads, kv_heads, head_dim = rank_heads(model)
        backend = TorchRefBackend(heads, kv_heads, head_dim, head_dim**-0.5)
    dtype = next(model.parameters()).dtype
    pool = KVCachePool(KVCacheConfig(num_blocks, kv_cache_specs(model, block_size, dtype)), "cpu")
    # Blocks handed out back to front, so block tables are not the identity.
    free_blocks = list(range(num_blocks))
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    hiddens, logits = [], []
    for chunks in steps:
        ids, positions, query_lens, seq_lens, step_tables = [], [], [], [], []
        for req, tokens in chunks.items():
            start, table = lens.get(req, 0), tables.setdefault(req, [])
            end = start + len(tokens)
            while len(table) * block_size < end:
                table.append(free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            step_tables.append(table)
            lens[req] = end
        common = build_attention_metadata(query_lens, seq_lens, step_tables, block_size, "cpu")
        with torch.no_grad(), forward_context(backend, backend.build_metadata(common), pool):
            hidden = model(torch.tensor(ids), torch.tensor(positions))
            hiddens.append(hidden)
            logits.append(model.compute_logits(hidden))
    return torch.cat(hiddens), torch.cat(logits)


_PROMPT_A = list(range(3, 23))
_PROMPT_B = [7, 100, 42, 5, 300, 11, 9, 17]
STEPS = [
    {"a": _PROMPT_A[:12], "b": _PROMPT_B[:7]},  # two prefills
    {"a": _PROMPT_A[12:], "b": _PROMPT_B[7:]},  # a chunk beside a decode row
    {"a": [44], "b": [45]},
]  # pure decode


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding of sums taken in another order (measured: about
    7e-7 of the largest value; a misplaced bias or a wrong shard is off by far more)."""
    assert got.shape == want.shape
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= 4e-6 * scale
