"""From ``--quantization`` and the checkpoint's quantization_config to a QuantConfig, and
the pass that hands every linear layer its method.

Resolution: a checkpoint that says it is quantized is read as such (``--quantization``
may repeat its method, never contradict it); otherwise ``--quantization`` quantizes a
float checkpoint (or dummy weights) while loading; otherwise nothing is quantized.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from pagoda.config import QUANTIZATION_METHODS
from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.linear import LinearBase
from pagoda.model.quant.base import QuantConfig
from pagoda.model.quant.unquantized import UNQUANTIZED

# quant_method in a checkpoint's config.json -> "module:function" reading it.
CHECKPOINT_FORMATS = {
    "fp8": "pagoda.model.quant.fp8_checkpoint:fp8_config_from_hf",
    "compressed-tensors": "pagoda.model.quant.fp8_checkpoint:compressed_tensors_config_from_hf",
}
# --quantization of a float checkpoint -> "module:callable" returning its QuantConfig.
ONLINE_METHODS = {
    "fp8": "pagoda.model.quant.fp8:Fp8Config.online",
    "int8": "pagoda.model.quant.cpu_int:Int8QuantConfig",
    "int4": "pagoda.model.quant.cpu_int:Int4QuantConfig",
}


def _load(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_quant_config(
    requested: str | None,
    checkpoint_config: dict | None,
    load_format: str,
    gguf_reader=None,
    quantize_lm_head: bool = False,
) -> QuantConfig | None:
    """The scheme to load with, or None for float weights. gguf_reader: the open GGUF
    file, for "gguf" (its tensors' block types pick each layer's method).
    quantize_lm_head: the scheme's LM head quantized too (QuantConfig.with_quantized_lm_head,
    FP8 only); refused for float weights."""
    scheme = _resolve_scheme(requested, checkpoint_config, load_format, gguf_reader)
    if not quantize_lm_head:
        return scheme
    if scheme is None:
        raise ValueError(
            "--quantize-lm-head needs --quantization fp8 (or an FP8 "
            "checkpoint): these weights are not quantized"
        )
    return scheme.with_quantized_lm_head()


def _resolve_scheme(
    requested: str | None, checkpoint_config: dict | None, load_format: str, gguf_reader=None
) -> QuantConfig | None:
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {requested!r}; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if checkpoint_config is not None:
        method = checkpoint_config["quant_method"]
        if method not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"the checkpoint is quantized with {method!r}, which Pagoda cannot "
                f"run; it reads FP8 checkpoints ({', '.join(CHECKPOINT_FORMATS)}) "
                f"or quantizes float ones (--quantization fp8|int8|int4)"
            )
        if load_format == "dummy":
            raise ValueError(
                f"dummy weights for a {method}-quantized config are not supported: "
                f"drop quantization_config from config.json and pass "
                f"--quantization fp8 to quantize random float weights"
            )
        if requested is not None and requested != method:
            raise ValueError(
                f"--quantization {requested} does not match the checkpoint's "
                f"quantization_config ({method}); leave --quantization unset to "
                f"read the checkpoint as it is"
            )
        return _load(CHECKPOINT_FORMATS[method])(checkpoint_config)
    if requested is None:
        return None
    if requested == "compressed-tensors":
        raise ValueError(
            "--quantization compressed-tensors reads a checkpoint quantized that "
            "way, and this one has no quantization_config; to quantize float "
            "weights use fp8 (GPU) or int8/int4 (CPU)"
        )
    if requested == "gguf":
        if load_format != "gguf" or gguf_reader is None:
            raise ValueError(
                "--quantization gguf keeps a GGUF file's quantized blocks: it needs "
                "a .gguf model (for other checkpoints use int8 or int4 on the CPU, "
                "fp8 on the GPU)"
            )
        return _load("pagoda.model.quant.gguf_quant:GGUFQuantConfig.from_reader")(gguf_reader)
    return _load(ONLINE_METHODS[requested])()


def attach_quant_methods(
    model: nn.Module,
    arch,
    quant_config: QuantConfig | None,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Gives each linear layer of a model built on meta its method (before materialising)."""
    if quant_config is None:
        return
    if arch.moe is not None or arch.mla is not None:
        raise ValueError(
            f"{quant_config.name} quantization of {arch.architecture} is not "
            f"supported yet (its MoE experts and MLA layers have no quantized "
            f"path); serve it unquantized"
        )
    quant_config.check_device(torch.device(device))
    quant_config.check_model_dtype(dtype)

    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            method = quant_config.linear_method(name, module)
            if method is not None:
                module.set_quant_method(method)
    head_method = quant_config.lm_head_method()
    if head_method is not None:
        model.lm_head.set_quant_method(head_method)


def process_loaded_weights(model: nn.Module) -> None:
    """After the weights are loaded: each quantized layer repacks or quantizes them;
    the float weights that freed are handed back to the device's allocator."""

    changed = False
    # A list first: processing the LM head adds a private quantized layer to the tree,
    # which must not be visited (and quantized again) by this same walk.
    for module in list(model.modules()):
        if isinstance(module, LinearBase) and module.quant_method is not UNQUANTIZED:
            module.quant_method.process_weights_after_loading(module)
            changed = True
        elif isinstance(module, ParallelLMHead) and module.quant_method is not None:
            module.process_weights_after_loading()
            changed = True
    if changed and torch.cuda.is_available():
        torch.cuda.empty_cache()
