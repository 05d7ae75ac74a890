"""torch_ref: the golden attention backend, plain torch, CPU and GPU.

Every kernel is tested against this. Arithmetic is in float32 whatever the input
dtype. Decode rows (query length 1) are batched into one masked matmul; prefill chunks
go through SDPA one request at a time with a causal mask offset by their context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionMetadata


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Writes k/v rows into the paged cache; rows with slot -1 (padding) are skipped."""
    num_tokens = k.shape[0]
    slots = slot_mapping[:num_tokens]
    valid = slots >= 0
    _, num_blocks, block_size, n_kv, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, n_kv, head_dim)
    if bool(valid.all()):
        flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))
    else:
        idx = slots[valid]
        flat[0].index_copy_(0, idx, k[valid].to(kv_cache.dtype))
        flat[1].index_copy_(0, idx, v[valid].to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """K and V of one request's first seq_len tokens: each [seq_len, n_kv, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        store_kv_ref(k, v, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(q)
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl, seq_lens = metadata.query_start_loc.cpu(), metadata.seq_lens.cpu()
        qsl_list, seq_list = qsl.tolist(), seq_lens.tolist()
        decode_rows, prefill_rows = [], []
        for i in range(metadata.num_reqs):
            (decode_rows if qsl_list[i + 1] - qsl_list[i] == 1 else prefill_rows).append(i)
        if decode_rows:
            self._decode(q, kv_cache, metadata, decode_rows, qsl_list, seq_list, out)
        for i in prefill_rows:
            start, end = qsl_list[i], qsl_list[i + 1]
            out[start:end] = self._prefill_one(q[start:end], kv_cache,
                                               metadata.block_tables[i], seq_list[i])
        return out

    def _prefill_one(self, q, kv_cache, block_table, seq_len: int) -> torch.Tensor:
        qlen = q.shape[0]
        k, v = gather_context(kv_cache, block_table, seq_len)
        group = self.num_heads // self.num_kv_heads
        qh = q.float().transpose(0, 1)  # [H, qlen, D]
        kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq, D]
        vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        # Query row j sits at position seq_len - qlen + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1).to(q.dtype)

    def _decode(self, q, kv_cache, metadata, rows, qsl_list, seq_list, out) -> None:
        """All single-token rows at once: gather each context padded to the longest."""
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
        scores = torch.einsum("bhgd,blhd->bhgl", qb, k.float()) * self.scale
        valid = torch.arange(nblk * block_size, device=device)[None, :] < lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
        out[tok_idx] = o.reshape(B, self.num_heads, self.head_dim).to(q.dtype)
