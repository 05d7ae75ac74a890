"""`pagoda serve` start-up as a user sees it: what is logged at the default level (the
server's settings, the `ready:` line, one line per request), a busy port failing
within seconds before anything loads, and a bad model path failing with the port
given back (each one `error:` line, non-zero exit, no traceback)."""

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
    assert "LlamaForCausalLM" in log and "float32" in log  # the engine says what it loads
    assert "KV cache:" in log and "max_model_len 256" in log
    assert "engine ready in" in log
    for line in (
        "served model names: SmolLM2-135M-Instruct",
        f"address: 127.0.0.1:{server.port}",
        "API key: off",
        "web UI: on (/ and /dashboard)",
        "API docs: off (--enable-api-docs; /openapi.json is served)",
        "tool calling: the chat template drops tools: responses to requests with tools "
        "carry x-pagoda-warning",
    ):
        assert line in log, line
    assert f"ready: {server.url} (OpenAI API at /v1)" in log
    # The ready line comes after loading: nothing listens before the model is there.
    assert log.index("engine ready in") < log.index("ready: http")
    request_line = next(line for line in log.splitlines() if request_id in line)
    assert "1 prompt tokens" in request_line and "max_tokens=2" in request_line
    assert "Traceback" not in log
    assert "loading weights" not in log  # no progress bar in a log file


def test_bad_model_path_fails_with_one_line_and_gives_the_port_back():
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
    # The port is given back: binding it now succeeds.
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
        assert "loading" in first  # the engine is loading now; nothing listens yet
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert rest.strip() == "interrupted"


def test_busy_port_fails_within_seconds_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--device", "cpu"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        elapsed = time.monotonic() - start
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, output
    assert output.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use; another "
        "process holds it: stop that process or choose another port with --port"
    ]
    # Before the server stack is imported (torch): the time of the CLI's own imports,
    # not of a model load (a bound on a busy 2-core machine).
    assert elapsed < 15, elapsed


def test_losing_the_port_while_loading_is_one_line_and_exit_1(caplog):
    """Another process that binds the port with SO_REUSEADDR while the model loads
    listens first: this server's listen fails with one line naming --port."""
    import uvicorn
    from fastapi import FastAPI

    from pagoda.entrypoints.openai.api_server import DrainingServer
    from pagoda.entrypoints.openai.middleware import ServerState
    from pagoda.entrypoints.openai.server_startup import bind_port

    sock = bind_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with sock, socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        config = uvicorn.Config(FastAPI(), host="127.0.0.1", port=port, lifespan="off")
        server = DrainingServer(config, ServerState(), None, shutdown_timeout=1.0)
        server.run(sockets=[sock])
    assert server.exit_code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"cannot listen on 127.0.0.1:{port}: Address already in use; another process "
        "took the port while the model loaded: choose another port with --port"
    ]
