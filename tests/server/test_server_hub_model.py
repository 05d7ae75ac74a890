"""`pagoda serve org/name`: a real server process resolves a hub id from the local hub
cache (HF_HUB_OFFLINE=1, HF_HOME in a temp dir) and serves it under that id."""

from __future__ import annotations

import httpx
from helpers.server_harness import launch_server
from helpers.tiny_models import save_tiny_hub_repo

REPO = "pagoda-test/served-llama"


def test_serve_by_hub_id(tmp_path, monkeypatch):
    save_tiny_hub_repo(tmp_path / "hub", REPO, "89abcdef" * 5)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the child inherits the environment
    server = launch_server(
        REPO,
        "--max-model-len",
        "64",
        "--kv-cache-memory",
        str(1 << 22),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        reply = httpx.post(
            f"{server.url}/v1/completions",
            timeout=60,
            json={"model": REPO, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
    finally:
        assert server.stop() == 0
