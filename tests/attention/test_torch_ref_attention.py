"""The reference backend against a dense causal attention computed from scratch."""

import math

import pytest
import torch
from helpers.kv_pool_helpers import pool_holding, store_and_attend

from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend


def dense_attention(q, k, v, q_positions, scale):
    """q [qlen, H, D] at given positions; k, v [seq, Hkv, D] (whole context)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    mask = torch.arange(k.shape[0])[None, :] <= torch.tensor(q_positions)[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (8, 2)])
def test_mixed_batch_matches_dense(n_heads, n_kv):
    torch.manual_seed(0)
    block_size, head_dim, num_blocks = 4, 16, 40
    scale = 1 / math.sqrt(head_dim)
    backend = TorchRefBackend(n_heads, n_kv, head_dim, scale)
    # (context already cached, query length): a fresh prefill, a chunk after a cached
    # prefix, and three decodes.
    shapes = [(0, 7), (5, 6), (9, 1), (1, 1), (14, 1)]
    cache = torch.randn(2, num_blocks, block_size, n_kv, head_dim)
    perm = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v = [], [], []
    for ctx, qlen in shapes:
        n = (ctx + qlen + block_size - 1) // block_size
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        full_k.append(torch.randn(ctx + qlen, n_kv, head_dim))
        full_v.append(torch.randn(ctx + qlen, n_kv, head_dim))
        for pos in range(ctx):  # the cached context, as an earlier step would have left it
            cache[0, table[pos // block_size], pos % block_size] = full_k[-1][pos]
            cache[1, table[pos // block_size], pos % block_size] = full_v[-1][pos]
    qlens = [q for _, q in shapes]
    seqs = [c + q for c, q in shapes]
    md = build_attention_metadata(qlens, seqs, tables, block_size, "cpu", pad_to=sum(qlens) + 2)
    q = torch.randn(sum(qlens) + 2, n_heads, head_dim)
    k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, shapes)] + [torch.randn(2, n_kv, head_dim)])
    v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, shapes)] + [torch.randn(2, n_kv, head_dim)])
    before = cache.clone()
    pool = pool_holding([cache])
    out = store_and_attend(backend, pool, 0, q, k, v, md)
    start = 0
    for (ctx, qlen), fk, fv in zip(shapes, full_k, full_v):
        ref = dense_attention(q[start : start + qlen], fk, fv, list(range(ctx, ctx + qlen)), scale)
        torch.testing.assert_close(out[start : start + qlen].double(), ref, atol=1e-5, rtol=1e-5)
        start += qlen
    # Every written slot holds the new k/v; padding rows wrote nothing else.
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for slot in md.slot_mapping.tolist():
        if slot >= 0:
            written[slot // block_size, slot % block_size] = True
    assert torch.equal(pool.cache(0)[:, ~written], before[:, ~written])
    assert int(written.sum()) == sum(qlens)
