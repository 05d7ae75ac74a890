"""Fixtures for the server tests: one real `pagoda serve` process shared by the session.

`main_server` starts it (see server_harness.MAIN_SERVER_FLAGS), waits for /health
200 with a bounded deadline, and stops it with SIGTERM at the end.
"""

from __future__ import annotations

import httpx
import pytest
from helpers.server_harness import API_KEY, MAIN_SERVER_FLAGS, launch_server


@pytest.fixture(scope="session")
def main_server():
    server = launch_server(*MAIN_SERVER_FLAGS, api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer

    return load_tokenizer(embedded_model_path())


@pytest.fixture(scope="module")
def http(main_server):
    """An HTTP client of the session's server, with its API key."""
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=60) as client:
        yield client
