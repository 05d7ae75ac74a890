"""`bench throughput` and `bench latency` on the offline engine (tiny dummy-weight model, CPU)."""

import json

import pytest

pytest.importorskip("pagoda.entrypoints.llm")

from pagoda.bench.cli import main  # noqa: E402
from pagoda.bench.offline import random_token_prompts, run_batch_steps  # noqa: E402

TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_llm():
    from pagoda import LLM

    with LLM(model="tiny-llama", load_format="dummy", device="cpu") as llm:
        yield llm


def test_batch_steps_split_prefill_from_decode(tiny_llm):
    import numpy as np

    from pagoda import SamplingParams

    prompts = random_token_prompts(list(range(3, 500)), [8, 8, 8], np.random.default_rng(0))
    assert [len(p) for p in prompts] == [8, 8, 8]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prefill, decode, e2e = run_batch_steps(tiny_llm.llm_engine, prompts, params)
    # One step prefills the whole batch (24 tokens fit the budget) and samples each
    # request's first token; the other 4 tokens take one decode step each.
    assert len(decode) == 4
    assert 0 < prefill <= e2e and sum(decode) <= e2e
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_throughput_cli(tmp_path):
    out = tmp_path / "tp.json"
    assert (
        main(
            [
                "throughput",
                *TINY,
                "--num-prompts",
                "6",
                "--input-len",
                "12",
                "--output-len",
                "5",
                "--random-range-ratio",
                "0.5",
                "--disable-tqdm",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["kind"] == "throughput" and report["num_prompts"] == 6
    # ignore_eos: every request generates exactly its requested length (2..8 here).
    assert 6 * 2 <= report["total_output_tokens"] <= 6 * 8
    assert 6 * 6 <= report["total_prompt_tokens"] <= 6 * 18
    assert (
        report["output_tokens_per_second"] == report["total_output_tokens"] / report["elapsed_time"]
    )
    assert report["engine"]["device"] == "cpu"


def test_latency_cli(tmp_path):
    out = tmp_path / "lat.json"
    assert (
        main(
            [
                "latency",
                *TINY,
                "--batch-size",
                "2",
                "--input-len",
                "6",
                "--output-len",
                "4",
                "--num-iters-warmup",
                "1",
                "--num-iters",
                "2",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert (report["kind"], report["batch_size"], report["num_iters"]) == ("latency", 2, 2)
    assert len(report["prefill_latencies_ms"]) == 2 and len(report["e2e_latencies_ms"]) == 2
    for key in ("prefill_latency_ms", "decode_step_latency_ms", "e2e_latency_ms"):
        assert set(report[key]) == {"mean", "median", "std", "p50", "p90", "p99"}
    assert report["decode_step_latency_ms"]["mean"] > 0


def test_latency_rejects_a_batch_that_cannot_run_at_once(capsys):
    assert main(["latency", *TINY, "--max-num-seqs", "2", "--batch-size", "3"]) == 2
    assert "batch_size 3 is larger than max_num_seqs 2" in capsys.readouterr().err
