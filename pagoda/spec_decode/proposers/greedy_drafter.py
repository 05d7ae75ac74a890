"""The drafting loop every model drafter shares: after a step's tokens are known, each
asked request's drafter feeds its newest token (and, for a drafter with a KV cache of
its own, the tokens it has not seen yet) and takes the argmax as the next draft, one
position per forward, until it has the drafts wanted.

A drafter says three things: which position its first forward starts at for a request
(`first_position`: a layer-skip drafter shares the target's cache, so only the newest
token; a draft model catches up on everything since it last ran), how to run one
forward over per-request segments of tokens (`last_hidden`: the hidden state of each
segment's last row), and its logits. With `confidence_threshold` a request stops
drafting once the drafter's own probability of its next guess falls below it (that
guess is not proposed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from pagoda.attention.metadata import build_attention_metadata


@dataclass
class DraftStart:
    """Where a request's drafting starts: its newest token (not in the KV cache yet)
    at `position`, the most drafts wanted, and its block ids. `prompt`, `outputs` and
    `tail` (the tokens the worker's state lacks: a pending one, then the step's kept
    ones, ending with token_id) together hold the request's tokens at positions
    0 .. position, for a drafter that catches up (they are the state's own lists: read,
    never modified)."""

    req_id: str
    token_id: int
    position: int
    num_drafts: int
    block_ids: list[int]
    prompt: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """The request's tokens at positions start .. end - 1 (end <= position + 1)."""
        lists, offset, tokens = (self.prompt, self.outputs, self.tail), 0, []
        for part in lists:
            lo, hi = max(start - offset, 0), min(end - offset, len(part))
            if lo < hi:
                tokens.extend(part[lo:hi])
            offset += len(part)
        if len(tokens) != end - start:
            raise ValueError(
                f"request {self.req_id} holds {offset} tokens, asked for "
                f"positions {start}..{end - 1}"
            )
        return tokens


@dataclass
class Segment:
    """One request's rows in a drafter forward: tokens at positions start .. start +
    len(tokens) - 1, attending to everything before them in the request's blocks."""

    start: int
    tokens: list[int]
    block_ids: list[int]


class GreedyDrafter(ABC):
    def __init__(self, max_model_len: int, confidence_threshold: float | None = None) -> None:
        self.max_model_len = max_model_len
        self.confidence_threshold = confidence_threshold

    @abstractmethod
    def first_position(self, start: DraftStart) -> int:
        """The first position this request's first drafting forward feeds."""

    @abstractmethod
    def last_hidden(self, segments: list[Segment]) -> torch.Tensor:
        """One forward over the segments: [len(segments), hidden], each segment's last
        row (the one whose logits guess the next token)."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""

    def fed(self, start: DraftStart) -> None:
        """Told once this request's tokens up to start.position went through a drafting
        forward (later positions held drafts: guesses, not the request's tokens)."""

    @torch.inference_mode()
    def propose(self, starts: list[DraftStart]) -> dict[str, list[int]]:
        """req_id -> its greedy drafts (fewer where max_model_len or the confidence
        threshold stop it)."""
        drafts: dict[str, list[int]] = {s.req_id: [] for s in starts}
        # Draft i sits at position + i + 1 and must stay inside max_model_len.
        limits = {s.req_id: min(s.num_drafts, self.max_model_len - 1 - s.position) for s in starts}
        active = [s for s in starts if limits[s.req_id] > 0]
        firsts = [self.first_position(s) for s in active]
        segments = [
            Segment(first, s.tokens_between(first, s.position + 1), s.block_ids)
            for s, first in zip(active, firsts)
        ]
        step = 0
        while active:
            guesses, confident = self._guess(segments)
            if step == 0:
                for start in active:
                    self.fed(start)
            still = []
            for start, token, sure in zip(active, guesses, confident):
                if not sure:
                    continue  # its guess is not proposed, and it stops here
                drafts[start.req_id].append(token)
                if limits[start.req_id] > step + 1:
                    still.append((start, token))
            step += 1
            active = [s for s, _ in still]
            segments = [Segment(s.position + step, [token], s.block_ids) for s, token in still]
        return drafts

    def _guess(self, segments: list[Segment]) -> tuple[list[int], list[bool]]:
        """Each segment's next token, and whether it clears the confidence threshold."""
        logits = self.logits(self.last_hidden(segments))
        if self.confidence_threshold is None:
            return logits.argmax(dim=-1).tolist(), [True] * len(segments)
        probs, ids = torch.softmax(logits, dim=-1).max(dim=-1)
        sure = (probs >= self.confidence_threshold).tolist()
        return ids.tolist(), sure


def segment_inputs(segments: list[Segment], block_size: int, device: torch.device):
    """(attention metadata, input ids, positions, each segment's last row) of one
    forward over the segments, flattened in order."""
    query_lens = [len(s.tokens) for s in segments]
    seq_lens = [s.start + len(s.tokens) for s in segments]
    metadata = build_attention_metadata(
        query_lens, seq_lens, [s.block_ids for s in segments], block_size, device
    )
    ids, pos, last_rows, row = [], [], [], 0
    for segment, n in zip(segments, query_lens):
        ids.extend(segment.tokens)
        pos.extend(range(segment.start, segment.start + n))
        row += n
        last_rows.append(row - 1)
    both = torch.tensor([ids, pos], dtype=torch.long).to(device)
    return metadata, both[0], both[1], last_rows
