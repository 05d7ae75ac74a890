"""Fixtures for the server tests: one real `pagoda serve` process shared by the session.

`main_server` starts it (see server_harness.MAIN_SERVER_FLAGS), waits for /health
200 with a bounded deadline, and stops it with SIGTERM at the end.
"""

from __future__ import annotations

import pytest
from server_harness import API_KEY, MAIN_SERVER_FLAGS, launch_server


@pytest.fixture(scope="session")
def main_server():
    server = launch_server(*MAIN_SERVER_FLAGS, api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
    return load_tokenizer(embedded_model_path())
