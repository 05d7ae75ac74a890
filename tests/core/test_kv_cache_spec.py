"""KV cache specs and the pool's sizing (pagoda/core/kv_cache_spec.py): exact bytes."""

from dataclasses import dataclass

import pytest

from pagoda.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    bytes_per_block,
    num_blocks_for_budget,
)


@dataclass(frozen=True)
class OneVectorSpec(KVCacheSpec):
    """A latent-style layer: one vector of `width` float16 values per token."""

    width: int

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.width * 2


def test_full_attention_page_size():
    # Llama-3.1-8B: 8 KV heads of 128, bf16, blocks of 16 tokens: 2 * 16 * 8 * 128 * 2.
    assert FullAttentionSpec(16, 8, 128, "bfloat16").page_size_bytes == 65536
    assert FullAttentionSpec(4, 2, 16, "float32").page_size_bytes == 1024
    assert FullAttentionSpec(1, 1, 1, "float16").page_size_bytes == 4


def test_specs_are_frozen_values():
    spec = FullAttentionSpec(16, 8, 128, "bfloat16")
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert len({spec, FullAttentionSpec(16, 8, 128, "bfloat16")}) == 1
    with pytest.raises(AttributeError):
        spec.block_size = 32
    with pytest.raises(TypeError):
        KVCacheSpec(16)  # abstract: a layer kind must say what a block costs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0, num_kv_heads=8, head_dim=128, dtype="bfloat16"), "block_size"),
        (dict(block_size=16, num_kv_heads=0, head_dim=128, dtype="bfloat16"), "num_kv_heads"),
        (dict(block_size=16, num_kv_heads=8, head_dim=1.5, dtype="bfloat16"), "head_dim"),
        (dict(block_size=16, num_kv_heads=8, head_dim=128, dtype="float8"), "dtype"),
    ],
)
def test_full_attention_spec_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FullAttentionSpec(**kwargs)


def test_bytes_per_block_sums_the_layers_of_every_kind():
    full = FullAttentionSpec(16, 8, 128, "bfloat16")
    latent = OneVectorSpec(16, width=576)
    assert latent.page_size_bytes == 18432
    assert bytes_per_block([full] * 32) == 32 * 65536
    assert bytes_per_block([full, latent, full]) == 65536 + 18432 + 65536


def test_layers_must_share_one_block_size():
    with pytest.raises(ValueError, match=r"one block size, got \[16, 32\]"):
        bytes_per_block(
            [FullAttentionSpec(16, 8, 128, "bfloat16"), FullAttentionSpec(32, 8, 128, "bfloat16")]
        )
    with pytest.raises(ValueError, match="at least one layer"):
        bytes_per_block([])


def test_num_blocks_for_budget():
    specs = [FullAttentionSpec(16, 2, 64, "float32")] * 3  # 3 * 16384 = 49152 bytes a block
    assert num_blocks_for_budget(49152 * 100 + 49151, specs, max_model_len=1600) == 100
    assert num_blocks_for_budget(49152 * 100, specs, max_model_len=1) == 100
    with pytest.raises(
        ValueError,
        match=r"holds 99 blocks of 16 tokens, fewer than one "
        r"sequence of max_model_len=1585 needs \(100\)",
    ):
        num_blocks_for_budget(49152 * 99, specs, max_model_len=1585)


def test_kv_cache_config():
    specs = [FullAttentionSpec(16, 8, 128, "bfloat16"), OneVectorSpec(16, width=576)]
    config = KVCacheConfig(num_blocks=10, layer_specs=specs)
    assert config.layer_specs == tuple(specs)
    assert config.block_size == 16
    assert config.total_bytes == 10 * (65536 + 18432)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=0, layer_specs=specs)


def test_mla_spec_sizes_one_latent_entry_per_token():
    from pagoda.core.kv_cache_spec import MLAAttentionSpec

    # DeepSeek-V2-Lite: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token
    # and layer, no separate K and V; bf16 blocks of 16 tokens: 16 * 576 * 2 bytes.
    lite = MLAAttentionSpec(16, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")
    assert lite.entry_size == 576
    assert lite.page_size_bytes == 18432
    # The same 27 layers as a GQA cache of 16 KV heads x 128 (as its 16 heads would
    # need): 2 * 16 * 128 = 4096 values per token per layer, 7.11x the latent's.
    gqa = FullAttentionSpec(16, 16, 128, "bfloat16")
    assert bytes_per_block([gqa] * 27) * 576 == bytes_per_block([lite] * 27) * 4096
    assert num_blocks_for_budget(27 * 18432 * 100, [lite] * 27, max_model_len=1600) == 100
    assert MLAAttentionSpec(4, 32, 16, "float32").page_size_bytes == 4 * 48 * 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(block_size=16, kv_lora_rank=0, qk_rope_head_dim=64, dtype="bfloat16"),
            "kv_lora_rank",
        ),
        (
            dict(block_size=16, kv_lora_rank=512, qk_rope_head_dim=None, dtype="bfloat16"),
            "qk_rope_head_dim",
        ),
        (dict(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype="int8"), "dtype"),
    ],
)
def test_mla_spec_rejects_bad_fields(kwargs, match):
    from pagoda.core.kv_cache_spec import MLAAttentionSpec

    with pytest.raises(ValueError, match=match):
        MLAAttentionSpec(**kwargs)


def test_fp8_entries_take_one_byte_and_double_the_blocks_of_a_budget():
    # Llama-3.1-8B shape: 32 layers of 8 KV heads x 128, blocks of 16 tokens.
    bf16 = FullAttentionSpec(16, 8, 128, "bfloat16")
    fp8 = FullAttentionSpec(16, 8, 128, "float8_e4m3fn")
    assert fp8.page_size_bytes == 2 * 16 * 8 * 128 == 32768
    assert bytes_per_block([fp8] * 32) == 1048576
    budget = 40 * 2**30  # 40 GiB of KV: 20480 bf16 blocks, 40960 fp8 blocks
    assert num_blocks_for_budget(budget, [bf16] * 32, max_model_len=131072) == 20480
    assert num_blocks_for_budget(budget, [fp8] * 32, max_model_len=131072) == 40960
    assert KVCacheConfig(40960, [fp8] * 32).total_bytes == budget


def test_mla_spec_refuses_fp8_with_a_reason():
    from pagoda.core.kv_cache_spec import MLAAttentionSpec

    with pytest.raises(ValueError, match="not supported for MLA yet"):
        MLAAttentionSpec(16, 512, 64, "float8_e4m3fn")
