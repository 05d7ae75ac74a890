"""Multi-head latent attention (DeepSeek V2/V3): projections, latent cache, both paths.

``MLAAttention`` holds the projections, named as in Hugging Face checkpoints:
q_proj (or q_a_proj -> q_a_layernorm -> q_b_proj), kv_a_proj_with_mqa (-> the
compressed KV c and the shared rotary key k_rope), kv_a_layernorm (on c), kv_b_proj
(c -> per head k_nope and v) and o_proj. ``MLALatentAttention`` is its Attention
layer: it declares the latent KV spec (one entry of kv_lora_rank + qk_rope_head_dim
values per token), stores [norm(c), rope(k_rope)] (one kernel on CUDA:
pagoda.kernels.attention.mla_store.norm_rope_store_latent) and runs the
rows of the step as the backend's plan says (pagoda/attention/mla_backend.py):

- latent rows (decodes; every row in a CUDA graph): q_lat = q_nope W_UK per head,
  attention over the cached entries, o = o_lat W_UV^T; W_UK / W_UV are views of
  kv_b_proj's weight ([H, qk_nope + v, kv_lora_rank] per rank), never copied. The query
  [q_lat, rope(q_rope)] and the value projection are one Triton kernel each on CUDA
  (pagoda.kernels.attention.mla_absorb, unless PAGODA_FUSED_OPS=0) for up to a few rows, bmm +
  rotary + cat and a bmm otherwise (their references), so q_rope reaches this layer
  un-rotated with the step's cos / sin;
- prefill rows: the contexts' latents gathered from the cache (the cached prefix and
  this step's rows alike), decompressed by kv_b_proj into k_nope and V (views of its
  output), then causal attention with keys [k_nope, k_rope]: the backend gets the
  pieces, k_rope once for every head (the Triton backend reads them in place with
  one kernel, pagoda.kernels.attention.mla_prefill; the reference backend concatenates them).

Sparse MLA (DeepSeek V3.2): the layer also holds a lightning indexer
(pagoda/model/layers/dsa.py), which picks each row's top-k cached tokens; every row then
takes the latent path over its selected entries only (``backend.forward_sparse``), and
the backend plans every row of the step as latent. A step whose rows all see at most
top-k tokens attends over all of them with the dense latent kernel instead.

Tensor parallelism: heads split across ranks (q_proj / q_b_proj and kv_b_proj
column-parallel by head, o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa and the
latent cache are replicated on every rank (the latent is shared by all heads).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.forward_context import get_forward_context
from pagoda.attention.kv_pool import MLALatentLayout
from pagoda.core.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.dsa import LightningIndexer
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import ColumnParallelLinear, RowParallelLinear, divide
from pagoda.model.layers.rotary import apply_rotary
from pagoda.model.mla_config import MLAConfig, mla_softmax_scale
from pagoda.model.parallel import TensorParallel

# DeepSeek's q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon, not the
# config's rms_norm_eps (as in the reference implementation and transformers).
_LORA_NORM_EPS = 1e-6


def _per_token_kernels_take(rows: torch.Tensor) -> bool:
    """Whether the per-token Triton kernels of pagoda.kernels.attention.mla_absorb run: on CUDA,
    unless PAGODA_FUSED_OPS=0, for at most PER_TOKEN_MAX_ROWS rows. Each program reads
    its head's weights again, so a batch of hundreds of rows goes to the bmm (one read
    per head)."""
    if not rows.is_cuda:
        return False
    from pagoda.kernels.attention.mla_absorb import PER_TOKEN_MAX_ROWS
    from pagoda.kernels.norm import fused_ops  # imports triton: CUDA only

    return fused_ops.FUSED_OPS_ENABLED and rows.shape[0] <= PER_TOKEN_MAX_ROWS


def absorbed_query(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_uk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """[q_nope W_UK per head, rope(q_rope)] -> [N, H, kv_lora_rank + qk_rope]: one
    Triton kernel on CUDA for a few rows, this torch code (its reference) elsewhere."""
    if _per_token_kernels_take(q_nope):
        from pagoda.kernels.attention.mla_absorb import absorb_q  # Triton: CUDA only

        return absorb_q(q_nope, q_rope, w_uk, cos, sin)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, kv_lora_rank]
    return torch.cat((q_lat, apply_rotary(q_rope, cos, sin)), dim=-1)


def value_projection(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [N, H, kv_lora_rank] -> [N, H, v_head_dim] (o_lat W_UV^T per head): one
    Triton kernel on CUDA with a contiguous result for a few rows, this bmm (its
    reference) elsewhere."""
    if _per_token_kernels_take(o_lat):
        from pagoda.kernels.attention.mla_absorb import project_v  # Triton: CUDA only

        return project_v(o_lat, w_uv)
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def replicated_linear(input_size: int, output_size: int) -> ColumnParallelLinear:
    """A projection every rank holds whole: a column-parallel layer of one rank."""
    return ColumnParallelLinear(input_size, output_size, bias=False, tp_rank=0, tp_size=1)


class MLALatentAttention(Attention):
    """The attention of one MLA layer: latent KV spec, store, and the plan's two paths."""

    def __init__(self, layer_idx: int, num_heads: int, mla: MLAConfig, scale: float) -> None:
        super().__init__(layer_idx, num_heads, 1, mla.latent_dim, scale)
        self.mla = mla

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return MLAAttentionSpec(
            block_size,
            self.mla.kv_lora_rank,
            self.mla.qk_rope_head_dim,
            str(dtype).removeprefix("torch."),
        )

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_a: torch.Tensor,
        kv_a_layernorm: RMSNorm,
        kv_b_proj: ColumnParallelLinear,
        cos: torch.Tensor,
        sin: torch.Tensor,
        topk_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [T, H, qk_nope], q_rope [T, H, qk_rope] (not yet rotated; cos / sin
        [T, qk_rope / 2]), kv_a [T, kv_lora_rank + qk_rope] (kv_a_proj_with_mqa's output:
        c, then the un-rotated k_rope) -> [T, H * v_head_dim]; stores this step's latent
        entries [kv_a_layernorm(c), rope(k_rope)]. topk_positions (sparse MLA): int32
        [N, topk] of the plan's latent rows, the tokens each attends to."""
        ctx = get_forward_context()
        plan = ctx.metadata
        cache = ctx.kv_pool.cache(self.layer_idx)
        self._store_latents(kv_a, kv_a_layernorm, cos, sin, cache, ctx)
        mla, num_tokens, heads = self.mla, q_nope.shape[0], self.num_heads
        w = kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]
        rows = plan.latent_rows
        if topk_positions is not None:
            return self._sparse(q_nope, q_rope, cos, sin, cache, w_uk, w_uv, topk_positions, ctx)
        if rows is None and not plan.prefill_chunks:  # every row latent (decode, graphs)
            out = self._latent(q_nope, q_rope, cos, sin, cache, w_uk, w_uv, ctx)
            return out.reshape(num_tokens, heads * mla.v_head_dim)
        # Here latent_rows is a tensor (None only when the whole step is latent, above);
        # rows neither path names (padding) stay zero.
        out = q_nope.new_zeros(num_tokens, heads, mla.v_head_dim)
        if plan.num_latent_rows:
            out[rows] = self._latent(
                q_nope[rows], q_rope[rows], cos[rows], sin[rows], cache, w_uk, w_uv, ctx
            )
        if plan.prefill_chunks:
            self._prefill(out, q_nope, apply_rotary(q_rope, cos, sin), cache, kv_b_proj, ctx)
        return out.reshape(num_tokens, heads * mla.v_head_dim)

    def _store_latents(self, kv_a, kv_a_layernorm, cos, sin, cache, ctx) -> None:
        """One Triton launch (pagoda.kernels.attention.mla_store.norm_rope_store_latent) where the
        pool itself would store with its Triton kernel (CUDA), unless
        PAGODA_FUSED_OPS=0; the torch code here is its reference."""
        plan, rank = ctx.metadata, self.mla.kv_lora_rank
        if self.pool_stores_with_triton(MLALatentLayout):
            from pagoda.kernels.norm import fused_ops  # imports triton

            if fused_ops.FUSED_OPS_ENABLED:
                from pagoda.kernels.attention.mla_store import (
                    norm_rope_store_latent,  # Triton: CUDA only
                )

                norm_rope_store_latent(
                    kv_a,
                    kv_a_layernorm.weight,
                    kv_a_layernorm.eps,
                    cos,
                    sin,
                    cache,
                    plan.common.slot_mapping,
                )
                return
        c, k_rope = kv_a.split([rank, self.mla.qk_rope_head_dim], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat((kv_a_layernorm(c.contiguous()), k_rope), dim=-1)
        ctx.kv_pool.store(self.layer_idx, plan.common, latent)

    def _latent(self, q_nope, q_rope, cos, sin, cache, w_uk, w_uv, ctx) -> torch.Tensor:
        """The absorbed path: [N, H, *] queries (q_rope not rotated) -> [N, H, v_head_dim]."""
        q = absorbed_query(q_nope, q_rope, w_uk, cos, sin)
        o_lat = ctx.backend.forward(q, cache, ctx.metadata)  # [N, H, kv_lora_rank]
        return value_projection(o_lat, w_uv)

    def _sparse(self, q_nope, q_rope, cos, sin, cache, w_uk, w_uv, positions, ctx):
        """Every latent row over its selected entries -> [T, H * v_head_dim] (rows the
        plan leaves out, padding, stay zero)."""
        plan, mla = ctx.metadata, self.mla
        if plan.prefill_chunks:
            raise RuntimeError("sparse MLA needs a plan with every row latent")
        num_tokens, width = q_nope.shape[0], self.num_heads * mla.v_head_dim
        rows = plan.latent_rows
        if rows is not None:
            q_nope, q_rope, cos, sin = q_nope[rows], q_rope[rows], cos[rows], sin[rows]
        q = absorbed_query(q_nope, q_rope, w_uk, cos, sin)
        o_lat = ctx.backend.forward_sparse(q, cache, positions, plan)  # [N, H, kv_lora_rank]
        out = value_projection(o_lat, w_uv).reshape(-1, width)
        if rows is None:
            return out
        full = out.new_zeros(num_tokens, width)
        full[rows] = out
        return full

    def _prefill(self, out, q_nope, q_rope, cache, kv_b_proj, ctx) -> None:
        """The decompressed path: writes the plan's prefill rows of out [T, H, v_head_dim]
        from q_nope / q_rope (rotated) [T, H, *], every row of the step. The backend gets
        the pieces as views (k_nope and v: halves of kv_b_proj's output; k_rope: the
        gathered entries' tail, one key for every head) and assembles what it needs."""
        plan, mla = ctx.metadata, self.mla
        entries = cache.view(-1, mla.latent_dim).index_select(0, plan.prefill_slots)
        kv = kv_b_proj(entries[:, : mla.kv_lora_rank]).view(
            entries.shape[0], self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim
        )
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        ctx.backend.forward_prefill(
            out, q_nope, q_rope, k_nope, entries[:, mla.kv_lora_rank :], v, plan
        )


class MLAAttention(nn.Module):
    """One DeepSeek attention block: hidden [T, hidden] -> [T, hidden]."""

    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        mla = arch.mla
        if mla is None:
            raise ValueError(f"{arch.architecture} has no MLA config")
        self.mla = mla
        heads = arch.num_attention_heads
        self.num_heads = divide(heads, tp.size, "num_attention_heads")
        column = dict(bias=False, tp_rank=tp.rank, tp_size=tp.size)
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(arch.hidden_size, heads * mla.qk_head_dim, **column)
        else:
            self.q_a_proj = replicated_linear(arch.hidden_size, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, **column)
        self.kv_a_proj_with_mqa = replicated_linear(arch.hidden_size, mla.latent_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), **column
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, arch.hidden_size, **column)
        self.attn = MLALatentAttention(
            layer_idx, self.num_heads, mla, mla_softmax_scale(mla, arch.rope_scaling)
        )
        if mla.indexer is not None:  # its keys: a pool layer after every decoder layer's
            self.indexer = LightningIndexer(
                arch.hidden_size, mla, arch.num_hidden_layers + layer_idx, replicated_linear
            )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or [len(output_rows), hidden] for those rows only
        (attention still runs, and stores its latent, for every row)."""
        mla, num_tokens = self.mla, hidden.shape[0]
        positions = None
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
            if mla.indexer is not None:
                positions = self.indexer(hidden, q_resid, cos, sin)
        q_nope, q_rope = q.view(num_tokens, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        out = self.attn(
            q_nope,
            q_rope,
            self.kv_a_proj_with_mqa(hidden),
            self.kv_a_layernorm,
            self.kv_b_proj,
            cos,
            sin,
            positions,
        )
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)
