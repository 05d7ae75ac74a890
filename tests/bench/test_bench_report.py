"""Reports: the JSON schema, the CLI end to end against a fake server, compare and plot."""

import argparse
import json

import pytest

from pagoda.bench import metrics as m
from pagoda.bench.cli import build_bench_parser, main, parse_goodput
from pagoda.bench.compare import compare_reports, format_markdown, format_table
from pagoda.bench.metrics import RequestResult
from pagoda.bench.plot import load_axis, write_plots
from pagoda.bench.report import (
    SCHEMA_VERSION,
    length_buckets,
    load_report,
    save_report,
    serve_report,
    validate_report,
)
from pagoda.bench.serve import RunOutcome, plan_from_args


def parse(argv):
    return build_bench_parser(argparse.ArgumentParser(prog="pagoda bench")).parse_args(argv)


def recorded_results(scale=1.0):
    """Three completed requests, one 429 and one never sent (times scaled by `scale`)."""

    def t(x):
        return x * scale

    return [
        RequestResult(
            10,
            4,
            start=0.0,
            end=t(1.5),
            chunk_times=[t(0.5), t(0.75), t(1.0), t(1.5)],
            output_tokens=4,
            success=True,
        ),
        RequestResult(
            300,
            2,
            start=t(0.25),
            end=t(2.5),
            chunk_times=[t(1.25), t(2.25)],
            output_tokens=2,
            success=True,
        ),
        RequestResult(
            7, 8, start=t(1.0), end=t(1.125), status=429, error_kind="http_429", error="full"
        ),
        RequestResult(9, 8),
        RequestResult(
            5, 1, start=t(2.0), end=t(2.75), chunk_times=[t(2.5)], output_tokens=1, success=True
        ),
    ]


def make_report(label="A", rate="inf", concurrency=None, scale=1.0, goodput=None):
    argv = ["serve", "--model", "m", "--label", label, "--request-rate", str(rate)]
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    args = parse(argv)
    args.goodput = parse_goodput(goodput)
    results = recorded_results(scale)
    outcome = RunOutcome(results, 4.0 * scale, False, {}, {"available": False, "reason": "test"})
    summary = m.summarize(
        results, outcome.duration, args.percentile_metrics, args.metric_percentiles, args.goodput
    )
    return serve_report(args, plan_from_args(args), summary, outcome, "toy", "http://127.0.0.1:1")


def test_serve_report_schema():
    report = make_report(goodput=["ttft:600"])
    validate_report(report)
    assert report["schema_version"] == SCHEMA_VERSION and report["kind"] == "serve"
    assert report["request_rate"] == "inf"
    assert report["config"]["request_rate"] == "inf"
    assert (report["completed"], report["failed"], report["not_sent"]) == (3, 1, 1)
    assert report["request_goodput"] == 2 / 4.0
    assert report["goodput_slos_ms"] == {"ttft": 600.0}
    assert report["errors"] == ["http_429: full"]
    assert report["requests"]["ttft_ms"] == [500.0, 1000.0, None, None, 500.0]
    assert report["requests"]["error_kinds"] == [None, None, "http_429", "not_sent", None]
    assert report["requests"]["output_lens"] == [4, 2, None, None, 1]
    assert "itls_ms" not in report["requests"]
    for key in ("p50_ttft_ms", "p90_tpot_ms", "p95_itl_ms", "p99_e2el_ms", "std_ttft_ms"):
        assert key in report
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN or Infinity


def test_buckets_group_by_length():
    rows = length_buckets(recorded_results())
    assert [(r["input_len"], r["output_len"], r["count"], r["completed"]) for r in rows] == [
        ("4-7", "1", 1, 1),
        ("4-7", "8-15", 1, 0),
        ("8-15", "4-7", 1, 1),
        ("256-511", "2-3", 1, 1),
    ]
    assert rows[0]["mean_ttft_ms"] == 500.0
    assert rows[1]["mean_ttft_ms"] is None  # only a failed request there


def test_validate_report_names_the_problem(tmp_path):
    report = make_report()
    for mutate, message in [
        (lambda r: r.update(schema_version=2), "schema_version must be 1"),
        (lambda r: r.update(kind="other"), "kind must be one of"),
        (lambda r: r.pop("completed"), "missing key 'completed'"),
        (lambda r: r.update(completed="3"), "'completed' must be int"),
        (lambda r: r.update(completed=True), "'completed' must be int"),
    ]:
        broken = json.loads(json.dumps(report))
        mutate(broken)
        with pytest.raises(ValueError, match=message):
            validate_report(broken)
    path = save_report(report, str(tmp_path), "r.json")
    assert load_report(path) == json.loads(json.dumps(report))
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_report(str(tmp_path / "junk.json"))


def test_cli_serve_end_to_end(fake_server, tmp_path):
    code = main(
        [
            "serve",
            "--base-url",
            fake_server.url,
            "--num-prompts",
            "6",
            "--random-input-len",
            "20",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "0.5",
            "--num-warmups",
            "1",
            "--disable-tqdm",
            "--goodput",
            "ttft:60000",
            "e2el:60000",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "run.json",
            "--metrics-interval",
            "0",
        ]
    )
    assert code == 0
    report = load_report(str(tmp_path / "run.json"))
    assert report["model_id"] == "ok"  # discovered from /v1/models
    assert report["tokenizer_id"].startswith("server:")
    assert (report["completed"], report["failed"], report["num_prompts"]) == (6, 0, 6)
    bodies = fake_server.bodies[1:]  # the first one was the warmup
    assert report["total_output_tokens"] == sum(b["max_tokens"] for b in bodies)  # from usage
    assert all(2 <= b["max_tokens"] <= 8 for b in bodies)  # 5 * [0.5, 1.5], floor and ceil
    assert report["request_goodput"] == 6 / report["duration"]
    assert report["server_metrics"]["available"] and report["server_metrics"]["preemptions"] == 2
    # Token-exact prompts: the fake server counts prompt + BOS in usage.
    counts = sorted(len(fake_server.tokenizer.encode(b["prompt"])) for b in bodies)
    assert sorted(report["requests"]["input_lens"]) == [c + 1 for c in counts]
    assert all(10 <= c <= 30 for c in counts)
    itls = report["requests"]["itls_ms"]  # one token per chunk: output_len - 1 gaps each
    assert [len(x) for x in itls] == [n - 1 for n in report["requests"]["output_lens"]]


def test_cli_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--percentile-metrics", "ttft,latency"])
    with pytest.raises(SystemExit):
        parse(["serve", "--metric-percentiles", "0,50"])
    with pytest.raises(SystemExit):
        parse(["serve", "--request-rate", "0"])
    assert (
        main(["serve", "--base-url", "http://127.0.0.1:1", "--model", "m", "--goodput", "itl:5"])
        == 2
    )
    assert "--goodput takes NAME:MS" in capsys.readouterr().err
    assert main(["serve", "--base-url", "127.0.0.1:1", "--model", "m"]) == 2
    assert "base_url must be" in capsys.readouterr().err


def test_cli_without_tokenizer_says_why(bare_server, capsys):
    assert (
        main(["serve", "--base-url", bare_server.url, "--model", "ok", "--num-prompts", "2"]) == 2
    )
    err = capsys.readouterr().err
    assert "needs a tokenizer" in err and "HTTP 404" in err


def test_compare_deltas_ratios_and_verdicts():
    a, b = make_report("A", scale=1.0), make_report("B", scale=0.5)  # B: everything twice as fast
    table = compare_reports([a, b], ["A", "B"])
    rows = {r["metric"]: r for r in table["rows"]}
    assert rows["output_throughput"]["values"] == [7 / 4.0, 7 / 2.0]
    assert rows["output_throughput"]["deltas"] == [7 / 2.0 - 7 / 4.0]
    assert rows["output_throughput"]["ratios"] == [2.0]
    assert rows["output_throughput"]["verdicts"] == ["better"]
    assert rows["mean_ttft_ms"]["ratios"] == [0.5] and rows["mean_ttft_ms"]["verdicts"] == [
        "better"
    ]
    assert rows["completed"]["verdicts"] == [""]  # equal
    worse = compare_reports([b, a], ["B", "A"])
    assert {r["metric"]: r for r in worse["rows"]}["p99_ttft_ms"]["verdicts"] == ["worse"]
    assert "request_goodput" not in rows  # no SLOs in either run: the row is left out
    text = format_table(table)
    assert text.splitlines()[0].split() == ["metric", "A", "B", "delta", "ratio"]
    assert "2.000x" in text and "better" in text
    md = format_markdown(table)
    assert md.startswith("| metric | A | B | delta | ratio |  |") and "| output_throughput |" in md


def test_compare_cli_and_errors(tmp_path, capsys):
    pa = save_report(make_report("A"), str(tmp_path), "a.json")
    pb = save_report(make_report("B", scale=2.0), str(tmp_path), "b.json")
    out = tmp_path / "cmp.md"
    assert (
        main(
            [
                "compare",
                pa,
                pb,
                "--format",
                "markdown",
                "--metrics",
                "output_throughput,server_metrics.available,mean_e2el_ms",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    written = out.read_text()
    assert "| output_throughput | 1.75 | 0.88 | -0.88 | 0.500x | worse |" in written
    assert "| mean_e2el_ms | 1500.00 | 3000.00 | +1500.00 | 2.000x | worse |" in written
    assert "server_metrics.available" not in written  # not a number
    assert main(["compare", pa]) == 2
    assert "at least two" in capsys.readouterr().err


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plots_are_valid_pngs(tmp_path):
    reports = [
        make_report(label, rate=r, scale=s)
        for label, shift in (("pagoda", 1.0), ("peer", 1.5))
        for r, s in ((1, 0.5 * shift), (2, 0.75 * shift), (4, 1.0 * shift))
    ]
    paths = write_plots(reports, str(tmp_path / "plots"), dpi=50)
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "latency_cdf.png",
        "throughput_vs_rate.png",
        "p99_ttft_vs_rate.png",
    ]
    from PIL import Image

    for path in paths:
        width, height = _png_size(path)
        assert width > 100 and height > 100
        with Image.open(path) as image:
            image.verify()
            assert image.size == (width, height)
    assert load_axis(reports)[:2] == ("request rate (req/s)", [1.0, 2.0, 4.0, 1.0, 2.0, 4.0])


def test_plot_axis_falls_back_to_concurrency_or_order():
    by_conc = [make_report(concurrency=c) for c in (1, 8)]
    assert load_axis(by_conc)[:2] == ("max concurrency", [1.0, 8.0])
    mixed = [make_report(rate=2), make_report(rate="inf")]
    assert load_axis(mixed) == ("request rate (req/s)", [0.0, 1.0], ["2", "inf"])


def test_plot_cli(tmp_path):
    paths = [save_report(make_report("A", rate=r), str(tmp_path), f"a{r}.json") for r in (1, 2)]
    assert main(["plot", *paths, "--output-dir", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "latency_cdf.png",
        "p99_ttft_vs_rate.png",
        "throughput_vs_rate.png",
    ]


def test_compare_server_with_offline_engine():
    serve = make_report("server")
    offline = {
        "schema_version": 1,
        "kind": "throughput",
        "date": "d",
        "label": "offline",
        "config": {},
        "model_id": "m",
        "num_prompts": 3,
        "elapsed_time": 2.0,
        "requests_per_second": 1.5,
        "tokens_per_second": 21.0,
        "output_tokens_per_second": 3.5,
    }
    validate_report(offline)
    table = compare_reports([offline, serve], ["offline", "server"])
    rows = {r["metric"]: r for r in table["rows"]}
    assert rows["output_throughput"]["values"] == [3.5, 7 / 4.0]
    assert rows["output_throughput"]["ratios"] == [0.5]
    assert rows["duration"]["values"] == [2.0, 4.0] and rows["duration"]["verdicts"] == ["worse"]
    latency = dict(offline, kind="latency")
    with pytest.raises(ValueError, match="cannot compare reports of kinds"):
        compare_reports([latency, serve], ["a", "b"])
