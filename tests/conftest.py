"""Shared fixtures: the embedded SmolLM2 GGUF and tiny random Hugging Face models; a
check that every engine a test module starts ends with it (threads, running engines);
and the markers: `gpu` (or `gpu(n)`) skips a test on a machine with fewer CUDA GPUs,
tests under tests/server/ are `server`, the browser tests `browser`.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

import pytest

# One intra-op thread: the models in tests are small, a busy-waiting thread pool only
# loses time on two shared cores, and server subprocesses inherit the setting.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402  (after the thread setting)

torch.set_num_threads(1)

# Without a GPU, Triton kernels run in its interpreter. Triton reads TRITON_INTERPRET when
# it is first imported (its own standard library is decorated then), and transformers or
# torch may import it before the kernel tests do: set it for the whole session, first.
if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton imported before conftest"
    os.environ.setdefault("TRITON_INTERPRET", "1")


import tqdm  # noqa: E402
from helpers.tiny_models import save_tiny_hf_model  # noqa: E402  (after the thread setting)

# tqdm's monitor thread, started by the first progress bar, runs until the interpreter
# exits: off, so that the threads a test leaves are only those it started.
tqdm.tqdm.monitor_interval = 0


def pytest_collection_modifyitems(config, items) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        path = item.path.as_posix()
        if "/tests/server/" in path:
            item.add_marker(pytest.mark.server)
        if path.endswith("_browser.py"):
            item.add_marker(pytest.mark.browser)
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            wanted = marker.args[0] if marker.args else 1
            if gpus < wanted:
                item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA GPU(s)"))


def pytest_unconfigure(config) -> None:
    """After pytest's summary: Triton's bindings (nanobind) list the objects they still
    hold when the interpreter exits, dozens of lines that say nothing about the tests.
    The run ends on the summary line instead; the exit status is pytest's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


@pytest.fixture(scope="session")
def smollm2_gguf():
    from helpers.embedded import embedded_gguf

    return embedded_gguf()


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    """{arch: (directory, transformers model)} for llama, qwen2 and qwen3."""
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        models[arch] = (str(path), save_tiny_hf_model(path, arch))
    return models


def engine_threads() -> set[threading.Thread]:
    """The threads engines start (loop, KV offload I/O, disk tier, grammar compiles)."""
    return {t for t in threading.enumerate() if t.name.startswith("pagoda-")}


@pytest.fixture(scope="module", autouse=True)
def engines_end_with_their_module(request):
    """Fails the module whose engines outlive it: one still running once its tests and
    fixtures are done, or an engine thread it started still alive. Engines nobody
    references are collected here, which shuts them down (their finalizers); pytest
    still holds the module's last test's fixture values at this point, so a module
    fixture shuts its engine down itself (yield, then shutdown())."""
    from pagoda.engine.release import running_engines

    before = engine_threads()
    running_before = set(map(id, running_engines()))
    yield
    gc.collect()
    running = [e for e in running_engines() if id(e) not in running_before]
    leaked = engine_threads() - before
    if running or leaked:
        pytest.fail(
            f"{request.node.nodeid} left {len(running)} engine(s) running and threads "
            f"{sorted(t.name for t in leaked)}: shut engines down in the fixture or "
            "test that made them",
            pytrace=False,
        )
