"""`kairos bench` against a plain vLLM OpenAI server (no Kairos in between), so users can compare.

Uses vLLM's own OpenAI API server (the `vllm_server` fixture of conftest.py) and replays a short
synthetic trace with the load generator's defaults: token-id
prompts of exact lengths, ignore_eos + min_tokens so outputs have the trace's lengths, streaming.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]


def test_bench_replays_a_trace_against_plain_vllm(vllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = subprocess.run([sys.executable, "-m", "kairos.cli", "bench", "--url", vllm_server, "--trace", "synthetic",
                         "--rate", "4", "--duration", "6", "--lengths", "conv", "--max-input-len", "400",
                         "--max-output-len", "24", "--token-range", "10,900", "--seed", "3", "--no-progress",
                         "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stdout[-3000:] + rc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("ttft_p50", "ttft_p95", "ttft_p99", "tbt_p95", "tbt_p99", "ttft_slo_attainment",
                "tbt_slo_attainment", "slo_attainment", "requests", "errors", "goodput"):
        assert key in r, key
    assert r["requests"] > 5
    assert not r["errors"], r["errors"]
    assert r["ttft_p50"] > 0
