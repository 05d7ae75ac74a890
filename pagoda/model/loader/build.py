"""Building a model for its weights: the class for an architecture, built on meta, its
quantization methods attached, materialised on the device; and finding a checkpoint's
files (``find_gguf_file``, ``is_safetensors_dir``). Shared by every format's loader."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import reset_kv_scales
from pagoda.model.parallel import SINGLE_RANK, TensorParallel, check_tensor_parallel
from pagoda.model.quant.registry import attach_quant_methods
from pagoda.model.registry import get_model_class


def find_gguf_file(path: Path) -> Path | None:
    """The .gguf file at path (a file, or a directory holding exactly one), else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(
                f"{path} holds several .gguf files ({', '.join(f.name for f in files)}); "
                f"pass the file itself"
            )
        return files[0] if files else None
    return None


def is_safetensors_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def build_model(
    arch: ArchConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TensorParallel = SINGLE_RANK,
    quant_config=None,
) -> nn.Module:
    """The model for arch, this rank's share of it (tp), with uninitialised weights of
    dtype on device (built on meta, so nothing is allocated or initialised twice); with
    quant_config (a pagoda.model.quant QuantConfig) its linear layers take their
    methods' parameters (the scheme is kept as model.quant_config). Call
    process_loaded_weights once the weights are in."""
    cls = get_model_class(arch.architecture)
    check_tensor_parallel(
        arch, tp.size, tp.expert_parallel
    )  # a clear message before any layer's own check
    with torch.device("meta"):
        model = cls(arch, tp)
    attach_quant_methods(model, arch, quant_config, torch.device(device), dtype)
    model.quant_config = quant_config  # what describe_weights reports
    model.materialize(device, dtype)
    reset_kv_scales(model)  # buffers come out of materialize uninitialised
    return model.eval()
