"""AsyncEngine against a scripted fake engine: streaming, failure isolation,
cancellation, draining, load failure. No model, so these run in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from pagoda.engine.async_engine import (
    AsyncEngine,
    EngineDrainingError,
    EngineNotReadyError,
    EngineStepError,
    RequestFailedError,
)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

QUEUE_S = 0.25


class FakeEngine:
    """One token per step per request, each output reporting the request as first
    scheduled QUEUE_S after its arrival. Prompt "bad" is refused, "poison" fails in a
    step; `fail_once_all_emitted` makes a step raise. Records aborts and the thread it runs on."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.prompts: dict[str, str] = {}
        self.arrivals: dict[str, float] = {}
        self.aborted: list[str] = []
        self.emitted: dict[str, int] = {}
        self.threads: set[str] = set()
        # A step fails (once) when every request named here has emitted a token.
        self.fail_once_all_emitted: set[str] = set()
        self.dead_after_failure = False  # check_health raises once a step failed
        self.failed = False
        self.shut_down = False

    def add_request(
        self, request_id, prompt, params, arrival_time=None, priority=0, output_kind="cumulative"
    ):
        self.threads.add(threading.current_thread().name)
        assert output_kind == "delta"
        if prompt == "bad":
            raise ValueError("prompt is bad")
        self.remaining[request_id] = params.max_tokens
        self.prompts[request_id] = prompt
        self.arrivals[request_id] = arrival_time

    def abort_request(self, request_ids):
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            if self.remaining.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def check_health(self) -> None:
        if self.dead_after_failure and self.failed:
            raise RuntimeError("the workers are gone")

    def shutdown(self) -> None:
        self.shut_down = True

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        if self.fail_once_all_emitted and all(
            self.emitted.get(r) for r in self.fail_once_all_emitted
        ):
            self.fail_once_all_emitted = set()
            self.failed = True
            raise RuntimeError("boom")
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            self.emitted[request_id] = self.emitted.get(request_id, 0) + 1
            done = self.remaining[request_id] == 0
            metrics = {"first_scheduled_time": self.arrivals[request_id] + QUEUE_S}
            reason, error = ("length" if done else None), None
            if self.prompts[request_id] == "poison":
                reason, error, done = "error", "bad logits", True
            if done:
                del self.remaining[request_id]
            outputs.append(
                RequestOutput(
                    request_id,
                    None,
                    [1],
                    [CompletionOutput(0, "x", [7], finish_reason=reason)],
                    finished=done,
                    metrics=metrics,
                    error=error,
                )
            )
        return outputs


async def _run(engine: AsyncEngine, prompt: str, request_id: str, max_tokens: int = 3) -> list:
    outputs = []
    async for output in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id):
        outputs.append(output)
    return outputs


@contextlib.asynccontextmanager
async def running(fake: FakeEngine, **kwargs):
    engine = AsyncEngine(lambda: fake, **kwargs)
    engine.start()
    await engine.wait_ready()
    try:
        yield engine
    finally:
        await engine.shutdown()


def test_streams_deltas_and_only_the_loop_thread_touches_the_engine():
    async def main():
        fake = FakeEngine()
        timings = []
        async with running(fake, timings_listener=timings.append) as engine:
            a, b = await asyncio.gather(_run(engine, "p", "a", 3), _run(engine, "p", "b", 5))
        assert [len(o.outputs[0].token_ids) for o in a] == [1, 1, 1]
        assert [o.finished for o in b] == [False] * 4 + [True]
        assert fake.threads == {"pagoda-engine-loop"}
        assert sorted(
            (t.request_id, t.num_generation_tokens, t.finish_reason) for t in timings
        ) == [("a", 3, "length"), ("b", 5, "length")]
        assert [t.queue_time for t in timings] == [pytest.approx(QUEUE_S)] * 2

    asyncio.run(main())


def test_refused_and_failed_requests_fail_alone():
    async def main():
        async with running(FakeEngine()) as engine:
            results = await asyncio.gather(
                _run(engine, "bad", "r1"),
                _run(engine, "poison", "r2"),
                _run(engine, "ok", "r3", 4),
                return_exceptions=True,
            )
        assert isinstance(results[0], ValueError) and "bad" in str(results[0])
        assert isinstance(results[1], RequestFailedError) and "bad logits" in str(results[1])
        assert len(results[2]) == 4 and results[2][-1].finished

    asyncio.run(main())


def test_failed_step_fails_in_flight_requests_and_the_loop_keeps_serving():
    async def main():
        fake = FakeEngine()
        fake.fail_once_all_emitted = {"a", "b"}
        async with running(fake) as engine:
            gens = [
                engine.generate("p", SamplingParams(max_tokens=10**6), rid) for rid in ("a", "b")
            ]
            firsts = await asyncio.gather(*(g.__anext__() for g in gens))
            assert all(not o.finished for o in firsts)
            for gen in gens:
                with pytest.raises(EngineStepError):
                    while True:
                        await gen.__anext__()
            assert sorted(fake.aborted) == ["a", "b"]
            after = await _run(engine, "p", "c", 2)
            assert after[-1].finished

    asyncio.run(main())


def test_a_dead_engine_stops_the_loop_and_fails_what_comes_next():
    async def main():
        fake = FakeEngine()
        fake.fail_once_all_emitted = {"a"}
        fake.dead_after_failure = True
        async with running(fake) as engine:
            gen = engine.generate("p", SamplingParams(max_tokens=10**6), "a")
            await gen.__anext__()
            with pytest.raises(EngineStepError):
                while True:
                    await gen.__anext__()
            await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 5.0)
            assert not engine.is_running
            assert fake.shut_down
            with pytest.raises(EngineNotReadyError, match="stopped"):
                await _run(engine, "p", "b", 2)

    asyncio.run(main())


def test_closing_the_stream_aborts_the_request():
    async def main():
        fake = FakeEngine()
        timings = []
        async with running(fake, timings_listener=timings.append) as engine:
            async with contextlib.aclosing(
                engine.generate("p", SamplingParams(max_tokens=10**6), "r")
            ) as gen:
                await gen.__anext__()
            assert await engine.call_in_loop(
                lambda e: (e.aborted, e.has_unfinished_requests())
            ) == (["r"], False)
            task = asyncio.ensure_future(_run(engine, "p", "t", 10**6))
            while engine.num_in_flight == 0:
                await asyncio.sleep(0)
            task.cancel()  # as when a client disconnects
            await asyncio.gather(task, return_exceptions=True)
            assert await engine.call_in_loop(lambda e: e.aborted) == ["r", "t"]
        assert [t.finish_reason for t in timings] == ["abort", "abort"]

    asyncio.run(main())


def test_shutdown_drains_in_flight_then_refuses_new_requests():
    async def main():
        engine = AsyncEngine(FakeEngine)
        engine.start()
        await engine.wait_ready()
        request = asyncio.ensure_future(_run(engine, "p", "a", 50))
        while engine.num_in_flight == 0:
            await asyncio.sleep(0)
        await engine.shutdown(timeout=30)
        assert (await request)[-1].finished
        assert not engine.is_running
        with pytest.raises(EngineDrainingError):
            await _run(engine, "p", "b")

    asyncio.run(main())


def test_load_failure_is_reported():
    def broken():
        raise OSError("no weights")

    async def main():
        engine = AsyncEngine(broken)
        with pytest.raises(EngineNotReadyError):
            await _run(engine, "p", "a")
        engine.start()
        with pytest.raises(OSError):
            await engine.wait_ready()
        with pytest.raises(EngineNotReadyError, match="no weights"):
            await _run(engine, "p", "a")

    asyncio.run(main())
