"""The live engine-statistics stream behind the dashboard: GET /v1/engine/stats/stream.

Owns `StatsHub`: one sampler per app, shared by every connected client. While at
least one client is connected, a task on the event loop samples the engine every
`interval_s` (default 0.25 s): one `get_stats()` call posted to the engine thread
(answered between two steps), rates from the difference with the previous sample,
and TTFT / ITL / e2e percentiles from the server's RequestLog (recomputed at most
once a second: sorting is the one non-trivial cost). With no client connected
nothing runs at all, so the stream costs nothing until a dashboard opens.

Each client gets Server-Sent Events:
- `event: info` once: the model, its context length and the engine's capacities;
- `event: stats` per sample: one JSON object serialized once for all clients;
- `event: requests` when requests finished since the client's last event: their
  summaries (the newest 50 on connecting).
A slow client drops its oldest pending samples instead of growing a queue.
The stream ends when the server starts draining, so it never holds a shutdown up;
`close()` (the app's shutdown) ends the sampler task and every stream at once.
Auth is the API-key middleware's, as for every data route: the page reads the
stream with fetch() and an Authorization header (EventSource cannot send one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.engine.async_engine import AsyncEngine
from pagoda.metrics.recent import RequestLog

logger = logging.getLogger(__name__)

STREAM_PATH = "/v1/engine/stats/stream"
BACKLOG_REQUESTS = 50  # finished requests a client gets on connecting
_MAX_PENDING = 4  # samples queued for one slow client before the oldest are dropped
_PERCENTILE_PERIOD_S = 1.0


def sse_event(event: str, data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n"


def _rate(now: float, then: float, dt: float) -> float | None:
    return (now - then) / dt if dt > 0 else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def derive(stats: Any, prev: tuple[float, Any] | None, now: float) -> dict[str, Any]:
    """The dashboard's view of one EngineStats sample; rates need the previous
    (time, stats) sample and are None without one."""
    out: dict[str, Any] = {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "preempted": getattr(stats, "num_preempted", 0),
        "max_num_seqs": getattr(stats, "max_num_seqs", 0),
        "kv_usage": stats.kv_cache_usage,
        "num_blocks": stats.num_blocks,
        "block_size": getattr(stats, "block_size", 0),
        "token_budget": getattr(stats, "max_num_batched_tokens", 0),
        "prompt_tokens_total": stats.prompt_tokens,
        "generation_tokens_total": stats.generation_tokens,
        "preemptions_total": stats.num_preemptions,
        "prefix_hit_rate_total": _ratio(stats.prefix_cache_hits, stats.prefix_cache_queries),
        "output_tok_s": None,
        "prompt_tok_s": None,
        "steps_per_s": None,
        "tokens_per_step": None,
        "prefix_hit_rate": None,
    }
    if prev is not None:
        then, old = prev
        dt = now - then
        steps = getattr(stats, "num_steps", 0) - getattr(old, "num_steps", 0)
        out.update(
            output_tok_s=_rate(stats.generation_tokens, old.generation_tokens, dt),
            prompt_tok_s=_rate(stats.prompt_tokens, old.prompt_tokens, dt),
            steps_per_s=_rate(steps, 0, dt),
            tokens_per_step=_ratio(
                getattr(stats, "scheduled_tokens", 0) - getattr(old, "scheduled_tokens", 0), steps
            ),
            prefix_hit_rate=_ratio(
                stats.prefix_cache_hits - old.prefix_cache_hits,
                stats.prefix_cache_queries - old.prefix_cache_queries,
            ),
        )
    out["spec"] = _spec(getattr(stats, "spec_decode", None), prev)
    return out


def _spec(spec: Any, prev: tuple[float, Any] | None) -> dict[str, Any] | None:
    """Speculative-decoding acceptance, when the engine's stats carry it (counters
    `num_draft_tokens` and `num_accepted_tokens` since start); None otherwise."""
    drafted = getattr(spec, "num_draft_tokens", None)
    accepted = getattr(spec, "num_accepted_tokens", None)
    if drafted is None or accepted is None:
        return None
    out = {
        "draft_tokens_total": drafted,
        "accepted_tokens_total": accepted,
        "acceptance_rate_total": _ratio(accepted, drafted),
        "acceptance_rate": None,
    }
    old = getattr(prev[1], "spec_decode", None) if prev is not None else None
    if old is not None:
        out["acceptance_rate"] = _ratio(
            accepted - old.num_accepted_tokens, drafted - old.num_draft_tokens
        )
    return out


class _Client:
    """One connected stream: its pending events and the last request it was sent."""

    def __init__(self, last_seq: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_seq = last_seq

    def offer(self, item: str | None) -> None:
        while self.queue.qsize() >= _MAX_PENDING:
            self.queue.get_nowait()
        self.queue.put_nowait(item)


class StatsHub:
    def __init__(
        self,
        engine: AsyncEngine,
        request_log: RequestLog,
        model_name: str,
        is_draining: Callable[[], bool],
        interval_s: float = 0.25,
    ) -> None:
        self.engine = engine
        self.request_log = request_log
        self.model_name = model_name
        self.is_draining = is_draining
        self.interval_s = interval_s
        self._clients: set[_Client] = set()
        self._task: asyncio.Task | None = None
        self._prev: tuple[float, Any] | None = None
        self._percentiles: dict[str, Any] | None = None
        self._percentiles_at = float("-inf")
        self.num_samples = 0  # samples taken since start (tests and cost checks read it)

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def info(self) -> dict[str, Any]:
        engine = self.engine.engine if self.engine.is_ready else None
        return {
            "model": self.model_name,
            "interval_s": self.interval_s,
            "window_s": self.request_log.window_s,
            "max_model_len": getattr(engine, "max_model_len", None),
        }

    async def sample(self) -> dict[str, Any]:
        """One stats object (taken now, not the broadcast one)."""
        now = time.monotonic()
        sample: dict[str, Any] = {
            "t": time.time(),
            "state": self._state(),
            "in_flight": self.engine.num_in_flight,
            "finished_total": self.request_log.num_finished,
            "finished_by_reason": dict(self.request_log.finished_by_reason),
        }
        if sample["state"] == "ready":
            try:
                stats = await self.engine.get_stats()
            except Exception:  # the engine stopped between the check and the call
                sample["state"] = "stopped"
            else:
                sample.update(derive(stats, self._prev, now))
                self._prev = (now, stats)
        if now - self._percentiles_at >= _PERCENTILE_PERIOD_S or self._percentiles is None:
            self._percentiles = self.request_log.percentiles(now)
            self._percentiles_at = now
        sample["latency"] = self._percentiles
        self.num_samples += 1
        return sample

    def _state(self) -> str:
        if self.engine.load_error is not None:
            return "failed"
        if not self.engine.is_ready:
            return "loading"
        return "ready" if self.engine.is_running else "stopped"

    async def stream(self) -> tuple[AsyncIterator[str], Callable[[], None]]:
        """A new client's SSE body and its clean-up (run when the response closes)."""
        client = _Client(last_seq=max(0, self.request_log.last_seq - BACKLOG_REQUESTS))
        self._clients.add(client)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

        async def body() -> AsyncIterator[str]:
            yield sse_event("info", self.info())
            while True:
                item = await client.queue.get()
                if item is None:  # draining, or the sampler failed
                    return
                yield item
                requests = from_requests(client)
                if requests:
                    yield requests

        def from_requests(client: _Client) -> str:
            newer = self.request_log.since(client.last_seq, BACKLOG_REQUESTS)
            if not newer:
                return ""
            client.last_seq = newer[-1].seq
            now = time.monotonic()
            return sse_event("requests", [s.as_dict(now) for s in newer])

        def close() -> None:
            self._clients.discard(client)

        return body(), close

    async def close(self) -> None:
        """Ends every stream and the sampler task, and waits for the task (idempotent);
        a stream opened afterwards starts a new one."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for client in list(self._clients):
            client.offer(None)
        self._clients.clear()
        self._prev = None

    async def _run(self) -> None:
        """Samples and broadcasts while anyone listens; ends every stream on a drain."""
        try:
            while self._clients:
                started = time.monotonic()
                if self.is_draining():
                    break
                event = sse_event("stats", await self.sample())
                for client in list(self._clients):
                    client.offer(event)
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        except Exception:
            logger.exception("the engine stats sampler failed; closing its streams")
        for client in list(self._clients):
            client.offer(None)
        self._prev = None
