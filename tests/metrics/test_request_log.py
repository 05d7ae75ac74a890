"""RequestLog (the dashboard's recent requests and latency window): exact values."""

from __future__ import annotations

import pytest

from pagoda.engine.async_engine import RequestTimings
from pagoda.metrics.recent import RequestLog, nearest_rank, summarize


def _timings(
    rid: str,
    arrival: float,
    first: float | None,
    finished: float,
    itls: list[float],
    reason: str = "stop",
    prompt: int = 5,
) -> RequestTimings:
    return RequestTimings(
        request_id=rid,
        arrival_time=arrival,
        first_token_time=first,
        finished_time=finished,
        queue_time=0.5,
        num_prompt_tokens=prompt,
        num_generation_tokens=len(itls) + (first is not None),
        finish_reason=reason,
        inter_token_latencies=itls,
    )


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert nearest_rank(values, 50) == 5.0
    assert nearest_rank(values, 90) == 9.0
    assert nearest_rank(values, 99) == 10.0
    assert nearest_rank([7.0], 50) == 7.0
    assert summarize([3.0, 1.0, 2.0]) == {"n": 3, "p50": 2.0, "p90": 3.0, "p99": 3.0}
    assert summarize([]) is None


def test_summary_of_one_request():
    log = RequestLog()
    log.observe(_timings("a", arrival=10.0, first=10.25, finished=11.0, itls=[0.25, 0.5]))
    (summary,) = log.since(0, 10)
    assert (summary.seq, summary.request_id, summary.finish_reason) == (1, "a", "stop")
    assert (summary.prompt_tokens, summary.output_tokens) == (5, 3)
    assert (summary.queue_s, summary.ttft_s, summary.itl_mean_s, summary.e2e_s) == (
        0.5,
        0.25,
        0.375,
        1.0,
    )
    assert summary.as_dict(now=13.0)["finished_ago_s"] == 2.0
    # An aborted request with no token has no TTFT nor ITL.
    log.observe(_timings("b", arrival=11.0, first=None, finished=11.5, itls=[], reason="abort"))
    assert log.since(1, 10)[0].ttft_s is None and log.since(1, 10)[0].itl_mean_s is None
    assert dict(log.finished_by_reason) == {"stop": 1, "abort": 1}
    assert log.num_finished == 2


def test_since_returns_the_newest_after_a_sequence_number():
    log = RequestLog(max_requests=4)
    for i in range(6):
        log.observe(_timings(f"r{i}", arrival=i, first=i + 0.5, finished=i + 1.0, itls=[]))
    assert [s.request_id for s in log.since(0, 10)] == ["r2", "r3", "r4", "r5"]  # 4 kept
    assert [s.request_id for s in log.since(0, 2)] == ["r4", "r5"]  # the newest 2, in order
    assert [s.request_id for s in log.since(5, 10)] == ["r5"]
    assert log.since(6, 10) == []
    assert log.last_seq == 6


def test_percentiles_over_the_window_and_expiry():
    log = RequestLog(window_s=10.0)
    log.observe(_timings("old", arrival=0.0, first=4.0, finished=5.0, itls=[0.9]))
    log.observe(_timings("new", arrival=10.0, first=11.0, finished=12.0, itls=[0.1, 0.2]))
    both = log.percentiles(now=14.0)
    assert both["ttft"] == {"n": 2, "p50": 1.0, "p90": 4.0, "p99": 4.0}
    assert both["itl"] == {"n": 3, "p50": 0.2, "p90": 0.9, "p99": 0.9}
    assert both["e2e"] == {"n": 2, "p50": 2.0, "p90": 5.0, "p99": 5.0}
    newer = log.percentiles(now=15.5)  # "old" finished 10.5 s ago: out of the window
    assert newer["ttft"] == {"n": 1, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    assert newer["itl"] == {"n": 2, "p50": 0.1, "p90": 0.2, "p99": 0.2}
    assert log.percentiles(now=30.0) == {"window_s": 10.0, "ttft": None, "e2e": None, "itl": None}


def test_inter_token_samples_are_capped_oldest_request_first():
    log = RequestLog(max_itl_samples=4)
    log.observe(_timings("a", 0.0, 0.1, 1.0, [1.0, 1.0]))
    log.observe(_timings("b", 0.0, 0.1, 1.0, [2.0, 2.0]))
    assert log.percentiles(2.0)["itl"]["n"] == 4
    log.observe(_timings("c", 0.0, 0.1, 1.0, [3.0]))  # over the cap: "a" goes
    assert log.percentiles(2.0)["itl"] == {"n": 3, "p50": 2.0, "p90": 3.0, "p99": 3.0}
    log.observe(_timings("d", 0.0, 0.1, 1.0, [4.0] * 6))  # alone over the cap: kept whole
    assert log.percentiles(2.0)["itl"] == {"n": 6, "p50": 4.0, "p90": 4.0, "p99": 4.0}
    # TTFT and e2e keep every request of the window.
    assert log.percentiles(2.0)["ttft"]["n"] == 4


def test_window_holds_at_most_max_window_requests():
    log = RequestLog(max_window_requests=3)
    for i in range(5):
        log.observe(_timings(f"r{i}", 0.0, float(i), 10.0, []))
    assert log.percentiles(10.0)["ttft"] == {"n": 3, "p50": 3.0, "p90": 4.0, "p99": 4.0}


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="window_s"):
        RequestLog(window_s=0)
    with pytest.raises(ValueError, match="max_itl_samples"):
        RequestLog(max_itl_samples=0)
