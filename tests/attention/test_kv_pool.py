"""The KV pool (pagoda/attention/kv_pool.py): storage allocated from per-layer specs, the
writes dispatched by spec kind, two kinds of layer in one pool; layers declaring their
specs; and the backend's plan built once per step in an engine run."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagoda.attention import torch_ref
from pagoda.attention.kv_pool import KVCachePool, KVLayout, default_kv_layouts
from pagoda.attention.metadata import build_attention_metadata
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec, bytes_per_block
from pagoda.model.layers.attention import Attention, kv_cache_specs


@dataclass(frozen=True)
class LatentSpec(KVCacheSpec):
    """Test-only: one float32 vector of `width` per token (an MLA-like latent entry)."""

    width: int

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.width * 4


class LatentLayout(KVLayout):
    """Storage [num_blocks, block_size, width]; stores one tensor [num_tokens, width]."""

    def allocate(self, spec, num_blocks, device):
        return torch.zeros(num_blocks, spec.block_size, spec.width, device=device)

    def store(self, cache, metadata, *entries):
        (latent,) = entries
        n = metadata.num_actual_tokens
        cache.view(-1, cache.shape[-1]).index_copy_(0, metadata.slot_mapping[:n], latent[:n])


BLOCK, NUM_BLOCKS = 4, 12
FULL = FullAttentionSpec(BLOCK, 2, 8, "float32")
LATENT = LatentSpec(BLOCK, width=5)


def test_two_layer_kinds_in_one_pool_store_and_read_back_exactly():
    specs = [FULL, LATENT, FULL, LATENT]
    layouts = {**default_kv_layouts("cpu"), LatentSpec: LatentLayout()}
    pool = KVCachePool(KVCacheConfig(NUM_BLOCKS, specs), "cpu", layouts)
    # Sizing is the sum of the specs, and is what was allocated.
    assert bytes_per_block(specs) == 2 * (2 * 4 * 2 * 8 * 4) + 2 * (4 * 5 * 4) == 1184
    allocated = sum(c.numel() * c.element_size() for c in pool.caches)
    assert pool.nbytes == allocated == NUM_BLOCKS * 1184
    assert [tuple(c.shape) for c in pool.caches] == [(2, 12, 4, 2, 8), (12, 4, 5)] * 2
    assert all(not c.any() for c in pool.caches)  # zero-initialised
    # Two requests: 3 new tokens after 2 cached ones in blocks [5, 2]; one decode at
    # position 6 in blocks [7, 0]; two padding rows.
    md = build_attention_metadata([3, 1], [5, 7], [[5, 2], [7, 0]], BLOCK, "cpu", pad_to=6)
    slots = [5 * 4 + 2, 5 * 4 + 3, 2 * 4 + 0, 0 * 4 + 2]
    assert md.slot_mapping.tolist() == slots + [-1, -1]
    gen = torch.Generator().manual_seed(0)
    written = {}
    for layer, spec in enumerate(specs):
        if isinstance(spec, FullAttentionSpec):
            entries = (torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen))
        else:
            entries = (torch.randn(6, 5, generator=gen),)
        pool.store(layer, md, *entries)
        written[layer] = entries
    for layer, spec in enumerate(specs):
        cache = pool.cache(layer)
        if isinstance(spec, FullAttentionSpec):
            flat = cache.view(2, -1, 2, 8)
            k, v = written[layer]
            assert torch.equal(flat[0, slots], k[:4]) and torch.equal(flat[1, slots], v[:4])
            untouched = torch.ones(flat.shape[1], dtype=torch.bool)
            untouched[slots] = False
            assert not flat[:, untouched].any()  # padding rows wrote nothing
        else:
            flat = cache.view(-1, 5)
            assert torch.equal(flat[slots], written[layer][0][:4])
            assert int((flat != 0).any(-1).sum()) == 4


def test_graph_mode_metadata_skips_padding_requests_on_the_torch_path():
    """Without host copies (CUDA-graph buffers) padding requests may sit among the first
    num_actual_tokens rows: their slot is -1 and nothing is written for them."""
    pool = KVCachePool(KVCacheConfig(NUM_BLOCKS, [FULL]), "cpu")
    md = build_attention_metadata([1, 1], [3, 2], [[4], [6]], BLOCK, "cpu")
    md.slot_mapping[1] = -1
    md.query_start_loc_cpu = md.seq_lens_cpu = None
    k = torch.arange(2 * 2 * 8, dtype=torch.float32).view(2, 2, 8) + 1
    pool.store(0, md, k, -k)
    flat = pool.cache(0).view(2, -1, 2, 8)
    assert torch.equal(flat[0, 4 * 4 + 2], k[0]) and torch.equal(flat[1, 4 * 4 + 2], -k[0])
    assert int((flat != 0).any(-1).any(-1).sum()) == 2  # one slot, K and V


def test_pool_rejects_unknown_kinds_and_layouts_that_disagree_with_their_spec():
    with pytest.raises(
        ValueError,
        match=r"layer 1: no KV storage layout for LatentSpec "
        r"\(known: FullAttentionSpec, MLAAttentionSpec, IndexerKeySpec\)",
    ):
        KVCachePool(KVCacheConfig(NUM_BLOCKS, [FULL, LATENT]), "cpu")

    class TooSmall(LatentLayout):
        def allocate(self, spec, num_blocks, device):
            return torch.zeros(num_blocks, spec.block_size, spec.width - 1)

    with pytest.raises(RuntimeError, match="allocated 768 bytes, its spec sizes 960"):
        KVCachePool(KVCacheConfig(NUM_BLOCKS, [LATENT]), "cpu", {LatentSpec: TooSmall()})


def test_layers_declare_their_specs_in_layer_order():
    layers = torch.nn.ModuleList([Attention(i, 8, 2, 64, 0.125) for i in (1, 0, 2)])
    assert layers[0].get_kv_cache_spec(16, torch.bfloat16) == FullAttentionSpec(
        16, 2, 64, "bfloat16"
    )
    assert (
        kv_cache_specs(layers, 16, torch.float16) == [FullAttentionSpec(16, 2, 64, "float16")] * 3
    )
    duplicated = torch.nn.ModuleList([Attention(0, 8, 2, 64, 0.125), Attention(0, 8, 2, 64, 0.125)])
    with pytest.raises(ValueError, match=r"indices must be 0..1, each once; got \[0, 0\]"):
        kv_cache_specs(duplicated, 16, torch.float16)


def test_engine_builds_the_attention_plan_once_per_step(monkeypatch):
    """An engine run: one build_metadata (and one torch_ref step plan) per forward step,
    none per layer; the runner's pool is allocated from the model's specs."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        "tiny-llama", load_format="dummy", device="cpu", max_model_len=128, kv_cache_memory=4 << 20
    )
    runner = llm.llm_engine.executor.runner
    arch = runner.arch
    specs = kv_cache_specs(runner.model, runner.block_size, runner.dtype)
    assert runner.kv_pool.config == KVCacheConfig(runner.num_blocks, specs)
    assert (
        specs
        == [
            FullAttentionSpec(runner.block_size, arch.num_key_value_heads, arch.head_dim, "float32")
        ]
        * arch.num_hidden_layers
    )
    assert runner.num_blocks == (4 << 20) // bytes_per_block(specs)
    counts = {"steps": 0, "build_metadata": 0, "step_plans": 0}
    launch, build = runner.execute_model, runner.backend.build_metadata
    plan_step = torch_ref.build_step_plan

    def counted(key, fn, when=lambda *a: True):
        def wrapper(*args):
            counts[key] += bool(when(*args))
            return fn(*args)

        return wrapper

    monkeypatch.setattr(
        runner,
        "execute_model",
        counted("steps", launch, lambda out: out.total_num_scheduled_tokens > 0),
    )
    monkeypatch.setattr(runner.backend, "build_metadata", counted("build_metadata", build))
    monkeypatch.setattr(torch_ref, "build_step_plan", counted("step_plans", plan_step))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert counts["steps"] >= 6
    assert counts["build_metadata"] == counts["step_plans"] == counts["steps"]
