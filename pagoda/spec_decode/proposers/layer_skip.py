"""Layer-skip self-speculation: the target's first m layers, its final norm and its LM
head draft k tokens greedily, one position per forward, right after a step's tokens
are known (on the worker, in the target's own KV cache; the loop is
spec_decode/greedy_drafter.py's).

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

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.spec_decode.proposers.greedy_drafter import (
    DraftStart,
    GreedyDrafter,
    Segment,
    segment_inputs,
)


class LayerSkipProposer(GreedyDrafter):
    def __init__(
        self,
        model,
        num_layers: int,
        backend,
        kv_pool,
        block_size: int,
        device: torch.device,
        max_model_len: int,
        confidence_threshold: float | None = None,
    ) -> None:
        super().__init__(max_model_len, confidence_threshold)
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, name) for name in needed):
            raise ValueError(
                f"layer_skip speculation needs a Llama-family decoder "
                f"(embed_tokens, layers, norm); {type(model).__name__} is not one"
            )
        if not 1 <= num_layers < len(inner.layers):
            raise ValueError(
                f"layer_skip num_layers ({num_layers}) must be smaller than "
                f"the target's {len(inner.layers)} layers"
            )
        self.model, self.inner = model, inner
        self.num_layers = num_layers
        self.backend, self.kv_pool = backend, kv_pool
        self.block_size, self.device = block_size, device

    def first_position(self, start: DraftStart) -> int:
        return start.position  # the target wrote every earlier position's layers < m

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def last_hidden(self, segments: list[Segment]) -> torch.Tensor:
        """The segments through the first num_layers layers and the final norm."""
        metadata, ids, pos, last_rows = segment_inputs(segments, self.block_size, self.device)
        inner = self.inner
        with forward_context(self.backend, self.backend.build_metadata(metadata), self.kv_pool):
            # LlamaModel.rotary: the form its layers take (CPU tables); else the plain one.
            cos, sin = getattr(inner, "rotary", inner.rotary_emb)(pos)
            hidden, residual = inner.embed_tokens(ids), None
            for layer in inner.layers[: self.num_layers]:
                hidden, residual = layer(hidden, residual, cos, sin)
            hidden, _ = inner.norm(hidden, residual)
        if len(last_rows) != hidden.shape[0]:
            hidden = hidden[last_rows]
        return hidden
