"""benchmarks/: every program parses its arguments and imports on the CPU as
`python -m benchmarks.<name>`, none edits sys.path, and the harness's pure parts (result
file, rooflines, stage timer, disk ceiling) do what they say."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.results import write_result
from benchmarks.harness.rooflines import (
    disk_read_ceiling,
    model_bytes_and_flops,
    roofline_decode_ms,
)
from benchmarks.harness.timing import StageTimer

ROOT = Path(__file__).resolve().parents[2]
# name -> the argument lists whose --help must parse (a mode per subcommand)
SCRIPTS = {
    "gpu_compare": [[]],
    "cpu_compare": [[]],
    "cpu_quant": [[]],
    "ttft": [[]],
    "soak": [[]],
    "dashboard_overhead": [[]],
    "structured_overhead": [[]],
    "profile_step": [[], ["decode"], ["static"], ["timeline"], ["cpu"]],
    "spec_decode": [[], ["cpu"], ["replay"], ["draft"], ["serve"]],
    "tp": [[], ["compare"], ["allreduce"], ["executors"]],
    "kv_offload": [[], ["serve"], ["steps"], ["disk"]],
    "fp8": [[], ["quality"], ["kv"]],
    "kernels": [[]],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_program_parses_its_arguments(name):
    for argv in SCRIPTS[name]:
        out = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", *argv, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "usage:" in out.stdout


def test_no_program_edits_sys_path():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    offenders = [
        str(f.relative_to(ROOT))
        for f in files
        if re.search(r"sys\.path\.(insert|append)", f.read_text())
    ]
    assert files and offenders == []


def test_write_result_adds_date_and_machine_and_keeps_the_programs_own(tmp_path):
    path = tmp_path / "deep" / "result.json"
    write_result(str(path), {"benchmark": "x", "machine": {"gpu": "mine", "threads": 2}})
    data = json.loads(path.read_text())
    assert data["benchmark"] == "x" and data["date"]
    assert data["machine"]["gpu"] == "mine" and data["machine"]["threads"] == 2
    assert {"platform", "python", "torch", "triton", "cpus"} <= set(data["machine"])


def test_llama_8b_bytes_and_roofline():
    from pagoda.model.presets import get_preset

    info = model_bytes_and_flops(get_preset("llama-3.1-8b"))
    assert 8.0e9 < info["params"] < 8.1e9
    assert info["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert roofline_decode_ms(info, {}, 1, 128) == {}
    ceilings = {"copy_bytes_per_s": 3e12, "bf16_matmul_flops": 787e12}
    bound = roofline_decode_ms(info, ceilings, 256, 1036)
    weights = info["weight_bytes"] - info["embedding_bytes"]
    assert bound["bytes_read"] == weights + 256 * 1036 * info["kv_bytes_per_token"]
    assert bound["roofline_ms"] == max(bound["memory_ms"], bound["compute_ms"])


def test_stage_timer_sums_and_counts_only_while_active():
    class Owner:
        def work(self, x):
            return x + 1

    owner, timer = Owner(), StageTimer()
    timer.wrap(owner, "work", "w")
    assert owner.work(1) == 2
    timer.active = False
    owner.work(1)
    assert timer.calls["w"] == 1 and timer.totals["w"] >= 0.0
    timer.steps = 2
    assert timer.per_step_ms() == {"w": timer.totals["w"] / 2 * 1e3}
    timer.reset()
    assert not timer.totals and not timer.calls and timer.steps == 0


def test_disk_ceiling_reads_back_what_it_wrote(tmp_path):
    ceiling = disk_read_ceiling(str(tmp_path), 4 << 20, 2, 1 << 20)
    assert ceiling["file_bytes"] == 4 << 20 and ceiling["threads"] == 2
    assert all(
        ceiling[k] > 0
        for k in (
            "write_gb_per_s",
            "cold_sequential_read_gb_per_s",
            "cold_parallel_read_gb_per_s",
            "hot_parallel_read_gb_per_s",
        )
    )
    assert list(tmp_path.iterdir()) == []  # its file is removed
