"""`bench sweep` against the fake server: one result file per load point, a summary, plots."""

import json

import pytest

from pagoda.bench.cli import main
from pagoda.bench.report import load_report


def test_sweep_over_request_rates(fake_server, tmp_path):
    assert (
        main(
            [
                "sweep",
                "--base-url",
                fake_server.url,
                "--model",
                "ok",
                "--num-prompts",
                "4",
                "--random-input-len",
                "10",
                "--random-output-len",
                "3",
                "--request-rates",
                "200,inf",
                "--result-dir",
                str(tmp_path),
                "--label",
                "fake",
                "--plot",
                "--disable-tqdm",
                "--metrics-interval",
                "0",
            ]
        )
        == 0
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "fake-rate200.json",
        "fake-rateinf.json",
        "latency_cdf.png",
        "p99_ttft_vs_rate.png",
        "sweep-fake.json",
        "throughput_vs_rate.png",
    ]
    slow, fast = (
        load_report(str(tmp_path / "fake-rate200.json")),
        load_report(str(tmp_path / "fake-rateinf.json")),
    )
    assert (slow["request_rate"], fast["request_rate"]) == (200.0, "inf")
    assert slow["completed"] == fast["completed"] == 4
    summary = json.loads((tmp_path / "sweep-fake.json").read_text())
    assert [p["request_rate"] for p in summary["points"]] == [200.0, "inf"]
    # The same prompts at every point: 2 points x 4 prompts, identical bodies per point.
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert sorted(prompts[:4]) == sorted(prompts[4:])


def test_sweep_over_concurrencies(fake_server, tmp_path):
    assert (
        main(
            [
                "sweep",
                "--base-url",
                fake_server.url,
                "--model",
                "ok",
                "--num-prompts",
                "3",
                "--random-input-len",
                "5",
                "--random-output-len",
                "2",
                "--max-concurrencies",
                "1,3",
                "--result-dir",
                str(tmp_path),
                "--label",
                "c",
                "--disable-tqdm",
                "--metrics-interval",
                "0",
            ]
        )
        == 0
    )
    one = load_report(str(tmp_path / "c-conc1.json"))
    assert one["max_concurrency"] == 1 and one["max_concurrent_requests"] == 1


@pytest.mark.parametrize("flags", [[], ["--request-rates", "1", "--max-concurrencies", "2"]])
def test_sweep_needs_exactly_one_axis(flags, capsys):
    assert main(["sweep", "--base-url", "http://127.0.0.1:1", "--model", "m", *flags]) == 2
    assert "exactly one of --request-rates and --max-concurrencies" in capsys.readouterr().err
