"""Layer-skip self-speculation: the target's first m layers, its final norm and its LM
head draft k tokens greedily, one position per forward, right after a step's tokens
are known (on the worker, in the target's own KV cache).

The KV invariant that makes sharing the cache exact: the keys and values of layer
l < m at position p are a function of the tokens at positions 0..p only, computed by
the same weights whether the full target or the m-layer drafter runs them (layer l's
input depends on layers < l alone). So
- the drafter reads layers < m at positions before its first one, which the target
  wrote for the request's real tokens: what it would have computed itself;
- the drafter writes layers < m at the positions of its drafts q .. q + k - 1 (slots
  the scheduler reserved as lookahead); the next verify step feeds exactly those
  tokens at those positions and writes every layer there before it attends (store
  then attend, per layer), so for layers < m it writes what the drafter wrote, and
  layers >= m, which the drafter never touched, get their first values;
- positions past the accepted ones hold stale values, as after any rejected draft:
  no step reads them (every sequence length ends at the last real token) before a
  later step writes them again.
Blocks holding draft positions are never in the prefix cache: only blocks full of
computed real tokens are registered, and drafts sit at or past the first uncomputed
position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.metadata import build_attention_metadata


@dataclass
class DraftStart:
    """Where a request's drafting starts: its newest token (not in the KV cache yet)
    at `position`, the most drafts wanted, and its block ids."""

    req_id: str
    token_id: int
    position: int
    num_drafts: int
    block_ids: list[int]


class LayerSkipProposer:
    def __init__(self, model, num_layers: int, backend, kv_pool, block_size: int,
                 device: torch.device, max_model_len: int) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, name) for name in needed):
            raise ValueError(f"layer_skip speculation needs a Llama-family decoder "
                             f"(embed_tokens, layers, norm); {type(model).__name__} is not one")
        if not 1 <= num_layers < len(inner.layers):
            raise ValueError(f"layer_skip num_layers ({num_layers}) must be smaller than "
                             f"the target's {len(inner.layers)} layers")
        self.model, self.inner = model, inner
        self.num_layers = num_layers
        self.backend, self.kv_pool = backend, kv_pool
        self.block_size, self.device = block_size, device
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def propose(self, starts: list[DraftStart]) -> dict[str, list[int]]:
        """req_id -> its greedy drafts (fewer where max_model_len leaves no room)."""
        drafts: dict[str, list[int]] = {s.req_id: [] for s in starts}
        # Draft i sits at position + i + 1 and must stay inside max_model_len.
        limits = {s.req_id: min(s.num_drafts, self.max_model_len - 1 - s.position)
                  for s in starts}
        active = [s for s in starts if limits[s.req_id] > 0]
        tokens = {s.req_id: s.token_id for s in active}
        step = 0
        while active:
            positions = [s.position + step for s in active]
            next_ids = self._forward([tokens[s.req_id] for s in active], positions,
                                     [s.block_ids for s in active])
            for start, token in zip(active, next_ids):
                drafts[start.req_id].append(token)
                tokens[start.req_id] = token
            step += 1
            active = [s for s in active if limits[s.req_id] > step]
        return drafts

    def _forward(self, token_ids: list[int], positions: list[int],
                 tables: list[list[int]]) -> list[int]:
        """One position per request through the first num_layers layers; the argmax."""
        common = build_attention_metadata([1] * len(token_ids), [p + 1 for p in positions],
                                          tables, self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device)
        inner = self.inner
        with forward_context(self.backend, self.backend.build_metadata(common), self.kv_pool):
            # LlamaModel.rotary: the form its layers take (CPU tables); else the plain one.
            cos, sin = getattr(inner, "rotary", inner.rotary_emb)(pos)
            hidden, residual = inner.embed_tokens(ids), None
            for layer in inner.layers[:self.num_layers]:
                hidden, residual = layer(hidden, residual, cos, sin)
            hidden, _ = inner.norm(hidden, residual)
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()
