"""Splitting an output's text into reasoning_content and content, streamed or at once.

Owns `ReasoningSplitter`, fed the output's text and token ids as they arrive (the
deltas the engine streams). The section boundaries come from the token ids (the
reasoning parser's tags are single tokens); the text offsets from the tags' text
when the tokenizer prints them (an added, non-special token such as Qwen3's and
DeepSeek-R1's `<think>`), else (a special token that decoding skips) from the length
of the decoded prefix. The tags themselves belong to neither part. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagoda.structured.reasoning import ReasoningTokens


class ReasoningSplitter:
    """One output's split; `feed` returns (reasoning delta, content delta)."""

    def __init__(
        self,
        tokens: ReasoningTokens,
        prompt_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        """decode(ids) -> text, with the request's skip_special_tokens."""
        self.tokens = tokens
        self.decode = decode
        start = tokens.thinking_at_start(prompt_token_ids)
        self.pending = start is None  # the first token decides
        self.thinking = bool(start)
        self.ids: list[int] = []
        self.text = ""
        self.start_tag = decode([tokens.start_id])
        self.end_tag = decode([tokens.end_id])
        # Char offsets into text: reasoning is [reasoning_begin, reasoning_end), content
        # starts at content_begin (None: not known yet).
        self.reasoning_begin: int | None = 0 if self.thinking else None
        self.reasoning_end: int | None = None
        self.content_begin: int | None = None if self.thinking or self.pending else 0
        self._end_index: int | None = None  # index in ids of the end tag
        self._sent_reasoning = 0  # chars of text handed out as reasoning / content
        self._sent_content = 0

    def feed(self, delta_text: str, delta_ids: Sequence[int]) -> tuple[str, str]:
        first_new = len(self.ids)
        self.ids.extend(delta_ids)
        self.text += delta_text
        if self.pending and self.ids:
            self._decide_first_token()
        if self.thinking and self._end_index is None:
            for i in range(
                max(first_new, 1 if self.ids[:1] == [self.tokens.start_id] else 0), len(self.ids)
            ):
                if self.ids[i] == self.tokens.end_id:
                    self._end_index = i
                    break
        if self._end_index is not None and self.content_begin is None:
            self._locate_end()
        return self._take_reasoning(), self._take_content()

    def _decide_first_token(self) -> None:
        self.pending = False
        if self.ids[0] == self.tokens.start_id:
            self.thinking = True
            self.reasoning_begin = None  # after the start tag's text, once it arrives
        else:
            self.content_begin = 0

    def _locate_end(self) -> None:
        if self.end_tag:  # printed: find it after the reasoning's beginning
            position = self.text.find(self.end_tag, self._reasoning_begin_or_zero())
            if position < 0:
                return  # its text has not arrived yet
            self.reasoning_end = position
            self.content_begin = position + len(self.end_tag)
        else:  # skipped when decoding: the decoded prefix ends where content starts
            self.reasoning_end = self.content_begin = len(
                self.decode(self.ids[: self._end_index + 1])
            )

    def _reasoning_begin_or_zero(self) -> int:
        if self.reasoning_begin is None and self.text.startswith(self.start_tag):
            self.reasoning_begin = len(self.start_tag)
        return self.reasoning_begin or 0

    def _take_reasoning(self) -> str:
        if not self.thinking:
            return ""
        begin = self._reasoning_begin_or_zero()
        if self.reasoning_begin is None:
            return ""  # the start tag's text has not arrived yet
        end = self.reasoning_end
        if end is None:
            end = len(self.text) - _partial_suffix(self.text, self.end_tag)
        start = max(begin, self._sent_reasoning)
        if end <= start:
            return ""
        self._sent_reasoning = end
        return self.text[start:end]

    def _take_content(self) -> str:
        if self.content_begin is None or len(self.text) <= self.content_begin:
            return ""
        start = max(self.content_begin, self._sent_content)
        self._sent_content = len(self.text)
        return self.text[start:]

    @property
    def reasoning_ended(self) -> bool:
        """Whether the answer has begun (content may follow)."""
        return self.content_begin is not None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of tag that text ends with (held back)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def split_reasoning(
    tokens: ReasoningTokens,
    prompt_token_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    text: str,
    token_ids: Sequence[int],
) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole output."""
    splitter = ReasoningSplitter(tokens, prompt_token_ids, decode)
    reasoning, content = splitter.feed(text, token_ids)
    return (reasoning if splitter.thinking else None), content
