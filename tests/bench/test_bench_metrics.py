"""Metric definitions against hand-computed values from a recorded stream of timestamps.

Timestamps are multiples of 1/8 s so every difference is exact in binary floating
point; figures that involve a division are compared with the same division.
"""

import pytest

from pagoda.bench import metrics as m
from pagoda.bench.metrics import RequestResult


def recorded_run() -> list[RequestResult]:
    a = RequestResult(
        10, 4, start=0.0, end=1.5, chunk_times=[0.5, 0.75, 1.0, 1.5], output_tokens=4, success=True
    )
    b = RequestResult(
        20, 2, start=0.25, end=2.5, chunk_times=[1.25, 2.25], output_tokens=2, success=True
    )
    c = RequestResult(7, 8, start=1.0, end=1.125, status=429, error_kind="http_429", error="busy")
    d = RequestResult(9, 8)  # never sent
    e = RequestResult(5, 1, start=2.0, end=2.75, chunk_times=[2.5], output_tokens=1, success=True)
    return [a, b, c, d, e]


def test_per_request_definitions():
    a, b, c, d, e = recorded_run()
    assert (m.ttft(a), m.ttft(b), m.ttft(e)) == (0.5, 1.0, 0.5)
    assert m.itls(a) == [0.25, 0.25, 0.5]
    assert m.itls(b) == [1.0]
    assert m.itls(e) == []
    assert (m.e2el(a), m.e2el(b), m.e2el(e)) == (1.5, 2.25, 0.75)
    assert m.tpot(a) == (1.5 - 0.5) / (4 - 1)
    assert m.tpot(b) == 1.25
    assert m.tpot(e) is None  # one output token: TPOT is undefined
    assert m.ttft(c) is None and m.ttft(d) is None and m.e2el(d) is None


def test_tpot_uses_usage_tokens_not_chunks():
    # Two chunks that carried 6 tokens (e.g. speculative decoding): TPOT divides by 5.
    r = RequestResult(
        3, 6, start=0.0, end=1.5, chunk_times=[0.25, 1.5], output_tokens=6, success=True
    )
    assert m.tpot(r) == (1.5 - 0.25) / 5
    no_usage = RequestResult(3, 6, start=0.0, end=1.5, chunk_times=[0.25, 1.0, 1.5], success=True)
    assert m.output_token_count(no_usage) == 3
    assert m.tpot(no_usage) == (1.5 - 0.25) / 2


def test_summary_of_recorded_run():
    s = m.summarize(recorded_run(), duration=4.0, percentiles=[50, 99])
    assert (s["num_requests"], s["completed"], s["failed"], s["cancelled"], s["not_sent"]) == (
        5,
        3,
        1,
        0,
        1,
    )
    assert s["failures"] == {"http_429": 1}
    assert s["completed"] + s["failed"] + s["cancelled"] + s["not_sent"] == s["num_requests"]
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 7)
    assert s["request_throughput"] == 3 / 4.0
    assert s["output_throughput"] == 7 / 4.0
    assert s["total_token_throughput"] == 42 / 4.0
    # 1-second buckets: [0,1): 0.5, 0.75 -> 2; [1,2): 1.0, 1.5, 1.25 -> 3; [2,3): 2.25, 2.5 -> 2
    assert s["max_output_tokens_per_s"] == 3.0
    # At t=1.0 a, b and c are in flight.
    assert s["max_concurrent_requests"] == 3
    assert s["usage_missing"] == 0
    assert s["request_goodput"] is None
    assert s["mean_ttft_ms"] == pytest.approx(2000 / 3, rel=1e-12)
    assert s["median_ttft_ms"] == 500.0
    assert s["p50_ttft_ms"] == 500.0
    assert s["p99_ttft_ms"] == pytest.approx(500 + 0.98 * 500, rel=1e-12)  # linear interpolation
    assert s["mean_itl_ms"] == 500.0  # [250, 250, 500, 1000]
    assert s["median_itl_ms"] == 375.0
    assert s["mean_tpot_ms"] == pytest.approx((1000 / 3 + 1250) / 2, rel=1e-12)
    assert (s["mean_e2el_ms"], s["median_e2el_ms"]) == (1500.0, 1500.0)
    assert s["std_e2el_ms"] == pytest.approx((((0**2) + 750**2 + 750**2) / 3) ** 0.5, rel=1e-12)


@pytest.mark.parametrize(
    "slos,good",
    [
        ({"ttft": 600}, 2),  # a (500) and e (500) pass; b (1000) fails
        ({"tpot": 400}, 2),  # a 333 ms passes, b 1250 fails, e has no TPOT and passes
        ({"e2el": 1000}, 1),  # only e (750)
        ({"ttft": 600, "tpot": 300}, 1),  # a fails TPOT now; only e
        ({"ttft": 1000, "tpot": 1250, "e2el": 2250}, 3),  # limits are inclusive
    ],
)
def test_goodput(slos, good):
    s = m.summarize(recorded_run(), duration=4.0, goodput_slos_ms=slos)
    assert s["request_goodput"] == good / 4.0


def test_goodput_fails_ttft_without_content():
    r = RequestResult(3, 4, start=0.0, end=0.5, output_tokens=1, success=True)
    assert not m.meets_slos(r, {"ttft": 10_000})
    assert m.meets_slos(r, {"e2el": 10_000})
    with pytest.raises(ValueError, match="goodput metric"):
        m.meets_slos(r, {"itl": 5})


def test_peak_tokens_spread_usage_over_chunks():
    r1 = RequestResult(
        1, 6, start=0.0, end=1.5, chunk_times=[0.5, 1.5], output_tokens=6, success=True
    )
    r2 = RequestResult(
        1, 2, start=0.0, end=0.75, chunk_times=[0.25, 0.75], output_tokens=2, success=True
    )
    failed = RequestResult(
        1, 2, start=0.0, end=0.5, chunk_times=[0.25, 0.5], error_kind="connection_error"
    )
    # [0,1): 3 (r1) + 2 (r2) = 5; [1,2): 3. The failed request's chunks do not count.
    assert m.peak_output_tokens_per_second([r1, r2, failed]) == 5.0


def test_peak_concurrency_touching_intervals_do_not_overlap():
    rs = [
        RequestResult(1, 1, start=0.0, end=1.0),
        RequestResult(1, 1, start=1.0, end=2.0),
        RequestResult(1, 1, start=1.5, end=None),
    ]  # still in flight at the end
    assert m.peak_concurrency(rs) == 2
    assert m.peak_concurrency([]) == 0


def test_cancelled_are_counted_apart_from_failures():
    rs = recorded_run() + [
        RequestResult(4, 4, start=3.0, end=4.0, chunk_times=[3.5], error_kind=m.CANCELLED)
    ]
    s = m.summarize(rs, duration=4.0)
    assert (s["failed"], s["cancelled"]) == (1, 1)
    assert s["failures"] == {"cancelled": 1, "http_429": 1}
    assert s["completed"] + s["failed"] + s["cancelled"] + s["not_sent"] == len(rs)


def test_empty_and_invalid_inputs():
    s = m.summarize(
        [RequestResult(1, 1, start=0.0, end=1.0, error_kind="timeout")],
        duration=1.0,
        selected=["ttft"],
        percentiles=[99.9],
    )
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["p99.9_ttft_ms"] is None
    assert "mean_itl_ms" not in s
    with pytest.raises(ValueError, match="duration"):
        m.summarize([], duration=0.0)
    with pytest.raises(ValueError, match="percentile metric"):
        m.summarize([], duration=1.0, selected=["latency"])
    assert m.percentile_key(99) == "p99" and m.percentile_key(99.9) == "p99.9"
