"""The engine's structured-output state: per-request constraints and each step's bitmasks.

Owns `StructuredOutputManager`, which lives beside the scheduler on the engine's loop:
- `add_request` starts a request's grammar compile (GrammarCompiler's pool) and
  reports whether the constraint is ready; the engine holds a request that is not
  (it is not scheduled) until `pop_ready()` hands it back, or its compile error;
- `accept(req_id, tokens)` advances a request's state with the tokens a step kept;
- `step_bitmasks(scheduler_output)` fills the masks of every row the step samples:
  the engine calls it after the forward is launched and the previous step's tokens
  were accepted (async scheduling), so the CPU fills masks while the device works;
- `remove` forgets a finished or aborted request.

A request is constrained when it sets structured_outputs, or when a reasoning parser
is configured and it has a thinking budget (its own thinking_token_budget or the
engine's default). With a reasoning parser, a grammar starts after the thinking.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.sampling_params import SamplingParams
from pagoda.structured.grammar_state import RequestConstraint
from pagoda.structured.reasoning import ReasoningTokens, ThinkingState, get_reasoning_parser
from pagoda.structured.stats import StructuredOutputStats

logger = logging.getLogger(__name__)

_BITS = 32


@dataclass
class _Pending:
    future: concurrent.futures.Future
    params: SamplingParams
    prompt_token_ids: list[int]


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        reasoning_parser: str | None = None,
        default_thinking_token_budget: int | None = None,
        compile_threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // _BITS)
        self.reasoning: ReasoningTokens | None = None
        if reasoning_parser is not None:
            self.reasoning = ReasoningTokens.from_tokenizer(
                get_reasoning_parser(reasoning_parser), tokenizer
            )
        self.default_thinking_token_budget = default_thinking_token_budget
        self.stats = StructuredOutputStats()
        # Called (from a compile thread) when a held request's grammar is ready: the
        # async engine uses it to wake its loop, which otherwise sleeps with no work.
        self.on_ready: Callable[[], None] | None = None
        self._compile_threads = compile_threads
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._closed = False  # shut down: no compiler (and no pool threads) again
        self._batch = None  # xgrammar's BatchGrammarMatcher, made with the compiler
        self._constraints: dict[str, RequestConstraint] = {}
        self._pending: dict[str, _Pending] = {}

    # ---- requests -------------------------------------------------------------------------
    def thinking_budget(self, params: SamplingParams) -> int | None:
        if params.thinking_token_budget is not None:
            return params.thinking_token_budget
        return self.default_thinking_token_budget

    def wants(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None or (
            self.reasoning is not None and self.thinking_budget(params) is not None
        )

    def check_params(self, params: SamplingParams) -> None:
        """ValueError for what this engine cannot do with params."""
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError(
                "thinking_token_budget needs a reasoning parser "
                "(--reasoning-parser deepseek_r1 or qwen3)"
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer; this model has none")
            if not params.all_stop_token_ids:
                raise ValueError(
                    "structured_outputs need an end-of-sequence token to finish "
                    "the output at the grammar's end; this model has none"
                )

    def compiler(self):
        """The GrammarCompiler (made on first use, so xgrammar loads only when needed)."""
        with self._compiler_lock:
            if self._closed:
                raise RuntimeError("the engine was shut down: no grammar compiles any more")
            if self._compiler is None:
                from pagoda.structured.compiler import GrammarCompiler

                eos = getattr(self.tokenizer, "eos_token_id", None)
                self._compiler = GrammarCompiler(
                    self.tokenizer,
                    self.vocab_size,
                    [] if eos is None else [int(eos)],
                    max_threads=self._compile_threads,
                    on_compiled=self.stats.observe_compile,
                )
            return self._compiler

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> bool:
        """Registers a constrained request; True if its constraint is ready now."""
        self.check_params(params)
        structured = params.structured_outputs
        if structured is None:
            self._constraints[req_id] = self._make(params, prompt_token_ids, None)
            return True
        self.stats.count_request(structured.kind)
        future = self.compiler().submit(structured)
        if future.done() and future.exception() is None:
            self._constraints[req_id] = self._make(params, prompt_token_ids, future.result())
            return True
        self._pending[req_id] = _Pending(future, params, list(prompt_token_ids))
        future.add_done_callback(self._notify_ready)
        return False

    def _notify_ready(self, _future) -> None:
        callback = self.on_ready
        if callback is not None:
            callback()

    def _make(
        self, params: SamplingParams, prompt_token_ids: list[int], compiled
    ) -> RequestConstraint:
        thinking = None
        if self.reasoning is not None:
            thinking = ThinkingState(self.reasoning, prompt_token_ids, self.thinking_budget(params))
        matcher = None
        if compiled is not None:
            import xgrammar as xgr

            matcher = xgr.GrammarMatcher(
                compiled, override_stop_tokens=sorted(params.all_stop_token_ids)
            )
        return RequestConstraint(matcher, thinking)

    def has_constraints(self) -> bool:
        return bool(self._constraints)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_ready_pending(self) -> bool:
        return any(p.future.done() for p in self._pending.values())

    def wait_for_pending(self) -> None:
        """Blocks until some held request's compile ends (the offline engine, idle)."""
        if self._pending:
            concurrent.futures.wait(
                [p.future for p in self._pending.values()],
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    def pop_ready(self) -> list[tuple[str, str | None]]:
        """Held requests whose compile ended, in arrival order: (req_id, None) when its
        constraint is ready, (req_id, error message) when the grammar failed."""
        ready = []
        for req_id in [r for r, p in self._pending.items() if p.future.done()]:
            pending = self._pending.pop(req_id)
            error = pending.future.exception()
            if error is not None:
                ready.append((req_id, str(error)))
                continue
            self._constraints[req_id] = self._make(
                pending.params, pending.prompt_token_ids, pending.future.result()
            )
            ready.append((req_id, None))
        return ready

    def remove(self, req_id: str) -> None:
        self._constraints.pop(req_id, None)
        self._pending.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._constraints or req_id in self._pending

    # ---- the step -------------------------------------------------------------------------
    def accept(self, req_id: str, token_ids: list[int]) -> str | None:
        """Advances req_id past the kept tokens; an error message if the grammar refused one."""
        constraint = self._constraints.get(req_id)
        if constraint is None or not token_ids:
            return None
        if not constraint.accept_tokens(token_ids):
            return f"the output broke its grammar (tokens {token_ids} were refused)"
        return None

    def step_bitmasks(self, scheduler_output) -> dict[str, np.ndarray]:
        """req_id -> int32 [rows it samples this step, words], for the constrained rows."""
        if not self._constraints:
            return {}
        start = time.perf_counter()
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        plan: list[tuple[str, RequestConstraint, list[int]]] = []
        for req_id in scheduler_output.sampling_req_ids:
            constraint = self._constraints.get(req_id)
            if constraint is None:
                continue
            drafts = list(drafts_of.get(req_id, ()))
            if drafts or constraint.needs_row_mask():
                plan.append((req_id, constraint, drafts))
        if not plan:
            return {}
        bitmask = np.full((sum(len(d) + 1 for _, _, d in plan), self.words), -1, dtype=np.int32)
        masks: dict[str, np.ndarray] = {}
        batched, batched_rows, row = [], [], 0
        for req_id, constraint, drafts in plan:
            if not drafts and constraint.grammar_fills_row():
                batched.append(constraint.matcher)
                batched_rows.append(row)
            else:
                constraint.fill_rows(bitmask, row, drafts)
            masks[req_id] = bitmask[row : row + len(drafts) + 1]
            row += len(drafts) + 1
        if batched:
            self._batch_fill(batched, bitmask, batched_rows)
        self.stats.observe_bitmask(time.perf_counter() - start)
        return masks

    def _batch_fill(self, matchers: list, bitmask: np.ndarray, rows: list[int]) -> None:
        """One xgrammar call (outside the GIL) fills every plain grammar row. One thread:
        a fill from a cached state takes microseconds (128 rows of a JSON schema: 0.2 ms
        on one CPU core), less than handing work to other threads costs."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def shutdown(self) -> None:
        """Stops the compile pool's threads and drops every request's state (idempotent).
        Held requests' compiles are cancelled; on_ready is no longer called."""
        self.on_ready = None
        with self._compiler_lock:
            compiler, self._compiler = self._compiler, None
            self._closed = True
        if compiler is not None:
            compiler.shutdown()
        self._batch = None
        self._constraints.clear()
        self._pending.clear()
