"""One router against R router replicas, live, alternated: is R replicas' P95 TTFT within 10 % of one router's?

    python -m bench.replicas_live --out DIR [--routers 4 --pairs 2 --time-scale 2
                                             --start 840 --duration 60 --rate-scale 0.35 --planner off]
    scripts/replicas-live.sh DIR [options]     (the same, niced)

Each run is a `kairos up` cluster (simulated engines on `--profile`, 2P2D, policy Kairos at its
defaults, modeled KV transfers, no monitor; with R > 1 the R replicas share the HTTP port through
SO_REUSEPORT and every worker registers with each) replaying the same slice of the code trace
with `kairos bench` (open loop), then stopped. The runs go 1, R, R, 1, 1, R, ... (`--pairs`
pairs, the order alternated so that a drift of the host's load favours neither side).

The role planner is off by default (`--planner off`): with replicas only one of them runs it,
judging by its own queue, and on a loaded host it flipped workers 0-3 times a run, differently
from run to run (docs/results/router-replicas.md): a flip changes the cluster's shape mid-run and
hides what the routing did. `--planner on` measures the two together.

`--time-scale K` (default 2) runs the same scenario K times slower, so that the routers, the
workers and the client need 1/K of the CPU per simulated second: every modeled step and KV
transfer x K, the SLOs x K (the requests' own and the routers' defaults), the trace's arrivals K
times further apart, the heartbeat interval, KV wait timeout, request deadline and planner periods
x K (as bench/live_vs_sim.py). Not scaled: the 2 ms prompt heartbeat, the replicas' 3 ms turns,
the bus, and the routers' CPU per request. TTFTs below are divided by K (seconds of the x1 scenario).

Per run: the host's load average (1 min) before and after; requests refused with HTTP 429
(admission's overload shedding) and other errors; TTFT P50 and the served requests' P95/P99 (the
429s are not in them: a router that refuses more of the requests that would wait longest flatters
its served percentiles, so the TTFT SLO attainment counting a refusal as a miss is given too);
both-SLO attainment (TTFT and every gap within the SLOs, refusals as misses); the requests each
replica served (`request_done` lines in its log); the planner's flips. Then, per pair, R replicas'
served P95 over one router's. The summary goes to DIR/replicas-live.json, each run's client
results and logs to DIR/<run>/.

The host must be otherwise idle for a figure to compare: with R router processes, four workers and
the client on two cores, the CPU is part of what is measured (the load average says how much).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.live_vs_sim import TBT_SLO, TTFT_SLO, _lines, scaled_env
from common.config import RouterConfig
from kairos.up import Cluster, ClusterSpec


def order(routers: int, pairs: int) -> list[tuple[int, str]]:
    """The runs: (router count, label), one router and `routers` alternated, pair by pair
    (1, R, R, 1, 1, R, ...), labelled by pair (a, b, c, ...)."""
    runs: list[tuple[int, str]] = []
    for i in range(pairs):
        label = chr(ord("a") + i % 26) + (str(i // 26) if i >= 26 else "")
        pair = [1, routers] if i % 2 == 0 else [routers, 1]
        runs += [(r, label) for r in pair]
    return runs


def per_replica(logs: Path, names: list[str]) -> tuple[list[int], int]:
    """Requests each router process served (its `request_done` lines, outcome ok) in `names`'
    order, and the role planner's flips (`role_flip` lines, any router)."""
    served, flips = [], 0
    for n in names:
        lines = _lines(logs / f"{n}.log")
        served.append(sum(1 for e in lines if e.get("event") == "request_done" and e.get("outcome") == "ok"))
        flips += sum(1 for e in lines if e.get("event") == "role_flip")
    return served, flips


def run_one(a: argparse.Namespace, routers: int, label: str, out: Path) -> dict[str, Any]:
    k = a.time_scale
    d = out / f"r{routers}-{label}"
    d.mkdir(parents=True, exist_ok=True)
    logs = d / "kairos-logs"
    env = {"KAIROS_PLANNER": "true" if a.planner == "on" else "false", "KAIROS_LOG_REQUESTS": "true",
           **scaled_env(k), **dict(kv.split("=", 1) for kv in a.router_env)}
    spec = ClusterSpec.ephemeral(prefill=a.prefill, decode=a.decode, engine="sim", profile=a.profile,
                                 policy="kairos", kv_transport="modeled", monitor=False, log_dir=str(logs),
                                 log_level="info", time_scale=k, routers=routers, router_env=env)
    c = Cluster(spec)
    c.start(timeout=300)
    load_before = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "kairos.loadgen", "--url", spec.api + "/v1", "--trace", a.trace,
           "--start", repr(a.start), "--duration", repr(a.duration), "--rate-scale", repr(a.rate_scale / k),
           "--ttft-slo", repr(TTFT_SLO * k), "--tbt-slo", repr(TBT_SLO * k),
           "--timeout", repr(RouterConfig().request_timeout * k), "--no-progress", "--quiet",
           "--out", str(d / "bench.json")]
    t0 = time.time()
    try:
        subprocess.run(cmd, check=True, timeout=a.duration / a.rate_scale * k * 3 + 600)
    finally:
        load_after = os.getloadavg()[0]
        c.stop(30)
    b = json.loads((d / "bench.json").read_text())
    served, flips = per_replica(logs, spec.router_names)
    errors: dict[str, int] = b.get("errors") or {}

    def s(x: float | None) -> float | None:
        return None if x is None else round(x / k, 4)

    return {"routers": routers, "run": label, "wall_s": round(time.time() - t0, 1),
            "load_before": round(load_before, 2), "load_after": round(load_after, 2),
            "requests": b.get("requests"), "refused_429": errors.get("http_429", 0),
            "other_errors": {e: n for e, n in errors.items() if e != "http_429"},
            "ttft_p50": s(b.get("ttft_p50")), "served_p95": s(b.get("ttft_p95_served")),
            "served_p99": s(b.get("ttft_p99_served")), "ttft_slo": b.get("ttft_slo_attainment"),
            "both_slo": b.get("slo_attainment"), "served_per_replica": served, "flips": flips,
            "command": " ".join(cmd[2:])}


def ratios(runs: list[dict[str, Any]], routers: int) -> list[dict[str, Any]]:
    """Per pair: R replicas' served P95 TTFT over one router's."""
    out = []
    for label in dict.fromkeys(r["run"] for r in runs):
        one = next((r for r in runs if r["run"] == label and r["routers"] == 1), None)
        many = next((r for r in runs if r["run"] == label and r["routers"] == routers), None)
        if one and many and one["served_p95"] and many["served_p95"] is not None:
            out.append({"run": label, "one": one["served_p95"], "replicas": many["served_p95"],
                        "ratio": round(many["served_p95"] / one["served_p95"], 3)})
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def table(res: dict[str, Any]) -> str:
    rows = ["| routers | run | load before / after | 429 | TTFT p50 | served p95 | served p99 | TTFT SLO | both SLOs "
            "| served per replica | flips |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        rows.append(f"| {r['routers']} | {r['run']} | {r['load_before']} / {r['load_after']} | {r['refused_429']} | "
                    f"{r['ttft_p50']} | {r['served_p95']} | {r['served_p99']} | {_pct(r['ttft_slo'])} | "
                    f"{_pct(r['both_slo'])} | {', '.join(map(str, r['served_per_replica']))} | {r['flips']} |")
    rows.append("")
    for p in res["pairs"]:
        rows.append(f"pair {p['run']}: {res['routers']} replicas' served P95 TTFT {p['replicas']} s against one "
                    f"router's {p['one']} s: x{p['ratio']} ({'within' if p['ratio'] <= 1.1 else 'NOT within'} 10 %)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for each run's client results and logs, and the summary")
    p.add_argument("--routers", type=int, default=4, help="router replicas against one router (default 4)")
    p.add_argument("--pairs", type=int, default=2, help="pairs of runs, one router and R, order alternated (default 2)")
    p.add_argument("--trace", default="code", help="the trace `kairos bench` replays (default code)")
    p.add_argument("--start", type=float, default=840.0,
                   help="slice start, seconds of trace time (default 840: the code trace's burst minute at x0.35)")
    p.add_argument("--duration", type=float, default=60.0, help="slice length, seconds of trace time (default 60)")
    p.add_argument("--rate-scale", type=float, default=0.35, help="the trace's rate scale at x1 (default 0.35)")
    p.add_argument("--time-scale", type=float, default=2.0, metavar="K",
                   help="the scenario K times slower, for the CPU (see above; default 2)")
    p.add_argument("--planner", choices=("on", "off"), default="off",
                   help="the role planner (default off: its flips would change the cluster mid-run)")
    p.add_argument("--router-env", action="append", default=[], metavar="KAIROS_X=VALUE",
                   help="a router setting for every run, e.g. KAIROS_REPLICA_STAGGER_MS=10 (repeatable)")
    p.add_argument("--replicas-only", action="store_true",
                   help="only the R-replica runs (--pairs of them), to compare a setting with an earlier series")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--profile", default="h100-llama2-70b-tp4")
    a = p.parse_args(argv)
    if not a.time_scale > 0:
        p.error("--time-scale must be positive (1: the profile's own timing)")
    if a.routers < 2 or a.pairs < 1:
        p.error("--routers must be 2 or more and --pairs 1 or more")
    if bad := [kv for kv in a.router_env if not kv.startswith("KAIROS_") or "=" not in kv]:
        p.error(f"--router-env takes KAIROS_NAME=VALUE (got {bad[0]!r}; `kairos router --help` lists the settings)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "trace": a.trace, "slice": [a.start, a.start + a.duration], "rate_scale": a.rate_scale,
        "time_scale": a.time_scale, "planner": a.planner, "routers": a.routers, "router_env": a.router_env,
        "shape": f"{a.prefill}P{a.decode}D", "profile": a.profile, "runs": []}
    summary = out / "replicas-live.json"
    runs = order(a.routers, a.pairs)
    if a.replicas_only:
        runs = [(r, label) for r, label in runs if r > 1]
    for routers, label in runs:
        res["runs"].append(run_one(a, routers, label, out))
        res["pairs"] = ratios(res["runs"], a.routers)
        summary.write_text(json.dumps(res, indent=2))  # after every run: an interrupted series keeps its runs
        print(json.dumps({k: v for k, v in res["runs"][-1].items() if k != "command"}), flush=True)
    print(table(res))
    print(f"\nTTFT in seconds of the x1 scenario (divided by --time-scale {a.time_scale}); summary: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
