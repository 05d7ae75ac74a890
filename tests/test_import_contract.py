"""The import contract (tools/check_imports.py) holds for the package, and breaks on a
deliberate violation of each of its rules."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools/check_imports.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_imports", module)
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_the_contract():
    assert _checker().check(ROOT) == []


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(
        ROOT / "pagoda",
        root / "pagoda",
        ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.h", "web"),
    )
    return root


def _violate(root: Path, module: str, line: str) -> list[str]:
    path = root / (module.replace(".", "/") + ".py")
    original = path.read_text()
    path.write_text(original + "\n" + line + "\n")
    try:
        return _checker().check(root)
    finally:
        path.write_text(original)


@pytest.mark.parametrize(
    "module, line, expected",
    [
        # a lower layer imports a higher one
        ("pagoda.attention.backend", "from pagoda.worker import model_runner", "attention layer"),
        ("pagoda.model.llama", "import pagoda.engine.llm_engine", "model layer"),
        # the torch-free core imports torch, even inside a function
        ("pagoda.core.scheduler", "def _probe():\n    import torch", "torch-free"),
        # a kernel family reaches into another one it may not use
        ("pagoda.kernels.gemv.gemv", "from pagoda.kernels.moe import align", "kernel family"),
        # a cycle between modules of one layer, dodged by a function-local import
        (
            "pagoda.core.block_hash",
            "def _late():\n    from pagoda.core import scheduler",
            "import cycle",
        ),
    ],
)
def test_a_deliberate_violation_fails(package_copy, module, line, expected):
    problems = _violate(package_copy, module, line)
    assert any(expected in p for p in problems), problems
