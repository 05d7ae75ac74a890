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


from tiny_models import save_tiny_hf_model  # noqa: E402  (after the thread setting)


@pytest.fixture(scope="session")
def smollm2_gguf():
    from pagoda.model.tokenizer import embedded_model_path
    return embedded_model_path()


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    """{arch: (directory, transformers model)} for llama, qwen2 and qwen3."""
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        models[arch] = (str(path), save_tiny_hf_model(path, arch))
    return models
