"""`pagoda serve` start-up as a user sees it: what is logged at the default level, the
`ready:` line, one log line per request, and a bad model path failing before the port
is bound (one `error:` line, non-zero exit, no traceback)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from helpers.server_harness import die_with_parent, free_port, launch_server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_level_logs_startup_ready_line_and_requests():
    server = launch_server("--max-model-len", "256", "--disable-uvicorn-access-log")
    try:
        response = httpx.post(
            f"{server.url}/v1/completions",
            timeout=60,
            json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
        )
        assert response.status_code == 200
        request_id = response.json()["id"]
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 256
        deadline = time.monotonic() + 30
        while request_id not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # the log line is written by the server process
        log = server.log_text()
    finally:
        assert server.stop() == 0
    assert "LlamaForCausalLM, float32 on cpu, weights" in log
    assert "KV cache:" in log and "max_model_len 256" in log
    assert "engine ready in" in log
    assert f"ready: {server.url} (OpenAI API at /v1)" in log
    # The ready line comes after loading: nothing listens before the model is there.
    assert log.index("engine ready in") < log.index("ready: http")
    request_line = next(line for line in log.splitlines() if request_id in line)
    assert "1 prompt tokens" in request_line and "max_tokens=2" in request_line
    assert "Traceback" not in log
    assert "loading weights" not in log  # no progress bar in a log file


def test_bad_model_path_fails_before_the_port_is_bound():
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "serve",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--model",
            "/nonexistent/model.gguf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/nonexistent/model.gguf" in errors[0]
    assert "Traceback" not in output and "Uvicorn running" not in output
    # The port was never taken: binding it now succeeds.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_request_logging_is_on_by_default_and_the_flag_turns_it_off():
    from pagoda.entrypoints.cli import build_parser
    from pagoda.entrypoints.openai.api_server import settings_from_args

    parser = build_parser()
    assert settings_from_args(parser.parse_args(["serve"])).log_requests is True
    assert (
        settings_from_args(parser.parse_args(["serve", "--disable-log-requests"])).log_requests
        is False
    )


def test_ctrl_c_while_loading_exits_without_a_traceback():
    # A shell's Ctrl-C reaches a foreground process with SIGINT's default disposition;
    # restore it (a test runner's child may inherit it ignored).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "serve",
            "--device",
            "cpu",
            "--port",
            str(free_port()),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), die_with_parent()),
    )
    try:
        first = proc.stdout.readline().decode()
        assert "loading" in first  # the engine is loading now; the port is not bound
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert rest.strip() == "interrupted"
