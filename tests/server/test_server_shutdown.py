"""Stopping `pagoda serve` with Ctrl-C twice: the first signal drains, the second ends
the requests in flight with an SSE error event (not a cut connection) and the process
exits 0 without CancelledError tracebacks or a C++ `terminate called`."""

from __future__ import annotations

import json
import signal
import time

import httpx
from helpers.server_harness import launch_server


def _wait_for_log(server, text: str, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while text not in server.log_text():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log_text()}"
        time.sleep(0.05)  # polling the server process's log file


def test_second_ctrl_c_ends_streams_with_an_error_event_and_exits_cleanly():
    server = launch_server("--max-model-len", "512", "--disable-uvicorn-access-log")
    try:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # generating now
            server.proc.send_signal(signal.SIGINT)
            _wait_for_log(server, "draining (1 request(s) in flight")
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        code = server.proc.wait(60)
        log = server.log_text()
    finally:
        server.stop()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == "service_unavailable"
    assert "stopped before this request finished" in error["message"]
    assert code == 0
    for bad in ("Traceback", "CancelledError", "terminate called"):
        assert bad not in log, log
