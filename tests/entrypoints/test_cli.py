"""The `pagoda` command's parser and its user-facing errors: --version, --log-level on
every subcommand, defaults in --help, "did you mean" for mistyped flags naming the
subcommand's usage, --device cuda without a GPU, generate's context-length check, a
text command on a preset shape without a tokenizer (refused before anything loads), and
engine errors spelled as flags."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import pagoda
from pagoda.entrypoints import cli


def _run(capsys, *argv):
    """(exit status, stdout, stderr) of `pagoda argv...`, whether it returns or exits."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"pagoda {pagoda.__version__}"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--log-level", "info"],
        ["--log-level", "INFO", "serve"],
        ["generate", "hi", "--log-level", "debug"],
        ["chat", "--log-level", "warning"],
        ["bench", "serve", "--log-level", "error"],
    ],
)
def test_log_level_accepted_before_and_after_any_subcommand(argv):
    ns = cli.build_parser().parse_args(argv)
    assert ns.log_level in ("DEBUG", "INFO", "WARNING", "ERROR")


def test_log_level_default_is_info_and_not_overwritten_by_the_subcommand():
    assert cli.build_parser().parse_args(["serve"]).log_level == "INFO"
    assert cli.build_parser().parse_args(["--log-level", "debug", "serve"]).log_level == "DEBUG"


def test_help_shows_defaults(capsys):
    code, out, _ = _run(capsys, "generate", "--help")
    assert code == 0
    flat = " ".join(out.split())  # argparse wraps help text
    assert "tokens to generate at most (default: 128)" in flat
    assert "0 means greedy (default: 0.7)" in flat
    assert "(0: off) (default: 0)" in flat  # a zero default is shown too


@pytest.mark.parametrize(
    "argv, usage, suggestion",
    [
        (["serve", "--max-model-length", "512"], "usage: pagoda serve", "--max-model-len"),
        (["generate", "hi", "--max-tokns", "5"], "usage: pagoda generate", "--max-tokens"),
        (["bench", "serve", "--num-promts", "3"], "usage: pagoda bench serve", "--num-prompts"),
        (["chat", "--temprature=0.5"], "usage: pagoda chat", "--temperature"),
    ],
)
def test_mistyped_flag_names_the_subcommand_and_suggests(capsys, argv, usage, suggestion):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    hint, usage_line = err.strip().splitlines()  # the hint first, then one usage line
    assert hint.startswith(usage[len("usage: ") :] + ": error: unrecognized arguments")
    assert hint.endswith(f"did you mean {suggestion}?")
    assert usage_line.startswith(usage + " [options]")


def test_unknown_flag_without_a_close_match_has_no_suggestion(capsys):
    code, _, err = _run(capsys, "serve", "--zzzz")
    assert code == 2 and "unrecognized arguments: --zzzz" in err and "did you mean" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_gpu_names_the_flag(capsys):
    code, _, err = _run(capsys, "generate", "hi", "--device", "cuda")
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --device cuda: no CUDA GPU is available on this machine; use --device cpu "
        "(or leave --device out to pick automatically)"
    ]


def test_generate_checks_the_context_length(capsys):
    code, out, err = _run(
        capsys,
        "--log-level",
        "warning",
        "generate",
        "Hello there",
        "--device",
        "cpu",
        "--max-model-len",
        "128",
        "--max-tokens",
        "9000",
    )
    assert code == 2 and out == ""
    assert "error: this model's maximum context length is 128 tokens" in err
    assert "lower --max-tokens" in err and "Traceback" not in err


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if the command gets as far as building an engine; records the
    parsed flags it would have built it from."""
    seen = []

    def make_llm(ns):
        seen.append(ns)
        raise AssertionError("the engine was built")

    monkeypatch.setattr(cli, "_make_llm", make_llm)
    return seen


TEXT_ARGVS = [
    ["generate", "hi"],
    ["chat"],
    pytest.param(
        ["serve"],
        marks=pytest.mark.skipif(
            importlib.util.find_spec("fastapi") is None, reason="no server stack"
        ),
    ),
]


@pytest.mark.parametrize("argv", TEXT_ARGVS)
def test_preset_without_tokenizer_fails_before_loading_naming_the_flag(capsys, no_engine, argv):
    model = ["llama-3.1-8b"] if argv[0] == "serve" else ["--model", "llama-3.1-8b"]
    args = argv + model + ["--load-format", "dummy"]
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == "" and not no_engine
    serve_hint = ", or --skip-tokenizer-init to serve token ids" if argv[0] == "serve" else ""
    assert err.strip().splitlines() == [
        "error: llama-3.1-8b is a preset shape with random weights and no tokenizer: pass "
        "--tokenizer (a GGUF file, or a Hugging Face directory or hub id with the same "
        f"vocabulary){serve_hint}"
    ]


def test_the_embedded_models_shape_takes_its_tokenizer(no_engine, smollm2_gguf):
    argv = ["generate", "hi", "--model", "smollm2-135m", "--load-format", "dummy"]
    with pytest.raises(AssertionError, match="the engine was built"):
        cli.main(argv)
    assert no_engine[0].tokenizer == str(smollm2_gguf)


def test_a_given_tokenizer_or_real_weights_need_no_check(no_engine, smollm2_gguf):
    argv = ["generate", "hi", "--model", "llama-3.1-8b", "--load-format", "dummy"]
    with pytest.raises(AssertionError, match="the engine was built"):
        cli.main(argv + ["--tokenizer", str(smollm2_gguf)])
    with pytest.raises(AssertionError, match="the engine was built"):
        cli.main(["generate", "hi", "--model", str(smollm2_gguf)])
    assert [ns.tokenizer for ns in no_engine] == [str(smollm2_gguf), None]


def test_text_commands_refuse_skip_tokenizer_init(capsys, no_engine):
    code, _, err = _run(capsys, "generate", "hi", "--skip-tokenizer-init")
    assert code == 2 and not no_engine
    assert err.strip() == (
        "error: pagoda generate takes text, and --skip-tokenizer-init leaves it no "
        "tokenizer: drop --skip-tokenizer-init"
    )


def test_engine_errors_read_as_flags(capsys):
    """A preset named without --load-format dummy, and a model that is nothing: the
    loader's errors in the flags' spelling, the presets listed from their one table."""
    from pagoda.model.presets import PRESET_NAMES

    code, _, err = _run(capsys, "generate", "hi", "--model", "qwen3-8b", "--device", "cpu")
    assert code == 2
    assert err.strip() == (
        "error: 'qwen3-8b' is a preset (a shape without weights): pass --load-format dummy "
        "to run it with random weights"
    )
    code, _, err = _run(capsys, "generate", "hi", "--model", "no-such-model", "--device", "cpu")
    assert code == 2 and "load_format" not in err and len(err.strip().splitlines()) == 1
    assert f"or a preset name ({', '.join(PRESET_NAMES)}) with --load-format dummy" in err


def test_getting_started_lists_every_preset_and_no_other():
    from pagoda.model.presets import PRESET_NAMES

    text = (Path(__file__).parents[2] / "docs" / "getting-started.md").read_text()
    start = text.index("Presets:")
    listed = re.findall(r"`([^`]+)`", text[start : text.index("`.", start) + 1])
    assert sorted(listed) == sorted(PRESET_NAMES)
