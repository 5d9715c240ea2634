"""What a KV benchmark's JSON says about the machine, and its transfer-rate summary.

Shared by `kairos kv-bench` (common.kv.bench, host memory) and its GPU-memory variant
(common.kv.tensor_bench), so that both write the same fields.
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = 0.0
    return {"cpus": os.cpu_count(), "arch": platform.machine(), "cpu_model": model, "mem_gib": mem_gib,
            "os": platform.platform(), "python": platform.python_version()}


def rate_summary(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"gbps_median": round(statistics.median(rates), 3), "gbps_min": round(min(rates), 3),
            "gbps_max": round(max(rates), 3), "ms_median": round(1e3 * statistics.median(seconds), 3)}
