"""DeepSeek Sparse Attention's lightning indexer: scores and top-k token selection.

Owns `indexer_scores_ref` (plain torch), `indexer_scores` (the Triton kernel of
dsa_indexer_kernel.py, imported only when launched: importing this module imports no
triton), `select_topk` and `indexer_topk`, which runs both in chunks of rows.

Query row n (request row_req[n], which sees the first row_len[n] tokens of its context;
0 = a padding row) scores every token t < row_len[n] of the indexer key cache
[num_blocks, block_size, D] (token t of request r at block block_tables[r, t //
block_size], offset t % block_size):

    score[n, t] = sum_h weights[n, h] * relu(q[n, h, :] . k[t, :])

with the softmax scale and n_heads**-0.5 folded into weights by the caller; positions
t >= row_len[n] score -inf. The row then attends only to its k best tokens
(sparse_mla.py): a row that sees at most k tokens takes them all.
"""

from __future__ import annotations

import torch

from pagoda.kernels.attention.dsa_config import DSAKernelConfig


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Scores of q [N, Hi, D] against the paged key cache (module docstring), float32
    [N, width]: -inf at t >= row_len[n]. Gathers N x width keys at once: for tests and
    the CPU path at small shapes."""
    num_rows = q.shape[0]
    out = torch.full((num_rows, width), float("-inf"), dtype=torch.float32, device=q.device)
    if num_rows == 0 or width == 0:
        return out
    bs = key_cache.shape[1]
    pos = torch.arange(width, device=q.device)
    seen = pos[None, :] < row_len[:, None].long()  # [N, width]
    tables = block_tables[row_req.long()].long()  # [N, max_blocks]
    nblk = min(-(-width // bs), tables.shape[1])
    blocks = tables[:, :nblk][:, (pos // bs).clamp(max=nblk - 1)]
    slots = torch.where(seen, blocks * bs + pos % bs, 0)
    keys = key_cache.reshape(-1, key_cache.shape[-1])[slots].float()  # [N, width, D]
    keys = keys.masked_fill(~seen[..., None], 0.0)  # unused slots may hold NaN
    logits = torch.einsum("nhd,ntd->nht", q.float(), keys).clamp_min(0.0)
    scores = torch.einsum("nh,nht->nt", weights.float(), logits)
    return torch.where(seen, scores, out)


def indexer_scores(
    out: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    config: DSAKernelConfig | None = None,
) -> None:
    """indexer_scores_ref's result written into out, float32 [N, width] (its rows may be
    strided), by the Triton kernel: no host sync, so it can be captured in a CUDA graph.
    q and key_cache share one dtype; weights are float32 [N, Hi]; config: the tiles
    (default: DSAKernelConfig.for_device(q.device))."""
    num_rows, num_heads, head_dim = q.shape
    if key_cache.dim() != 3 or key_cache.shape[2] != head_dim:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, {head_dim}], got {tuple(key_cache.shape)}"
        )
    if out.dim() != 2 or out.shape[0] != num_rows or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{num_rows}, width], got {tuple(out.shape)}")
    if weights.shape != (num_rows, num_heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32 [{num_rows}, {num_heads}]")
    if q.dtype != key_cache.dtype or q.stride(2) != 1 or key_cache.stride(2) != 1:
        raise ValueError("q and key_cache need one dtype and a contiguous last dimension")
    if out.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError("out and weights need a contiguous last dimension")
    if row_req.shape[0] < num_rows or row_len.shape[0] < num_rows:
        raise ValueError(f"row_req/row_len need {num_rows} entries")
    if num_rows == 0 or out.shape[1] == 0:
        return
    from pagoda.kernels.attention.dsa_indexer_kernel import launch_indexer_scores

    tiles = (config or DSAKernelConfig.for_device(q.device)).indexer_tiles(q.dtype)
    launch_indexer_scores(out, q, weights, key_cache, block_tables, row_req, row_len, tiles)


def leading_positions(row_len: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, k]: 0..row_len[n]-1 then -1s (every token of a row that sees at most k)."""
    pos = torch.arange(k, dtype=torch.int32, device=row_len.device)
    return torch.where(pos[None, :] < row_len[:, None], pos[None, :], -1)


def select_topk(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """Token positions int32 [N, k] each row attends to, -1 where unused: a row with
    row_len <= k gets 0..row_len-1 then -1s, whatever its scores; a longer row the
    positions of its k largest scores, in ascending order. No host sync."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    num_rows, width = scores.shape
    row_len = row_len[:num_rows]
    chosen = leading_positions(row_len, k)
    if width <= k:  # no row may see more than width tokens: every row is short
        return chosen
    best = torch.topk(scores, k, dim=-1, sorted=False).indices
    best = torch.sort(best, dim=-1).values.to(torch.int32)
    return torch.where((row_len > k)[:, None], best, chosen)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    k: int,
    max_len: int,
    row_chunk: int,
    use_kernel: bool | None = None,
    config: DSAKernelConfig | None = None,
) -> torch.Tensor:
    """The k positions each row attends to (select_topk), int32 [N, k]. max_len: the
    longest row_len (or any bound on it, as a CUDA graph's; 0 = unknown: read from
    row_len, a host sync that a graph cannot capture); the scores of at most row_chunk
    rows x max_len tokens exist at once. use_kernel: the Triton kernel (default: on
    CUDA) or indexer_scores_ref. Nothing is scored when max_len <= k."""
    if row_chunk <= 0:
        raise ValueError(f"row_chunk must be positive, got {row_chunk}")
    num_rows = q.shape[0]
    if max_len <= 0 and num_rows > 0:
        max_len = int(row_len[:num_rows].max())
    if max_len <= k or num_rows == 0:
        return leading_positions(row_len[:num_rows], k)
    kernel = q.is_cuda if use_kernel is None else use_kernel
    out = torch.empty(num_rows, k, dtype=torch.int32, device=q.device)
    chunk = min(row_chunk, num_rows)
    buffer = torch.empty(chunk, max_len, dtype=torch.float32, device=q.device) if kernel else None
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        rows = (q[start:end], weights[start:end], key_cache, block_tables)
        lens = (row_req[start:end], row_len[start:end])
        if buffer is not None:
            scores = buffer[: end - start]
            indexer_scores(scores, *rows, *lens, config=config)
        else:
            scores = indexer_scores_ref(*rows, *lens, max_len)
        out[start:end] = select_topk(scores, lens[1], k)
    return out
