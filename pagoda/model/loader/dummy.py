"""Dummy weights: seeded random values of the right shapes, made on the target device.

For benchmarks, where only the shape matters. Norm weights are ones (so activations
keep a sane scale), every other parameter is normal(0, 0.02). One generator on the
target device walks the parameters in a fixed order: the same seed on the same device
gives the same weights, and an 8B model never makes a CPU round trip.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.dtypes import resolve_dtype
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.loader.build import build_model
from pagoda.model.loader.safetensors import read_arch_config
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.presets import get_preset
from pagoda.model.quant.registry import resolve_quant_config

WEIGHT_STD = 0.02


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    seen: set[int] = set()  # tied parameters appear under two modules
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if isinstance(module, RMSNorm):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, WEIGHT_STD, generator=generator)


def dummy_arch_config(name: str) -> ArchConfig:
    """A preset name, or a directory whose config.json gives the shape."""
    path = Path(name)
    if path.is_dir():
        return read_arch_config(path)
    return get_preset(name)


def load_dummy_model(
    name: str,
    dtype: str | torch.dtype,
    device: str | torch.device,
    seed: int,
    tp: TensorParallel = SINGLE_RANK,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> tuple[nn.Module, ArchConfig]:

    arch = dummy_arch_config(name)
    quant = resolve_quant_config(
        quantization, arch.quantization_config, "dummy", quantize_lm_head=quantize_lm_head
    )
    model = build_model(arch, resolve_dtype(dtype, device, arch.torch_dtype), device, tp, quant)
    fill_dummy_weights(model, seed)
    return model, arch
