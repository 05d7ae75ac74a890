"""Mixed decode steps for the torch_ref attention tests: metadata and per-layer q/k/v for
requests given as (cached context, query length), block tables from a permutation, and
one forward of several Attention layers sharing a forward context."""

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.metadata import build_attention_metadata
from pagoda.model.layers.attention import Attention

BLOCK, HEAD_DIM, NUM_BLOCKS, LAYERS = 4, 16, 64, 3


def make_step(gen, shapes, n_heads, n_kv, tables, pad: int):
    """Metadata and per-layer q/k/v for requests given as (context already cached, query
    length); tables are the requests' block tables."""
    qlens = [q for _, q in shapes]
    seqs = [c + q for c, q in shapes]
    md = build_attention_metadata(qlens, seqs, tables, BLOCK, "cpu", pad_to=sum(qlens) + pad)
    rows = sum(qlens) + pad
    return md, [
        (
            torch.randn(rows, n_heads, HEAD_DIM, generator=gen),
            torch.randn(rows, n_kv, HEAD_DIM, generator=gen),
            torch.randn(rows, n_kv, HEAD_DIM, generator=gen),
        )
        for _ in range(LAYERS)
    ]


def run_layers(backend, md, qkv, pool):
    """One model forward: the step's plan built once, then every layer's Attention
    (store through the pool, attend) inside one forward context. Returns the outputs
    [T, H, D] per layer and the plan."""
    plan = backend.build_metadata(md)
    outs = []
    with forward_context(backend, plan, pool):
        for layer, (q, k, v) in enumerate(qkv):
            attn = Attention(layer, q.shape[1], k.shape[1], HEAD_DIM, backend.scale)
            out = attn(q.flatten(1), k.flatten(1), v.flatten(1))
            outs.append(out.view(q.shape))
    return outs, plan


def tables_for(shapes, perm):
    tables = []
    for ctx, qlen in shapes:
        n = -(-(ctx + qlen) // BLOCK)
        tables.append(perm[:n])
        perm = perm[n:]
    return tables
