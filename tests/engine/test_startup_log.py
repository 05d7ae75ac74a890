"""The engine's start-up summary (pagoda.engine.startup_log): a line for the model, the
weights' storage, the KV cache and the limits, and one for each feature that is on."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from pagoda.engine.startup_log import kv_offload_line, size_text, speculation_line

LOGGER = "pagoda.engine.startup_log"


def _startup_lines(caplog, model=None, **kwargs) -> list[str]:
    """The summary an LLM(model, **kwargs) logs, without its 'engine ready' line."""
    from pagoda.entrypoints.llm import LLM

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llm = LLM(model, device="cpu", **kwargs)
    llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert re.fullmatch(r"engine ready in \d+\.\ds", lines[-1]), lines
    return lines[:-1]


def test_int4_with_ngram_speculation_names_both(caplog):
    lines = _startup_lines(
        caplog,
        "tiny-llama",
        load_format="dummy",
        quantization="int4",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        max_num_seqs=4,
        kv_cache_memory="4MiB",
    )
    assert lines[:3] == [
        "model tiny-llama: LlamaForCausalLM on cpu, activations float32",
        "weights: int4 blocks (Q4_1 ×8 linear layers; LM head Q8_0), 0.3 MiB",
        "KV cache: 512 blocks of 16 tokens (8192 tokens, float32, 4.0 MiB); prefix caching on",
    ]
    assert lines[3].startswith("limits: max_model_len 512, max_num_seqs 4, max_num_batched_tokens ")
    assert "speculative decoding: ngram, k=3 (adaptive per step); n-grams of 2-5 tokens" in lines
    assert lines[-1] == "no tokenizer: prompts and outputs are token ids; no structured output"
    assert not any(line.startswith(("KV offloading", "tensor parallel")) for line in lines)


def test_embedded_model_reports_its_gguf_blocks_and_the_kv_tier(caplog):
    lines = _startup_lines(
        caplog, max_model_len=256, kv_cache_memory="16MiB", kv_offloading_size=0.01
    )
    assert lines[0].endswith(
        "SmolLM2-135M-Instruct.Q4_1.gguf: LlamaForCausalLM on cpu, activations float32"
    )
    assert re.fullmatch(
        r"weights: gguf blocks \(Q4_1 ×120 linear layers; LM head Q8_0\), \d+\.\d MiB", lines[1]
    ), lines[1]
    assert not any("float32 on cpu" in line for line in lines)
    assert lines[3].startswith("limits: max_model_len 256, ")
    assert re.fullmatch(r"KV offloading: cpu 10\.2 MiB \(\d+ blocks\)", lines[4]), lines[4]
    assert lines[5].startswith("structured output: ")


def test_float_weights_are_named_by_their_dtype():
    from pagoda.model.loader import load_model
    from pagoda.model.quant.registry import describe_weights

    model, _ = load_model("tiny-llama", "dummy", "float32", "cpu")
    assert describe_weights(model) == "float32"
    model, _ = load_model("tiny-llama", "dummy", "float32", "cpu", quantization="int8")
    assert describe_weights(model) == "int8 blocks (Q8_0 ×8 linear layers; LM head Q8_0)"


def test_kv_offload_line_gives_each_tiers_size_and_place():
    cache = SimpleNamespace(
        kv_offloading_size=0.5,
        kv_offloading_disk_path="/var/kv",
        kv_offloading_disk_size=4.0,
        kv_offloading_tier=None,
    )
    assert kv_offload_line(cache, [("cpu", 100), ("disk", 800)]) == (
        "KV offloading: cpu 512.0 MiB (100 blocks), disk /var/kv 4.00 GiB (800 blocks)"
    )
    cache.kv_offloading_tier = "my_tiers:RemoteTier"
    assert kv_offload_line(cache, [("cpu", 100), ("remote", 50)]) == (
        "KV offloading: cpu 512.0 MiB (100 blocks), remote (my_tiers:RemoteTier) (50 blocks)"
    )


@pytest.mark.parametrize(
    "spec,line",
    [
        (
            dict(method="layer_skip", num_speculative_tokens=2, num_layers=29, adaptive=False),
            "speculative decoding: layer_skip, k=2 (fixed); the first 29 layers draft",
        ),
        (
            dict(method="draft_model", num_speculative_tokens=4, model="tiny-llama", adaptive=True),
            "speculative decoding: draft_model, k=4 (adaptive per step); draft model tiny-llama",
        ),
    ],
)
def test_speculation_line_names_method_k_and_drafter(spec, line):
    assert speculation_line(SimpleNamespace(**spec)) == line


def test_sizes_read_as_mib_below_a_gib():
    assert size_text(98.3 * (1 << 20)) == "98.3 MiB"
    assert size_text(1 << 30) == "1.00 GiB"
