"""Model registry: architecture name (as in HF config.json) -> model class."""

from __future__ import annotations

from torch import nn

from pagoda.model.arch_config import SUPPORTED_ARCHITECTURES
from pagoda.model.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
)
from pagoda.model.gemma3 import Gemma3ForCausalLM
from pagoda.model.gpt_oss import GptOssForCausalLM
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.qwen3_moe import Qwen3MoeForCausalLM

# Qwen2/Qwen3/Mistral run on the Llama code; ArchConfig flags select their differences.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
if set(_MODEL_CLASSES) != set(SUPPORTED_ARCHITECTURES):
    raise RuntimeError("the model registry and ArchConfig's supported architectures disagree")


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return _MODEL_CLASSES[architecture]
