"""One request's constraint state: its grammar matcher and/or its thinking section.

Owns `RequestConstraint`, the per-request API the engine drives:
- `accept_tokens(tokens)`: advance with the tokens the step kept (False: the grammar
  refused one; the state then stands just before it);
- `rollback(n)`: forget the last n accepted tokens (rejected speculative drafts);
- `fill_rows(bitmask, drafts)`: the masks of every row the request samples this step:
  row k is the next-token mask after the drafts[:k] (accepted, then rolled back).

Routing: while the request thinks (reasoning parser), its tokens go to the thinking
state only and the grammar waits; the grammar sees the answer's tokens, from the
first token after the end tag. A spent thinking budget masks a row to the one token
it forces. A grammar that has terminated (accepted a stop token) masks nothing: the
request finishes with that token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagoda.structured.reasoning import MAX_ROLLBACK_TOKENS, Phase, ThinkingState

_BITS = 32


def _bit(token_id: int) -> np.int32:
    """Token id's bit in its int32 word (bit 31 is the sign bit)."""
    value = 1 << (token_id % _BITS)
    return np.int32(value - (1 << _BITS) if value >= 1 << (_BITS - 1) else value)


def set_only(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Row allows token_id alone."""
    bitmask[row] = 0
    bitmask[row, token_id // _BITS] = _bit(token_id)


def allow(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Row also allows token_id."""
    bitmask[row, token_id // _BITS] |= _bit(token_id)


class RequestConstraint:
    """A request's grammar matcher (None: no grammar) and thinking state (None: none)."""

    def __init__(self, matcher=None, thinking: ThinkingState | None = None) -> None:
        if matcher is None and thinking is None:
            raise ValueError("a constraint needs a grammar or a thinking state")
        self.matcher = matcher
        self.thinking = thinking
        # Per accepted token (the last few): whether the grammar accepted it too.
        self._to_grammar: list[bool] = []

    @property
    def grammar_active(self) -> bool:
        return self.matcher is not None and (self.thinking is None or self.thinking.in_answer)

    @property
    def is_terminated(self) -> bool:
        return self.grammar_active and self.matcher.is_terminated()

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for token_id in token_ids:
            if not self._accept(token_id):
                return False
        return True

    def _accept(self, token_id: int) -> bool:
        answer = True if self.thinking is None else self.thinking.accept(token_id)
        to_grammar = answer and self.matcher is not None
        if to_grammar and not self.matcher.accept_token(token_id):
            if self.thinking is not None:
                self.thinking.rollback(1)
            return False
        self._to_grammar.append(to_grammar)
        if len(self._to_grammar) > 2 * MAX_ROLLBACK_TOKENS:  # only the last few roll back
            del self._to_grammar[:MAX_ROLLBACK_TOKENS]
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._to_grammar):
            raise ValueError(f"cannot roll back {num_tokens} tokens")
        undone = self._to_grammar[-num_tokens:]
        del self._to_grammar[-num_tokens:]
        if self.thinking is not None:
            self.thinking.rollback(num_tokens)
        num_grammar = sum(undone)
        if num_grammar:
            self.matcher.rollback(num_grammar)

    # ---- masks ----------------------------------------------------------------------------
    def needs_row_mask(self) -> bool:
        """False when the next row would be all ones (thinking freely, or terminated)."""
        thinking = self.thinking
        if thinking is not None:
            if thinking.forced_token() is not None:
                return True
            if thinking.phase == Phase.THINKING:
                return False
            if thinking.phase == Phase.PENDING:
                return self.matcher is not None
        return self.matcher is not None and not self.matcher.is_terminated()

    def grammar_fills_row(self) -> bool:
        """True when the next row is exactly the grammar's mask (a batched fill can do it)."""
        return self.grammar_active and not self.matcher.is_terminated()

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        """The next token's mask into bitmask[row] (all ones when unconstrained)."""
        thinking = self.thinking
        forced = None if thinking is None else thinking.forced_token()
        if forced is not None:
            set_only(bitmask, row, forced)
        elif not self.needs_row_mask():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            if thinking is not None and thinking.phase == Phase.PENDING:
                allow(bitmask, row, thinking.tokens.start_id)  # or open the thinking section

    def fill_rows(self, bitmask: np.ndarray, first_row: int, drafts: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(drafts): row k after drafts[:k]. The state is
        left as it was. A draft the constraint refuses ends the walk: its own row already
        excludes it, so every later row is rejected anyway (they copy its mask)."""
        num_accepted = 0
        for k in range(len(drafts) + 1):
            self.fill_row(bitmask, first_row + k)
            if k == len(drafts):
                break
            if not self.accept_tokens([drafts[k]]):
                bitmask[first_row + k + 1 : first_row + len(drafts) + 1] = bitmask[first_row + k]
                break
            num_accepted += 1
        self.rollback(num_accepted)
