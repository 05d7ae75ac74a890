"""Incremental detokenization of one generated sequence, with stop strings.

Owns `IncrementalDetokenizer`: turns token ids into text a few at a time so that
the concatenated pieces equal a one-shot decode of the whole output, and ends
generation on a stop string.

Decoding uses a sliding window (the prefix_offset / read_offset scheme of TGI and
vLLM): the text of a new token is decode(tokens[prefix:]) minus decode(tokens[prefix:read]).
Decoding with a few previous tokens keeps BPE/SentencePiece leading spaces right,
and text that ends in U+FFFD (an incomplete multi-byte UTF-8 character split over
byte-level tokens) is held back until the character completes.

Text states, in order: stable text goes to `output_text`; while stop strings are
set, the last len(longest stop) - 1 characters of it are not yet visible to
streaming (`get_delta_text`, `visible_text`) so a client never sees the beginning
of a stop string that is then trimmed away.

`spaces_between_special_tokens` has no effect here: fast tokenizers render special
tokens exactly as written (vLLM's fast path behaves the same).
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first generated tokens' decode window.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence's output tokens incrementally and checks stop strings.

    Invariants: tokens[:read_offset] have been turned into text; that text ends on a
    whole character; prefix_offset <= read_offset is where the decode window starts.
    `_num_sent <= len(output_text)` at all times (text already streamed is never trimmed).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True (got stop with detokenize=False)")
        self.tokenizer = tokenizer
        self.detokenize = params.detokenize
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Characters withheld from streaming: the longest partial stop string that could still grow.
        self._holdback = max((len(s) for s in self.stop_strings), default=1) - 1

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.tokens: list[int] = context  # decode window source: prompt context + output
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._num_sent = 0
        # Stop strings are searched from here on (text produced before min_tokens is exempt).
        self._stop_check_from = 0
        self._decode = self._pick_decoder(tokenizer)

    def _pick_decoder(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        skip = self.skip_special_tokens
        if backend is not None:  # the Rust tokenizer: fast, and never "cleans up" spaces
            return lambda ids: backend.decode(ids, skip_special_tokens=skip)
        return lambda ids: tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )

    # ------------------------------------------------------------------ feeding tokens

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Appends tokens; returns the stop string that matched, or None.

        `stop_terminated`: the last token ended generation (eos or a stop token id);
        its text is left out of the output unless include_stop_str_in_output.
        """
        if self.finished:
            return None
        self.output_token_ids.extend(new_token_ids)
        if not self.detokenize:
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and to_decode and not self.include_stop_str_in_output:
            to_decode.pop()
        text_before = len(self.output_text)
        first_index = len(self.output_token_ids) - len(new_token_ids)
        for offset, token_id in enumerate(to_decode):
            self.tokens.append(token_id)
            self.output_text += self._decode_next()
            if first_index + offset + 1 <= self.min_tokens:
                self._stop_check_from = len(self.output_text)
        return self._check_stop_strings(text_before)

    def _decode_next(self) -> str:
        """Text completed by the tokens after read_offset ("" while a character is incomplete)."""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full_text[len(prefix_text) :]

    def finish(self) -> str | None:
        """Marks the sequence finished: flushes held-back text; returns a stop string found in it."""
        if self.finished:
            return None
        stop = None
        if self.detokenize and self.read_offset < len(self.tokens):
            # An incomplete character at the very end: emit it as the one-shot decode would.
            text_before = len(self.output_text)
            prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full_text = self._decode(self.tokens[self.prefix_offset :])
            self.output_text += full_text[len(prefix_text) :]
            self.read_offset = len(self.tokens)
            stop = self._check_stop_strings(text_before)
        self.finished = True
        return stop

    # ------------------------------------------------------------------ stop strings

    def _check_stop_strings(self, text_before: int) -> str | None:
        """Finds the earliest stop string ending in the new text; truncates the output there."""
        if not self.stop_strings or len(self.output_text) == text_before:
            return None
        # A stop string ending in the new text starts at most len(stop) - 1 chars before it.
        search_from = max(self._stop_check_from, text_before - self._holdback)
        best_index, best_stop = -1, None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self.output_text = self.output_text[:end]
        self.stop_reason = best_stop
        self.finished = True
        return best_stop

    # ------------------------------------------------------------------ reading text

    def _visible_length(self) -> int:
        if self.finished:
            return len(self.output_text)
        return max(len(self.output_text) - self._holdback, self._num_sent)

    def visible_text(self) -> str:
        """output_text without the tail that could still turn out to be a stop string."""
        return self.output_text[: self._visible_length()]

    def get_delta_text(self) -> str:
        """Visible text not returned by a previous call."""
        end = self._visible_length()
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta
