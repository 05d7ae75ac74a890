"""`--backend` names: Pagoda's two protocols, vLLM's OpenAI-compatible aliases, clear refusals."""

import argparse

import pytest

from pagoda.bench.backends import ALIASES, BACKENDS, resolve_backend
from pagoda.bench.cli import build_bench_parser
from pagoda.bench.serve import make_target


def parse(argv):
    return build_bench_parser(argparse.ArgumentParser(prog="pagoda bench")).parse_args(argv)


@pytest.mark.parametrize(
    "name,protocol",
    [
        ("openai", "openai"),
        ("openai-chat", "openai-chat"),
        ("vllm", "openai"),
        ("sglang", "openai"),
        ("lmdeploy", "openai"),
        ("scalellm", "openai"),
        ("llama.cpp", "openai"),
    ],
)
def test_vllm_backend_names_parse_to_the_protocol_they_send(name, protocol):
    for command in ("serve", "sweep"):
        extra = ["--request-rates", "1"] if command == "sweep" else []
        args = parse([command, "--backend", name, "--model", "m", *extra])
        assert args.backend == protocol
    target = make_target(parse(["serve", "--backend", name, "--model", "m"]), "http://127.0.0.1:1")
    assert target.url == "http://127.0.0.1:1" + BACKENDS[protocol]


def test_default_backend_is_openai_completions():
    assert parse(["serve", "--model", "m"]).backend == "openai"


@pytest.mark.parametrize(
    "name,words",
    [
        ("tgi", "openai-chat"),
        ("tensorrt-llm", "Triton"),
        ("deepspeed-mii", "MII"),
        ("openai-embeddings", "embeddings"),
        ("vllm-rerank", "reranking"),
        ("openai-audio", "transcription"),
        ("vlm", "unknown backend"),
    ],
)
def test_other_names_fail_with_what_to_use(name, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "--backend", name])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --backend" in err and name in err and words in err


def test_every_alias_names_a_real_protocol():
    assert set(ALIASES.values()) <= set(BACKENDS)
    assert not set(ALIASES) & set(BACKENDS)
    with pytest.raises(ValueError, match="openai, openai-chat"):
        resolve_backend("nope")
