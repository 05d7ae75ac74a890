"""Shared fixtures: the embedded SmolLM2 GGUF and tiny random Hugging Face models."""

from __future__ import annotations

import os

import pytest

# One intra-op thread: the models in tests are small, a busy-waiting thread pool only
# loses time on two shared cores, and server subprocesses inherit the setting.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402  (after the thread setting)

torch.set_num_threads(1)

# Without a GPU, Triton kernels run in its interpreter. Triton reads TRITON_INTERPRET when
# it is first imported (its own standard library is decorated then), and transformers or
# torch may import it before the kernel tests do: set it for the whole session, first.
if not torch.cuda.is_available():
    assert "triton" not in __import__("sys").modules, "triton imported before conftest"
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from pagoda.model.tokenizer import embedded_model_path
    return embedded_model_path()


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


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    """{arch: (directory, transformers model)} for llama, qwen2 and qwen3."""
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        models[arch] = (str(path), save_tiny_hf_model(path, arch))
    return models
