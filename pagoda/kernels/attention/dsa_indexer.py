"""DeepSeek Sparse Attention's lightning indexer: scores and top-k token selection.

Owns `indexer_scores_ref` (plain torch), `indexer_scores` (the Triton kernel of
dsa_indexer_kernel.py), `select_topk` (plain torch) and `topk_positions` (the Triton
kernel of dsa_topk_kernel.py), and `indexer_topk`, which scores and selects in chunks of
rows. The kernels' modules are imported only when launched: importing this module
imports no triton.

Query row n (request row_req[n], which sees the first row_len[n] tokens of its context;
0 = a padding row) scores every token t < row_len[n] of the indexer key cache
[num_blocks, block_size, D] (token t of request r at block block_tables[r, t //
block_size], offset t % block_size):

    score[n, t] = sum_h weights[n, h] * relu(q[n, h, :] . k[t, :])

with the softmax scale and n_heads**-0.5 folded into weights by the caller; positions
t >= row_len[n] score -inf. The row then attends only to its k best tokens
(sparse_mla.py): a row that sees at most k tokens takes them all. Ties at the k-th
largest score go to the lowest positions, so the selection is one exact answer that
the reference and the kernel both give.
"""

from __future__ import annotations

import torch

from pagoda.kernels.attention.dsa_config import DSAKernelConfig
from pagoda.kernels.launch.capability import sm_count


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
    fill: bool = True,
) -> None:
    """indexer_scores_ref's result written into out, float32 [N, width] (its rows may be
    strided), by the Triton kernel: no host sync, so it can be captured in a CUDA graph.
    q and key_cache share one dtype; weights are float32 [N, Hi]; config: the tiles
    (default: DSAKernelConfig.for_device(q.device)). fill=False leaves out[n, t] for t >=
    row_len[n] as it was (for topk_positions, which never reads it)."""
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
    launch_indexer_scores(out, q, weights, key_cache, block_tables, row_req, row_len, tiles, fill)


def leading_positions(row_len: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, k]: 0..row_len[n]-1 then -1s (every token of a row that sees at most k)."""
    pos = torch.arange(k, dtype=torch.int32, device=row_len.device)
    return torch.where(pos[None, :] < row_len[:, None], pos[None, :], -1)


def select_topk(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """Token positions int32 [N, k] each row attends to, -1 where unused: a row with
    row_len <= k gets 0..row_len-1 then -1s, whatever its scores; a longer row the
    positions of its k largest scores among scores[n, :row_len[n]] (the rest of the row
    is ignored), in ascending order, ties at the k-th largest going to the lowest
    positions (-0 equals +0; -inf is lowest). No host sync: the torch reference of
    topk_positions."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    num_rows, width = scores.shape
    row_len = row_len[:num_rows]
    chosen = leading_positions(row_len, k)
    if width <= k:  # no row may see more than width tokens: every row is short
        return chosen
    pos = torch.arange(width, device=scores.device)
    inside = pos[None, :] < row_len[:, None]
    masked = scores.float().masked_fill(~inside, float("-inf"))
    kth = torch.topk(masked, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = masked > kth
    tie = inside & (masked == kth)
    wanted = k - above.sum(-1, keepdim=True)
    take = above | (tie & (tie.cumsum(-1) <= wanted))
    # Taken tokens go to slots 0..k-1 in position order; the rest to a dropped slot k.
    slot = torch.where(take, take.cumsum(-1) - 1, k).clamp(max=k)
    best = torch.full((num_rows, k + 1), -1, dtype=torch.int32, device=scores.device)
    best.scatter_(1, slot, pos.to(torch.int32).expand(num_rows, width).contiguous())
    return torch.where((row_len > k)[:, None], best[:, :k], chosen)


def topk_positions(
    scores: torch.Tensor,
    row_len: torch.Tensor,
    k: int,
    out: torch.Tensor | None = None,
    config: DSAKernelConfig | None = None,
    segments: int | None = None,
) -> torch.Tensor:
    """select_topk by the Triton kernel, into out (int32 [N, k], rows may be strided; a
    new tensor when None), returned. scores: float32 [N, W] with a contiguous last
    dimension; row_len: [N] int32 (or int64), each at most W; only scores[n, t] for t <
    row_len[n] are read, so the rest may hold anything. No host sync, no shape that
    depends on the data: it can be captured in a CUDA graph. config: the tiles
    (default: DSAKernelConfig.for_device(scores.device)); segments: the parts each row
    is cut into (default: config.topk.segments for N, W and the device: 1, one program
    a row, unless the rows are too few to fill the GPU)."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be float32 [N, W], contiguous rows, got {scores.shape}")
    num_rows, width = scores.shape
    if row_len.shape[0] < num_rows or row_len.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_len must be int32 or int64 with {num_rows} entries")
    if out is None:
        out = torch.empty(num_rows, k, dtype=torch.int32, device=scores.device)
    elif out.shape != (num_rows, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [{num_rows}, {k}], got {tuple(out.shape)}")
    if num_rows == 0:
        return out
    if width == 0:  # no score to read: every row is short
        out.copy_(leading_positions(row_len[:num_rows], k))
        return out
    from pagoda.kernels.attention.dsa_topk_kernel import launch_topk_positions

    config = config or DSAKernelConfig.for_device(scores.device)
    if segments is None:
        num_sms = sm_count(scores.device)
        segments = config.topk.segments(num_rows, width, num_sms, config.programs_per_sm)
    launch_topk_positions(out, scores, row_len, k, config.topk, segments)
    return out


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
    longest row_len or any bound on it, as a CUDA graph's max_model_len (0 = unknown:
    read from row_len, a host sync that a graph cannot capture); the scores of at most
    row_chunk rows x max_len tokens exist at once. use_kernel: the Triton kernels
    (indexer_scores then topk_positions; default: on CUDA), which read and write no
    score past a row's length, so a loose bound costs memory and idle programs, not
    reads; else indexer_scores_ref and select_topk. Nothing is scored when max_len <= k."""
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
            indexer_scores(scores, *rows, *lens, config=config, fill=False)
            topk_positions(scores, lens[1], k, out=out[start:end], config=config)
        else:
            scores = indexer_scores_ref(*rows, *lens, max_len)
            out[start:end] = select_topk(scores, lens[1], k)
    return out
