"""Per-request state the worker keeps between steps, and the flattened step inputs.

The scheduler sends diffs (new requests in full, then only new tokens / blocks); this
module applies them and builds the step's token ids, positions and attention metadata.

With async scheduling a step may compute one position whose token the host does not
know yet: the token the previous step sampled (still on the device), at the request's
first unknown position, before any draft tokens. Its row gets a placeholder id on the
host and is filled on the device from `PrevSampled`, so the host never waits for the
previous step.

Optimistic steps (core/optimistic_drafts.py): after a step in which a request was
asked to propose drafts (SchedulerOutput.num_drafts_to_propose), the worker has read
its kept tokens on its host (worker/drafting.py record_kept): they join the state's
output tokens at once (`num_unsent`: the scheduler has not sent them yet; its diffs
send them again later and are checked against them). While such tokens are unsent the
scheduler's view of the request is optimistic: its num_computed_tokens counts every
draft of that step as accepted and its drafts are placeholders. The state corrects
both on the host, where it knows the truth: num_computed_tokens minus that step's
rejected drafts, and its own proposals as the drafts (fewer rows where it proposed
fewer than the scheduler counted). Sequence lengths and slot mappings follow from the
true positions; the scheduler's extra slots are never written.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.metadata import build_attention_metadata
from pagoda.core.outputs import SchedulerOutput
from pagoda.kernels.launch.host_copy import tensor_to_device
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.planning.optimistic import is_placeholder
from pagoda.worker.block_table import DeviceBlockTable
from pagoda.worker.staging import StagingRing


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    # Optimistic steps (module docstring): output tokens (at the end of
    # output_token_ids) the scheduler has not sent yet; the drafts that the last step
    # the worker read on its host rejected of those the scheduler counted; the drafts
    # proposed after it; and the drafts the scheduler counted in this step.
    num_unsent: int = 0
    num_rejected: int = 0
    proposed: list[int] = field(default_factory=list)
    num_scheduled_drafts: int = 0

    @property
    def num_unproposed(self) -> int:
        """Drafts the scheduler counted this step that the worker did not propose."""
        return self.num_scheduled_drafts - len(self.spec_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions start .. end - 1 (list slices: a 16k-token prefill
        step would otherwise call token_at 16k times)."""
        prompt = self.prompt_token_ids
        n_prompt = len(prompt)
        if end <= n_prompt:
            return prompt[start:end]
        rest = self.output_token_ids + self.spec_token_ids
        if start >= n_prompt:
            return rest[start - n_prompt : end - n_prompt]
        return prompt[start:] + rest[: end - n_prompt]

    def token_at(self, pos: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        if pos < n_prompt:
            return self.prompt_token_ids[pos]
        pos -= n_prompt
        if pos < len(self.output_token_ids):
            return self.output_token_ids[pos]
        return self.spec_token_ids[pos - len(self.output_token_ids)]


@dataclass
class PrevSampled:
    """The sampled ids of the last step executed, kept on the device for the next one."""

    token_ids: torch.Tensor  # [num sampled rows] int64 on device
    index_of: dict[str, int]  # req_id -> its row in token_ids


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens] on device
    positions: torch.Tensor  # [num_tokens] on device
    metadata: AttentionMetadata
    # Row of the flattened batch whose logits are sampled, per request that samples.
    sample_rows: list[int]
    sample_req_ids: list[str]
    # req_id -> (first row, positions) of prompt rows whose logprobs are requested.
    prompt_logprob_rows: dict[str, tuple[int, list[int]]]
    # Sampling requests whose last output token is still on the device (async
    # scheduling): req_id -> its row in the previous step's sampled ids.
    pending_output: dict[str, int] = field(default_factory=dict)
    # Requests verifying drafts this step: req_id -> the drafts its rows check
    # (sample_req_ids then holds the request len(drafts) + 1 times, in a row).
    verified_drafts: dict[str, list[int]] = field(default_factory=dict)
    # Built with defer_pending: int64 [2, k] on device, the rows of input_ids that take
    # the previous step's sampled ids and those ids' rows there (fill_pending_tokens);
    # None when input_ids is complete.
    pending_index: torch.Tensor | None = None


def apply_scheduler_output(
    states: dict[str, CachedRequestState],
    out: SchedulerOutput,
    make_generator,
    block_table: DeviceBlockTable | None = None,
) -> None:
    """Applies the scheduler's diff to the per-request states (and to the device block
    table, when the worker keeps one: it mirrors state.block_ids)."""
    for req_id in out.finished_req_ids | out.preempted_req_ids:
        states.pop(req_id, None)
        if block_table is not None:
            block_table.remove(req_id)
    for req_id, keep in out.trimmed_block_tables.items():
        state = states.get(req_id)
        if state is not None:
            del state.block_ids[keep:]  # in place: a draft model keys on the list
            if block_table is not None:
                block_table.truncate(req_id, keep)
    for new in out.scheduled_new_reqs:
        gen = (
            make_generator(new.sampling_params.seed)
            if new.sampling_params.seed is not None
            else None
        )
        states[new.req_id] = CachedRequestState(
            new.req_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            new.sampling_params,
            list(new.block_ids),
            new.num_computed_tokens,
            gen,
        )
        if block_table is not None:  # a resumed request's row went with its preemption
            block_table.add(new.req_id, new.block_ids)
    for cached in out.scheduled_cached_reqs:
        state = states[cached.req_id]
        _take_sent_tokens(state, cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        # Optimistic (tokens unsent): the scheduler counts the last step's drafts as accepted.
        surplus = state.num_rejected if state.num_unsent else 0
        state.num_computed_tokens = cached.num_computed_tokens - surplus
        if block_table is not None and cached.new_block_ids:
            block_table.append(cached.req_id, cached.new_block_ids)
    for req_id in out.num_scheduled_tokens:  # drafts last only for the step they are in
        _set_drafts(states[req_id], out.scheduled_spec_decode_tokens.get(req_id, []))


def _take_sent_tokens(state: CachedRequestState, new_token_ids: list[int]) -> None:
    """Appends the tokens the scheduler sent; those the worker holds unsent already
    must be the same (it kept them from the same sampled rows)."""
    overlap = min(state.num_unsent, len(new_token_ids))
    if overlap:
        known = len(state.output_token_ids) - state.num_unsent
        if state.output_token_ids[known : known + overlap] != new_token_ids[:overlap]:
            raise RuntimeError(
                f"internal error: request {state.req_id!r}: the scheduler sent "
                f"{new_token_ids[:overlap]}, the worker kept "
                f"{state.output_token_ids[known : known + overlap]}"
            )
        state.num_unsent -= overlap
    state.output_token_ids.extend(new_token_ids[overlap:])


def _set_drafts(state: CachedRequestState, scheduled: list[int]) -> None:
    """This step's drafts: the scheduler's, or, optimistic, the worker's own proposals
    (the scheduler sent as many placeholders as it counted)."""
    state.num_scheduled_drafts = len(scheduled)
    placeholders = is_placeholder(scheduled)
    if placeholders != bool(state.num_unsent and scheduled):
        raise RuntimeError(
            f"internal error: request {state.req_id!r} is scheduled with "
            f"drafts {scheduled} while the worker holds {state.num_unsent} "
            "tokens the scheduler has not seen"
        )
    state.spec_token_ids = state.proposed[: len(scheduled)] if placeholders else list(scheduled)


def _pending_source(
    req_id: str, state: CachedRequestState, end: int, prev: PrevSampled | None
) -> int | None:
    """Row in prev's sampled ids of the one token this step needs but the host lacks:
    the token sampled last step, at position state.num_tokens (before any drafts)."""
    if end <= state.num_tokens + len(state.spec_token_ids):
        return None
    if (
        end != state.num_tokens + len(state.spec_token_ids) + 1
        or prev is None
        or req_id not in prev.index_of
    ):
        raise RuntimeError(
            f"internal error: request {req_id!r} is scheduled up to position "
            f"{end - 1} but the worker knows {state.num_tokens} tokens and "
            f"{len(state.spec_token_ids)} drafts, and the previous step sampled "
            "no single token for it"
        )
    return prev.index_of[req_id]


def _chunk_tokens(state: CachedRequestState, start: int, end: int, pending: bool) -> list[int]:
    """Token ids at positions start .. end - 1; with a pending token, position
    state.num_tokens holds a placeholder 0 (filled on the device) and the drafts follow."""
    if not pending:
        if end - start == 1:
            return [state.token_at(start)]
        return state.tokens_between(start, end)
    known = state.num_tokens
    drafts = state.spec_token_ids[: end - known - 1]
    return state.tokens_between(start, known) + [0] + drafts


def single_row_index(sample_req_ids: list[str]) -> dict[str, int]:
    """req_id -> its sampled row, for the requests that sampled exactly one row (a
    verifying request's next token is known only after acceptance, on the host)."""
    index: dict[str, int] = {}
    repeated = set()
    for row, req_id in enumerate(sample_req_ids):
        if req_id in index:
            repeated.add(req_id)
        index[req_id] = row
    for req_id in repeated:
        del index[req_id]
    return index


def build_step_inputs(
    states: dict[str, CachedRequestState],
    out: SchedulerOutput,
    block_size: int,
    device,
    pad_to: int | None = None,
    prev: PrevSampled | None = None,
    block_table: DeviceBlockTable | None = None,
    staging: StagingRing | None = None,
    defer_pending: bool = False,
) -> StepInputs:
    """The step's flattened inputs. With a device block table the metadata's block
    tables are gathered on the device from it; otherwise built and uploaded whole.
    staging: the worker's pinned buffers for the uploads (None: fresh ones).
    defer_pending: leave the tokens still on the device (prev) out of input_ids and
    return their index (StepInputs.pending_index) for fill_pending_tokens, so the
    inputs can be built on another stream than the one that sampled them.

    A request whose chunk reaches its last known token samples there, and once more
    after each draft of the chunk (a verify step): rows last .. end - 1."""
    req_ids, token_ids, positions = [], [], []
    query_lens, seq_lens, tables = [], [], []
    sample_rows, sample_req_ids, verified = [], [], {}
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    pending_dst, pending_src, pending_output = [], [], {}
    row = 0
    for req_id, n in out.num_scheduled_tokens.items():
        state = states[req_id]
        n -= state.num_unproposed  # rows only for the drafts there are
        start = state.num_computed_tokens
        end = start + n
        req_ids.append(req_id)
        source = _pending_source(req_id, state, end, prev)
        token_ids.extend(_chunk_tokens(state, start, end, source is not None))
        last = state.num_tokens - 1  # the last token known (or pending) before the drafts
        if source is not None:
            last += 1
            pending_dst.append(row + last - start)
            pending_src.append(source)
            pending_output[req_id] = source
        positions.extend(range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(state.block_ids)
        if end > last:  # the chunk reaches the last token: sample there and after each draft
            sample_rows.extend(range(row + last - start, row + n))
            sample_req_ids.extend([req_id] * (end - last))
            if end - last > 1:
                verified[req_id] = state.spec_token_ids[: end - last - 1]
        if state.params.prompt_logprobs is not None:
            last_prompt_pos = len(state.prompt_token_ids) - 1  # predicts no prompt token
            wanted = [p for p in range(start, min(end, last_prompt_pos))]
            if wanted:
                prompt_rows[req_id] = (row, wanted)
        row += n
    device_tables = None if block_table is None else block_table.gather(req_ids)
    pad = (pad_to or row) - row
    uploads = (
        staging.step()
        if staging is not None
        else nullcontext(lambda tensor: tensor_to_device(tensor, device))
    )
    with uploads as upload:
        metadata = build_attention_metadata(
            query_lens,
            seq_lens,
            tables,
            block_size,
            device,
            pad_to,
            device_block_tables=device_tables,
            upload=upload,
        )
        ids_pos = upload(
            torch.tensor([token_ids + [0] * pad, positions + [0] * pad], dtype=torch.long)
        )
        pending_index = None
        if pending_dst:
            pending_index = upload(torch.tensor([pending_dst, pending_src], dtype=torch.long))
            if not defer_pending:
                fill_pending_tokens(ids_pos[0], pending_index, prev)
                pending_index = None
    return StepInputs(
        req_ids,
        ids_pos[0],
        ids_pos[1],
        metadata,
        sample_rows,
        sample_req_ids,
        prompt_rows,
        pending_output,
        verified,
        pending_index,
    )


def fill_pending_tokens(
    input_ids: torch.Tensor, pending_index: torch.Tensor, prev: PrevSampled
) -> None:
    """input_ids[rows] = prev.token_ids[sources] for pending_index = [rows, sources], on
    the device (no host sync; one launch on CUDA: pagoda.kernels.sample.pending_fill)."""
    if input_ids.device.type == "cuda":
        from pagoda.kernels.sample.pending_fill import fill_pending  # Triton: CUDA only

        fill_pending(input_ids, pending_index, prev.token_ids)
    else:
        input_ids.index_copy_(0, pending_index[0], prev.token_ids.index_select(0, pending_index[1]))
