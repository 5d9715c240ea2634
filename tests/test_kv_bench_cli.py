"""`kairos kv-bench --memory vram` on an install without PyTorch: one clear line, exit 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here "
                    "(tests/vllm/test_kv_vram.py checks the refusal without CUDA)")
def test_vram_mode_without_torch_says_so_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "common.kv.bench", "--memory", "vram", "--out", str(tmp_path / "k.json")],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "needs PyTorch with CUDA" in r.stderr and "torch is not installed" in r.stderr
