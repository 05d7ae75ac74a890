"""The TTFT stage trace (pagoda/engine/trace.py): off by default, stage bookkeeping, output."""

from __future__ import annotations

import json
import sys

import pytest

from pagoda.engine import async_engine, trace
from pagoda.outputs import CompletionOutput, RequestOutput


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace.set_enabled(str(path))
    yield path
    trace.set_enabled(None)


def _output(request_id: str, token_ids: list[int]) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1],
        outputs=[CompletionOutput(index=0, text="", token_ids=token_ids)],
    )


def test_off_by_default_records_nothing():
    assert not trace.ENABLED
    assert trace.open_trace("/v1/completions") is None
    assert trace.register("r1") is None
    assert trace.StepClock.start() is trace.NULL_CLOCK
    trace.mark("parsed")
    trace.mark_id("r1", "picked_up")
    assert trace.lookup("r1") is None


def test_stages_keep_their_first_time_and_are_written_once(trace_file):
    request_trace = trace.open_trace("/v1/completions")
    trace.mark("parsed")
    assert trace.register("r1") is request_trace
    arrival = request_trace.times["arrival"]
    trace.mark_id("r1", "picked_up", at=arrival + 0.002)
    trace.mark_id("r1", "picked_up", at=arrival + 0.009)
    clock = trace.StepClock.start()
    clock.lap("step_launched")
    clock.first_tokens([_output("r1", []), _output("other", [5])])
    assert not request_trace.first_token_done  # no token for r1 in this step
    clock.first_tokens([_output("r1", [7])])
    assert request_trace.first_token_done
    request_trace.mark("first_body")
    trace.finish(request_trace)
    assert trace.lookup("r1") is None
    (line,) = trace_file.read_text().splitlines()
    record = json.loads(line)
    assert record["request_ids"] == ["r1"]
    assert record["ms"]["picked_up"] == pytest.approx(2.0, abs=1e-3)
    assert list(record["ms"])[0] == "arrival"
    assert {"parsed", "step_schedule_start", "step_launched", "first_body"} <= set(record["ms"])


def test_a_request_that_sent_nothing_is_not_written(trace_file):
    request_trace = trace.open_trace("/v1/completions")
    trace.register("r2")
    trace.finish(request_trace)
    assert not trace_file.exists()
    assert trace.lookup("r2") is None


def test_first_text_needs_non_empty_text_or_content():
    pytest.importorskip("fastapi")
    from pagoda.entrypoints.openai.trace_middleware import _has_text

    assert _has_text(b'data: {"choices":[{"index":0,"text":" hi"}]}\n\n')
    assert not _has_text(b'data: {"choices":[{"index":0,"text":""}]}\n\n')
    assert _has_text(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    assert not _has_text(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
    assert not _has_text(b"data: [DONE]\n\n")


def test_switch_interval_is_only_ever_lowered(monkeypatch):
    original = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        monkeypatch.setenv(async_engine.SWITCH_INTERVAL_ENV, "0.001")
        async_engine._shorten_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.001)
        monkeypatch.setenv(async_engine.SWITCH_INTERVAL_ENV, "0.01")
        async_engine._shorten_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.001)
        monkeypatch.setenv(async_engine.SWITCH_INTERVAL_ENV, "0")
        async_engine._shorten_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(original)
