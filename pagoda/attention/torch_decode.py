"""Batched decode attention for torch_ref: one plan per step, shared by every layer.

A decode row (query length 1) attends to its request's whole context, scattered over
the paged cache. The reference (TorchRefBackend._decode_reference) gathers each row's
blocks and computes an einsum, per layer. Here the host work and the index arithmetic
are done once per step (``build_step_plan``, called by TorchRefBackend.build_metadata),
since every layer of one forward sees the same metadata and caches of the same shape:

- which requests are decode rows and which are prefill chunks;
- for the decode rows, their slots in the DecodeWorkspace (pagoda.attention.
  decode_workspace: the contexts kept contiguous from step to step, one slot per
  request) and the copies that bring each slot up to date, as flat row indices: from
  the layer's cache viewed as [cache slots * kv_heads, head_dim] into the workspace
  viewed as [slots * kv_heads * capacity, head_dim]; once for a layer whose buffers
  carry the previous step (the new token of carried rows, whole contexts of the rest),
  once for a layer filled from scratch;
- the mask of positions past each slot's context (and, per sliding window asked for,
  of positions before the window: ``DecodePlan.window_mask``).

Per layer, ``decode_attention`` then costs one small copy (K and V together), two
batched matmuls over the workspace and a softmax. Same arithmetic as the reference
(float32, scores scaled then masked to -inf), checked against it in
tests/attention/test_torch_decode.py. An FP8 cache's workspace holds the stored bytes (copied as
uint8); its K scale is folded into the score scale and its V scale applied to the
output (the reference dequantizes instead: equal up to float32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.attention.backend import AttentionMetadata, BackendMetadata
from pagoda.attention.decode_workspace import DecodeWorkspace, SlotAssignment
from pagoda.attention.kv_quant import as_bits, is_fp8


@dataclass
class DecodePlan:
    token_rows: torch.Tensor  # int64 [B]: the rows of q (and of the output) to attend
    all_rows: bool  # the decode rows are rows 0..B-1 of the step, and nothing else
    assignment: SlotAssignment  # workspace slots of the rows
    slots: torch.Tensor  # int64 [B]: assignment.slots on the device
    in_slot_order: bool  # row i sits in slot i and there are B slots
    carry_copy: tuple[torch.Tensor, torch.Tensor]  # (cache rows, workspace rows)
    # bool [slots, 1, 1, L]: True where past the slot's context; None when no slot has
    # such a position (every slot holds a row of length L: the mask would be a no-op).
    padding: torch.Tensor | None
    max_len: int  # L
    # [B, kv_heads, L] grids of cache and workspace rows, and where they are inside a
    # context: the full copy is taken from them on first use (a layer whose buffers do
    # not carry), since in steady decoding every layer carries and none needs it.
    grids: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # int64 [slots]: each slot's context length (1 for a slot no row uses).
    slot_lens: torch.Tensor | None = None
    _full_copy: tuple[torch.Tensor, torch.Tensor] | None = None
    # window -> bool [slots, 1, 1, L]: True where past the context or before its window.
    _window_masks: dict = field(default_factory=dict)

    # (carry, cache K rows, workspace K rows) -> the K and V copy as one index pair.
    _kv_copies: dict = field(default_factory=dict)

    def full_copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache rows, workspace rows) bringing every row's whole context in."""
        if self._full_copy is None:
            src, dst, inside = self.grids
            self._full_copy = (src[inside], dst[inside])
        return self._full_copy

    def window_mask(self, window: int) -> torch.Tensor | None:
        """padding, plus the positions before each slot's last `window` (built once per
        step and window); None where no slot has a masked position."""
        if self.max_len <= window:
            return self.padding
        mask = self._window_masks.get(window)
        if mask is None:
            pos = torch.arange(self.max_len, device=self.slot_lens.device)[None, :]
            lens = self.slot_lens[:, None]
            mask = ((pos >= lens) | (pos < lens - window))[:, None, None, :]
            self._window_masks[window] = mask
        return mask

    def kv_copy(
        self, carry: bool, cache_rows: int, workspace_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K rows' copy (carry_copy or full_copy) followed by the same rows of V,
        which sit cache_rows further in the cache and workspace_rows further in the
        workspace (both hold K, then V). Built once per step and shape."""
        key = (carry, cache_rows, workspace_rows)
        copy = self._kv_copies.get(key)
        if copy is None:
            src, dst = self.carry_copy if carry else self.full_copy()
            copy = (torch.cat((src, src + cache_rows)), torch.cat((dst, dst + workspace_rows)))
            self._kv_copies[key] = copy
        return copy


@dataclass
class StepPlan(BackendMetadata):
    """torch_ref's metadata for one step (the common metadata is `common`)."""

    decode_rows: list[int]  # request indices with one query token
    prefill_rows: list[int]  # request indices with several (a prompt chunk)
    qsl: list[int]  # query_start_loc on the host
    seq_lens: list[int]
    decode: DecodePlan | None
    workspace: DecodeWorkspace | None  # what decode reads through (None: the reference)


def host_lengths(metadata: AttentionMetadata) -> tuple[list[int], list[int]]:
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    if qsl is None or seq_lens is None:
        qsl, seq_lens = metadata.query_start_loc.cpu(), metadata.seq_lens.cpu()
    return qsl.tolist(), seq_lens.tolist()


def build_step_plan(
    metadata: AttentionMetadata, num_kv_heads: int, workspace: DecodeWorkspace | None
) -> StepPlan:
    """Everything about this step's attention that does not depend on the layer (the
    decode plan only with a workspace: without one, decode rows take the reference).
    A workspace counts each call as one step: call once per forward."""
    qsl, seq_lens = host_lengths(metadata)
    decode_rows, prefill_rows = [], []
    for i in range(metadata.num_reqs):
        (decode_rows if qsl[i + 1] - qsl[i] == 1 else prefill_rows).append(i)
    decode = None
    if workspace is not None and decode_rows:
        decode = build_decode_plan(metadata, decode_rows, qsl, seq_lens, num_kv_heads, workspace)
    elif workspace is not None:
        workspace.skip_step()  # slots carry only from the forward just before
    return StepPlan(metadata, decode_rows, prefill_rows, qsl, seq_lens, decode, workspace)


def build_decode_plan(
    metadata: AttentionMetadata,
    rows: list[int],
    qsl: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    workspace: DecodeWorkspace,
) -> DecodePlan:
    device = metadata.block_tables.device
    block_size = metadata.block_size
    lengths = [seq_lens[i] for i in rows]
    max_len = max(lengths)
    rows_t = torch.tensor(rows, device=device)
    tables = metadata.block_tables[rows_t, : -(-max_len // block_size)].long()
    assignment = workspace.assign(tables.tolist(), lengths)
    slots = torch.tensor(assignment.slots, device=device)
    lens = torch.tensor(lengths, device=device)
    pos = torch.arange(max_len, device=device)
    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    # [B, kv_heads, L] grids: cache row and workspace row of each (row, head, position).
    cache_slot = tables[:, pos // block_size] * block_size + pos % block_size
    src = cache_slot[:, None, :] * num_kv_heads + heads
    dst = (slots[:, None, None] * num_kv_heads + heads) * assignment.capacity + pos
    inside = (pos < lens[:, None])[:, None, :].expand_as(src)
    newest = (pos == lens[:, None] - 1)[:, None, :]
    carried = torch.tensor(assignment.carried, device=device)[:, None, None]
    fresh = inside & (newest | ~carried)
    padding = None
    # Unused slots get a context of 1 (never all -inf: no NaN even where nobody reads).
    slot_lens = torch.ones(assignment.num_slots, dtype=torch.long, device=device)
    slot_lens[slots] = lens
    if assignment.num_slots > len(rows) or min(lengths) < max_len:
        padding = (pos[None, :] >= slot_lens[:, None])[:, None, None, :]
    token_rows = [qsl[i] for i in rows]
    all_rows = token_rows == list(range(len(rows))) and metadata.slot_mapping.shape[0] == len(rows)
    in_order = assignment.slots == list(range(len(rows))) and assignment.num_slots == len(rows)
    return DecodePlan(
        torch.tensor(token_rows, device=device),
        all_rows,
        assignment,
        slots,
        in_order,
        (src[fresh], dst[fresh]),
        padding,
        max_len,
        (src, dst, inside),
        slot_lens,
    )


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def check_window(sliding_window: int | None) -> None:
    """A layer's window is None (full attention) or a positive number of keys."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """A layer's sinks are None or one float32 logit per query head."""
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
        raise ValueError(
            f"sinks must be float32 [{num_heads}] (one logit per head), "
            f"got {sinks.dtype} {tuple(sinks.shape)}"
        )


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of scores with one more logit (sinks, broadcast to
    scores[..., :1]) in the denominator and no probability returned for it."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: DecodePlan,
    workspace: DecodeWorkspace,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (all of the step's rows) -> [B, H, D] for the plan's decode rows,
    in float32. When plan.all_rows, T == B and the result is the whole output.
    kv_scales: an FP8 cache's [k_scale, v_scale]. sliding_window: each row sees its
    context's last sliding_window keys (the workspace still holds whole contexts).
    sinks: float32 [H], one extra softmax logit per head (no value)."""
    head_dim, num_kv_heads = kv_cache.shape[-1], kv_cache.shape[-2]
    kv_ws, carry = workspace.buffers(kv_cache, plan.assignment)
    src, dst = plan.kv_copy(
        carry, kv_cache.numel() // (2 * head_dim), kv_ws.numel() // (2 * head_dim)
    )
    # FP8: copied as bytes (torch has no float8 index_copy_ on the CPU).
    as_bits(kv_ws).view(-1, head_dim).index_copy_(
        0, dst, as_bits(kv_cache).view(-1, head_dim).index_select(0, src)
    )
    fp8 = is_fp8(kv_cache.dtype)
    num_slots, group = plan.assignment.num_slots, q.shape[1] // num_kv_heads
    rows = num_slots * num_kv_heads  # (slot, kv head) pairs: the batch of the bmm calls
    # [2, S*Hkv, L, D]: K and V views of the workspace (no copy in float32).
    kv = _as_float32(kv_ws.view(2, rows, -1, head_dim)[:, :, : plan.max_len])
    qs = q if plan.all_rows else q.index_select(0, plan.token_rows)
    if not plan.in_slot_order:
        qs = qs.new_zeros(num_slots, *q.shape[1:]).index_copy_(0, plan.slots, qs)
    # A view when q's rows are contiguous (batch 1); q is often a column slice of the
    # qkv rows, and then this is one small copy.
    qs = _as_float32(qs).reshape(rows, group, head_dim)
    # [S*Hkv, G, L]; an FP8 cache's stored keys times k_scale are its keys.
    scores = torch.bmm(qs, kv[0].transpose(1, 2)).mul_(scale * kv_scales[0] if fp8 else scale)
    mask = plan.padding if sliding_window is None else plan.window_mask(sliding_window)
    if mask is not None:
        scores.view(num_slots, num_kv_heads, group, -1).masked_fill_(mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # scores rows are (slot, kv head) pairs of G query heads each
        head_sinks = sinks.view(1, num_kv_heads, group, 1).expand(num_slots, -1, -1, -1)
        probs = softmax_with_sinks(scores, head_sinks.reshape(rows, group, 1))
    out = torch.bmm(probs, kv[1]).view(num_slots, num_kv_heads * group, head_dim)
    if fp8:
        out = out * kv_scales[1]
    return out if plan.in_slot_order else out.index_select(0, plan.slots)
