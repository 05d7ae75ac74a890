"""benchmarks/harness/variants.py: named kernel-config variants build from the device's
KernelConfigs by overrides (never by patching a module), refuse what they cannot set,
and reach the model runner; the kernel timer's modes all parse."""

import argparse
import dataclasses

import pytest
import torch

from benchmarks.harness import variants


def test_every_named_variant_builds_and_changes_only_its_fields():
    default = variants.configs_for("default", "cpu")
    for name, overrides in variants.VARIANTS.items():
        configs = variants.configs_for(name, "cpu")
        changed = {
            f.name
            for f in dataclasses.fields(configs)
            if getattr(configs, f.name) != getattr(default, f.name)
        }
        assert changed == {o.split(".")[0] for o in overrides}, name


def test_overrides_set_dataclass_fields_plain_fields_and_table_entries():
    from pagoda.kernels.attention.decode_config import DecodeTiles
    from pagoda.kernels.gemv.config import GemvTiles
    from pagoda.kernels.moe.config import DownTiles

    configs = variants.configs_for(
        "decode.tiles_fp8=64,4,5+decode.short_context_splits=2+moe.narrow_down=2,,1,3"
        "+gemv.table[7,7,1]=8,256,1,3,4,1",
        "cpu",
    )
    assert configs.decode.tiles_fp8 == DecodeTiles(64, 4, 5)  # min_block_h: its default
    assert configs.decode.short_context_splits == 2
    assert configs.moe.narrow_down == DownTiles(2, None, 1, 3)
    assert configs.gemv.table[(7, 7, 1)] == GemvTiles(8, 256, 1, 3, 4, True)
    assert (7, 7, 1) not in variants.configs_for("default", "cpu").gemv.table  # a copy


@pytest.mark.parametrize(
    "name, message",
    [
        ("no-such-variant", "unknown kernel variant"),
        ("decode.no_field=1", "has no field"),
        ("nothing.tiles_fp8=1", "no kernel family"),
        ("decode.tiles_fp8=1,2,3,4,5", "has 4 fields"),
        ("decode.short_context_splits[1,2]=3", "is no table"),
    ],
)
def test_bad_variants_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        variants.configs_for(name, "cpu")


def test_the_kernel_timer_parses_every_mode():
    from benchmarks import kernels

    for mode in kernels.MODES:
        args = kernels.parse_args([mode, "--smoke"])
        assert args.mode == mode and args.smoke
    args = kernels.parse_args(["decode", "--config", "fp8-tiles-64-keys"])
    assert variants.variant_names(args) == ["fp8-tiles-64-keys"]
    args = kernels.parse_args(["steps", "--variants", "default,short-splits-4"])
    assert variants.variant_names(args) == ["default", "short-splits-4"]


def test_steps_mode_runs_each_variant_each_round_on_a_tiny_model():
    """The A/B loop on the CPU (no graphs there): two requests decoding together, two
    variants taking turns for two rounds, the runner back on the default configs."""
    from benchmarks.kernel_bench import steps
    from benchmarks.kernel_bench.common import Run

    args = argparse.Namespace(
        preset="tiny-llama",
        variants="default,moe-down-2x1w-s3",
        max_model_len=128,
        batch=2,
        max_num_batched_tokens=None,
        quantization=None,
        kv_cache_dtype="auto",
        prompt=12,
        tokens=6,
        rounds=2,
    )
    run = Run("cpu", torch.float32, "graph", 1, True, {})
    rows = steps.run_steps(args, run)["rows"]
    assert [r["variant"] for r in rows] == ["default", "moe-down-2x1w-s3"]
    assert all(len(r["ms_per_step"]) == 2 and r["median_ms"] > 0 for r in rows)


def test_the_runner_installs_a_variant_on_its_layers_and_backend():
    """use_kernel_configs gives every linear layer the variant's GEMV table and the
    attention backend a new decode config (what the steps mode relies on)."""
    from pagoda import LLM

    llm = LLM(
        "tiny-llama",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_model_len=64,
        skip_tokenizer_init=True,
        kv_cache_memory=1 << 22,
    )
    runner = llm.llm_engine.executor.runner
    configs = variants.configs_for("qwen3-qkv-8x256-s3", "cpu")
    runner.use_kernel_configs(configs)
    from pagoda.model.layers.linear import LinearBase

    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.gemv_config is configs.gemv for m in layers)
    assert runner.kernel_configs is configs
    llm.llm_engine.shutdown()
