"""Draft-model speculation: a second, smaller model with the target's vocabulary
drafts k tokens greedily after each step, in KV cache layers of its own inside the
target's block pool.

The draft's attention layers are numbered after the target's (pool layers n .. n + m
- 1), so every block holds the target's layers and the draft's: the block manager,
prefix cache, preemption and offload tiers see one pool and one block table, and
the draft's cache takes its share of the same byte budget.

The draft catches up lazily. It runs only for requests asked to draft, and first
feeds the tokens it has not seen since it last ran for that request (`_fed`: the
positions before which its layers hold the request's real tokens), ending with the
newest token, whose logits give the first draft; later drafts are one token each.
So a step where nobody drafts costs the draft nothing, and a request that starts
drafting late (or took a prefix-cache hit: blocks whose draft layers another request
may never have written) catches up from its start in bounded chunks. The KV invariant
is layer-skip's (spec_decode/layer_skip.py): draft positions past the accepted ones
hold stale values no forward reads before it writes them again.

`_fed` is keyed by request and checked against the request's block list object: a
request the scheduler preempted comes back as a new worker state (new list) and so
catches up from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.attention.forward_context import forward_context
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import Attention, kv_cache_specs
from pagoda.model.loader import load_model
from pagoda.model.presets import is_preset
from pagoda.spec_decode.proposers.greedy_drafter import (
    DraftStart,
    GreedyDrafter,
    Segment,
    segment_inputs,
)

# Prune `_fed` of requests the worker no longer holds once it has this many entries
# per running request slot (finished requests are never told to the drafter).
_PRUNE_FACTOR = 2


@dataclass
class LoadedDraft:
    """A draft model on the worker: its weights, shape and bytes; its attention layers
    already renumbered to start at first_layer."""

    model: nn.Module
    arch: ArchConfig
    weight_bytes: int
    first_layer: int
    kv_specs: list


def load_draft_model(
    name: str,
    target_arch: ArchConfig,
    target_load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    tp,
    block_size: int,
    kv_dtype: torch.dtype,
) -> LoadedDraft:
    """Loads the draft `name` and renumbers its attention layers after the target's.
    Random weights (seeded with seed + 1: another model than a same-shaped target) for
    a preset, or when the target itself has dummy weights (then a directory's
    config.json gives the shape); otherwise the weights at the path."""

    dummy = is_preset(name) or target_load_format == "dummy"
    model, arch = load_model(name, "dummy" if dummy else "auto", dtype, device, seed + 1, tp)
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"speculative_config draft model {name!r} has a vocabulary of "
            f"{arch.vocab_size} tokens, the target {target_arch.vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    if arch.mla is not None:
        raise ValueError(
            f"speculative_config draft model {name!r} uses latent attention "
            "(MLA); draft models with full attention only"
        )
    specs = kv_cache_specs(model, block_size, kv_dtype)
    first_layer = target_arch.num_hidden_layers
    for module in model.modules():
        if isinstance(module, Attention):
            module.layer_idx += first_layer
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadedDraft(model, arch, weight_bytes, first_layer, specs)


class DraftModelProposer(GreedyDrafter):
    def __init__(
        self,
        draft: LoadedDraft,
        backend,
        kv_pool,
        block_size: int,
        device: torch.device,
        max_model_len: int,
        max_rows: int,
        max_num_seqs: int,
        confidence_threshold: float | None = None,
        graph_runner=None,
    ) -> None:
        """max_rows: the most rows one draft forward takes (catch-ups are chunked);
        graph_runner: the draft's CUDA graphs (None: eager)."""
        if draft.arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config draft model holds "
                f"{draft.arch.max_position_embeddings} positions, fewer than "
                f"max_model_len ({max_model_len})"
            )
        super().__init__(max_model_len, confidence_threshold)
        self.draft, self.model = draft, draft.model
        self.backend, self.kv_pool = backend, kv_pool
        self.block_size, self.device = block_size, device
        self.max_rows = max(1, max_rows)
        self.max_num_seqs = max_num_seqs
        self.graphs = graph_runner
        # req_id -> (its block list, first position the draft has not fed)
        self._fed: dict[str, tuple[list[int], int]] = {}

    def first_position(self, start: DraftStart) -> int:
        entry = self._fed.get(start.req_id)
        if entry is None or entry[0] is not start.block_ids:
            return 0
        return min(entry[1], start.position)

    def fed(self, start: DraftStart) -> None:
        self._fed[start.req_id] = (start.block_ids, start.position + 1)

    def propose(self, starts: list[DraftStart]) -> dict[str, list[int]]:
        if len(self._fed) > _PRUNE_FACTOR * self.max_num_seqs:
            self.prune({s.req_id for s in starts})
        return super().propose(starts)

    def prune(self, keep: set[str]) -> None:
        """Drops every request's catch-up mark but keep's (they would catch up anew)."""
        self._fed = {rid: entry for rid, entry in self._fed.items() if rid in keep}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def last_hidden(self, segments: list[Segment]) -> torch.Tensor:
        """Long catch-ups go in rounds of at most max_rows rows: round r feeds piece r
        of every segment that has one (a request appears once per forward, and its
        pieces go in order, so each attends to what the earlier rounds wrote)."""
        piece = max(1, self.max_rows // len(segments))
        rounds = max(-(-len(s.tokens) // piece) for s in segments)
        if rounds == 1:
            return self._forward(segments)
        last: list[torch.Tensor | None] = [None] * len(segments)
        for r in range(rounds):
            members = [i for i, s in enumerate(segments) if len(s.tokens) > r * piece]
            pieces = [
                Segment(
                    segments[i].start + r * piece,
                    segments[i].tokens[r * piece : (r + 1) * piece],
                    segments[i].block_ids,
                )
                for i in members
            ]
            hidden = self._forward(pieces)
            for row, i in enumerate(members):
                if len(segments[i].tokens) <= (r + 1) * piece:
                    last[i] = hidden[row]
        return torch.stack(last)

    def _forward(self, segments: list[Segment]) -> torch.Tensor:
        """One draft forward: each segment's last row, [len(segments), hidden]."""
        metadata, ids, pos, last_rows = segment_inputs(segments, self.block_size, self.device)
        rows = torch.tensor(last_rows, dtype=torch.long).to(self.device)
        if self.graphs is not None and self.graphs.can_run(metadata, ids.shape[0]):
            return self.graphs.run(ids, pos, metadata).index_select(0, rows)
        output_rows = None if len(last_rows) == ids.shape[0] else rows
        with forward_context(self.backend, self.backend.build_metadata(metadata), self.kv_pool):
            hidden = self.model(ids, pos, output_rows)
        return hidden
