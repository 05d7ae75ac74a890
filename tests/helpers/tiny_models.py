"""Tiny random transformers checkpoints saved as safetensors, for tests that load real
files (conftest's fixtures, and tests that need their own shapes)."""

from __future__ import annotations


def save_tiny_hf_model(path, arch: str, seed: int = 0, **overrides):
    """A randomly initialised tiny transformers model saved as a safetensors directory
    (overrides: config fields replacing the tiny defaults, e.g. num_key_value_heads)."""
    import torch
    import transformers

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, rope_theta=10000.0)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        # 8 experts, top 2, renormalised; layer 1 keeps a dense MLP (mlp_only_layers).
        moe = dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
        moe.update({k: common.pop(k) for k in list(common) if k in moe})
        config = transformers.Qwen3MoeConfig(**common, **moe, head_dim=16, rope_theta=10000.0)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch in ("deepseek_v2", "deepseek_v3", "deepseek_v32"):
        config, cls = tiny_deepseek_config(arch, **overrides)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights than the default init: decisive argmaxes
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


# Multi-head latent attention at a tiny scale: 4 heads, latent 32 + 8 rotary values, q/k
# heads 16 + 8 wide, values 16; YaRN rope whose mscale_all_dim sharpens the softmax and
# whose mscale / mscale_all_dim ratio scales cos and sin, with positions past the
# original 32. Layer 0 is dense, layer 1 an MoE block: 4 routed experts (top 2) in 2
# groups, one shared expert.
DEEPSEEK_TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    q_lora_rank=None,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
)


def tiny_deepseek_config(arch: str, **overrides):
    """(transformers config, model class) of a tiny DeepSeek V2, V3 or V3.2 (eager
    attention; V3.2: a query LoRA and an indexer of 8 heads of 16 keeping 8 tokens)."""
    import transformers

    fields = dict(DEEPSEEK_TINY, **overrides)
    if arch == "deepseek_v2":
        config, cls = transformers.DeepseekV2Config(**fields), transformers.DeepseekV2ForCausalLM
    elif arch == "deepseek_v32":
        sparse = dict(q_lora_rank=24, index_n_heads=8, index_head_dim=16, index_topk=8)
        config = transformers.DeepseekV32Config(**{**DEEPSEEK_TINY, **sparse, **overrides})
        cls = transformers.DeepseekV32ForCausalLM
    else:
        config, cls = transformers.DeepseekV3Config(**fields), transformers.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    return config, cls


def save_tiny_hub_repo(hub_cache, repo_id: str, commit: str, ref: str = "main"):
    """A tiny random Llama with the embedded SmolLM2 tokenizer, laid out as
    huggingface_hub caches a download: <hub_cache>/models--org--name/snapshots/<commit>/
    and refs/<ref> holding the commit. Returns the snapshot directory."""
    from pathlib import Path

    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    save_tiny_servable_model(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def save_tiny_servable_model(path, **overrides):
    """A tiny random Llama (4 heads, 2 KV heads: it splits over 2 tensor-parallel ranks)
    with the embedded SmolLM2 tokenizer beside it: a directory `pagoda serve` can serve."""
    from helpers.embedded import embedded_gguf
    from pagoda.model.tokenizer import load_tokenizer

    # The vocabulary matches the tokenizer's 49152 ids; tied embeddings keep it small.
    save_tiny_hf_model(
        path, "llama", **{"vocab_size": 49152, "tie_word_embeddings": True, **overrides}
    )
    load_tokenizer(embedded_gguf()).save_pretrained(path)


# Token-id prompts of the GPU switch tests: a short one, a repeated token, a longer run.
SWITCH_TEST_PROMPTS = ([11, 42, 7, 99, 3], [5] * 40, list(range(60, 90)))


def greedy_dummy_run(preset: str, prompts=SWITCH_TEST_PROMPTS, enforce_eager: bool = False):
    """[(token ids, top logprob of each)] of 12 greedy tokens per prompt (token-id lists)
    from a preset with dummy bf16 weights on the default device: what GPU tests compare
    with a kernel switch off and on (a switch that may change timing only)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        preset,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
        kv_cache_memory=1 << 28,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
        use_tqdm=False,
    )
    llm.llm_engine.shutdown()
    return [
        (
            o.outputs[0].token_ids,
            [max(lp.values(), key=lambda v: v.logprob).logprob for lp in o.outputs[0].logprobs],
        )
        for o in outs
    ]
