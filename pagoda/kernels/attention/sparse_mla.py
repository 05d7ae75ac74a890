"""Sparse latent attention: MLA's absorbed form over each row's selected tokens only.

Owns `sparse_latent_attention_ref` (plain torch) and `sparse_latent_attention` (the
Triton kernel of sparse_mla_kernel.py, imported only when launched: importing this
module imports no triton). The split count comes from DSAKernelConfig.sparse_splits
unless the caller passes one.

Row n of q ([N, H, E], E = kv_lora_rank + rope: the latent query q_nope W_UK then the
rotated q_rope, as pagoda.attention.mla_backend.latent_attention_ref takes it) attends
to the entries of the latent cache [num_blocks, block_size, E] at the token positions
positions[n] (int32 [N, K], token t of request row_req[n] at block block_tables[req, t
// block_size], offset t % block_size; -1 = unused, in any place): scores are the dot
product over the whole entry times scale, the softmax runs over the selected entries
only, the value is an entry's first kv_lora_rank values. A row with no selected entry
gets zeros. With every position of a row's context selected, this is
latent_attention_ref.
"""

from __future__ import annotations

import torch

from pagoda.kernels.attention.dsa_config import DSAKernelConfig
from pagoda.kernels.launch.capability import sm_count


def sparse_latent_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The module docstring's attention in float32: [N, H, kv_lora_rank]."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    if num_rows == 0 or positions.shape[1] == 0:
        return out
    bs = cache.shape[1]
    real = positions >= 0  # [N, K]
    pos = positions.long().clamp_min(0)
    tables = block_tables[row_req.long()].long()  # [N, max_blocks]
    slots = torch.gather(tables, 1, pos // bs) * bs + pos % bs
    slots = torch.where(real, slots, 0)
    entries = cache.reshape(-1, cache.shape[-1])[slots].float()  # [N, K, E]
    entries = entries.masked_fill(~real[..., None], 0.0)  # unused slots may hold NaN
    scores = torch.einsum("nhe,nke->nhk", q.float(), entries) * scale
    scores = scores.masked_fill(~real[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing selected
    return torch.einsum("nhk,nkc->nhc", probs, entries[..., :kv_lora_rank])


def sparse_latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    count: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: DSAKernelConfig | None = None,
) -> torch.Tensor:
    """sparse_latent_attention_ref's result by the Triton kernel, [N, H, kv_lora_rank]
    in out (q's dtype or float32; default: a new tensor in q's dtype), which it returns.
    No host sync, so it can be captured in a CUDA graph. num_splits (a runtime argument:
    no recompilation when it changes) splits each row's list with a log-sum-exp merge;
    default: config.sparse_splits for the launch's shape and device. count (int32 [N],
    optional): row n reads only positions[n, :count[n]], the rest taken as -1;
    dsa_indexer.select_topk's lists hold min(row_len, k) positions then -1s, so passing
    count = row_len there skips the -1s of short rows. config: the tiles (default: for
    q's device)."""
    num_rows, num_heads, _ = q.shape
    if out is None:
        out = torch.empty(num_rows, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    config = config or DSAKernelConfig.for_device(q.device)
    if num_splits is None:
        num_splits = config.sparse_splits(
            num_rows, num_heads, positions.shape[-1], sm_count(q.device), q.dtype
        )
    _check_args(out, q, cache, row_req, positions, count, kv_lora_rank, num_splits)
    if num_rows == 0:
        return out
    if positions.shape[1] == 0:
        return out.zero_()
    from pagoda.kernels.attention.sparse_mla_kernel import launch_sparse_latent_attention

    launch_sparse_latent_attention(
        out,
        q,
        cache,
        block_tables,
        row_req,
        positions,
        count,
        scale,
        kv_lora_rank,
        num_splits,
        config.sparse_tiles(q.dtype),
    )
    return out


def _check_args(out, q, cache, row_req, positions, count, kv_lora_rank, num_splits) -> None:
    """ValueError, with what is wrong, for arguments the kernel does not take."""
    num_rows, num_heads, entry = q.shape
    if cache.dim() != 3 or cache.shape[2] != entry or not 0 < kv_lora_rank < entry:
        raise ValueError(
            f"cache must be [num_blocks, block_size, {entry}] with kv_lora_rank "
            f"< {entry}, got {tuple(cache.shape)}, kv_lora_rank {kv_lora_rank}"
        )
    if out.shape != (num_rows, num_heads, kv_lora_rank) or out.stride(2) != 1:
        raise ValueError(
            f"out must be [{num_rows}, {num_heads}, {kv_lora_rank}] with a "
            f"contiguous last dimension, got {tuple(out.shape)}"
        )
    if out.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"out must be {q.dtype} or float32, got {out.dtype}")
    if q.stride(2) != 1 or cache.stride(2) != 1 or q.dtype != cache.dtype:
        raise ValueError("q and cache need one dtype and a contiguous last dimension")
    if positions.dim() != 2 or positions.shape[0] < num_rows or positions.stride(1) != 1:
        raise ValueError(f"positions must be [{num_rows}, K] with a contiguous last dimension")
    if positions.dtype != torch.int32 or (count is not None and count.dtype != torch.int32):
        raise ValueError("positions and count must be int32")
    if row_req.shape[0] < num_rows or (count is not None and count.shape[0] < num_rows):
        raise ValueError(f"row_req and count need {num_rows} entries")
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
