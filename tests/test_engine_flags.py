"""Engine flags defined once (pagoda.engine_flags): the CLI, EngineArgs and the nested
configs agree on every default; sizes with units; engine errors spelled as CLI flags;
usage errors as the error line then one usage line."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from pagoda.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineArgs,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from pagoda.engine_flags import ENGINE_FLAGS, FLAG_GROUPS, GIB, cli_flag, parse_bytes, parse_gib
from pagoda.entrypoints import cli
from pagoda.entrypoints.cli_args import (
    add_engine_args,
    cli_error_message,
    engine_args_from_namespace,
)

NESTED = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    StructuredOutputsConfig,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def _run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- one definition, no drift -------------------------------------------------------


def test_cli_defaults_parse_to_the_dataclass_defaults():
    ns = _parser().parse_args([])
    for name, field in ENGINE_FLAGS.items():
        assert getattr(ns, name) == field.default, name
    assert engine_args_from_namespace(ns) == EngineArgs()
    assert set(vars(ns)) == EngineArgs.field_names()


def test_every_nested_field_comes_from_a_flag_with_the_same_default():
    used, resolved = set(), set()
    for cls in NESTED:
        for field in dataclasses.fields(cls):
            flag = field.metadata.get("flag")
            assert flag in ENGINE_FLAGS, f"{cls.__name__}.{field.name} names no engine flag"
            used.add(flag)
            if (cls, field.name) != (SchedulerConfig, "async_scheduling"):  # None resolved
                assert field.default == ENGINE_FLAGS[flag].default, (cls.__name__, field.name)
            if field.metadata["resolved"]:
                resolved.add(flag)
    assert resolved == {"device", "max_num_batched_tokens", "kv_cache_memory", "async_scheduling"}
    # Every flag reaches a nested config (speculative_config through SpeculativeConfig).
    assert used | {"speculative_config"} == set(ENGINE_FLAGS)


def test_config_built_from_default_args_matches_the_nested_defaults():
    config = EngineArgs().create_engine_config()
    built = {
        ModelConfig: config.model,
        CacheConfig: config.cache,
        SchedulerConfig: config.scheduler,
        ParallelConfig: config.parallel,
        DeviceConfig: config.device,
        StructuredOutputsConfig: config.structured_outputs,
    }
    for cls, instance in built.items():
        own = cls()
        for field in dataclasses.fields(cls):
            if not field.metadata["resolved"]:  # device, budget, ...: resolved per machine
                assert getattr(instance, field.name) == getattr(own, field.name), field.name
    assert config.speculative is None


def test_flags_keep_their_names_aliases_choices_and_actions():
    parser = _parser()
    actions = parser._option_string_actions
    for name, field in ENGINE_FLAGS.items():
        action = actions[cli_flag(name)]
        assert action.dest == name and action.help == field.metadata["help"]
        assert action.choices == field.metadata["choices"]
    assert actions["-tp"] is actions["--tensor-parallel-size"]
    assert actions["-q"] is actions["--quantization"]
    ns = parser.parse_args(
        [
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--no-async-scheduling",
            "--enforce-eager",
            "-tp",
            "2",
            "-q",
            "int8",
            "--block-size",
            "32",
        ]
    )
    assert (ns.enable_prefix_caching, ns.enable_chunked_prefill, ns.async_scheduling) == (
        False,
        False,
        False,
    )
    assert (ns.enforce_eager, ns.tensor_parallel_size, ns.quantization, ns.block_size) == (
        True,
        2,
        "int8",
        32,
    )
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "12"])


def test_help_is_grouped_in_order():
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    positions = [help_text.index(f"\n{title}:\n") for title in FLAG_GROUPS]
    assert positions == sorted(positions)
    kv = help_text[positions[1] : positions[2]]
    assert "--kv-cache-memory SIZE" in kv
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in kv


def test_config_modules_stay_torch_free():
    code = "import sys, pagoda.config, pagoda.engine_flags; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [
        ("2GiB", 2 * GIB),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("1e9", 10**9),
        ("1073741824", GIB),
        (" 2 gib ", 2 * GIB),
        ("2g", 2 * GIB),
        ("64KB", 64_000),
        ("3B", 3),
    ],
)
def test_sizes_in_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    "text, gib", [("4", 4.0), ("0.5", 0.5), ("512MiB", 0.5), ("2GiB", 2.0), ("1TiB", 1024.0)]
)
def test_sizes_in_gib(text, gib):
    assert parse_gib(text) == gib


@pytest.mark.parametrize("text", ["2GB x", "", "GiB", "abc", "-1", "2XB", "1,5GB", "inf"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match=r"cannot read .* as a size; use e\.g\. 2GiB or 512MiB"):
        parse_bytes(text)


def test_size_flags_take_units_and_a_bare_number_keeps_its_unit():
    parser = _parser()
    ns = parser.parse_args(
        [
            "--kv-cache-memory",
            "2GiB",
            "--kv-offloading-size",
            "512MiB",
            "--kv-offloading-disk-size",
            "1.5GB",
        ]
    )
    assert ns.kv_cache_memory == 2 * GIB and ns.kv_offloading_size == 0.5
    assert ns.kv_offloading_disk_size == pytest.approx(1.5e9 / GIB)
    ns = parser.parse_args(["--kv-cache-memory", "1048576", "--kv-offloading-size", "4"])
    assert ns.kv_cache_memory == 1 << 20 and isinstance(ns.kv_cache_memory, int)
    assert ns.kv_offloading_size == 4.0
    for name, unit in (
        ("kv_cache_memory", "bytes"),
        ("kv_offloading_size", "GiB"),
        ("kv_offloading_disk_size", "GiB"),
    ):
        assert f"a bare number is {unit}" in ENGINE_FLAGS[name].metadata["help"]


def test_bad_size_on_the_cli_is_one_line_naming_the_flag(capsys):
    code, _, err = _run(capsys, "serve", "--kv-cache-memory", "2GB x")
    assert code == 2
    error, usage = err.strip().splitlines()
    assert error.endswith(
        "--kv-cache-memory: cannot read '2GB x' as a size; use e.g. 2GiB or 512MiB"
    )
    assert usage.startswith("usage: pagoda serve [options]")


def test_sizes_through_the_python_api():
    config = EngineArgs.from_kwargs(
        device="cpu", kv_cache_memory="64MiB", kv_offloading_size="256MiB"
    ).create_engine_config()
    assert config.cache.kv_cache_memory == 64 << 20 and config.cache.kv_offloading_size == 0.25
    assert (
        EngineArgs(device="cpu", kv_cache_memory=1 << 20)
        .create_engine_config()
        .cache.kv_cache_memory
        == 1 << 20
    )
    with pytest.raises(ConfigError, match="kv_cache_memory: cannot read '2GB x' as a size"):
        EngineArgs(device="cpu", kv_cache_memory="2GB x").create_engine_config()


def test_llm_takes_a_size_with_a_unit():
    from pagoda.entrypoints.llm import LLM

    llm = LLM(
        model="tiny-llama",
        load_format="dummy",
        device="cpu",
        kv_cache_memory="8MiB",
        max_model_len=64,
    )
    assert llm.llm_engine.config.cache.kv_cache_memory == 8 << 20


# ---- errors name CLI flags ----------------------------------------------------------


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "'tiny' is a preset: pass load_format='dummy' to run it",
            "'tiny' is a preset: pass --load-format dummy to run it",
        ),
        (
            "this model has no tokenizer: pass token ids, or set tokenizer=",
            "this model has no tokenizer: pass token ids, or set --tokenizer",
        ),
        ('use device="cpu" instead', "use --device cpu instead"),
        (
            "raise kv_cache_memory / gpu_memory_utilization or lower max_model_len",
            "raise --kv-cache-memory / --gpu-memory-utilization or lower --max-model-len",
        ),
        # Not engine arguments, quoted, dotted or in a path: left alone.
        (
            "max_tokens=5 in 'max_model_len' at config.max_model_len or /a/max_model_len",
            "max_tokens=5 in 'max_model_len' at config.max_model_len or /a/max_model_len",
        ),
        ("the model is too large for this device", "the model is too large for this device"),
    ],
)
def test_error_messages_name_flags(message, expected):
    assert cli_error_message(ValueError(message)) == expected


def test_config_errors_name_their_fields_as_flags():
    with pytest.raises(ConfigError) as info:
        ModelConfig(dtype="float8")
    assert info.value.fields == ("dtype",)
    assert cli_error_message(info.value).startswith("--dtype must be one of auto, ")
    with pytest.raises(ConfigError) as info:
        StructuredOutputsConfig(thinking_token_budget=3)
    assert cli_error_message(info.value) == (
        "--thinking-token-budget needs a --reasoning-parser (deepseek_r1, qwen3)"
    )


def test_cli_prints_engine_errors_with_flags(capsys):
    code, out, err = _run(
        capsys,
        "--log-level",
        "warning",
        "generate",
        "hi",
        "--device",
        "cpu",
        "--model",
        "tiny-llama",
    )
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: 'tiny-llama' is a preset (a shape without weights): pass --load-format dummy "
        "to run it with random weights"
    ]
    code, _, err = _run(capsys, "generate", "hi", "--device", "cpu", "--max-model-len", "1")
    assert code == 2 and err.strip() == "error: --max-model-len must be an integer >= 2, got 1"


def test_usage_errors_are_one_error_line_then_one_usage_line(capsys):
    code, _, err = _run(capsys, "serve", "--max-model-length", "512")
    assert code == 2
    assert err.strip().splitlines() == [
        "pagoda serve: error: unrecognized arguments: --max-model-length; "
        "did you mean --max-model-len?",
        "usage: pagoda serve [options] [model_tag] (pagoda serve --help lists the options)",
    ]
    code, _, err = _run(capsys, "generate")
    assert err.strip().splitlines()[1].startswith("usage: pagoda generate [options] prompts")
