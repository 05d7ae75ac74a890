"""The SSE body both streaming handlers send (generation.stream_chunks), against a
scripted engine: chunk framing, usage, the in-band error event, [DONE], the ticket."""

from __future__ import annotations

import asyncio
import json

from pagoda.engine.async_engine import RequestFailedError
from pagoda.entrypoints.openai.admission import AdmissionController
from pagoda.entrypoints.openai.generation import GenerationJob, stream_chunks
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}


class ScriptedEngine:
    """generate() yields one delta output per (text, num tokens, finish reason) of the
    script, then raises `fail_with` if set."""

    def __init__(self, script, fail_with=None) -> None:
        self.script, self.fail_with = script, fail_with

    async def generate(self, prompt, params, request_id, priority=0):
        for text, num_tokens, finish in self.script:
            yield RequestOutput(
                request_id,
                None,
                prompt["prompt_token_ids"],
                [CompletionOutput(0, text, [1] * num_tokens, finish_reason=finish)],
                finished=finish is not None,
            )
        if self.fail_with is not None:
            raise self.fail_with


def _run(engine, include_usage, opening=None):
    controller = AdmissionController(None, None)
    job = GenerationJob(
        "cmpl-1",
        "m",
        7,
        [{"prompt": None, "prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=4),
        0,
        controller.admit([3]),
    )

    def choices_of(prompt_index, output):
        return [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            for c in output.outputs
        ]

    async def body():
        return [
            event
            async for event in stream_chunks(engine, job, HEAD, include_usage, choices_of, opening)
        ]

    events = asyncio.run(body())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert controller.num_queued == 0 and controller.num_queued_tokens == 0  # ticket released
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_chunks_then_usage_then_done():
    engine = ScriptedEngine([("He", 1, None), ("llo", 2, "length")])
    opening = [{"index": 0, "text": "", "finish_reason": None}]
    assert _run(engine, include_usage=True, opening=opening) == [
        {**HEAD, "choices": opening, "usage": None},
        {**HEAD, "choices": [{"index": 0, "text": "He", "finish_reason": None}], "usage": None},
        {
            **HEAD,
            "choices": [{"index": 0, "text": "llo", "finish_reason": "length"}],
            "usage": None,
        },
        {
            **HEAD,
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        },
    ]
    assert _run(engine, include_usage=False) == [
        {**HEAD, "choices": [{"index": 0, "text": "He", "finish_reason": None}]},
        {**HEAD, "choices": [{"index": 0, "text": "llo", "finish_reason": "length"}]},
    ]


def test_failure_after_the_headers_is_an_error_event_then_done():
    engine = ScriptedEngine([("He", 1, None)], fail_with=RequestFailedError("bad logits"))
    first, error = _run(engine, include_usage=True)
    assert first["choices"][0]["text"] == "He"
    assert set(error) == {"error"}
    assert error["error"]["code"] == "request_failed" and "bad logits" in error["error"]["message"]
    engine = ScriptedEngine([], fail_with=KeyError("x"))
    (error,) = _run(engine, include_usage=False)
    assert error["error"]["code"] == "500" and "KeyError" in error["error"]["message"]
