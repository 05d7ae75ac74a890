"""A benchmark's result file: one JSON document with the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """Platform, CPUs, Python, torch and triton versions, and the GPUs when torch is
    already imported and sees one (this never imports torch itself)."""
    info = {
        "platform": platform.platform(),
        "hostname": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "gpu": None,
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def write_result(path: str, data: dict, indent: int = 2) -> None:
    """Writes data to path as JSON (directories created) and says where. A "date" is
    added when data has none, and "machine" (machine_info) is added or, when data has
    a "machine" dict of its own, completed with the keys it lacks."""
    machine = data.get("machine")
    info = machine_info()
    data = {**data, "machine": {**info, **machine} if isinstance(machine, dict) else info}
    data.setdefault("date", datetime.now(UTC).isoformat(timespec="seconds"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    print(f"wrote {path}")
