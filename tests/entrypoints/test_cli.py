"""The `pagoda` command's parser and its user-facing errors: --version, --log-level on
every subcommand, defaults in --help, "did you mean" for mistyped flags naming the
subcommand's usage, --device cuda without a GPU, and generate's context-length check."""

from __future__ import annotations

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
