"""Named architecture presets: real model shapes for dummy-weight benchmarks, tiny ones for tests.

A preset is only a shape (an ArchConfig); its weights come from the dummy loader.
"""

from __future__ import annotations

import dataclasses

from pagoda.model.arch_config import ArchConfig, GptOssExperts
from pagoda.model.mla_config import MLAConfig, SparseIndexerConfig
from pagoda.model.moe_config import MoEConfig

# What every Llama 3.1 size shares: vocabulary, rotary scaling, context, special ids.
_LLAMA_31_COMMON = dict(
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)

_DEEPSEEK_V3 = ArchConfig(
    architecture="DeepseekV3ForCausalLM",
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    head_dim=64,
    intermediate_size=18432,
    vocab_size=129280,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    max_position_embeddings=163840,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
    mla=MLAConfig(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    moe=MoEConfig(
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        renormalize=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        first_k_dense_replace=3,
    ),
)

_PRESETS: dict[str, ArchConfig] = {
    "llama-3.1-8b": ArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        **_LLAMA_31_COMMON,
    ),
    # Llama-3.2-1B: the Llama 3 vocabulary at 1.2B parameters (a draft for the 8B).
    "llama-3.2-1b": ArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        **{
            **_LLAMA_31_COMMON,
            "tie_word_embeddings": True,
            "rope_scaling": {**_LLAMA_31_COMMON["rope_scaling"], "factor": 32.0},
        },
    ),
    "llama-3.1-70b": ArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        **_LLAMA_31_COMMON,
    ),
    "qwen3-8b": ArchConfig(
        architecture="Qwen3ForCausalLM",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen3-30B-A3B: 128 experts of 768, 8 active per token (about 3.3B active parameters).
    "qwen3-30b-a3b": ArchConfig(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
        moe=MoEConfig(
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, renormalize=True
        ),
    ),
    # DeepSeek-V2-Lite: MLA (no q LoRA, latent 512 + rope 64), 64 routed experts of 1408
    # (6 active) and 2 shared, layer 0 dense; YaRN rope as in its config.json.
    "deepseek-v2-lite": ArchConfig(
        architecture="DeepseekV2ForCausalLM",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        intermediate_size=10944,
        vocab_size=102400,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=100000,
        eos_token_id=100001,
        mla=MLAConfig(
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEConfig(
            num_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=1408,
            n_shared_experts=2,
            first_k_dense_replace=1,
        ),
    ),
    # DeepSeek-V3 as released (671B, 37B active): MLA with a query LoRA, 256 routed
    # experts of 2048 (8 active, sigmoid noaux_tc routing in 8 groups) and 1 shared, the
    # first 3 layers dense; for dummy-weight benchmarks of a few of its layers.
    "deepseek-v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (an indexer of 64 heads of 128
    # keeping 2048 tokens per query).
    "deepseek-v3.2": _DEEPSEEK_V3.replace(
        architecture="DeepseekV32ForCausalLM",
        mla=dataclasses.replace(_DEEPSEEK_V3.mla, indexer=SparseIndexerConfig(64, 128, 2048)),
    ),
    # Gemma 3 27B (text): 5 sliding-window layers (1,024 tokens, rope base 10k) to 1
    # global (rope base 1M, linear x8), softmax scale query_pre_attn_scalar^-0.5,
    # GELU-tanh MLP.
    "gemma-3-27b": ArchConfig(
        architecture="Gemma3ForCausalLM",
        hidden_size=5376,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        intermediate_size=21504,
        vocab_size=262208,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        hidden_act="gelu_pytorch_tanh",
        bos_token_id=2,
        eos_token_id=[1, 106],
        sliding_window=1024,
        layer_types=tuple(
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
        ),
        query_pre_attn_scalar=168,
        local_rope_theta=10_000.0,
    ),
    # gpt-oss-20b (openai/gpt-oss-20b's config.json): 24 layers alternating sliding
    # (128 tokens) and full attention, sinks, 32 experts top-4 of width 2880, YaRN x32
    # over a 4k original context. Dummy weights are bf16 experts (the release's are
    # MXFP4, dequantized while loading).
    "gpt-oss-20b": ArchConfig(
        architecture="GptOssForCausalLM",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        vocab_size=201088,
        rms_norm_eps=1e-5,
        rope_theta=150_000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=True,
        torch_dtype="bfloat16",
        eos_token_id=200002,
        sliding_window=128,
        layer_types=tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)
        ),
        gpt_oss=GptOssExperts(num_experts=32, num_experts_per_tok=4),
    ),
    # tests/helpers/tiny_models.py's DeepSeek-V2 shape (layer 0 dense, layer 1 MoE), for smoke runs.
    "tiny-deepseek-v2": ArchConfig(
        architecture="DeepseekV2ForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=128,
        vocab_size=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        mla=MLAConfig(
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        moe=MoEConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    ),
    "smollm2-135m": ArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny-llama": ArchConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    ),
    # 8 experts, top 2, layer 1 dense (mlp_only_layers), as tests/helpers/tiny_models.py's qwen3_moe.
    "tiny-qwen3-moe": ArchConfig(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        qk_norm=True,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        moe=MoEConfig(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            renormalize=True,
            mlp_only_layers=(1,),
        ),
    ),
    # head_dim * heads (128) != hidden_size (64), as in real Qwen3 models.
    "tiny-qwen3": ArchConfig(
        architecture="Qwen3ForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        qk_norm=True,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def is_preset(name: str) -> bool:
    return name in _PRESETS


# Presets whose tokenizer ships with Pagoda: smollm2-135m is the embedded model's shape,
# and the embedded GGUF holds its tokenizer.
_EMBEDDED_TOKENIZER_PRESETS = ("smollm2-135m",)


def preset_tokenizer(name: str) -> str | None:
    """A local tokenizer for the preset's vocabulary (a path), or None when none ships
    with Pagoda (then text needs --tokenizer, or token ids are sent)."""
    if name not in _EMBEDDED_TOKENIZER_PRESETS:
        return None
    from pagoda.model.tokenizer import embedded_model_path

    try:
        return str(embedded_model_path())
    except FileNotFoundError:  # the embedded model package is not installed
        return None


def get_preset(name: str) -> ArchConfig:
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESET_NAMES)}")
    return _PRESETS[name]
