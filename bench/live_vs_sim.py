"""One slice of a shifting workload, live and simulated: does the live system do what `kairos sim` says?

    python -m bench.live_vs_sim --out DIR [--workload shift-code --start 100 --duration 150 --rate-scale 0.75]
                                          [--time-scale K]
    scripts/live-vs-sim.sh DIR            (the same, niced)

Writes the workload's report slice (sim/workloads.py, its seed 11) as JSON lines (DIR/trace.jsonl),
then replays trace time [start, start + duration) at `rate-scale`:

- simulated: `kairos sim --trace DIR/trace.jsonl ... --planner on` (Kairos, its shipped settings);
- live: a `kairos up` cluster of the same shape (simulated engines on the same profile, the same
  policy and settings, the role planner on, modeled KV transfers, no monitor), driven by `kairos
  bench` with the same slice; then the router's log (`role_flip`, `role_flip_done`, one
  `request_done` line per request) and the workers' (`role_change_kept`).

`--time-scale K` runs both sides as the same scenario K times slower, so that the live cluster
needs 1/K of the CPU per simulated second (two cores shared by the router, four workers and the
client keep up): every modeled step and KV transfer x K (`kairos up --time-scale`, `kairos sim
--time-scale`), the TTFT and TBT SLOs x K, the trace's arrivals K times further apart (rate-scale /
K), and the periods that are part of the scenario x K on both sides: the workers' heartbeat (and
with it the router's liveness window, 10 heartbeats), the KV wait timeout, the router's request
deadline (live; the simulator has none) and the role planner's interval, window, dwell, gap and
flip timeout (sim/router.py `router_periods`). Times in the output are the slowed ones; attainments
compare directly with an unscaled run's.

Prints, for each side: requests, completed, rejected, TTFT SLO %, TBT % (every gap within the SLO,
over served requests), TBT % on each request's P99 gap, both-SLO %, and the role flips (when,
which worker, to which role, why, how many running decodes it kept). The live side twice: as the
client measured it (`kairos bench`: its own clock, so a client short of CPU counts its own lateness)
and as the router recorded it (`request_done`: TTFT, each request's largest and P99 gap, taken where
the workers' tokens arrive). Then where the client's extra misses come from: for each request the
client saw miss TBT, its largest gap on the client against the router's where the tokens arrived
(`tbt_max_s`) and where the router wrote them to the socket (`write_gap_max_s`; `gaps`), and the
TBT delivery allowance the live router planned with (`delivery`; `--tbt-delivery-allowance-ms`
gives both sides the same configured part, common/router_core/delivery.py). Also the host's
load average before and after and the client's send lag: a loaded host starves the live side, never
the simulated one. The summary goes to DIR/live-vs-sim.json.
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

from common.config import RouterConfig
from common.sessions import write_jsonl
from kairos.up import Cluster, ClusterSpec
from sim.router import router_periods
from sim.workloads import WORKLOADS, load

TTFT_SLO, TBT_SLO = 2.0, 0.1  # `kairos sim`'s and `kairos bench`'s defaults
KEYS = ("requests", "completed", "rejected", "ttft_slo_attainment", "tbt_slo_attainment",
        "tbt_p99_slo_attainment", "slo_attainment")


def _pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in KEYS}


def _lines(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def router_view(router_log: list[dict[str, Any]], ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """The requests as the router recorded them (`request_done`): TTFT and each one's largest and
    P99 gap (as the simulator's and the client's TBT %: every gap within the SLO, over served requests)."""
    done = [e for e in router_log if e.get("event") == "request_done"]
    ok = [e for e in done if e.get("outcome") == "ok"]
    ttft = [e for e in ok if e.get("ttft_s") is not None and e["ttft_s"] <= ttft_slo]
    tbt = [e for e in ok if (e.get("tbt_p99_s") or 0.0) <= tbt_slo]
    tbt_max = [e for e in ok if (e.get("tbt_max_s") or 0.0) <= tbt_slo]
    both = [e for e in ttft if (e.get("tbt_max_s") or 0.0) <= tbt_slo]
    n = len(done)
    return {"requests": n, "completed": len(ok), "outcomes": _count(e.get("outcome") for e in done),
            "ttft_slo_attainment": len(ttft) / n if n else None,
            "tbt_slo_attainment": len(tbt_max) / len(ok) if ok else None,
            "tbt_p99_slo_attainment": len(tbt) / len(ok) if ok else None,
            "slo_attainment": len(both) / n if n else None,
            "migrated": sum(1 for e in done if e.get("migrations")),
            "retried": sum(1 for e in done if (e.get("attempts") or 1) > 1)}


def gap_sources(records: list[dict[str, Any]], router_log: list[dict[str, Any]], tbt_slo: float) -> dict[str, Any]:
    """Where the client's TBT misses come from: for each request the client served with a gap past
    the SLO, its largest gap as the client saw it against the router's (`request_done` tbt_max_s,
    taken where the worker's tokens arrive: the engine's step and the worker -> router delivery).
    `router_too`: the router saw a gap past the SLO as well (the step or the delivery to the router);
    `client_only`: the router's gaps were all within it (router -> client, or the client itself)."""
    done = {e.get("request_id"): e for e in router_log if e.get("event") == "request_done"}
    miss = [r for r in records if r.get("error") is None and r.get("gaps") and max(r["gaps"]) > tbt_slo]
    joined = [(max(r["gaps"]), done[r["request_id"]]) for r in miss if r.get("request_id") in done]
    pairs = [(c, e.get("tbt_max_s") or 0.0) for c, e in joined]
    extra = sorted(c - g for c, g in pairs)
    # the router's own socket writes (`write_gap_max_s`: every write but the stream's last chunk):
    # between the token's arrival and its write (router) or after the write (network, client)
    writes = [(c, e.get("tbt_max_s") or 0.0, e["write_gap_max_s"]) for c, e in joined
              if e.get("write_gap_max_s") is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    gaps = sorted(g for r in records if r.get("error") is None for g in r.get("gaps") or ())
    return {"client_misses": len(miss), "joined": len(pairs),
            "router_too": sum(1 for _, g in pairs if g > tbt_slo),
            "client_only": sum(1 for _, g in pairs if g <= tbt_slo),
            "client_max_gap_p50": pct(sorted(c for c, _ in pairs), 0.5),
            "router_max_gap_p50": pct(sorted(g for _, g in pairs), 0.5),
            "client_minus_router_max_gap_p50": pct(extra, 0.5), "client_minus_router_max_gap_p90": pct(extra, 0.9),
            "with_write_gaps": len(writes),
            "write_minus_router_max_gap_p50": pct(sorted(w - g for _, g, w in writes), 0.5),
            "write_minus_router_max_gap_p90": pct(sorted(w - g for _, g, w in writes), 0.9),
            "client_minus_write_max_gap_p50": pct(sorted(c - w for c, _, w in writes), 0.5),
            "client_minus_write_max_gap_p90": pct(sorted(c - w for c, _, w in writes), 0.9),
            "write_past_slo": sum(1 for _, _, w in writes if w > tbt_slo),
            "client_gap_p50": pct(gaps, 0.5), "client_gap_p99": pct(gaps, 0.99)}


def delivery_view(router_log: list[dict[str, Any]]) -> dict[str, Any]:
    """The live router's TBT delivery allowance (its `delivery_allowance` lines, written when it
    moves by 1 ms, at most every 10 s): the configured part, the largest measured part and allowance seen, the last."""
    lines = [e for e in router_log if e.get("event") == "delivery_allowance"]
    if not lines:
        return {}
    return {"configured_ms": lines[-1].get("configured_ms"),
            "measured_ms_max": max(e.get("measured_ms") or 0.0 for e in lines),
            "allowance_ms_max": max(e.get("allowance_ms") or 0.0 for e in lines),
            "last": {k: lines[-1].get(k) for k in ("allowance_ms", "measured_ms", "samples", "plan_tbt_ms")}}


def _count(xs: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def live_flips(router_log: list[dict[str, Any]], worker_logs: dict[str, list[dict[str, Any]]],
               t0: float) -> list[dict[str, Any]]:
    """Each flip the live router decided, with when (seconds after the replay began), its reason,
    how long until the worker was back, and how many running decodes the worker kept."""
    flips = []
    for e in router_log:
        if e.get("event") != "role_flip":
            continue
        at = _ts(e)
        done = next((x for x in router_log if x.get("event") == "role_flip_done" and x.get("worker") == e["worker"]
                     and _ts(x) >= at), None)
        kept = [x.get("requests") for x in worker_logs.get(e["worker"], [])
                if x.get("event") == "role_change_kept" and _ts(x) >= at]
        flips.append({"at": round(at - t0, 1), "worker": e["worker"], "to": e.get("to"), "reason": e.get("reason"),
                      "back_after_s": round(_ts(done) - at, 2) if done else None, "kept": kept[0] if kept else 0})
    return flips


def _ts(e: dict[str, Any] | None) -> float:
    """A log line's wall time in seconds (structlog's ISO timestamp)."""
    from datetime import datetime

    if not e or "timestamp" not in e:
        return 0.0
    return datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


def run_sim(a: argparse.Namespace, trace: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kairos.cli", "sim", "--trace", str(trace), "--start", str(a.start),
           "--duration", str(a.duration), "--rate-scale", str(a.rate_scale), "--prefill", str(a.prefill),
           "--decode", str(a.decode), "--profile", a.profile, "--policy", "kairos", "--planner", "on",
           "--time-scale", str(a.time_scale), "--tbt-delivery-allowance-ms", repr(a.tbt_delivery_allowance_ms),
           "--out", str(out / "sim.json")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    k = json.loads((out / "sim.json").read_text())["policies"]["kairos"]
    flips = [{"at": f["at"], "worker": f["worker"], "to": f["to"], "reason": f["reason"],
              "back_after_s": f["out_s"], "kept": f["kept"]} for f in k.get("sim", {}).get("role_flips", [])]
    return {"summary": _pick(k), "flips": flips, "final_split": k.get("sim", {}).get("final_split"),
            "command": " ".join(cmd[2:])}


def scaled_env(k: float, ttft_slo: float = TTFT_SLO, tbt_slo: float = TBT_SLO) -> dict[str, str]:
    """The live router's settings for the scenario `k` times slower, as `kairos sim --time-scale k`
    sets the simulated router's: the SLOs, the heartbeat interval the router asks its workers for
    (its liveness window is 10 of them), the KV wait timeout, a request's deadline (300 s: a
    2,000-token answer at K = 4 takes over 700 s) and the role planner's periods."""
    d = RouterConfig()
    env = {"KAIROS_TTFT_SLO": repr(ttft_slo * k), "KAIROS_TBT_SLO": repr(tbt_slo * k),
           "KAIROS_HEARTBEAT_INTERVAL": repr(d.heartbeat_interval * k),
           "KAIROS_KV_WAIT_TIMEOUT": repr(d.kv_wait_timeout * k), "KAIROS_REQUEST_TIMEOUT": repr(d.request_timeout * k)}
    env.update({"KAIROS_" + name.upper(): repr(v) for name, v in router_periods(k).items()})
    return env


def run_live(a: argparse.Namespace, trace: Path, out: Path) -> dict[str, Any]:
    logs = out / "kairos-logs"
    k = a.time_scale
    spec = ClusterSpec.ephemeral(prefill=a.prefill, decode=a.decode, engine="sim", profile=a.profile,
                                 policy="kairos", kv_transport="modeled", monitor=False, log_dir=str(logs),
                                 time_scale=k, router_env={"KAIROS_PLANNER": "true", "KAIROS_LOG_REQUESTS": "true",
                                                           "KAIROS_TBT_DELIVERY_ALLOWANCE_MS":
                                                               repr(a.tbt_delivery_allowance_ms),
                                                           **scaled_env(k)})
    c = Cluster(spec)
    c.start(timeout=300)
    load_before = os.getloadavg()
    cmd = [sys.executable, "-m", "kairos.loadgen", "--url", spec.api + "/v1", "--trace", str(trace),
           "--start", str(a.start), "--duration", str(a.duration), "--rate-scale", repr(a.rate_scale / k),
           "--ttft-slo", repr(TTFT_SLO * k), "--tbt-slo", repr(TBT_SLO * k),
           "--timeout", repr(RouterConfig().request_timeout * k),
           "--records", "--no-progress", "--quiet", "--out", str(out / "bench.json")]
    t0 = time.time()
    try:
        subprocess.run(cmd, check=True, timeout=a.duration / a.rate_scale * k * 3 + 600)
        _, got = c.get("/v1/kairos/stats")
        stats: dict[str, Any] = got if isinstance(got, dict) else {}
    finally:
        c.stop(30)
    bench = json.loads((out / "bench.json").read_text())
    router_log = _lines(logs / "router.log")
    workers = {p.stem: _lines(p) for p in logs.glob("*.log") if p.stem.startswith(("prefill-", "decode-"))}
    return {"summary": _pick(bench), "router": router_view(router_log, bench["ttft_slo"], bench["tbt_slo"]),
            "gaps": gap_sources(bench.get("records") or [], router_log, bench["tbt_slo"]),
            "delivery": delivery_view(router_log),
            "flips": live_flips(router_log, workers, t0), "final_roles": {w: v["role"] for w, v in
                                                                         stats.get("workers", {}).items()},
            "router_failed": stats.get("counts", {}).get("failed", 0),
            "send_lag_p99_s": bench.get("send_lag_p99"), "errors": bench.get("errors"),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "command": " ".join(cmd[2:])}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table(res: dict[str, Any]) -> str:
    rows = ["| | requests | completed | rejected | TTFT % | TBT % (max gap) | TBT % (P99 gap) | both % | flips |",
            "|---|---|---|---|---|---|---|---|---|"]

    def flips(fs: list[dict[str, Any]]) -> str:
        return "; ".join(f"{f['worker']} -> {f['to']} ({f['reason']}) at {f['at']} s, back after "
                         f"{f['back_after_s']} s, kept {f['kept']}" for f in fs) or "none"

    for side in ("live", "sim"):
        s = res[side]["summary"]
        rows.append(f"| {side} (client)" if side == "live" else f"| {side}")
        rows[-1] += (f" | {s['requests']} | {s['completed']} | {s['rejected']} | {_pct(s['ttft_slo_attainment'])} | "
                     f"{_pct(s['tbt_slo_attainment'])} | {_pct(s['tbt_p99_slo_attainment'])} | "
                     f"{_pct(s['slo_attainment'])} | {flips(res[side]['flips'])} |")
        if side == "live":
            r = res["live"]["router"]
            rows.append(f"| live (router's records) | {r['requests']} | {r['completed']} | - | "
                        f"{_pct(r['ttft_slo_attainment'])} | {_pct(r['tbt_slo_attainment'])} | "
                        f"{_pct(r['tbt_p99_slo_attainment'])} | {_pct(r['slo_attainment'])} | migrated "
                        f"{r['migrated']}, retried {r['retried']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the trace, the logs, the results and the summary")
    p.add_argument("--workload", default="shift-code", choices=sorted(w for w in WORKLOADS if
                                                                      WORKLOADS[w].trace == "shift"),
                   help="a shifting workload of sim/workloads.py (its report slice, seed 11); default shift-code")
    p.add_argument("--start", type=float, default=100.0, help="slice start, seconds of trace time (default 100: "
                   "the end of shift-code's code phase, then its output-heavy phase)")
    p.add_argument("--duration", type=float, default=150.0, help="slice length, seconds of trace time (default 150)")
    p.add_argument("--rate-scale", type=float, default=0.75, help="time compression (default 0.75)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--profile", default="h100-llama2-70b-tp4")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                   help="both sides as the same scenario K times slower (steps, KV transfers, SLOs, arrival gaps, "
                        "heartbeats and the planner's periods x K), so that the live cluster needs 1/K of the CPU "
                        "per simulated second (default 1)")
    p.add_argument("--tbt-delivery-allowance-ms", type=float, default=0.0, metavar="MS",
                   help="the router's configured TBT delivery allowance, on both sides (live: "
                        "KAIROS_TBT_DELIVERY_ALLOWANCE_MS; simulated: kairos sim --tbt-delivery-allowance-ms): decode "
                        "steps are planned to the TBT SLO less it (live, less the measured part too). Not scaled by "
                        "--time-scale (default 0)")
    p.add_argument("--sim-only", action="store_true", help="the simulated side only (seconds)")
    a = p.parse_args(argv)
    if not a.time_scale > 0:
        p.error("--time-scale must be positive (1: the profile's own timing)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    w = WORKLOADS[a.workload]
    trace = out / "trace.jsonl"
    write_jsonl(load(w, w.report, 1.0), trace)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "workload": a.workload, "slice": [a.start, a.start + a.duration], "rate_scale": a.rate_scale,
        "time_scale": a.time_scale, "tbt_delivery_allowance_ms": a.tbt_delivery_allowance_ms,
        "shape": f"{a.prefill}P{a.decode}D", "profile": a.profile, "sim": run_sim(a, trace, out)}
    if not a.sim_only:
        res["live"] = run_live(a, trace, out)
    (out / "live-vs-sim.json").write_text(json.dumps(res, indent=2))
    if a.sim_only:
        print(json.dumps(res["sim"], indent=2))
        return 0
    print(table(res))
    live = res["live"]
    print(f"\nload average before/after the live run: {live['load_average_before']} / {live['load_average_after']}; "
          f"client send lag p99 {live['send_lag_p99_s']} s; errors {live['errors']}; client's TBT misses against "
          f"the router's gaps {live['gaps']}; delivery allowance {live['delivery']}; final roles "
          f"{live['final_roles']}\nsummary: {out / 'live-vs-sim.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
