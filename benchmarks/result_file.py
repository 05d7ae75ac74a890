"""Writing a benchmark's results: one JSON file, its directory made as needed."""

from __future__ import annotations

import json
import os


def write_json(path: str, data, indent: int = 2) -> None:
    """Writes data to path as JSON (directories created) and says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    print(f"wrote {path}")
