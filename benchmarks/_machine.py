"""What the benchmarks print about the machine they ran on (every figure names its CPU), and the
JSON file their figures go to (``--json PATH``)."""

from __future__ import annotations

import json
import platform
from typing import Optional

__all__ = ["cpu_name", "write_json"]


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_json(path: Optional[str], out: dict) -> None:
    """Write a benchmark's figures ``out`` (its CPU among them) to ``path`` as indented JSON;
    nothing when ``path`` is ``None`` (no ``--json``)."""
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
