"""Token bitmasks: per sampled row, which tokens may be sampled (a grammar's mask).

A bitmask row is int32 [ceil(vocab / 32)]: bit t % 32 of word t // 32 set = token t
allowed. The engine hands one array per request (StepExtras.grammar_bitmasks: [rows
the request samples this step, words]); `stack_row_bitmasks` lays them out in the
step's row order (unmasked rows all ones) and `apply_token_bitmask` sets the logits
of disallowed tokens to -inf on the device, before any other logits processing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pagoda.kernels.launch.host_copy import host_to_device

_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // _BITS)


def stack_row_bitmasks(
    bitmasks: Mapping[str, np.ndarray], row_req_ids: Sequence[str], vocab_size: int
) -> np.ndarray:
    """int32 [len(row_req_ids), words]: request r's k-th row takes bitmasks[r][k]."""
    words = bitmask_words(vocab_size)
    stacked = np.full((len(row_req_ids), words), -1, dtype=np.int32)
    rows_of: dict[str, list[int]] = {}
    for row, req_id in enumerate(row_req_ids):
        rows_of.setdefault(req_id, []).append(row)
    for req_id, mask in bitmasks.items():
        rows = rows_of.get(req_id)
        if rows is None:
            continue  # not sampling this step (a prefill chunk short of the prompt's end)
        mask = np.asarray(mask)
        if mask.dtype != np.int32 or mask.shape != (len(rows), words):
            raise ValueError(
                f"grammar bitmask of request {req_id!r} must be int32 "
                f"{(len(rows), words)}, got {mask.dtype} {mask.shape}"
            )
        stacked[rows] = mask
    return stacked


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, device) -> None:
    """logits [rows, vocab] in place: -inf where the row's bit for the token is 0."""
    words = host_to_device(bitmask, torch.int32, device)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
