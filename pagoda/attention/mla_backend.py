"""MLA attention backends: the step's plan and the torch reference (CPU and GPU).

Multi-head latent attention (pagoda/model/layers/mla.py) caches one latent entry per
token: c (kv_lora_rank values, the compressed keys and values) then k_rope. Head h's
key is [W_UK[h] c, k_rope] and its value W_UV[h] c (kv_b_proj holds W_UK and W_UV).
Two ways to attend, equal in exact arithmetic:

- decompressed (prefill): K and V of the whole context are rebuilt from the gathered
  latents by kv_b_proj and attended like ordinary attention, with query/key width
  qk_nope + qk_rope and value width v_head_dim. Cheap per query row when a request
  brings many rows;
- latent (absorbed): the query is taken into latent space, q_lat = [q_nope W_UK[h],
  q_rope], and attends to the cached entries themselves (one shared "KV head" of
  width kv_lora_rank + qk_rope; the value is the first kv_lora_rank values); the
  output o_lat is brought back by W_UV[h]. Nothing is decompressed: what decode wants.

The plan (MLAPlan, built once per step by ``build_metadata``) says which rows take
which way: eager steps send requests with one query row (decodes) through the latent
path and the others (prefill chunks, with any cached prefix) through the decompressed
one; a plan without host copies (CUDA graphs, pagoda/attention/mla_triton.py) sends
every row through the latent path, which handles any query length (row j of a request
of query length q and seq_len s sees s - q + j + 1 tokens). ``latent_rows="all"``
forces that on eager steps too (tests compare the two paths with it).

Sparse MLA (DeepSeek V3.2) plans every row latent (``latent_rows="all"``) and adds two
calls: ``indexer_topk`` (each row's top-k cached tokens by the layer's indexer scores)
and ``forward_sparse(q_lat, cache, positions, plan)`` (the latent path over those
tokens only); here both are the torch references of
pagoda/kernels/attention/dsa_indexer.py and sparse_mla.py.

The layer calls ``forward(q_lat, cache, plan)`` for the latent rows and
``forward_prefill(out, q_nope, q_rope, k_nope, k_rope, v, plan)`` for the prefill rows:
the pieces as the layer holds them (every row of the step's queries, kv_b_proj's output
split in place, the rope key once for every head), the backend writing the prefill
rows of out. This module's backend assembles q = [q_nope, q_rope] and k = [k_nope,
k_rope] and computes both paths in float32 with plain torch: it is the reference the
Triton kernels are tested against. The KV pool has stored the step's latents before
either runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionMetadata, BackendMetadata
from pagoda.attention.torch_decode import host_lengths
from pagoda.kernels.attention.dsa_indexer import indexer_topk
from pagoda.kernels.attention.sparse_mla import sparse_latent_attention_ref
from pagoda.kernels.launch.host_copy import host_to_device

LATENT_ROWS = ("decode", "all")


@dataclass
class PrefillChunk:
    """One request's rows on the decompressed path: q rows [row_start, row_end) of the
    prefill rows, its context rows [ctx_start, ctx_end) of the gathered latents."""

    row_start: int
    row_end: int
    ctx_start: int
    ctx_end: int


@dataclass
class MLAPlan(BackendMetadata):
    """The step's MLA plan, shared by every layer."""

    # Latent path: rows of the step (None: rows 0..num_latent_rows-1, the whole step),
    # the request of each and how many tokens of context it sees (0: a padding row,
    # whose output is zero).
    latent_rows: torch.Tensor | None  # int64 [N] on device
    num_latent_rows: int
    row_req: torch.Tensor  # int32 [N]
    row_len: torch.Tensor  # int32 [N]
    # Decompressed path: the rows (int64 [P]), each request's chunk, and the cache slots
    # of every chunk's whole context, concatenated (int64 [C]).
    prefill_rows: torch.Tensor | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    prefill_slots: torch.Tensor | None = None
    # Host: a bound on the latent rows' contexts, exact on eager steps; a graph's plan
    # gives the longest context its block table holds (0: unknown).
    max_row_len: int = 0


def plan_eager(common: AttentionMetadata, latent_rows: str) -> MLAPlan:
    """The plan of a step with host copies: decodes (or every row) latent, the rest
    decompressed."""
    qsl, seq_lens = host_lengths(common)
    device = common.block_tables.device
    rows, reqs, lens, prefill_rows, chunks, slot_parts = [], [], [], [], [], []
    ctx = 0
    for i in range(common.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        qlen = end - start
        if qlen == 1 or latent_rows == "all":
            rows.extend(range(start, end))
            reqs.extend([i] * qlen)
            lens.extend(range(seq_len - qlen + 1, seq_len + 1))
            continue
        chunks.append(PrefillChunk(len(prefill_rows), len(prefill_rows) + qlen, ctx, ctx + seq_len))
        prefill_rows.extend(range(start, end))
        ctx += seq_len
        slot_parts.append(_context_slots(common, i, seq_len))
    whole = rows == list(range(common.num_actual_tokens)) and (
        common.slot_mapping.shape[0] == len(rows)
    )
    plan = MLAPlan(
        common,
        latent_rows=None if whole else host_to_device(rows, torch.long, device),
        num_latent_rows=len(rows),
        row_req=host_to_device(reqs, torch.int32, device),
        row_len=host_to_device(lens, torch.int32, device),
        max_row_len=max(lens, default=0),
    )
    if chunks:
        plan.prefill_rows = host_to_device(prefill_rows, torch.long, device)
        plan.prefill_chunks = chunks
        plan.prefill_slots = torch.cat(slot_parts)
    return plan


def _context_slots(common: AttentionMetadata, req: int, seq_len: int) -> torch.Tensor:
    """Cache slots of request req's tokens 0..seq_len-1, on the device."""
    bs = common.block_size
    pos = torch.arange(seq_len, device=common.block_tables.device)
    blocks = common.block_tables[req, : -(-seq_len // bs)].long()
    return blocks[pos // bs] * bs + pos % bs


def latent_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_len: int | None = None,
) -> torch.Tensor:
    """q [N, H, E] latent queries against the latent cache [num_blocks, block_size, E]:
    row n sees the first row_len[n] tokens of request row_req[n]. Returns [N, H,
    kv_lora_rank] in float32 (zeros for rows of length 0)."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(num_rows, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    if num_rows == 0:
        return out
    if max_len is None or max_len <= 0:
        max_len = int(row_len.max())
    if max_len == 0:
        return out
    bs = cache.shape[1]
    pos = torch.arange(max_len, device=q.device)
    tables = block_tables[row_req.long()].long()  # [N, max_blocks]
    nblk = -(-max_len // bs)
    slots = tables[:, :nblk][:, pos // bs] * bs + pos % bs  # [N, L]
    entries = cache.view(-1, cache.shape[-1])[slots].float()  # [N, L, E]
    scores = torch.einsum("nhe,nle->nhl", q.float(), entries) * scale
    valid = pos[None, :] < row_len[:, None].long()
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of length 0: all -inf
    return torch.einsum("nhl,nlc->nhc", probs, entries[..., :kv_lora_rank])


def assemble_prefill_qk(
    q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q = [q_nope, q_rope] [P, H, Dn + Dr] and k = [k_nope, k_rope for every head]
    [C, H, Dn + Dr]: what prefill_attention takes."""
    heads = k_nope.shape[1]
    k = torch.cat((k_nope, k_rope[:, None].expand(-1, heads, k_rope.shape[-1])), dim=-1)
    return torch.cat((q_nope, q_rope), dim=-1), k


def sdpa_prefill(
    out: torch.Tensor,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    plan: MLAPlan,
    scale: float,
    upcast: bool,
) -> None:
    """The plan's prefill rows of out from the layer's pieces (forward_prefill's
    arguments): q and k assembled, then prefill_attention per chunk."""
    rows = plan.prefill_rows
    q, k = assemble_prefill_qk(q_nope[rows], q_rope[rows], k_nope, k_rope)
    out[rows] = prefill_attention(q, k, v, plan.prefill_chunks, scale, upcast=upcast)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[PrefillChunk],
    scale: float,
    upcast: bool,
) -> torch.Tensor:
    """Causal attention of each chunk's query rows to its decompressed context: q [P, H,
    Dqk], k [C, H, Dqk], v [C, H, Dv] -> [P, H, Dv] in q's dtype. A chunk's query row j
    sits at position ctx_len - qlen + j. upcast: compute in float32 (the reference)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for c in chunks:
        qi, ki, vi = (
            q[c.row_start : c.row_end],
            k[c.ctx_start : c.ctx_end],
            v[c.ctx_start : c.ctx_end],
        )
        if upcast:
            qi, ki, vi = qi.float(), ki.float(), vi.float()
        qlen, klen = qi.shape[0], ki.shape[0]
        qh, kh, vh = qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)
        if qlen == klen:  # no cached prefix: the plain causal mask is the right one
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(klen - qlen, klen, device=q.device)[:, None]
            mask = torch.arange(klen, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[c.row_start : c.row_end] = o.transpose(0, 1).to(out.dtype)
    return out


class MLATorchBackend(AttentionBackend):
    """The reference MLA backend, plain torch in float32; CPU and GPU."""

    name = "torch_ref"
    uses_triton_kernels = False

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        scale: float,
        latent_rows: str = "decode",
    ) -> None:
        super().__init__(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale)
        if latent_rows not in LATENT_ROWS:
            raise ValueError(f"latent_rows must be one of {LATENT_ROWS}, got {latent_rows!r}")
        self.kv_lora_rank = kv_lora_rank
        self.latent_rows = latent_rows

    def build_metadata(self, common: AttentionMetadata) -> MLAPlan:
        return plan_eager(common, self.latent_rows)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLAPlan) -> torch.Tensor:
        """q [N, H, kv_lora_rank + rope] of the plan's latent rows -> [N, H, kv_lora_rank]."""
        common = metadata.common
        out = latent_attention_ref(
            q,
            kv_cache,
            common.block_tables,
            metadata.row_req,
            metadata.row_len,
            self.scale,
            self.kv_lora_rank,
            metadata.max_row_len,
        )
        return out.to(q.dtype)

    def forward_prefill(
        self,
        out: torch.Tensor,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
        v: torch.Tensor,
        metadata: MLAPlan,
    ) -> None:
        """Writes the plan's prefill rows of out [T, H, Dv]: q_nope [T, H, Dn] and q_rope
        [T, H, Dr] (rotated) hold every row of the step; k_nope [C, H, Dn], v [C, H, Dv]
        and k_rope [C, Dr] (shared by every head) the contexts, in metadata.prefill_slots
        order."""
        sdpa_prefill(out, q_nope, q_rope, k_nope, k_rope, v, metadata, self.scale, upcast=True)

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_cache: torch.Tensor,
        metadata: MLAPlan,
        topk: int,
        row_chunk: int,
    ) -> torch.Tensor:
        """The plan's latent rows' top-k token positions (int32 [N, topk], -1 unused)
        by the indexer scores sum_h weights[n, h] relu(q[n, h] . key[t])."""
        return indexer_topk(
            q,
            weights,
            key_cache,
            metadata.common.block_tables,
            metadata.row_req,
            metadata.row_len,
            topk,
            max_len=metadata.max_row_len,
            row_chunk=row_chunk,
            use_kernel=self.uses_triton_kernels,
        )

    def forward_sparse(
        self, q: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, metadata: MLAPlan
    ) -> torch.Tensor:
        """q [N, H, E] of the plan's latent rows, each over its positions [N, topk] of
        its request's tokens (-1 unused) -> [N, H, kv_lora_rank]."""
        out = sparse_latent_attention_ref(
            q,
            kv_cache,
            metadata.common.block_tables,
            metadata.row_req,
            positions,
            self.scale,
            self.kv_lora_rank,
        )
        return out.to(q.dtype)
