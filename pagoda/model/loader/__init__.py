"""Model loading: pick the weight format, build the model on meta, materialise, fill.

``load_model(model_path_or_preset, load_format, dtype, device, seed, tp, quantization)
-> (model, arch)`` (tp: this rank's TensorParallel; the loaders shard while loading;
quantization: ``--quantization``, resolved with the checkpoint's own quantization_config
by pagoda.model.quant.registry: layers get their methods before materialising and
quantize or repack once loaded);
``load_arch_config(model_path_or_preset, load_format) -> arch`` without the weights.

Formats:
- "gguf": a .gguf file, or a directory holding exactly one.
- "safetensors": a Hugging Face directory (config.json + *.safetensors, sharded or not).
- "dummy": a preset name (see pagoda.model.presets) or a directory with config.json;
  weights are seeded random values.
- "auto": the first of the above that the path fits; a preset name needs "dummy"
  explicitly (a benchmark shape must never be mistaken for a real model).

dtype "auto" means the checkpoint's torch_dtype (pagoda.model.dtypes.resolve_dtype):
config.json's for HF directories, the preset's for dummy weights, float32 for GGUF (the
dtype its expanded weights and its activations take; on the CPU its Q4_0/Q4_1/Q8_0
blocks stay quantized unless quantization="none"). The engine never passes "auto": it
resolves the dtype for its device first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagoda.config import LOAD_FORMATS
from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader.build import build_model, find_gguf_file, is_safetensors_dir
from pagoda.model.loader.dummy import dummy_arch_config, load_dummy_model
from pagoda.model.loader.gguf import load_gguf_model, read_gguf_arch_config
from pagoda.model.loader.safetensors import load_safetensors_model, read_arch_config
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.presets import PRESET_NAMES, is_preset
from pagoda.model.quant.registry import process_loaded_weights

__all__ = [
    "build_model",
    "detect_load_format",
    "find_gguf_file",
    "is_safetensors_dir",
    "load_arch_config",
    "load_model",
]


def detect_load_format(model: str) -> str:
    """The format "auto" resolves to for this path or preset name."""
    path = Path(model)
    if find_gguf_file(path) is not None:
        return "gguf"
    if is_safetensors_dir(path):
        return "safetensors"
    if is_preset(model):
        raise ValueError(
            f"{model!r} is a preset (a shape without weights): pass "
            f"load_format='dummy' to run it with random weights"
        )
    raise ValueError(
        f"cannot load {model!r}: looked for a .gguf file (or a directory holding "
        f"one), a directory with config.json and *.safetensors, or a preset name "
        f"({', '.join(PRESET_NAMES)}) with load_format='dummy'"
    )


def _resolve_format(model_path_or_preset, load_format: str) -> tuple[str, str]:
    """(the model as a string, its concrete format); "auto" is detected from the path."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"unsupported load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}"
        )
    name = str(model_path_or_preset)
    return name, detect_load_format(name) if load_format == "auto" else load_format


def load_arch_config(model_path_or_preset: str, load_format: str = "auto") -> ArchConfig:
    """The ArchConfig load_model would build, read without touching any weight (for
    checks made before workers start, e.g. check_tensor_parallel)."""
    name, fmt = _resolve_format(model_path_or_preset, load_format)
    if fmt == "gguf":
        return read_gguf_arch_config(Path(name))
    if fmt == "safetensors":
        return read_arch_config(Path(name))
    return dummy_arch_config(name)


def load_model(
    model_path_or_preset: str,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    tp: TensorParallel = SINGLE_RANK,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> tuple[nn.Module, ArchConfig]:
    """The model (this rank's share: loaders shard while loading) and its ArchConfig.
    quantize_lm_head: the quantization scheme covers the LM head too (FP8 only)."""
    name, fmt = _resolve_format(model_path_or_preset, load_format)
    if fmt == "gguf":
        model, arch = load_gguf_model(Path(name), dtype, device, tp, quantization, quantize_lm_head)
    elif fmt == "safetensors":
        model, arch = load_safetensors_model(
            Path(name), dtype, device, tp, quantization, quantize_lm_head
        )
    else:
        model, arch = load_dummy_model(
            name, dtype, device, seed, tp, quantization, quantize_lm_head
        )
    process_loaded_weights(model)
    return model, arch
