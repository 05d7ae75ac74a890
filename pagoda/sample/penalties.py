"""Logit processors applied before the greedy/random split: logit bias, min_tokens
bans, and repetition / frequency / presence penalties.

Each function takes raw logits [B, V] and returns new logits (the caller's tensor is
never modified). All of them are plain tensor ops: no host sync.
"""

from __future__ import annotations

import torch

from pagoda.sample.metadata import PenaltyTensors, SparseLogitEdits


def apply_logit_bias(logits: torch.Tensor, bias: SparseLogitEdits | None) -> torch.Tensor:
    """logits[row, token] += value for every (row, token, value) of the bias."""
    if bias is None:
        return logits
    return logits.index_put((bias.row_indices, bias.token_ids), bias.values, accumulate=True)


def apply_min_tokens_bans(logits: torch.Tensor, bans: SparseLogitEdits | None) -> torch.Tensor:
    """Sets the banned (row, stop token) logits to -inf: a row can't stop before min_tokens."""
    if bans is None:
        return logits
    # Filled on the device: a host scalar copied there would make the host wait.
    minus_inf = torch.full(
        bans.token_ids.shape, float("-inf"), dtype=logits.dtype, device=logits.device
    )
    return logits.index_put((bans.row_indices, bans.token_ids), minus_inf)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors | None) -> torch.Tensor:
    """Repetition first (tokens seen in prompt or output: positive logits divided by
    the penalty, negative ones multiplied), then frequency (-= f * count in output),
    then presence (-= p if the token occurs in the output).

    Rows with neutral values (1, 0, 0) come out bit-identical: x / 1, x * 1 and
    x - 0 are exact.
    """
    if penalties is None:
        return logits
    counts = penalties.output_token_counts
    in_output = counts > 0
    if penalties.repetition is not None:
        seen = in_output if penalties.prompt_mask is None else in_output | penalties.prompt_mask
        rep = penalties.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if penalties.frequency is not None:
        logits = logits - penalties.frequency.unsqueeze(1) * counts
    if penalties.presence is not None:
        logits = logits - penalties.presence.unsqueeze(1) * in_output.to(logits.dtype)
    return logits
