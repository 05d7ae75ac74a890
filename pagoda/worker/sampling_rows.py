"""What a step's sampling takes from the worker's request states, row by sampled row.

Owns, for ModelRunner._sample and sample_tokens: the SamplingRow of each sampled row (a
request verifying drafts has one per draft plus one, row k seeing drafts[:k] as
outputs, with a generator re-seeded for its position), the rows' device penalty
history (worker/penalty_state.py), the output tokens that only the previous step's
sampled ids hold (async scheduling), and the packed logprobs of the prompt rows a step
computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.kernels.launch.host_copy import host_to_device
from pagoda.sample.logprobs import compute_token_logprobs, pack_token_logprobs
from pagoda.sample.metadata import PendingOutputs, SamplingRow, token_seed
from pagoda.worker.input_batch import CachedRequestState, PrevSampled, StepInputs
from pagoda.worker.penalty_state import PenaltyState, StepPenalties


def sampling_rows(
    states: dict[str, CachedRequestState],
    inputs: StepInputs,
    make_generator: Callable[[int], torch.Generator],
) -> list[SamplingRow]:
    """One SamplingRow per sampled row; a request verifying drafts has several, row
    k seeing drafts[:k] as outputs (what it samples is conditioned on them).
    make_generator(seed): the generator of a seeded request's rows after its first."""
    rows, seen = [], {}
    for req_id in inputs.sample_req_ids:
        offset = seen.get(req_id, 0)
        seen[req_id] = offset + 1
        num_pending = int(req_id in inputs.pending_output)
        rows.append(_sampling_row(states[req_id], num_pending, offset, make_generator))
    return rows


def _sampling_row(
    state: CachedRequestState,
    num_pending: int,
    offset: int,
    make_generator: Callable[[int], torch.Generator],
) -> SamplingRow:
    outputs = state.output_token_ids
    if offset:
        outputs = outputs + state.spec_token_ids[:offset]
    generator = state.generator
    if generator is not None:  # a host-side re-seed: no device work, no sync
        seed = token_seed(state.params.seed, len(outputs) + num_pending)
        if offset:  # row 0 keeps the request's own generator; later rows get theirs
            generator = make_generator(seed)
        else:
            generator.manual_seed(seed)
    return SamplingRow(
        state.params,
        state.prompt_token_ids,
        outputs,
        generator,
        num_pending_outputs=num_pending,
    )


def step_penalties(
    penalty_state: PenaltyState | None,
    states: dict[str, CachedRequestState],
    inputs: StepInputs,
) -> StepPenalties | None:
    """This step's rows of the device penalty history (None: no row has one, or the
    history is rebuilt from the host's lists: penalty_state None)."""
    if penalty_state is None:
        return None
    num_known = {
        req_id: len(states[req_id].output_token_ids) + int(req_id in inputs.pending_output)
        for req_id in set(inputs.sample_req_ids)
        if req_id in penalty_state
    }
    return penalty_state.begin_step(inputs.sample_req_ids, inputs.verified_drafts, num_known)


def pending_outputs(inputs: StepInputs, prev_sampled: PrevSampled | None) -> PendingOutputs | None:
    """The rows' output tokens that only the previous step's sampled ids hold."""
    if not inputs.pending_output:
        return None
    rows, sources = [], []
    for row, req_id in enumerate(inputs.sample_req_ids):
        source = inputs.pending_output.get(req_id)
        if source is not None:
            rows.append(row)
            sources.append(source)
    return PendingOutputs(rows, sources, prev_sampled.token_ids)


def packed_prompt_logprobs(
    model,
    states: dict[str, CachedRequestState],
    hidden: torch.Tensor,
    inputs: StepInputs,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """req_id -> packed prompt logprobs (on device) of the rows this step computed, from
    model's LM head over those rows of hidden."""
    result: dict[str, torch.Tensor] = {}
    for req_id, (first_row, positions) in inputs.prompt_logprob_rows.items():
        state = states[req_id]
        start = state.num_computed_tokens
        rows = host_to_device([first_row + p - start for p in positions], torch.long, device)
        targets = host_to_device(
            [state.prompt_token_ids[p + 1] for p in positions], torch.long, device
        )
        logits = model.compute_logits(hidden.index_select(0, rows))
        ids, lps, ranks = compute_token_logprobs(logits, targets, state.params.prompt_logprobs)
        result[req_id] = pack_token_logprobs(ids, lps, ranks)
    return result
