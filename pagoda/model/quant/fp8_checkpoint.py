"""Reading FP8 checkpoints' quantization_config into an Fp8Config, or refusing it by name.

Two formats (the ones FP8 checkpoints on the Hugging Face hub use):
- ``quant_method: "fp8"`` (transformers' FineGrainedFP8 / DeepSeek-V3): e4m3 weights;
  ``weight_block_size: [128, 128]`` means block scales named ``weight_scale_inv``,
  otherwise one ``weight_scale`` per tensor; ``activation_scheme`` "dynamic" or "static"
  (an ``input_scale`` per tensor); ``modules_to_not_convert`` / ``ignored_layers`` stay float.
- ``quant_method: "compressed-tensors"`` (llm-compressor): one config group targeting
  ``Linear`` with 8-bit float weights (strategy "channel", "tensor" or "block") and
  8-bit float input activations (dynamic per token, static per tensor, or dynamic
  per group of 128 for block weights); ``ignore`` lists float layers.
Anything else (int4/int8 compressed-tensors, GPTQ, AWQ, weight-only FP8, ...) raises a
ValueError naming what Pagoda cannot run.
"""

from __future__ import annotations

from typing import Any

from pagoda.model.quant.fp8 import Fp8CheckpointLinearMethod, Fp8Config


def fp8_config_from_hf(config: dict) -> Fp8Config:
    """quant_method "fp8"."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"FP8 checkpoint format {fmt!r} is not supported (only e4m3)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported (dynamic or static)")
    ignored = list(config.get("modules_to_not_convert") or []) + list(
        config.get("ignored_layers") or []
    )
    block = config.get("weight_block_size")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError("FP8 block-scaled checkpoints need activation_scheme 'dynamic'")
        method = Fp8CheckpointLinearMethod("block", _block_size(block), "weight_scale_inv")
    else:
        method = Fp8CheckpointLinearMethod("tensor", static_input=scheme == "static")
    return Fp8Config(method, ignored, name="fp8")


def compressed_tensors_config_from_hf(config: dict) -> Fp8Config:
    """quant_method "compressed-tensors", FP8 W8A8 schemes only."""
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoints with {len(groups)} config groups are "
            f"not supported (one group targeting Linear layers)"
        )
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(
            f"compressed-tensors group targets {targets!r} are not supported (only ['Linear'])"
        )
    weights = group.get("weights") or {}
    _require_fp8(weights, "weights")
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    activations = group.get("input_activations")
    if activations is None:
        raise ValueError(
            "weight-only FP8 compressed-tensors checkpoints (no "
            "input_activations) are not supported yet; Pagoda runs FP8 W8A8"
        )
    _require_fp8(activations, "input_activations")
    method = _method_for(weights, activations)
    return Fp8Config(method, list(config.get("ignore") or []), name="compressed-tensors")


def _method_for(weights: dict, activations: dict) -> Fp8CheckpointLinearMethod:
    strategy = weights.get("strategy")
    act_strategy, act_dynamic = activations.get("strategy"), bool(activations.get("dynamic"))
    if strategy == "block":
        if not (
            act_dynamic
            and act_strategy == "group"
            and activations.get("group_size") == _block_size(weights.get("block_structure"))[1]
        ):
            raise ValueError(
                "compressed-tensors block weights need dynamic per-group input "
                "activations with group_size equal to the block's width"
            )
        return Fp8CheckpointLinearMethod("block", _block_size(weights.get("block_structure")))
    if strategy not in ("channel", "tensor"):
        raise ValueError(
            f"compressed-tensors weight strategy {strategy!r} is not supported "
            f"(channel, tensor or block)"
        )
    if act_dynamic and act_strategy == "token":
        return Fp8CheckpointLinearMethod(strategy)
    if not act_dynamic and act_strategy == "tensor":
        if strategy != "tensor":
            raise ValueError(
                "static per-tensor activations are supported with per-tensor weights only"
            )
        return Fp8CheckpointLinearMethod("tensor", static_input=True)
    raise ValueError(
        f"compressed-tensors input activations (strategy {act_strategy!r}, "
        f"dynamic={act_dynamic}) are not supported: dynamic per token, or "
        f"static per tensor"
    )


def _require_fp8(args: dict, what: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(
            f"compressed-tensors {what} of {args.get('num_bits')}-bit "
            f"{args.get('type')} are not supported; Pagoda runs 8-bit float (FP8) "
            f"compressed-tensors checkpoints"
        )
    if args.get("symmetric") is False:
        raise ValueError(f"asymmetric FP8 {what} are not supported")


def _block_size(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"an FP8 block size must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])
