"""Reasoning parsers (`<think>...</think>` models) on the token level, and thinking budgets.

Owns:
- REASONING_PARSERS: the parsers `--reasoning-parser` names. `deepseek_r1`: the
  output starts inside the thinking section (its template opens `<think>`), which
  ends at `</think>`. `qwen3`: the output thinks only if it opens with `<think>` (or
  the prompt left a `<think>` open). Either way, a prompt whose last tag is `</think>`
  (e.g. Qwen3's enable_thinking=false) starts in the answer.
- ReasoningTokens: a parser resolved against a tokenizer (the tags must be single tokens).
- ThinkingState: one request's phase (pending / thinking / answer), its reasoning token
  count, and the token a thinking_token_budget forces next; it advances with the kept
  tokens and rolls back (speculative decoding's rejected drafts).
- REASONING_EFFORT_BUDGETS: reasoning_effort low / medium / high as budgets.
Stdlib only.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# OpenAI's reasoning_effort as a thinking_token_budget (an explicit budget wins).
REASONING_EFFORT_BUDGETS = {"low": 512, "medium": 2048, "high": 8192}
# Tokens a constraint can roll back (speculative decoding's drafts are far fewer).
MAX_ROLLBACK_TOKENS = 64


@dataclass(frozen=True)
class ReasoningParserSpec:
    name: str
    start_tag: str
    end_tag: str
    # True: an output starts thinking unless the prompt closed the section.
    thinks_by_default: bool


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParserSpec("deepseek_r1", "<think>", "</think>", True),
    "qwen3": ReasoningParserSpec("qwen3", "<think>", "</think>", False),
}


def get_reasoning_parser(name: str) -> ReasoningParserSpec:
    spec = REASONING_PARSERS.get(name)
    if spec is None:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}"
        )
    return spec


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser's tags as token ids of one tokenizer."""

    spec: ReasoningParserSpec
    start_id: int
    end_id: int
    # What a spent budget forces, in order (the end tag: one token).
    end_sequence: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, spec: ReasoningParserSpec, tokenizer: Any) -> ReasoningTokens:
        if tokenizer is None:
            raise ValueError(f"reasoning parser {spec.name} needs a tokenizer; this model has none")
        ids = []
        for tag in (spec.start_tag, spec.end_tag):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"reasoning parser {spec.name} needs {tag!r} to be one token of "
                    f"the tokenizer; it encodes to {len(encoded)} tokens"
                )
            ids.append(encoded[0])
        return cls(spec, ids[0], ids[1], (ids[1],))

    def thinking_at_start(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """True: the output starts thinking; False: it starts in the answer; None: it
        thinks only if its first token opens the section (qwen3 without an open tag)."""
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
        return True if self.spec.thinks_by_default else None


class Phase(enum.IntEnum):
    PENDING = 0  # the first token decides: the start tag opens thinking, anything else answers
    THINKING = 1
    ANSWER = 2


class ThinkingState:
    """One request's place in its thinking section; `budget` None: unlimited."""

    def __init__(
        self, tokens: ReasoningTokens, prompt_token_ids: Sequence[int], budget: int | None
    ) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
        self.tokens = tokens
        self.budget = budget
        start = tokens.thinking_at_start(prompt_token_ids)
        self.phase = Phase.PENDING if start is None else (Phase.THINKING if start else Phase.ANSWER)
        self.num_reasoning_tokens = 0
        self.num_forced = 0  # tokens of end_sequence accepted while the budget forces it
        # (phase, count, forced) before each of the last accepted tokens, for rollback.
        self._history: collections.deque = collections.deque(maxlen=MAX_ROLLBACK_TOKENS)

    @property
    def in_answer(self) -> bool:
        return self.phase == Phase.ANSWER

    def forced_token(self) -> int | None:
        """The token the budget forces next (None: the model chooses)."""
        if (
            self.phase != Phase.THINKING
            or self.budget is None
            or self.num_reasoning_tokens < self.budget
        ):
            return None
        return self.tokens.end_sequence[self.num_forced]

    def accept(self, token_id: int) -> bool:
        """Advances past one kept token; True if the token belongs to the answer."""
        self._history.append((self.phase, self.num_reasoning_tokens, self.num_forced))
        if self.phase == Phase.ANSWER:
            return True
        if self.phase == Phase.PENDING:
            if token_id == self.tokens.start_id:
                self.phase = Phase.THINKING
                return False
            self.phase = Phase.ANSWER
            return True
        if self.forced_token() is not None:
            self.num_forced += 1
            if self.num_forced == len(self.tokens.end_sequence):
                self.phase = Phase.ANSWER
        elif token_id == self.tokens.end_id:
            self.phase = Phase.ANSWER
        else:
            self.num_reasoning_tokens += 1
        return False

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens (at most {len(self._history)})")
        for _ in range(num_tokens):
            self.phase, self.num_reasoning_tokens, self.num_forced = self._history.pop()
