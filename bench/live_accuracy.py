"""The live predictor's error on real engines: predicted against measured TTFT and step times.

    PYTHONPATH=$PWD .venv-vllm/bin/python -m bench.live_accuracy --out DIR [--rate 2 --duration 60]

Makes the tiny model, starts `kairos up --engine vllm` (1 prefill + 1 decode worker, the Kairos
policy) on measured profiles (each worker measures its engine at its first start; both share the
store in DIR/profiles, so the second loads what the first measured), replays a trace slice with
`kairos bench`, then reads:

- every request's predicted TTFT (the router's, for the route it chose) and its measured TTFT,
  from the router's `request_done` log lines;
- every step's predicted against measured time, as the workers report it (their /metrics,
  kairos_engine_step_prediction_error p50 / p90 over their last two minutes of steps).

Prints a JSON summary (also written to DIR/live-accuracy.json): median and p90 of
|predicted - actual| / actual, per route and over all, and the steps' error per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from common.ports import free_ports
from kairos.up import Cluster, ClusterSpec


def _q(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else None


def ttft_errors(router_log: Path, skip: int) -> dict[str, Any]:
    """|pred - actual| / actual TTFT of the requests the router logged, the first `skip` left out."""
    rows = []
    for line in router_log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "request_done" and e.get("ttft_s") and e.get("ttft_pred_s") is not None \
                and e.get("outcome") == "ok":
            rows.append(e)
    rows = rows[skip:]
    out: dict[str, Any] = {}
    for route in [*sorted({r["route"] for r in rows}), "all"]:
        sel = [r for r in rows if route in ("all", r["route"])]
        errs = [abs(r["ttft_pred_s"] - r["ttft_s"]) / r["ttft_s"] for r in sel]
        signed = [(r["ttft_pred_s"] - r["ttft_s"]) / r["ttft_s"] for r in sel]
        out[route] = {"n": len(sel), "median": _q(errs, 0.5), "p90": _q(errs, 0.9), "bias": _q(signed, 0.5),
                      "ttft_p50_s": _q([r["ttft_s"] for r in sel], 0.5)}
    return out


def step_errors(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kairos_engine_step_prediction_error{"):
            stat = line.split('stat="', 1)[1].split('"', 1)[0]
            out[stat] = round(float(line.rsplit(" ", 1)[1]), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the model, logs, profiles and the summary")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (kairos bench --rate)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the trace to replay")
    p.add_argument("--skip", type=int, default=10, help="leave out the first requests (the engines warm up)")
    p.add_argument("--vllm-profile", default="measured",
                   help="the workers' step-time model: measured (default) or a profile name, to compare")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from common.engines.tiny_model import make_tiny_model

        model = out / "tiny-llama"
        if not (model / "config.json").exists():
            make_tiny_model(model)
    p_port, d_port = free_ports(2)
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(model), policy="kairos",
                                 monitor=False, log_dir=str(out / "kairos-logs"), vllm_profile=a.vllm_profile,
                                 metrics_ports={"prefill-0": p_port, "decode-0": d_port},
                                 router_env={"KAIROS_CANDIDATES": "256,128,64", "KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50", "KAIROS_LOG_REQUESTS": "true"},
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64",
                                             "KAIROS_PROFILE_STORE": str(out / "profiles")})
    c = Cluster(spec)
    t0 = time.monotonic()
    c.start(timeout=600)
    started = time.monotonic() - t0
    try:
        bench = [sys.executable, "-m", "kairos.loadgen", "--url", c.spec.api + "/v1", "--model", model.name,
                 "--trace", "synthetic", "--arrival", "poisson", "--seed", "1",
                 "--rate", str(a.rate), "--duration", str(a.duration), "--max-input-len", "1536",
                 "--max-output-len", "64", "--token-range", "10,900", "--no-progress",
                 "--out", str(out / "bench.json")]
        subprocess.run(bench, check=True, timeout=a.duration * 4 + 120)
        steps = {"prefill-0": step_errors(p_port), "decode-0": step_errors(d_port)}
    finally:
        c.stop(30)
    profiles = [json.loads(f.read_text()) for f in sorted((out / "profiles").glob("*.json"))]
    summary = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": f"{platform.machine()} "
        f"{platform.processor()}".strip(), "cluster_start_s": round(started, 1), "rate": a.rate,
        "duration_s": a.duration, "skipped_first": a.skip, "vllm_profile": a.vllm_profile,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "ttft": ttft_errors(out / "kairos-logs" / "router.log", a.skip), "steps": steps,
        "profiles": [{"keys": pr.get("keys"), "fit_mape": pr.get("fit_mape", {}).get("all")} for pr in profiles],
    }
    (out / "live-accuracy.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
