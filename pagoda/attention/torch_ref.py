"""torch_ref: the golden attention backend, plain torch, CPU and GPU.

Every kernel is tested against this. Arithmetic is in float32 whatever the input
dtype. Decode rows (query length 1) are batched into one masked matmul; prefill chunks
go through SDPA one request at a time with a causal mask offset by their context.

``build_metadata`` plans the step once (a StepPlan: which rows are decodes and which
prefill chunks, and the decode gather); every layer's ``forward`` reads that plan. The
KV pool has stored the step's k/v before ``forward`` runs: this backend only reads the
cache.

Two decode paths: by default (``batched_decode=True``) the copy indices are part of the
step's plan and the decode contexts are kept contiguous from step to step
(pagoda.attention.torch_decode, decode_workspace: each build_metadata call is one step
of the workspace); ``batched_decode=False`` keeps the plain per-layer gather + einsum,
the reference the fast path is tested against.

The plan is built lazily (``LazyStepPlan``): on the first layer's ``forward``, so a
step whose layers never attend through the backend (the fused CPU decode step,
pagoda/model/cpu_fused_decode.py, which reads the cache itself) costs nothing here. The
workspace still sees every step: a step whose plan was never built counts as one
without decode rows (``DecodeWorkspace.skip_step``), so nothing carries across it.

A sliding-window layer passes its window to ``forward``: prefill rows mask keys left of
their window (and skip gathering those left of the first row's), decode rows mask the
keys before their last W.

Attention sinks (``forward(..., sinks=s)``, float32 [num_heads], gpt-oss): head h's
softmax gets one more logit s[h] with no value, so its probabilities over the keys sum
to less than 1 (``softmax_with_sinks``).

An FP8 cache (kv_cache_dtype fp8) is read as stored * scale with the layer's
``kv_scales``: dequantized explicitly here (attention/kv_quant.py), folded into the
score scale and the output on the batched decode path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionMetadata, BackendMetadata
from pagoda.attention.decode_workspace import DecodeWorkspace
from pagoda.attention.kv_quant import check_scales, dequantize_kv, is_fp8
from pagoda.attention.torch_decode import (
    StepPlan,
    build_step_plan,
    check_sinks,
    check_window,
    decode_attention,
    softmax_with_sinks,
)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """K and V of one request's first seq_len tokens: each [seq_len, n_kv, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


class LazyStepPlan(BackendMetadata):
    """build_metadata's result: the step's StepPlan, built on first use (``plan()``;
    its fields also read through, e.g. ``lazy.decode``)."""

    def __init__(self, common: AttentionMetadata, build: Callable[[], StepPlan]) -> None:
        super().__init__(common)
        self._build: Callable[[], StepPlan] | None = build
        self._plan: StepPlan | None = None

    @property
    def built(self) -> bool:
        return self._plan is not None

    def plan(self) -> StepPlan:
        if self._plan is None:
            if self._build is None:
                raise RuntimeError(
                    "a step's attention plan was first used after the next "
                    "step's was made (the workspace counts steps in order)"
                )
            self._plan, self._build = self._build(), None
        return self._plan

    def expire(self) -> None:
        """The next step's plan exists: this one, if never built, never will be."""
        self._build = None

    def __getattr__(self, name: str):  # only for names not set on the instance
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.plan(), name)


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        batched_decode: bool = True,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.batched_decode = batched_decode
        self._workspace: DecodeWorkspace | None = None  # decode contexts, step to step
        self._last: LazyStepPlan | None = None  # the previous step's plan

    def build_metadata(self, common: AttentionMetadata) -> LazyStepPlan:
        if self._last is not None and not self._last.built:
            self._last.expire()
            if self._workspace is not None:
                self._workspace.skip_step()  # that step ran without this backend: no carrying
        workspace = self._workspace_for(common.block_size)
        self._last = LazyStepPlan(
            common, lambda: build_step_plan(common, self.num_kv_heads, workspace)
        )
        return self._last

    def forward(
        self,
        q,
        kv_cache,
        metadata: StepPlan | LazyStepPlan,
        kv_scales=None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(metadata, LazyStepPlan):
            metadata = metadata.plan()
        plan, common = metadata, metadata.common
        if is_fp8(kv_cache.dtype):
            check_scales(kv_scales, kv_cache)
        else:
            kv_scales = None  # entries in the model's dtype are not scaled
        check_window(sliding_window)
        check_sinks(sinks, self.num_heads)
        window = sliding_window
        decode = plan.decode
        if decode is not None:
            o = decode_attention(
                q,
                kv_cache,
                decode,
                plan.workspace,
                self.scale,
                kv_scales,
                sliding_window=window,
                sinks=sinks,
            )
            if decode.all_rows and q.shape[0] == len(plan.decode_rows):  # a pure decode step
                return o if o.dtype == q.dtype else o.to(q.dtype)
        out = torch.zeros_like(q)
        if decode is not None:
            out[decode.token_rows] = o.to(q.dtype)
        elif plan.decode_rows:
            self._decode_reference(
                q,
                kv_cache,
                common,
                plan.decode_rows,
                (plan.qsl, plan.seq_lens),
                out,
                kv_scales,
                window,
                sinks,
            )
        for i in plan.prefill_rows:
            start, end = plan.qsl[i], plan.qsl[i + 1]
            out[start:end] = self._prefill_one(
                q[start:end],
                kv_cache,
                common.block_tables[i],
                plan.seq_lens[i],
                kv_scales,
                window,
                sinks,
            )
        return out

    def _workspace_for(self, block_size: int) -> DecodeWorkspace | None:
        """The persistent workspace (None for the reference path); a new block size
        starts a new one."""
        if not self.batched_decode:
            return None
        if self._workspace is None or self._workspace.block_size != block_size:
            self._workspace = DecodeWorkspace(block_size)
        return self._workspace

    def _prefill_one(
        self,
        q,
        kv_cache,
        block_table,
        seq_len: int,
        kv_scales=None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qlen = q.shape[0]
        # With a window, keys before the first row's window are never seen: not gathered.
        first = 0 if window is None else max(0, seq_len - qlen - window + 1)
        k, v = gather_context(kv_cache, block_table, seq_len)
        k, v = k[first:], v[first:]
        k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
        group = self.num_heads // self.num_kv_heads
        qh = q.float().transpose(0, 1)  # [H, qlen, D]
        kh = (
            dequantize_kv(k, k_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        )  # [H, seq, D]
        vh = dequantize_kv(v, v_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        # Query row j sits at position seq_len - qlen + j and sees keys 0..that position
        # (with a window W: that position - W + 1..that position).
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        if sinks is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        else:
            scores = torch.matmul(qh, kh.transpose(1, 2)) * self.scale  # [H, qlen, seq]
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(softmax_with_sinks(scores, sinks.view(-1, 1, 1)), vh)
        return o.transpose(0, 1).to(q.dtype)

    def _decode_reference(
        self, q, kv_cache, metadata, rows, lengths, out, kv_scales=None, window=None, sinks=None
    ) -> None:
        """All single-token rows at once: gather each context padded to the longest.
        lengths: (query_start_loc, seq_lens) on the host."""
        qsl_list, seq_list = lengths
        device = q.device
        block_size = kv_cache.shape[2]
        row_idx = torch.tensor(rows, device=device)
        tok_idx = torch.tensor([qsl_list[i] for i in rows], device=device)
        lens = torch.tensor([seq_list[i] for i in rows], device=device)
        max_len = max(seq_list[i] for i in rows)
        nblk = (max_len + block_size - 1) // block_size
        tables = metadata.block_tables[row_idx, :nblk].long()  # [B, nblk]
        B, G = len(rows), self.num_heads // self.num_kv_heads
        k = kv_cache[0][tables].reshape(B, nblk * block_size, self.num_kv_heads, self.head_dim)
        v = kv_cache[1][tables].reshape(B, nblk * block_size, self.num_kv_heads, self.head_dim)
        qb = q[tok_idx].float().view(B, self.num_kv_heads, G, self.head_dim)
        k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
        scores = torch.einsum("bhgd,blhd->bhgl", qb, dequantize_kv(k, k_scale)) * self.scale
        pos = torch.arange(nblk * block_size, device=device)[None, :]
        valid = pos < lens[:, None]
        if window is not None:
            valid &= pos >= lens[:, None] - window
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = softmax_with_sinks(scores, sinks.view(1, self.num_kv_heads, G, 1))
        o = torch.einsum("bhgl,blhd->bhgd", probs, dequantize_kv(v, v_scale))
        out[tok_idx] = o.reshape(B, self.num_heads, self.head_dim).to(q.dtype)
