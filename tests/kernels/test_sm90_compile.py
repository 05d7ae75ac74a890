"""The kernels tools/compile_sm90.py lists compile for Hopper (sm_90) with Triton's own
compiler and ptxas, on this machine without a GPU.

The interpreter the other kernel tests use runs a kernel's Python; it cannot see what
the GPU compiler rejects. Each case is compiled in a subprocess (the tests' process
has TRITON_INTERPRET set, which turns every kernel into an interpreted one). Skipped,
with the reason, where Triton has no CUDA backend or ptxas.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "compile_sm90.py")


def _ptxas_present() -> bool:
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
    except ImportError:
        return False
    if spec is None or spec.origin is None:
        return False
    return os.path.exists(
        os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas")
    )


@pytest.mark.skipif(
    not _ptxas_present(), reason="needs Triton with its CUDA backend (pip install 'pagoda[test]')"
)
@pytest.mark.slow
@pytest.mark.parametrize(
    "group", ["moe", "mla_prefill", "pdl", "fp8_fused_quant", "defaults", "dsa"]
)
def test_kernels_compile_for_sm90(group, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sass = ["--sass", str(tmp_path)] if group == "fp8_fused_quant" else []
    out = subprocess.run(
        [sys.executable, TOOL, "--loops", *sass, group],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "REG:" in out.stdout, out.stdout
    if sass:  # one SASS file per reported case, each with the kernel's instructions
        cases = [line.split(":")[0] for line in out.stdout.splitlines() if "REG:" in line]
        files = sorted(p.name for p in tmp_path.iterdir())
        assert len(files) == len(cases) > 0, (files, cases)
        for path in tmp_path.iterdir():
            assert re.search(r"/\*[0-9a-f]{4}\*/\s+EXIT", path.read_text()), path.name
    if group == "pdl":  # --loops finds the FP8 decode kernels' key loop
        lines = out.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("pdl.decode[fp8=True"):
                # The kernel's indented report lines (preloaded loads, loops) follow it.
                report = []
                for detail in lines[i + 1 :]:
                    if not detail.startswith("  "):
                        break
                    report.append(detail)
                assert any(
                    re.fullmatch(r"  loop at 0x[0-9a-f]+: [1-9]\d+ instructions \(.+\)", detail)
                    for detail in report
                ), [line] + report
