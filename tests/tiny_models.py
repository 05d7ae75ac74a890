"""Tiny random transformers checkpoints saved as safetensors, for tests that load real
files (conftest's fixtures, and tests that need their own shapes)."""

from __future__ import annotations


def save_tiny_hf_model(path, arch: str, seed: int = 0, **overrides):
    """A randomly initialised tiny transformers model saved as a safetensors directory
    (overrides: config fields replacing the tiny defaults, e.g. num_key_value_heads)."""
    import torch
    import transformers

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
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
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer

    # The vocabulary matches the tokenizer's 49152 ids; tied embeddings keep it small.
    save_tiny_hf_model(path, "llama", **{"vocab_size": 49152, "tie_word_embeddings": True,
                                         **overrides})
    load_tokenizer(embedded_model_path()).save_pretrained(path)
