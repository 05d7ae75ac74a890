"""Contracts between scheduler, worker and engine (no torch).

The scheduler sends diffs: a request's full data once (NewRequestData), then only
what changed (CachedRequestData). Workers keep persistent per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pagoda.kv_offload.planning.tiers import KVTransferPlan, KVTransferReport
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has no state for: first schedule, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty on first schedule); the worker needs
    # them for penalties and to recompute their KV.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since the last step."""

    req_id: str
    new_token_ids: list[int]  # tokens appended (sampled) since the last time it was scheduled
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step (draft tokens included).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft token ids scheduled for verification this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the worker must forget: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests whose step reaches their last token, so the model samples for them.
    sampling_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding with a proposer on the worker: req_id -> drafts to propose
    # after this step (ModelRunnerOutput.spec_token_ids), for sampling requests only.
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)
    # KV offload tiers: blocks to move this step, or a poll for transfers in flight.
    kv_transfers: KVTransferPlan | None = None
    # req_id -> how many of its block ids the worker keeps: the scheduler freed the
    # rest (taken for drafts rejected since; core/optimistic_drafts.py). Applied
    # before this step's new blocks.
    trimmed_block_tables: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no KV transfer to run or wait for."""
        return self.total_num_scheduled_tokens == 0 and self.kv_transfers is None


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the sampled (or prompt) token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the first token in the full distribution


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request (same order as req_ids): tokens sampled this step. Empty for a
    # prefill chunk that does not reach the end of the prompt.
    sampled_token_ids: list[list[int]]
    # Per request: logprobs of each sampled token, when the request asked for them.
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # req_id -> prompt logprobs computed this step (one entry per prompt position, the
    # first position has none and is omitted; chunked prefill appends across steps).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> error message, for a request whose step failed (bad logits, ...).
    errors: dict[str, str] = field(default_factory=dict)
    # KV offload transfers finished since the last report (None: offloading is off).
    kv_transfers: KVTransferReport | None = None


@dataclass
class EngineCoreOutput:
    """What the scheduler hands the output processor for one request after a step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: object = None
    num_cached_tokens: int = 0
    # When the scheduler first admitted the request (time.monotonic()); None if it never ran.
    first_scheduled_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepExtras:
    """What the engine learns after a step's forward is launched and before its sampling
    (`ModelRunner.sample_tokens`): with async scheduling the previous step's results are
    processed in between, so state that depends on them still reaches this step's sampler.

    grammar_bitmasks: req_id -> int32 array [rows the request samples this step,
    ceil(vocab_size / 32)]; bit t % 32 of word t // 32 allows token t in that row (a
    grammar's next-token mask). Requests without an entry are not masked.
    """

    grammar_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)


class RunnerOutputFuture(Protocol):
    """A launched step's output on its way back from the device (or a worker process)."""

    def result(self) -> ModelRunnerOutput:
        """Waits for this step's results (not for any later step) and returns them."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the loaded model (no torch, picklable)."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: int | list[int] | None
    # For the start-up log only: the weights' dtype and bytes this rank holds.
    dtype: str = ""
    weight_bytes: int = 0
    num_hidden_layers: int = 0  # what a layer-skip drafter's cost is measured against
    draft_weight_bytes: int = 0  # a draft model's (speculative decoding), this rank's share
