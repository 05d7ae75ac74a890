"""Hugging Face directory loader: config.json + *.safetensors (one file or sharded).

Tensors are streamed one at a time from each shard (safe_open memory-maps the file)
into the model's load_weights, so peak extra memory is one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.dtypes import resolve_dtype
from pagoda.model.loader.build import build_model
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.quant.registry import resolve_quant_config
from pagoda.progress import progress, progress_enabled

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by the index file when there is one, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}")
    return files


def iter_safetensors_weights(
    files: list[Path], rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every file in turn, with a progress bar on a terminal for rank 0
    (its total counts tensors: only the files' headers are read for it)."""
    total = None
    if progress_enabled(rank):
        total = 0
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                total += len(f.keys())
    bar = progress(_tensors_of(files), "loading weights", total, "tensor", rank)
    yield from bar


def _tensors_of(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_arch_config(model_dir: Path) -> ArchConfig:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    return ArchConfig.from_hf_config(json.loads(config_file.read_text()))


def load_safetensors_model(
    model_dir: Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    tp: TensorParallel = SINGLE_RANK,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> tuple[nn.Module, ArchConfig]:
    """The model with its weights loaded (quantized layers not yet processed: the
    caller, pagoda.model.loader.load_model, does that)."""

    arch = read_arch_config(model_dir)
    quant = resolve_quant_config(
        quantization, arch.quantization_config, "safetensors", quantize_lm_head=quantize_lm_head
    )
    model = build_model(arch, resolve_dtype(dtype, device, arch.torch_dtype), device, tp, quant)
    model.load_weights(iter_safetensors_weights(safetensors_files(model_dir), tp.rank))
    return model, arch
