"""The model's output_rows: the last layer's output projection and MLP run on the
sampled rows only, and nothing else changes (pagoda/model/llama.py)."""

from __future__ import annotations

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.model.loader import load_model


def _forward(model, arch, lens, ids, pos, tables, output_rows):
    pool = KVCachePool(KVCacheConfig(16, kv_cache_specs(model, 16, torch.float32)), "cpu")
    backend = TorchRefBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )
    md = build_attention_metadata(lens, lens, tables, 16, "cpu")
    with torch.inference_mode(), forward_context(backend, backend.build_metadata(md), pool):
        hidden = model(ids, pos, output_rows)
    return hidden, pool.caches


def test_output_rows_equal_the_full_forward_at_those_rows():
    model, arch = load_model("tiny-llama", "dummy", torch.float32, "cpu")
    lens = [7, 12, 3]  # three prefill chunks; the last row of each is "sampled"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    tables = [[0], [1], [2]]
    rows = torch.tensor([6, 18, 21, 21])  # repeats allowed: the runner pads with the last
    full, full_caches = _forward(model, arch, lens, ids, pos, tables, None)
    part, part_caches = _forward(model, arch, lens, ids, pos, tables, rows)
    assert part.shape == (4, arch.hidden_size)
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
    # Every layer, the last included, still stored K/V for every row.
    for a, b in zip(full_caches, part_caches):
        assert torch.equal(a, b)
