"""The embedded model's GGUF for the tests that need it.

`make test` installs the embedded model and a missing package fails the tests that need
it. A GPU machine's kernel run (tools/gpu_tests.sh) sets
PAGODA_TESTS_WITHOUT_EMBEDDED_MODEL=1 where the package is absent, and they skip.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from pagoda.model.tokenizer import embedded_model_path


def embedded_gguf() -> pathlib.Path:
    try:
        return embedded_model_path()
    except FileNotFoundError as exc:
        if os.environ.get("PAGODA_TESTS_WITHOUT_EMBEDDED_MODEL") == "1":
            pytest.skip(str(exc))
        raise
