"""DeepSeek Sparse Attention's lightning indexer (DeepSeek V3.2): which cached tokens each
query row attends to.

Per MLA layer, the indexer has its own small projections, named as in Hugging Face
checkpoints (``self_attn.indexer.*``): wq_b (the query LoRA q_resid -> num_heads heads
of head_dim), wk (hidden -> one key of head_dim per token), k_norm (a LayerNorm with a
bias) and weights_proj (hidden -> one weight per head). The first qk_rope_head_dim dims
of its queries and keys are rotated half-split (not interleaved, unlike the MLA rope
of the same checkpoints), with the model's cos / sin.

Each step the layer stores this step's keys in a pool layer of their own
(``IndexerKeyCache``: an IndexerKeySpec, numbered after every attention layer, so the
block table, prefix cache, preemption and offload tiers hold them as they hold the
latents), then scores, for each query row n and each token t it may see,

    score[n, t] = sum_h w[n, h] * relu(q[n, h] . k[t]),   w = weights_proj(x) / sqrt(H * D)

and keeps the topk best positions (-1 pads). A row that sees at most topk tokens keeps
all of them; a step whose rows are all that short skips the scoring and attends with
the dense latent kernel (the same tokens: what a short prompt costs stays that of dense
MLA plus the indexer's key projection).

Tensor parallelism: the indexer is replicated (its inputs, q_resid and the hidden
state, are replicated too), so every rank selects the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.forward_context import get_forward_context
from pagoda.core.kv_cache_spec import IndexerKeySpec, KVCacheSpec
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.rotary import apply_rotary
from pagoda.model.mla_config import MLAConfig

# The indexer's k_norm is a LayerNorm with DeepSeek's default epsilon.
_K_NORM_EPS = 1e-6
# The float32 score buffer of rows scored at once: at most this many bytes (rows times
# the step's longest context, or a CUDA graph's bound on it: a 64k-token prefill never
# holds 64k x 64k scores), and at most _SCORE_ROW_CHUNK rows.
_SCORE_BUFFER_BYTES = 512 << 20
_SCORE_ROW_CHUNK = 1024


class IndexerKeyCache(Attention):
    """The pool layer that holds one sparse-MLA layer's indexer keys."""

    def __init__(self, layer_idx: int, head_dim: int) -> None:
        super().__init__(layer_idx, 1, 1, head_dim, 1.0)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return IndexerKeySpec(block_size, self.head_dim, str(dtype).removeprefix("torch."))

    def store(self, keys: torch.Tensor) -> torch.Tensor:
        """Writes this step's keys [T, head_dim]; returns the layer's cache."""
        ctx = get_forward_context()
        ctx.kv_pool.store(self.layer_idx, ctx.metadata.common, keys)
        return ctx.kv_pool.cache(self.layer_idx)

    def forward(self, q, k, v):  # pragma: no cover - keys are stored, never attended here
        raise TypeError("IndexerKeyCache holds keys for the indexer; call store()")


class LightningIndexer(nn.Module):
    """The indexer of one sparse-MLA layer: stores its keys, returns each row's top-k."""

    def __init__(self, hidden_size: int, mla: MLAConfig, cache_index: int, linear_factory) -> None:
        """linear_factory(in, out): a projection every rank holds whole."""
        super().__init__()
        if mla.indexer is None or mla.q_lora_rank is None:
            raise ValueError("a lightning indexer needs MLA with an indexer and a query LoRA")
        index = mla.indexer
        self.num_heads, self.head_dim, self.topk = index.num_heads, index.head_dim, index.topk
        self.rope_dim = mla.qk_rope_head_dim
        self.wq_b = linear_factory(mla.q_lora_rank, index.num_heads * index.head_dim)
        self.wk = linear_factory(hidden_size, index.head_dim)
        self.k_norm = nn.LayerNorm(index.head_dim, eps=_K_NORM_EPS)
        self.weights_proj = linear_factory(hidden_size, index.num_heads)
        self.keys = IndexerKeyCache(cache_index, index.head_dim)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]: its first rope_dim dims rotated (half-split), the rest as is."""
        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """hidden [T, hidden], q_resid [T, q_lora_rank] -> int32 [N, topk] positions
        (token indices within each row's request, -1 unused) for the plan's N latent
        rows (a sparse backend plans every real row of the step as latent); None when
        every row sees at most topk tokens, so keeps all of them: the layer then attends
        over them with the dense latent kernel, the same tokens by a faster path."""
        ctx = get_forward_context()
        plan = ctx.metadata
        num_tokens = hidden.shape[0]
        k = self.k_norm(self.wk(hidden))
        k = self._rotate(k.unsqueeze(1), cos, sin).squeeze(1)
        key_cache = self.keys.store(k)
        longest = plan.max_row_len
        if 0 < longest <= self.topk:  # every row keeps all it sees
            return None
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        q = self._rotate(q, cos, sin)
        scale = (self.num_heads * self.head_dim) ** -0.5
        weights = self.weights_proj(hidden).float() * scale
        if plan.latent_rows is not None:  # a padded step: its real rows only
            q, weights = q[plan.latent_rows], weights[plan.latent_rows]
        row_chunk = min(_SCORE_ROW_CHUNK, max(1, _SCORE_BUFFER_BYTES // (4 * max(longest, 1))))
        return ctx.backend.indexer_topk(q, weights, key_cache, plan, self.topk, row_chunk)
