"""Token logprobs: the given token's logprob and rank plus the top-k, and the one
host transfer that turns them into the `TokenLogprobs` contract.

Used for sampled tokens (by the Sampler, on the raw logits) and for prompt tokens
(by the model runner, on prompt positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.core.outputs import TokenLogprobs


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of the N rows: the token's logprob then the top-k logprobs.

    Returns (ids [N, k+1] int64, logprobs [N, k+1] float32, ranks [N] int64), where
    column 0 is `token_ids` and ranks are 1-based: 1 + the number of tokens with a
    strictly larger logprob (a tie shares the better rank).
    """
    if k < 0:
        raise ValueError(f"logprobs must be >= 0, got {k}")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    ids = torch.cat([token_ids, top_ids], dim=1)
    values = torch.cat([token_logprobs, top_logprobs], dim=1)
    return ids, values, ranks


def to_token_logprobs(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    ranks: torch.Tensor,
    num_logprobs: Sequence[int] | None = None,
) -> list[TokenLogprobs]:
    """Converts the tensors of `compute_token_logprobs` to one TokenLogprobs per row.

    One device-to-host copy: ids, logprobs and ranks travel packed in one float64
    tensor (exact: ids and ranks < 2**53, float32 -> float64 is exact).
    `num_logprobs[i]` keeps only the first 1 + num_logprobs[i] entries of row i
    (rows of a batch may ask for fewer than the batch's k).
    """
    return unpack_token_logprobs(pack_token_logprobs(ids, logprobs, ranks).cpu(), num_logprobs)


def pack_token_logprobs(
    ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """[B, 2k + 1] float64 on the tensors' device: ids, then logprobs, then the rank."""
    return torch.cat(
        [ids.to(torch.float64), logprobs.to(torch.float64), ranks.to(torch.float64).unsqueeze(1)],
        dim=1,
    )


def unpack_token_logprobs(
    packed: torch.Tensor, num_logprobs: Sequence[int] | None = None
) -> list[TokenLogprobs]:
    """pack_token_logprobs' output (on the host) -> one TokenLogprobs per row."""
    rows = packed.tolist()
    width = (packed.shape[1] - 1) // 2
    if num_logprobs is not None and len(num_logprobs) != len(rows):
        raise ValueError(f"num_logprobs has {len(num_logprobs)} entries for {len(rows)} rows")
    result = []
    for i, row in enumerate(rows):
        keep = width if num_logprobs is None else 1 + num_logprobs[i]
        if not 1 <= keep <= width:
            raise ValueError(f"num_logprobs[{i}] must be in [0, {width - 1}], got {keep - 1}")
        result.append(
            TokenLogprobs(
                token_ids=[int(x) for x in row[:keep]],
                logprobs=row[width : width + keep],
                sampled_rank=int(row[2 * width]),
            )
        )
    return result
