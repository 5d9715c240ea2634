"""`vllm bench serve` against vLLM's own OpenAI server and against Kairos, the same requests.

    PYTHONPATH=$PWD .venv-vllm/bin/python -m tests.vllm.bench_side_by_side --out DIR

Makes the tiny model, starts vLLM's server (one engine) and `kairos up --engine vllm` (1 prefill +
1 decode worker, the Kairos policy), and runs the same two `vllm bench serve` workloads against each:
the random dataset and the first requests of the Azure conversation trace as a timed trace. Prints
a markdown table (the BENCHMARKS.md section) and leaves the raw results in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

from common.ports import free_port
from kairos.up import Cluster, ClusterSpec, die_with_parent
from tests.vllm.test_real_clients import timed_trace

WORKLOADS = {
    "random 64x(512 in, 32 out) @ 4/s": ["--dataset-name", "random", "--num-prompts", "64", "--random-input-len",
                                          "512", "--random-output-len", "32", "--request-rate", "4",
                                          "--ignore-eos"],
    "Azure conv trace, first 48": ["--dataset-name", "timed_trace", "--num-prompts", "48", "--ignore-eos"],
}
KEYS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "output_throughput")


def vllm_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
           "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", model.name]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM server exited; see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"vLLM server not ready in 300 s; see {log}")


def bench(base: str, model: Path, out: Path, args: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "tests.vllm.bench_serve", "--backend", "openai", "--base-url", base,
           "--endpoint", "/v1/completions", "--model", model.name, "--tokenizer", str(model), "--seed", "1",
           "--num-warmups", "2",  # the first sampled request of a vLLM engine is slow (seconds)
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1200)
    r = json.loads(out.read_text())
    return {k: float(r[k]) for k in KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the model, logs and raw results")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from common.engines.tiny_model import make_tiny_model

        make_tiny_model(model)
    trace = timed_trace(out / "trace.jsonl", rows=48)
    WORKLOADS["Azure conv trace, first 48"] += ["--dataset-path", str(trace)]
    results: dict[tuple[str, str], dict[str, float]] = {}
    proc, url = vllm_server(model, out / "vllm-server.log")
    try:
        for name, wl in WORKLOADS.items():
            results["vLLM server", name] = bench(url, model, out / f"vllm-{len(results)}.json", wl)
    finally:
        proc.terminate()
        proc.wait(30)
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(model), profile="cpu-tiny-llama",
                                 vllm_profile="cpu-tiny-llama", policy="kairos", monitor=False,
                                 log_dir=str(out / "kairos-logs"),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64", "KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50"},  # 5 s: the 2 shared CI cores stall workers
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64"})
    c = Cluster(spec)
    c.start(timeout=300)
    try:
        for name, wl in WORKLOADS.items():
            results["Kairos 1P+1D", name] = bench(c.spec.api, model, out / f"kairos-{len(results)}.json", wl)
    finally:
        c.stop(30)
    print("| workload | server | completed | failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        for server in ("vLLM server", "Kairos 1P+1D"):
            r = results[server, name]
            print(f"| {name} | {server} | {r['completed']:.0f} | {r['failed']:.0f} | {r['median_ttft_ms']:.1f} | "
                  f"{r['p99_ttft_ms']:.1f} | {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} | "
                  f"{r['output_throughput']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
