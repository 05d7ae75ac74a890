"""Triton split-K paged MLA attention in latent space (the absorbed path).

Owns `mla_decode`; its tiles come from an MLAKernelConfig (mla_config.py). Reference:
pagoda.attention.mla_backend.latent_attention_ref.

Row n of q ([N, H, kv_lora_rank + rope]: the latent query q_nope W_UK then the rotated
q_rope) attends to the first row_len[n] tokens of request row_req[n] in the latent
cache [num_blocks, block_size, kv_lora_rank + rope]: scores are the dot product over
the whole entry, the value is its first kv_lora_rank values; the output is
[N, H, kv_lora_rank]. Every head shares the one cached entry (MQA-like), so a program
takes BLOCK_H heads of one row and loads each key tile once for all of them. The latent
part and the rope part are loaded and multiplied separately, so neither width has to
be a power of two (each is padded to one, masked).

Grid (rows, head blocks, splits): a program folds one slice of the row's context into
an online softmax (base 2, float32), per_split = max(cdiv(row_len, num_splits),
min_split) rounded up to BLOCK_N, computed on the device. The launch depends on the
host only through num_splits, so a CUDA graph captured with a fixed count stays right
for any lengths. With one split the kernel writes the output directly; otherwise each
slice writes its normalised output and log-sum-exp to a float32 workspace and the
merge kernel (grid rows, heads) combines them. Rows of length 0 (padding) get zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.mla_config import MLAKernelConfig
from pagoda.kernels.attention.paged_attention import LOG2_E
from pagoda.kernels.attention.paged_decode import MIN_SPLIT_TOKENS


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt"])
def _mla_decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    row_req_ptr,
    row_len_ptr,
    qk_scale,
    num_splits,
    min_split,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ct,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_RANK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    ctx_len = tl.load(row_len_ptr + row)
    req = tl.load(row_req_ptr + row).to(tl.int64)
    per_split = tl.maximum(tl.cdiv(ctx_len, num_splits), min_split)
    per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    kv_start = split * per_split
    kv_end = tl.minimum(kv_start + per_split, ctx_len)

    head_ok = head < NUM_HEADS
    dc = tl.arange(0, BLOCK_C)
    dr = tl.arange(0, BLOCK_R)
    c_ok, r_ok = dc < KV_RANK, dr < ROPE
    q_base = q_ptr + row * stride_qn + head[:, None] * stride_qh
    q_c = tl.load(q_base + dc[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_base + KV_RANK + dr[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table = block_tables_ptr + req * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        n_ok = pos < kv_end  # never load past the context: unused slots may hold NaN
        page = tl.load(table + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        entry = cache_ptr + page * stride_cb + (pos % PAGE_SIZE) * stride_ct
        c = tl.load(entry[:, None] + dc[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        k_r = tl.load(
            entry[:, None] + KV_RANK + dr[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )
        s = _dot(q_c, tl.trans(c), IEEE_DOT) + _dot(q_r, tl.trans(k_r), IEEE_DOT)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        # Each tile holds at least one visible key (start_n < kv_end): m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, IEEE_DOT)
        m_i = m_new

    _store_slice(
        out_ptr, partial_out_ptr, partial_lse_ptr, acc, m_i, l_i, row, head, head_ok, dc,
        c_ok, split, num_splits, stride_on, stride_oh, NUM_HEADS, KV_RANK, DIRECT_OUT,
    )  # fmt: skip


@triton.jit
def _store_slice(
    out_ptr, partial_out_ptr, partial_lse_ptr, acc, m_i, l_i, row, head, head_ok, dc,
    c_ok, split, num_splits, stride_on, stride_oh,
    NUM_HEADS: tl.constexpr, KV_RANK: tl.constexpr, DIRECT_OUT: tl.constexpr,
):  # fmt: skip
    """The slice's normalised output: into out (one split), or with its log-sum-exp
    into the merge's workspace (the dense and the sparse latent kernels)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty slice or row (nothing selected): acc is 0
    out = acc / l_safe[:, None]
    out_mask = head_ok[:, None] & c_ok[None, :]
    if DIRECT_OUT:
        tl.store(
            out_ptr + row * stride_on + head[:, None] * stride_oh + dc[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        slot = (row * NUM_HEADS + head) * num_splits + split  # [BLOCK_H]
        tl.store(partial_lse_ptr + slot, lse, mask=head_ok)
        tl.store(partial_out_ptr + slot[:, None] * KV_RANK + dc[None, :], out, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_splits,
    stride_on,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    KV_RANK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    base = (row * NUM_HEADS + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    filled = lse > float("-inf")
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of length 0: every slice empty
    weight = tl.where(filled, tl.math.exp2(lse - top), 0.0)
    dc = tl.arange(0, BLOCK_C)
    # Empty slices were written too, but with zeros: masking them keeps 0 * anything out.
    partial = tl.load(
        partial_out_ptr + (base + splits)[:, None] * KV_RANK + dc[None, :],
        mask=filled[:, None] & (dc < KV_RANK)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + row * stride_on + head * stride_oh + dc,
        out.to(out_ptr.dtype.element_ty),
        mask=dc < KV_RANK,
    )


def mla_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    config: MLAKernelConfig | None = None,
) -> None:
    """Latent attention of every row of q into out [N, H, kv_lora_rank] (see the module
    docstring). num_splits is a runtime argument (no recompilation when it changes);
    config: the tiles (default: MLAKernelConfig.for_device(q.device))."""
    num_rows, num_heads, entry = q.shape
    if cache.dim() != 3 or cache.shape[2] != entry or not 0 < kv_lora_rank < entry:
        raise ValueError(
            f"cache must be [num_blocks, block_size, {entry}] with kv_lora_rank "
            f"< {entry}, got {tuple(cache.shape)}, kv_lora_rank {kv_lora_rank}"
        )
    if out.shape != (num_rows, num_heads, kv_lora_rank) or out.stride(2) != 1:
        raise ValueError(
            f"out must be [{num_rows}, {num_heads}, {kv_lora_rank}] with a "
            f"contiguous last dimension, got {tuple(out.shape)}"
        )
    if q.stride(2) != 1 or cache.stride(2) != 1 or q.dtype != cache.dtype:
        raise ValueError("q and cache need one dtype and a contiguous last dimension")
    if row_req.shape[0] < num_rows or row_len.shape[0] < num_rows:
        raise ValueError(f"row_req/row_len need {num_rows} entries")
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    if num_rows == 0:
        return
    tiles = (config or MLAKernelConfig.for_device(q.device)).decode_tiles(q.dtype)
    block_h = tiles.block_h
    rope = entry - kv_lora_rank
    if num_splits > 1:
        partial_out = torch.empty(
            num_rows, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:  # unused: the kernel writes out directly
        partial_out = partial_lse = out
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    _mla_decode_kernel[(num_rows, triton.cdiv(num_heads, block_h), num_splits)](
        out,
        partial_out,
        partial_lse,
        q,
        cache,
        block_tables,
        row_req,
        row_len,
        scale * LOG2_E,
        num_splits,
        max(1, min_split_tokens),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        cache.stride(0),
        cache.stride(1),
        NUM_HEADS=num_heads,
        BLOCK_H=block_h,
        PAGE_SIZE=cache.shape[1],
        KV_RANK=kv_lora_rank,
        BLOCK_C=block_c,
        ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        DIRECT_OUT=num_splits == 1,
        IEEE_DOT=q.dtype == torch.float32,
        **tiles.launch(),
    )
    if num_splits > 1:
        _mla_merge_kernel[(num_rows, num_heads)](
            out,
            partial_out,
            partial_lse,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            KV_RANK=kv_lora_rank,
            BLOCK_C=block_c,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
