"""Named kernel-config variants: what a benchmark selects instead of patching modules.

A variant is a KernelConfigs (pagoda.model.kernel_configs: one config per kernel
family) derived from a device's defaults by field overrides. `configs_for(name)` builds
one; `add_variant_args(parser)` adds the flag that names it (`--config NAME` for a
kernel mode, `--variants A,B,...` for an A/B of engine steps). A name is a key of
VARIANTS, or override strings joined by "+":

    decode.tiles_fp8=64,4,5,4          a dataclass field: its fields' values in order
    decode.short_context_splits=4      a plain field
    moe.narrow_down=4,,1,4             an empty value: None (here: the whole row a chunk)
    gemv.table[5120,2048,1]=8,256,1,3,4,0   one entry of the GEMV's routing table

The engine A/B mode passes the chosen configs to the model runner
(ModelRunner.use_kernel_configs) and captures its CUDA graphs again.
"""

from __future__ import annotations

import dataclasses
import re
import typing

# Variants measured in A/B runs: the FP8-KV decode's tiles (Llama-8B at batch 256 and
# batch 1), the short-context decode graphs' slices, and the batch-1 MoE and GEMV
# tiles (Qwen3-30B-A3B).
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "fp8-tiles-4-stages": ("decode.tiles_fp8=128,4,4,4",),
    "fp8-tiles-7-stages": ("decode.tiles_fp8=128,4,7,4",),
    "fp8-tiles-64-keys": ("decode.tiles_fp8=64,4,5,4",),
    "fp8-tiles-64-keys-2-warps": ("decode.tiles_fp8=64,2,3,4",),
    "fp8-two-buffers": ("decode.tiles_fp8=128,4,5,4",),
    "fp8-16-rows": ("decode.tiles_fp8=128,4,2,16",),
    "bf16-tiles-128-keys": ("decode.tiles_16bit=128,4,5,16",),
    "short-splits-1": ("decode.short_context_splits=1",),
    "short-splits-2": ("decode.short_context_splits=2",),
    "short-splits-4": ("decode.short_context_splits=4",),
    "moe-down-2x1w-s3": ("moe.narrow_down=2,,1,3",),
    "moe-down-4x1w-s4": ("moe.narrow_down=4,,1,4",),
    "moe-down-8x2w-s4": ("moe.narrow_down=8,,2,4",),
    "moe-gate-up-16x256-4w": ("moe.gate_up=16,256,4,2",),
    "moe-gate-up-8x256-2w": ("moe.gate_up=8,256,2,2",),
    "qwen3-qkv-8x256-s3": ("gemv.table[5120,2048,1]=8,256,1,3,4,0",),
    "qwen3-o-4x512-s3": ("gemv.table[2048,4096,1]=4,512,1,3,4,0",),
}


def configs_for(name: str, device=None):
    """The KernelConfigs of variant `name` on device (default: CUDA when present, else
    the CPU): the device's defaults with the variant's overrides applied."""
    import torch

    from pagoda.model.kernel_configs import KernelConfigs

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = KernelConfigs.for_device(torch.device(device))
    for override in overrides_of(name):
        configs = apply_override(configs, override)
    return configs


def overrides_of(name: str) -> tuple[str, ...]:
    """The override strings of a variant name (a VARIANTS key, or overrides joined by
    '+'); ValueError for an unknown name."""
    if name in VARIANTS:
        return VARIANTS[name]
    parts = tuple(p for p in name.split("+") if p)
    if not parts or not all("=" in p for p in parts):
        raise ValueError(
            f"unknown kernel variant {name!r}: one of {', '.join(VARIANTS)}, "
            "or overrides such as decode.tiles_fp8=64,4,5,4 joined by '+'"
        )
    return parts


_TARGET = re.compile(r"^(\w+)\.(\w+)(?:\[([\d,]+)\])?$")


def apply_override(configs, override: str):
    """configs with one override ("family.field=values" or "gemv.table[n,k,m]=values")
    applied; ValueError naming what is wrong."""
    target, _, raw = override.partition("=")
    match = _TARGET.match(target.strip())
    if not match:
        raise ValueError(f"override {override!r}: want family.field=values")
    family_name, field_name, key = match.groups()
    family = getattr(configs, family_name, None)
    if family is None or not dataclasses.is_dataclass(family):
        raise ValueError(f"override {override!r}: no kernel family {family_name!r}")
    fields = {f.name: f for f in dataclasses.fields(family)}
    if field_name not in fields:
        raise ValueError(
            f"override {override!r}: {type(family).__name__} has no field "
            f"{field_name!r} (fields: {', '.join(fields)})"
        )
    current = getattr(family, field_name)
    if key is not None:
        entry_key = tuple(int(v) for v in key.split(","))
        sample = next(iter(current.values()), None) if isinstance(current, dict) else None
        if sample is None:
            raise ValueError(f"override {override!r}: {field_name} is no table")
        value = dict(current)
        value[entry_key] = _build(type(sample), raw, override)
    else:
        value = _value_like(current, raw, override)
    return dataclasses.replace(
        configs, **{family_name: dataclasses.replace(family, **{field_name: value})}
    )


def _value_like(current, raw: str, override: str):
    """raw parsed as the type of current: a dataclass from its fields' values in order,
    a bool, an int."""
    if dataclasses.is_dataclass(current):
        return _build(type(current), raw, override)
    if isinstance(current, bool):
        return raw.strip().lower() in ("1", "true", "on", "yes")
    if isinstance(current, int):
        return int(raw)
    raise ValueError(f"override {override!r}: cannot set a {type(current).__name__}")


def _build(cls, raw: str, override: str):
    """An instance of dataclass cls from comma-separated values of its fields in order
    (trailing fields may be left out and keep their defaults; an empty value is None)."""
    values = raw.split(",")
    fields = dataclasses.fields(cls)
    hints = typing.get_type_hints(cls)
    if len(values) > len(fields):
        raise ValueError(f"override {override!r}: {cls.__name__} has {len(fields)} fields")
    kwargs = {}
    for field, text in zip(fields, values):
        text = text.strip()
        if text == "":
            kwargs[field.name] = None
        elif hints[field.name] is bool:
            kwargs[field.name] = text.lower() in ("1", "true", "on", "yes")
        else:
            kwargs[field.name] = int(text)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"override {override!r}: {exc}") from None


def add_variant_args(parser, multiple: bool = False) -> None:
    """--config NAME (one variant), or with multiple --variants A,B,... (variants taking
    turns in one engine); --list-variants prints the registry."""
    names = ", ".join(VARIANTS)
    if multiple:
        parser.add_argument(
            "--variants",
            default="default",
            help=f"comma-separated kernel variants ({names}, or "
            "overrides joined by '+'; benchmarks/harness/variants.py)",
        )
    else:
        parser.add_argument(
            "--config",
            default="default",
            help=f"a kernel variant ({names}, or overrides joined by '+'; "
            "benchmarks/harness/variants.py)",
        )
    parser.add_argument(
        "--list-variants",
        action="store_true",
        help="print the named variants and their overrides, then exit",
    )


def variant_names(args) -> list[str]:
    """The variant names the flags chose (checked: ValueError for an unknown one)."""
    names = (
        args.variants.split(",")
        if hasattr(args, "variants")
        else [getattr(args, "config", "default")]
    )
    for name in names:
        overrides_of(name)
    return names


def describe(name: str) -> str | None:
    """One line: the variant and its overrides."""
    overrides = overrides_of(name)
    return f"{name}: {' + '.join(overrides) if overrides else '(the device defaults)'}"
