"""scripts/gpu-check.sh in its CPU mode (tiny shapes): it runs end to end and writes what it says.

The GPU run itself needs a GPU (docs/deployment.md); this keeps the script, the model code and
the fit from rotting. It lives in the vLLM tier because that venv has PyTorch (the main one does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1100)]
ROOT = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch", reason="the GPU check needs PyTorch (the vLLM tier's venv has it)")


def test_gpu_check_cpu_mode(tmp_path: Path) -> None:
    from bench.gpu_check import TINY_SWEEP, plan
    from common.perf_model import load_profile

    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh"), "--tiny", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1050)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    steps = plan(TINY_SWEEP)
    assert result["device"] == "cpu" and len(result["samples"]) == len(steps)
    assert {s["kind"] for s in result["samples"]} == {"prefill", "decode", "mixed"}
    assert all(s["seconds"] > 0 for s in result["samples"])
    assert [(s["chunk"], s["context"], s["batch"], s["decode_context"]) for s in result["samples"]] == \
        [(k["chunk"], k["context"], k["batch"], k["decode_context"]) for _, k in steps]
    assert result["fit"]["a0"] >= 0 and all(result["fit"][a] >= 0 for a in ("a1", "a2", "a3", "a4", "a5"))
    assert set(result["fit_mape_per_kind"]) == {"prefill", "decode", "mixed"}
    assert "kv_bench" in result  # run, skipped or failed: always said
    assert result["kv_bench_vram"] == {"skipped": "no CUDA device"}
    vllm = result["vllm"]
    if "skipped" not in vllm:  # vLLM is installed: the stage ran on CPU, baseline and Kairos
        assert vllm["ok"], json.dumps(vllm, indent=1)[-3000:]
        assert vllm["platform"] == "cpu" and vllm["checks"]["identical_greedy_text"]
        assert set(vllm["runs"]) == {"disagg-least-loaded", "kairos"}
        assert all(e["kv_buffer_device"] == "cpu" for run in vllm["runs"].values() for e in run["logs"]["engines"])
    log = (tmp_path / "gpu-check.log").read_text()
    assert "== gpu-check summary" in log and "vLLM stage:" in log
    profile = load_profile(str(tmp_path / "gpu-check-profile.json"))
    assert profile.name == "gpu-check-tiny" and profile.model.a0 == result["fit"]["a0"]
    assert sum(1 for line in log.splitlines() if line.endswith(" ms")) == len(steps)


def test_gpu_check_refuses_full_run_without_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full run would start")
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
