"""The scheduler tests' harness: requests with reproducible prompts, a Scheduler on the
real KVCacheManager, and FakeRunner, a worker stand-in fed only by SchedulerOutput diffs.

FakeRunner writes each computed token into a fake paged KV store and checks, before
sampling, that the request's blocks hold exactly its tokens: wrong block ids, a stale
prefix hit or a wrong diff all fail there. Its sampled token is a function of the
whole sequence (next_token), so a request's output does not depend on batching,
chunking or preemption, and `alone` gives what it must be.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams

VOCAB = 50
BLOCK_SIZE = 4


def next_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + 7) % VOCAB


def make_request(
    rid: str,
    prompt,
    max_tokens: int | None = 16,
    *,
    eos: int | None = None,
    priority: int = 0,
    arrival: float | None = None,
    group_id=None,
    sample_index: int = 0,
    **params,
) -> Request:
    if isinstance(prompt, int):
        rng = random.Random(zlib.crc32(rid.encode()))  # distinct requests share no prefix
        prompt = [rng.randrange(1, VOCAB) for _ in range(prompt)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos,
        arrival_time=0.0 if arrival is None else arrival,
        priority=priority,
        group_id=group_id,
        sample_index=sample_index,
    )


def make_scheduler(
    num_blocks=64, budget=64, max_num_seqs=8, max_model_len=256, **kwargs
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK_SIZE),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        **kwargs,
    )


@dataclass
class _WorkerSeq:
    tokens: list[int]
    num_prompt: int
    blocks: list[int]
    num_computed: int
    params: SamplingParams


@dataclass
class FakeRunner:
    """Worker stand-in fed only by SchedulerOutput diffs."""

    kv: dict = field(default_factory=dict)  # (block_id, offset) -> token id
    seqs: dict = field(default_factory=dict)  # req_id -> _WorkerSeq

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(out)
        req_ids, sampled, prompt_logprobs = [], [], {}
        for rid, num_tokens in out.num_scheduled_tokens.items():
            seq = self.seqs[rid]
            start, end = seq.num_computed, seq.num_computed + num_tokens
            assert end <= len(seq.tokens), (rid, end, len(seq.tokens))
            assert len(seq.blocks) * BLOCK_SIZE >= end, f"{rid}: too few blocks for {end} tokens"
            for pos in range(start, end):
                self.kv[self._slot(seq, pos)] = seq.tokens[pos]
            held = [self.kv.get(self._slot(seq, pos)) for pos in range(end)]
            assert held == seq.tokens[:end], f"{rid}: KV blocks do not hold the request's tokens"
            # Logits at positions [start, end) score the tokens at [start + 1, end + 1).
            positions = range(start + 1, min(end + 1, seq.num_prompt))
            if seq.params.prompt_logprobs is not None and positions:
                prompt_logprobs[rid] = [
                    TokenLogprobs([seq.tokens[p]], [-1.0], 1) for p in positions
                ]
            seq.num_computed = end
            req_ids.append(rid)
            sampled.append([next_token(seq.tokens)] if end == len(seq.tokens) else [])
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=prompt_logprobs
        )

    def _apply_diff(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.seqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.seqs
            self.seqs[new.req_id] = _WorkerSeq(
                new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
            )
        for cached in out.scheduled_cached_reqs:
            seq = self.seqs[cached.req_id]
            assert cached.num_computed_tokens == seq.num_computed
            seq.tokens += cached.new_token_ids
            seq.blocks += cached.new_block_ids

    @staticmethod
    def _slot(seq: _WorkerSeq, pos: int) -> tuple[int, int]:
        return seq.blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    outputs = sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.audit()
    assert len(sched.running) <= sched.max_num_seqs
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    return out, outputs


def collect(outputs, tokens: dict, reasons: dict) -> None:
    for o in outputs:
        tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        if o.finished:
            reasons[o.req_id] = o.finish_reason


def run_to_completion(sched: Scheduler, runner: FakeRunner, tokens=None, max_steps=1000):
    """Steps until no request is left; returns tokens and finish reasons per request
    (added to `tokens` if given) and the SchedulerOutputs."""
    tokens = {} if tokens is None else tokens
    reasons, history = {}, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens, reasons, history
        out, outputs = step(sched, runner)
        history.append(out)
        collect(outputs, tokens, reasons)
    raise AssertionError("requests did not finish")


def alone(prompt: list[int], max_tokens: int = 16) -> list[int]:
    """The tokens the fake model generates for one prompt, computed directly."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]
