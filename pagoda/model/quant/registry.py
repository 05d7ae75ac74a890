"""From ``--quantization`` and the checkpoint's quantization_config to a QuantConfig, and
the pass that hands every linear layer its method.

Resolution: a checkpoint that says it is quantized is read as such (``--quantization``
may repeat its method, never contradict it, and ``none`` is refused: its weights cannot
be expanded); otherwise ``--quantization`` quantizes a float checkpoint (or dummy
weights) while loading, or ``none`` keeps float weights (a GGUF file's blocks expanded);
otherwise a GGUF file keeps its blocks where the ``gguf`` scheme runs faster than float
(gguf_quant.default_gguf_scheme) and every other checkpoint stays float.

``describe_weights(model)`` says, for the start-up log, how the loaded weights are
stored.
"""

from __future__ import annotations

import importlib
from collections import Counter

import torch
from torch import nn

from pagoda.config import QUANTIZATION_METHODS
from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.linear import LinearBase
from pagoda.model.layers.moe.fused_moe import FusedMoE
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
# Architectures with MoE experts or MLA whose quantized loading is implemented and tested
# (FusedMoE experts and MLA projections under the FP8 schemes, tests/model/test_fp8_moe.py).
QUANTIZED_MOE_MLA_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
# Schemes with MoE and MLA methods (QuantConfig.moe_method; kv_b_proj kept float).
QUANTIZED_MOE_MLA_SCHEMES = ("fp8", "compressed-tensors")
# How the start-up log names each scheme (describe_weights).
SCHEME_LABELS = {
    "gguf": "gguf blocks",
    "int8": "int8 blocks",
    "int4": "int4 blocks",
    "fp8": "fp8 W8A8",
    "compressed-tensors": "compressed-tensors fp8 W8A8",
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
    *,
    arch=None,
    device: torch.device | str | None = None,
) -> QuantConfig | None:
    """The scheme to load with, or None for float weights. gguf_reader: the open GGUF
    file, for "gguf" (its tensors' block types pick each layer's method).
    quantize_lm_head: the scheme's LM head quantized too (QuantConfig.with_quantized_lm_head,
    FP8 only); refused for float weights. arch and device: the model and where it runs,
    which decide whether a GGUF file keeps its blocks when nothing is requested (without
    them it is expanded to float)."""
    if requested is None and load_format == "gguf" and gguf_reader is not None:
        default_gguf_scheme = _load("pagoda.model.quant.gguf_quant:default_gguf_scheme")
        scheme = default_gguf_scheme(gguf_reader, arch, device)
    else:
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
    if requested == "none":
        return _float_weights(checkpoint_config, load_format)
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


def _float_weights(checkpoint_config: dict | None, load_format: str) -> None:
    """--quantization none: float weights, which a quantized checkpoint cannot give
    (its weights are read as stored; nothing expands them). Dummy weights of a
    quantized config are random float values of its shape."""
    if checkpoint_config is not None and load_format != "dummy":
        raise ValueError(
            f"--quantization none asks for float weights, but this checkpoint is "
            f"quantized ({checkpoint_config['quant_method']}) and Pagoda reads it only as "
            f"stored: leave --quantization unset, or load a float checkpoint"
        )
    return None


def attach_quant_methods(
    model: nn.Module,
    arch,
    quant_config: QuantConfig | None,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Gives each linear layer and each FusedMoE of a model built on meta its method
    (before materialising)."""
    if quant_config is None:
        return
    check_moe_mla_support(arch, quant_config)
    quant_config.check_device(torch.device(device))
    quant_config.check_model_dtype(dtype)

    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            method = quant_config.linear_method(name, module)
            if method is not None:
                module.set_quant_method(method)
        elif isinstance(module, FusedMoE):
            moe_method = quant_config.moe_method(name, module)
            if moe_method is not None:
                module.set_quant_method(moe_method)
    head_method = quant_config.lm_head_method()
    if head_method is not None:
        model.lm_head.set_quant_method(head_method)


def check_moe_mla_support(arch, quant_config: QuantConfig) -> None:
    """Raises for a model with MoE experts or MLA that the scheme has no tested path for."""
    if arch.moe is None and arch.mla is None:
        return
    parts = " and ".join(
        what for what, has in (("MoE experts", arch.moe), ("MLA layers", arch.mla)) if has
    )
    if quant_config.name not in QUANTIZED_MOE_MLA_SCHEMES:
        raise ValueError(
            f"{quant_config.name} quantization of {arch.architecture} is not supported "
            f"(its {parts} have no {quant_config.name} path); serve it unquantized, or "
            f"with fp8 on the GPU"
        )
    if arch.architecture not in QUANTIZED_MOE_MLA_ARCHITECTURES:
        raise ValueError(
            f"{quant_config.name} quantization of {arch.architecture} is not supported "
            f"yet (FP8 {parts} are implemented for "
            f"{', '.join(QUANTIZED_MOE_MLA_ARCHITECTURES)}); serve it unquantized"
        )


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
        elif isinstance(module, FusedMoE) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
            changed = True
    if changed and torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe_weights(model: nn.Module) -> str:
    """How the loaded model's weights are stored, one phrase for the start-up log: the
    float dtype ('float32'), or the scheme with what its linear layers and LM head hold,
    e.g. 'gguf blocks (Q4_1 ×120 linear layers; LM head Q8_0)'."""
    head = getattr(model, "lm_head", None)
    float_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if head is not None:
        float_dtype = str(head.weight.dtype).removeprefix("torch.")
    scheme = getattr(model, "quant_config", None)
    if scheme is None:
        return float_dtype
    formats: Counter[str] = Counter()
    experts: Counter[str] = Counter()
    for name, module in model.named_modules():
        # The LM head's private quantized layer is reported as the head.
        if isinstance(module, LinearBase) and not name.startswith("lm_head."):
            formats[module.quant_method.weight_format(module)] += 1
        elif isinstance(module, FusedMoE):
            method = module.quant_method
            experts[float_dtype if method is None else method.weight_format(module)] += 1
    layers = ", ".join(f"{fmt} ×{count}" for fmt, count in formats.most_common())
    parts = [f"{layers} linear layers"] if layers else []
    if experts:
        moe = ", ".join(f"{fmt} ×{count}" for fmt, count in experts.most_common())
        parts.append(f"experts {moe}")
    quantized = getattr(head, "quantized", None)
    if quantized is not None:
        parts.append(f"LM head {quantized.quant_method.weight_format(quantized)}")
    elif head is not None:
        parts.append(f"LM head {float_dtype}")
    label = SCHEME_LABELS.get(scheme.name, scheme.name)
    return f"{label} ({'; '.join(parts)})" if parts else label
