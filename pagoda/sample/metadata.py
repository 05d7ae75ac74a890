"""Batched sampling metadata: per-request SamplingParams turned into device tensors.

Owns `SamplingRow` (what the model runner knows about one row of the batch),
`make_generator` (the per-request generator of a seeded request) and
`build_sampling_metadata`, which packs a batch of rows into `SamplingMetadata`.

Every tensor that no row needs is left as None so the sampler can skip the work:
an all-greedy batch without penalties, bias or bans reduces to one argmax.
Building happens on the host from Python lists; the copies to the device are
host-to-device only (pinned + non_blocking on CUDA), never device-to-host.

The penalties' history (output-token counts, prompt masks) is either counted here
from the rows' token lists (the reference path) or handed in by a `PenaltyHistory`
that keeps it on the device between steps (pagoda.worker.penalty_state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from pagoda.kernels.launch.host_copy import host_to_device
from pagoda.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the batch as the model runner sees it at this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # grows by the sampled token(s) every step
    # The request's own generator when it has a seed; created once per request by
    # `make_generator` and kept across steps so its stream continues.
    generator: torch.Generator | None = None
    # Output tokens sampled already but still on the device (async scheduling): they
    # count for min_tokens, and build_sampling_metadata's `pending_outputs` gives
    # their ids for the penalties.
    num_pending_outputs: int = 0


@dataclass
class PendingOutputs:
    """Output tokens of some rows that only the device knows: row rows[i] has the token
    sampled_ids[sources[i]] (the previous step's sampled ids). Read only by the
    penalties, so a batch without penalties never touches the device for them."""

    rows: list[int]
    sources: list[int]
    sampled_ids: torch.Tensor  # int64 on the metadata's device

    def token_ids(self, device: torch.device) -> torch.Tensor:
        return self.sampled_ids.index_select(0, host_to_device(self.sources, torch.int64, device))


class PenaltyHistory(Protocol):
    """The penalties' history of a batch's rows, kept elsewhere (e.g. on the device)."""

    def tensors(self, with_prompt_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, V] float32 output-token counts, [B, V] bool prompt mask or None).

        Rows whose params use no penalty may hold any finite values: neutral penalties
        leave their logits bit-identical whatever the counts (apply_penalties)."""


def uses_penalties(params: SamplingParams) -> bool:
    """Whether a row's repetition, frequency or presence penalty departs from neutral."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator for a seeded request: create once, keep for the request's life."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, output_index: int) -> int:
    """The seed of a seeded request's draw for its output token number output_index.

    Re-seeding each draw from (seed, index) makes a seeded request's tokens independent
    of its history in the engine: a preempted request, resumed with a fresh worker
    state, draws exactly what it would have drawn had it never been preempted.
    splitmix64 keeps neighbouring (seed, index) pairs uncorrelated.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class PenaltyTensors:
    """Repetition / frequency / presence penalties of a batch (present only if used)."""

    # [B] float32; None when every row has repetition_penalty == 1.
    repetition: torch.Tensor | None
    # [B] float32; None when every row has the penalty 0.
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    # [B, V] bool: the token occurs in the row's prompt. Only built with the
    # repetition penalty, the one penalty that looks at the prompt.
    prompt_mask: torch.Tensor | None
    # [B, V] float32: how often each token occurs in the row's output so far.
    output_token_counts: torch.Tensor


@dataclass
class SparseLogitEdits:
    """(row, token) pairs of a batch with a value each: logit_bias or banned ids."""

    row_indices: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor | None = None  # [N] float32; None for bans (-inf)


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] bool, True for greedy rows; only for a mixed batch.
    is_greedy: torch.Tensor | None
    # [B] float32 (1.0 on greedy rows); None when no random row scales.
    temperature: torch.Tensor | None
    # [B] int64 in [1, V] (V = disabled); None when no random row uses top-k.
    top_k: torch.Tensor | None
    # Largest enabled top_k of a random row (host int, sizes a torch.topk); None if none.
    max_top_k: int | None
    # [B] float32 in (0, 1] (1 = disabled); None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32 in [0, 1] (0 = disabled); None when no random row uses min-p.
    min_p: torch.Tensor | None
    penalties: PenaltyTensors | None
    logit_bias: SparseLogitEdits | None
    # Stop ids banned on rows that have not reached min_tokens yet.
    min_tokens_bans: SparseLogitEdits | None
    # Largest `logprobs` asked by a row; None when no row asks.
    max_num_logprobs: int | None
    # Per row: the request's generator (seeded rows) or None.
    generators: list[torch.Generator | None]
    # Random rows that have their own generator (draw their noise alone).
    seeded_random_rows: list[int]
    # Draws the noise of unseeded random rows; None = torch's default generator.
    generator: torch.Generator | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _check_token_ids(ids, vocab_size: int, field_name: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{field_name} must hold token ids in [0, {vocab_size}), got {token_id}"
            )


def _token_positions(
    lists: Sequence[Sequence[int]], vocab_size: int, field_name: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, flattened.

    numpy does the flattening: a Python loop over ~100k history tokens per step
    would cost more than the sampling itself.
    """
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    token_ids = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0]
        raise ValueError(f"{field_name} must hold token ids in [0, {vocab_size}), got {bad}")
    row_indices = np.repeat(np.arange(len(lists), dtype=np.int64), lengths)
    return host_to_device(row_indices, torch.int64, device), host_to_device(
        token_ids, torch.int64, device
    )


def _count_history(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    pending: PendingOutputs | None,
    use_repetition: bool,
):
    """(output-token counts, prompt mask or None) counted from the rows' token lists."""
    shape = (len(rows), vocab_size)
    row_indices, token_ids = _token_positions(
        [r.output_token_ids for r in rows], vocab_size, "output_token_ids", device
    )
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    counts.index_put_(
        (row_indices, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True
    )
    if pending is not None and pending.rows:
        pending_rows = host_to_device(pending.rows, torch.int64, device)
        pending_ids = pending.token_ids(device)
        counts.index_put_(
            (pending_rows, pending_ids),
            torch.ones_like(pending_ids, dtype=torch.float32),
            accumulate=True,
        )
    prompt_mask = None
    if use_repetition:
        row_indices, token_ids = _token_positions(
            [r.prompt_token_ids for r in rows], vocab_size, "prompt_token_ids", device
        )
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        prompt_mask.index_put_(
            (row_indices, token_ids), torch.ones_like(token_ids, dtype=torch.bool)
        )
    return counts, prompt_mask


def _build_penalties(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    pending: PendingOutputs | None,
    history: PenaltyHistory | None,
) -> PenaltyTensors | None:
    if not any(uses_penalties(r.params) for r in rows):
        return None
    repetition = [r.params.repetition_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    presence = [r.params.presence_penalty for r in rows]
    use_repetition = any(x != 1.0 for x in repetition)
    use_frequency = any(x != 0.0 for x in frequency)
    use_presence = any(x != 0.0 for x in presence)
    if history is not None:
        counts, prompt_mask = history.tensors(use_repetition)
    else:
        counts, prompt_mask = _count_history(rows, vocab_size, device, pending, use_repetition)
    return PenaltyTensors(
        repetition=host_to_device(repetition, torch.float32, device) if use_repetition else None,
        frequency=host_to_device(frequency, torch.float32, device) if use_frequency else None,
        presence=host_to_device(presence, torch.float32, device) if use_presence else None,
        prompt_mask=prompt_mask,
        output_token_counts=counts,
    )


def _build_logit_bias(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> SparseLogitEdits | None:
    row_indices, token_ids, values = [], [], []
    for i, r in enumerate(rows):
        bias = r.params.logit_bias or {}
        _check_token_ids(bias, vocab_size, "logit_bias")
        for token_id, value in bias.items():
            row_indices.append(i)
            token_ids.append(token_id)
            values.append(value)
    if not row_indices:
        return None
    return SparseLogitEdits(
        host_to_device(row_indices, torch.int64, device),
        host_to_device(token_ids, torch.int64, device),
        host_to_device(values, torch.float32, device),
    )


def _build_min_tokens_bans(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> SparseLogitEdits | None:
    row_indices, token_ids = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) + r.num_pending_outputs >= r.params.min_tokens:
            continue
        # all_stop_token_ids holds eos (unless ignore_eos) once the engine filled it.
        stop_ids = sorted(set(r.params.all_stop_token_ids) | set(r.params.stop_token_ids))
        _check_token_ids(stop_ids, vocab_size, "stop_token_ids")
        row_indices.extend([i] * len(stop_ids))
        token_ids.extend(stop_ids)
    if not row_indices:
        return None
    return SparseLogitEdits(
        host_to_device(row_indices, torch.int64, device),
        host_to_device(token_ids, torch.int64, device),
    )


def _random_row_tensor(values, neutral, is_random, dtype, device) -> torch.Tensor | None:
    """A [B] tensor of one per-row setting, or None if no random row departs from `neutral`.

    Greedy rows get the neutral value: their setting cannot change an argmax.
    """
    values = [v if random else neutral for v, random in zip(values, is_random)]
    if all(v == neutral for v in values):
        return None
    return host_to_device(values, dtype, device)


def build_sampling_metadata(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    pending_outputs: PendingOutputs | None = None,
    penalty_history: PenaltyHistory | None = None,
) -> SamplingMetadata:
    """Packs the rows of one step into tensors on `device`.

    `generator` draws the noise of rows without their own generator (None: torch's
    default generator of that device). `pending_outputs` are output tokens of some
    rows known only on the device (counted by the penalties). `penalty_history`, when
    given, supplies the penalties' counts and prompt masks instead of counting them
    here from the rows' lists (`pending_outputs` is then unused). Raises ValueError
    for a token id outside the vocabulary or a seeded row without its generator.
    """
    device = torch.device(device)
    if not rows:
        raise ValueError("build_sampling_metadata needs at least one row")
    is_random = [not r.params.greedy for r in rows]
    for i, r in enumerate(rows):
        if is_random[i] and r.params.seed is not None and r.generator is None:
            raise ValueError(
                f"row {i} has seed={r.params.seed} but no generator (use make_generator once per request)"
            )
    all_greedy = not any(is_random)
    all_random = all(is_random)
    params = [r.params for r in rows]
    # top_k larger than the vocabulary is no filter at all.
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    enabled_top_k = [k for k, random in zip(top_k, is_random) if random and k < vocab_size]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        is_greedy=None
        if (all_greedy or all_random)
        else host_to_device([not x for x in is_random], torch.bool, device),
        temperature=_random_row_tensor(
            [p.temperature for p in params], 1.0, is_random, torch.float32, device
        ),
        top_k=_random_row_tensor(top_k, vocab_size, is_random, torch.int64, device),
        max_top_k=max(enabled_top_k) if enabled_top_k else None,
        top_p=_random_row_tensor([p.top_p for p in params], 1.0, is_random, torch.float32, device),
        min_p=_random_row_tensor([p.min_p for p in params], 0.0, is_random, torch.float32, device),
        penalties=_build_penalties(rows, vocab_size, device, pending_outputs, penalty_history),
        logit_bias=_build_logit_bias(rows, vocab_size, device),
        min_tokens_bans=_build_min_tokens_bans(rows, vocab_size, device),
        max_num_logprobs=max(logprobs) if logprobs else None,
        generators=[r.generator for r in rows],
        seeded_random_rows=[
            i for i, r in enumerate(rows) if is_random[i] and r.generator is not None
        ],
        generator=generator,
        device=device,
    )
