"""Per-request state the worker keeps between steps, and the flattened step inputs.

The scheduler sends diffs (new requests in full, then only new tokens / blocks); this
module applies them and builds the step's token ids, positions and attention metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.metadata import build_attention_metadata
from pagoda.core.outputs import SchedulerOutput
from pagoda.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator] = None
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, pos: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        if pos < n_prompt:
            return self.prompt_token_ids[pos]
        pos -= n_prompt
        if pos < len(self.output_token_ids):
            return self.output_token_ids[pos]
        return self.spec_token_ids[pos - len(self.output_token_ids)]


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


def apply_scheduler_output(states: dict[str, CachedRequestState], out: SchedulerOutput,
                           make_generator) -> None:
    for req_id in out.finished_req_ids | out.preempted_req_ids:
        states.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        gen = make_generator(new.sampling_params.seed) if new.sampling_params.seed is not None else None
        states[new.req_id] = CachedRequestState(
            new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
            new.sampling_params, list(new.block_ids), new.num_computed_tokens, gen)
    for cached in out.scheduled_cached_reqs:
        state = states[cached.req_id]
        state.output_token_ids.extend(cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
    for req_id, drafts in out.scheduled_spec_decode_tokens.items():
        states[req_id].spec_token_ids = list(drafts)


def build_step_inputs(states: dict[str, CachedRequestState], out: SchedulerOutput,
                      block_size: int, device, pad_to: Optional[int] = None) -> StepInputs:
    req_ids, token_ids, positions = [], [], []
    query_lens, seq_lens, tables = [], [], []
    sample_rows, sample_req_ids = [], []
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    row = 0
    for req_id, n in out.num_scheduled_tokens.items():
        state = states[req_id]
        start = state.num_computed_tokens
        end = start + n
        req_ids.append(req_id)
        if n == 1:
            token_ids.append(state.token_at(start))
        else:
            token_ids.extend(state.token_at(p) for p in range(start, end))
        positions.extend(range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(state.block_ids)
        if end >= state.num_tokens:  # the chunk reaches the last known token: sample
            sample_rows.append(row + state.num_tokens - 1 - start)
            sample_req_ids.append(req_id)
        if state.params.prompt_logprobs is not None:
            last_prompt_pos = len(state.prompt_token_ids) - 1  # predicts no prompt token
            wanted = [p for p in range(start, min(end, last_prompt_pos))]
            if wanted:
                prompt_rows[req_id] = (row, wanted)
        row += n
    metadata = build_attention_metadata(query_lens, seq_lens, tables, block_size, device, pad_to)
    pad = (pad_to or row) - row
    ids_pos = torch.tensor([token_ids + [0] * pad, positions + [0] * pad], dtype=torch.long)
    if torch.device(device).type == "cuda":  # pinned: a non-blocking copy
        ids_pos = ids_pos.pin_memory()
    ids_pos = ids_pos.to(device, non_blocking=True)
    return StepInputs(req_ids, ids_pos[0], ids_pos[1], metadata, sample_rows, sample_req_ids,
                      prompt_rows)
