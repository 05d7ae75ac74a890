"""What the fp8 modes share: a random-init transformers Llama saved as safetensors, and the
common prefix of two greedy continuations."""

from __future__ import annotations


def save_random_llama(path, shape: dict, layers: int, dtype: str, **config) -> None:
    """A random-init transformers Llama (its own default init, seed 0) as safetensors."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, rms_norm_eps=1e-5, tie_word_embeddings=False, **shape, **config
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    del model


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
