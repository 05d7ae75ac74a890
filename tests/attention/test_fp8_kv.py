"""FP8 KV cache (kv_cache_dtype fp8) on the CPU: config and clear errors, the torch
reference (store -> read round trip, attention against dequantized and unquantized
caches, the batched decode path against the per-layer reference), checkpoint K/V
scales, the engine end to end, and the offload tiers copying FP8 blocks."""

import pytest
import torch
from helpers.tiny_models import save_tiny_hf_model
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.kv_quant import (
    FP8_KV_DTYPE,
    dequantize_kv,
    quantize_kv,
    resolve_kv_cache_dtype,
)
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.config import CacheConfig, EngineArgs
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig

FP8 = "float8_e4m3fn"


# ---- config and errors ---------------------------------------------------------------


def test_config_accepts_vllm_names_and_refuses_the_rest_with_reasons():
    assert CacheConfig().cache_dtype == "auto"
    for name in ("fp8", "fp8_e4m3"):
        config = EngineArgs(kv_cache_dtype=name, device="cpu").create_engine_config()
        assert config.cache.cache_dtype == name
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported.*use kv_cache_dtype fp8"):
        CacheConfig(cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        CacheConfig(cache_dtype="int8")


def test_cli_flag_reaches_engine_args():
    import argparse

    from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"
    assert engine_args_from_namespace(parser.parse_args([])).kv_cache_dtype == "auto"


def test_resolve_kv_cache_dtype(monkeypatch):
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32, "cpu") == FP8_KV_DTYPE
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, "cpu") == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="not supported for MLA models yet"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "cpu", is_mla=True)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu", is_mla=True) == torch.bfloat16
    # An A100 (8.0) has no FP8; an H100 / H200 (9.0) has.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*this GPU is sm_80"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda") == FP8_KV_DTYPE


def test_pool_refuses_an_fp8_store_without_scales():
    pool = KVCachePool(KVCacheConfig(2, [FullAttentionSpec(4, 1, 8, FP8)]), "cpu")
    assert pool.cache(0).dtype == FP8_KV_DTYPE and pool.nbytes == 2 * 2 * 4 * 8
    md = build_attention_metadata([1], [1], [[0]], 4, "cpu")
    k = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="needs the layer's kv_scales"):
        pool.store(0, md, k, k)


# ---- the torch reference ---------------------------------------------------------------


def test_quantize_round_trip():
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e5, 0.0001, 2.4])
    scale = torch.tensor(0.5)
    stored = quantize_kv(x, scale)
    assert stored.dtype == FP8_KV_DTYPE
    # x / 0.5 = 0, 2, -6.6 -> -6.5 (e4m3 step 0.5 in [4, 8)), 2000 -> 448, -2e5 -> -448,
    # 2e-4 -> 0 (below half the smallest subnormal, 2^-10), 4.8 -> 5.0 (step 0.5).
    assert dequantize_kv(stored, scale).tolist() == [0.0, 1.0, -3.25, 224.0, -224.0, 0.0, 2.5]
    assert dequantize_kv(torch.ones(2, dtype=torch.float16), None).dtype == torch.float32


class RefCase:
    """A batch over three pools holding the same context: FP8 (stored with scales), its
    dequantized float32 copy, and the unquantized float32 original; k/v of this step
    stored into each by its pool."""

    def __init__(
        self, shapes, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=0, spare_tokens=0
    ):
        gen = torch.Generator().manual_seed(seed)
        tables, start = [], 0
        for ctx, qlen in shapes:
            n = -(-(ctx + qlen + spare_tokens) // block_size)  # room to grow (decode steps)
            tables.append(list(range(start, start + n)))
            start += n
        self.md = build_attention_metadata(
            [q for _, q in shapes], [c + q for c, q in shapes], tables, block_size, "cpu"
        )
        rows = sum(q for _, q in shapes)
        self.q = torch.randn(rows, num_heads, head_dim, generator=gen)
        self.k = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
        self.v = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
        self.scales = torch.tensor([0.02, 0.01])
        context = torch.randn(2, start, block_size, num_kv_heads, head_dim, generator=gen)
        fp8_spec = FullAttentionSpec(block_size, num_kv_heads, head_dim, FP8)
        f32_spec = FullAttentionSpec(block_size, num_kv_heads, head_dim, "float32")
        self.fp8 = KVCachePool(KVCacheConfig(start, [fp8_spec]), "cpu")
        self.fp8.cache(0).copy_(
            torch.stack([quantize_kv(context[i], self.scales[i]) for i in (0, 1)])
        )
        self.fp8.store(0, self.md, self.k, self.v, scales=self.scales)
        self.dequantized = KVCachePool(KVCacheConfig(start, [f32_spec]), "cpu")
        self.dequantized.cache(0).copy_(
            self.fp8.cache(0).float() * self.scales[:, None, None, None, None]
        )
        self.exact = KVCachePool(KVCacheConfig(start, [f32_spec]), "cpu")
        self.exact.cache(0).copy_(context)
        self.exact.store(0, self.md, self.k, self.v)


MIXED = [(0, 9), (13, 5), (6, 1), (21, 1), (0, 1)]


def attend(backend, pool, case, scales=None):
    kw = {} if scales is None else {"kv_scales": scales}
    return backend.forward(case.q, pool.cache(0), backend.build_metadata(case.md), **kw)


@pytest.mark.parametrize("batched_decode", [True, False])
def test_torch_ref_on_fp8_matches_the_dequantized_cache_and_approximates_the_exact_one(
    batched_decode,
):
    case = RefCase(MIXED)
    backend = TorchRefBackend(4, 2, 16, 0.25, batched_decode=batched_decode)
    out = attend(backend, case.fp8, case, case.scales)
    on_dequantized = attend(
        TorchRefBackend(4, 2, 16, 0.25, batched_decode=batched_decode), case.dequantized, case
    )
    torch.testing.assert_close(out, on_dequantized, atol=1e-6, rtol=1e-5)
    exact = attend(TorchRefBackend(4, 2, 16, 0.25), case.exact, case)
    # e4m3 keeps 3 mantissa bits: entries within 2^-4 relative; attention outputs of
    # unit-scale inputs stay within a few percent.
    err = (out - exact).norm() / exact.norm()
    assert 1e-3 < err < 0.05, err
    # Scales matter: the same bytes read with other scales give another answer.
    other = attend(
        TorchRefBackend(4, 2, 16, 0.25, batched_decode=batched_decode),
        case.fp8,
        case,
        case.scales * torch.tensor([2.0, 1.0]),
    )
    assert not torch.allclose(other, out, atol=1e-3)


def test_batched_decode_on_fp8_matches_the_reference_over_steps():
    """The workspace carries FP8 bytes from step to step; each step equals the plain
    per-layer gather."""
    fast, ref = (TorchRefBackend(4, 2, 16, 0.25, batched_decode=b) for b in (True, False))
    case = RefCase([(10, 1), (3, 1), (30, 1)], seed=1, spare_tokens=2)
    lens = case.md.seq_lens.tolist()
    tables = [case.md.block_tables[i, : -(-(n + 2) // 4)].tolist() for i, n in enumerate(lens)]
    for step in range(3):
        md = build_attention_metadata([1, 1, 1], [n + step for n in lens], tables, 4, "cpu")
        k = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(step))
        case.fp8.store(0, md, k, -k, scales=case.scales)
        outs = [
            b.forward(case.q, case.fp8.cache(0), b.build_metadata(md), kv_scales=case.scales)
            for b in (fast, ref)
        ]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)


# ---- checkpoints and the engine ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-fp8kv")
    save_tiny_hf_model(path, "llama", num_hidden_layers=2)
    return path


def with_kv_scales(src, dst, scales: dict) -> str:
    """A copy of the checkpoint src with the given extra tensors (name -> value)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    tensors.update(
        {name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()}
    )
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def llm(path, **kw):
    return LLM(
        str(path),
        skip_tokenizer_init=True,
        kv_cache_memory=1 << 20,
        max_model_len=256,
        device="cpu",
        **kw,
    )


def runner_of(engine_llm):
    return engine_llm.llm_engine.executor.runner


PROMPTS = [[5, 17, 99, 3, 250, 41, 8], list(range(30, 90, 3)), [200] * 4 + [7, 8, 9]]


def generate(engine_llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = engine_llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return tokens, torch.tensor([x for row in logprobs for x in row])


def fake_quantized_store(monkeypatch):
    """The reference engine: a float32 cache whose stored K/V are rounded through e4m3
    (scale 1.0, a checkpoint without scales) by the torch store."""
    import pagoda.attention.kv_pool as kv_pool

    plain_store = kv_pool.store_kv_torch
    one = torch.tensor(1.0)

    def store(k, v, kv_cache, metadata, scales=None):
        k, v = (dequantize_kv(quantize_kv(x, one), one) for x in (k, v))
        plain_store(k, v, kv_cache, metadata, scales)

    monkeypatch.setattr(kv_pool, "store_kv_torch", store)


def test_engine_fp8_kv_holds_more_tokens_and_matches_fake_quantized_kv(tiny_llama, monkeypatch):
    auto, fp8 = llm(tiny_llama), llm(tiny_llama, kv_cache_dtype="fp8")
    # float32 on the CPU: 4 bytes an entry against 1, so 4x the blocks in 1 MiB.
    # 2 layers x 2 (K, V) x 16 tokens x 2 KV heads x 16 dims: 2048 float32 entries a
    # block = 8 KiB -> 128 blocks; 2 KiB in FP8 -> 512.
    assert (auto.llm_engine.num_blocks, fp8.llm_engine.num_blocks) == (128, 512)
    caches = runner_of(fp8).kv_pool.caches
    assert all(c.dtype == FP8_KV_DTYPE for c in caches)
    assert [
        layer.self_attn.attn.kv_scales.tolist() for layer in runner_of(fp8).model.model.layers
    ] == [[1.0, 1.0]] * 2
    tokens_auto, lp_auto = generate(auto)
    # Steps of at most 16 tokens: the 20-token prompt is prefilled in two chunks, the
    # second attending to the first's FP8 entries; then decode steps read them all.
    tokens_fp8, lp_fp8 = generate(llm(tiny_llama, kv_cache_dtype="fp8", max_num_batched_tokens=16))
    # Against an engine whose float32 cache holds the same e4m3-rounded values: the
    # same greedy tokens, logprobs equal up to float32 rounding.
    fake_quantized_store(monkeypatch)
    tokens_ref, lp_ref = generate(llm(tiny_llama, max_num_batched_tokens=16))
    assert tokens_fp8 == tokens_ref
    torch.testing.assert_close(lp_fp8, lp_ref, atol=1e-4, rtol=1e-4)
    # Against unquantized float32 KV: this sharp random model (weights of std 0.2) moves
    # its prompt logprobs by ~0.08 nats on average under e4m3 rounding, and its greedy
    # tokens part ways with auto's on some prompts (figures in the benchmark's JSON).
    diff = (lp_fp8 - lp_auto).abs()
    assert 1e-3 < diff.mean() < 0.15 and diff.max() < 0.5, (diff.mean(), diff.max())
    assert tokens_fp8[0][:4] == tokens_auto[0][:4]


def test_checkpoint_kv_scales_load_and_scale_the_cache(tiny_llama, tmp_path):
    scales = {
        "model.layers.0.self_attn.k_scale": 0.05,
        "model.layers.0.self_attn.v_scale": 0.02,
        "model.layers.1.self_attn.k_scale": 0.04,
        "model.layers.1.self_attn.v_scale": 0.03,
    }
    scaled = with_kv_scales(tiny_llama, tmp_path / "scaled", scales)
    # An unscaled cache loads the scales too (nothing unknown) and does not use them.
    plain, auto_scaled = llm(tiny_llama), llm(scaled)
    layers = [layer.self_attn.attn for layer in runner_of(auto_scaled).model.model.layers]
    assert [a.kv_scales.tolist() for a in layers] == [
        pytest.approx([0.05, 0.02]),
        pytest.approx([0.04, 0.03]),
    ]
    assert generate(auto_scaled)[0] == generate(plain)[0]
    assert torch.equal(generate(auto_scaled)[1], generate(plain)[1])
    # An FP8 cache stores entries divided by them. Layer 0's K/V of a prompt depend on
    # the embeddings alone (no attention before them), so after a prefill its FP8 cache
    # is exactly the float32 cache quantized with the checkpoint's scales.
    fresh, fp8 = llm(scaled), llm(scaled, kv_cache_dtype="fp8")  # same blocks for the same prompts
    prefill = SamplingParams(max_tokens=1, temperature=0)
    for engine in (fresh, fp8):
        engine.generate(PROMPTS, prefill, use_tqdm=False)
    exact = runner_of(fresh).kv_pool.cache(0)
    stored = runner_of(fp8).kv_pool.cache(0)[:, : exact.shape[1]]
    for i, scale in enumerate((0.05, 0.02)):
        expect = quantize_kv(exact[i], torch.tensor(scale))
        assert torch.equal(stored[i].view(torch.uint8), expect.view(torch.uint8))
    assert stored.float().abs().max() > 50  # |K| ~5 / 0.05: the scales were used
    diff = (generate(fp8)[1] - generate(plain)[1]).abs()
    assert 1e-3 < diff.mean() < 0.15 and diff.max() < 0.5, (diff.mean(), diff.max())


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("model.layers.0.self_attn.k_scale", 0.0, "positive finite"),
        ("model.layers.0.self_attn.v_scale", float("inf"), "positive finite"),
        ("model.layers.0.self_attn.k_scale", [1.0, 2.0], "must be a scalar"),
        ("model.layers.0.mlp.k_scale", 1.0, "holds no attention layer"),
    ],
)
def test_bad_checkpoint_scales_are_refused_by_name(tiny_llama, tmp_path, name, value, match):
    bad = with_kv_scales(tiny_llama, tmp_path / "bad", {name: value})
    with pytest.raises(ValueError, match=match):
        llm(bad)


# ---- offload tiers ------------------------------------------------------------------------


def test_offload_tiers_copy_fp8_blocks_byte_for_byte(tmp_path):
    from pagoda.kv_offload.copy_engine import KVCopyEngine
    from pagoda.kv_offload.cpu_tier import BlockLayout, CpuTier
    from pagoda.kv_offload.disk_tier import DiskTier
    from pagoda.kv_offload.planning.tiers import KVTransferPlan, LoadJob, TierRead, TierWrite
    from pagoda.kv_offload.tier_api import KVBlockFormat

    specs = [FullAttentionSpec(4, 2, 8, FP8)] * 2
    pool = KVCachePool(KVCacheConfig(8, specs), "cpu")
    gen = torch.Generator().manual_seed(0)
    for cache in pool.caches:
        cache.copy_(quantize_kv(torch.randn(cache.shape, generator=gen), torch.tensor(0.01)))
    layout = BlockLayout(specs)
    assert layout.description == f"2x[full:2x4x2x8:{FP8}]" and layout.block_bytes == 2 * 128
    disk = DiskTier(
        KVBlockFormat("tiny", FP8, 4, layout.description, layout.block_bytes),
        str(tmp_path),
        1 << 20,
    )
    engine = KVCopyEngine(
        pool, layout, CpuTier(4, layout.block_bytes, pin_memory=False), [disk], torch.device("cpu")
    )
    original = [c.view(torch.uint8).clone() for c in pool.caches]
    key = (3).to_bytes(32, "big")
    try:
        engine.execute(
            KVTransferPlan(
                store_id=1,
                store_gpu_block_ids=[3],
                store_cpu_slots=[2],
                store_hashes=[key],
                writes=[TierWrite(5, 1, key, 2)],
            )
        )
        engine.writer.close()  # drain the disk write
        report = engine.poll()
        assert report.stores_done == [1] and report.writes_done == {5: True}
        engine.cpu.data.zero_()
        for cache in pool.caches:
            cache.view(torch.uint8).zero_()
        engine.reader.close()
        engine.reader = type(engine.writer)("test-read")
        engine.execute(KVTransferPlan(loads=[LoadJob(2, [0], [6], [TierRead(1, key, 0)])]))
        engine.reader.close()
        assert engine.poll().loads_done == {2: 1}
        for cache, before in zip(pool.caches, original):
            assert torch.equal(cache.view(torch.uint8)[:, 6], before[:, 3])
            assert not cache.view(torch.uint8)[:, [0, 1, 2, 3, 4, 5, 7]].any()
    finally:
        engine.close()
