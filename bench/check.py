"""`make bench-check`: short runs of bench-router and bench-decision against committed figures.

    python -m bench.check                  # measure, compare with bench/baseline.json, exit 1 on a regression
    python -m bench.check --update         # measure and write the figures as the new baseline
    python -m bench.check --out FILE.json  # also keep what was measured

What it compares is two ratios measured within one run, so that the machine's speed and load
cancel out (absolute microseconds move by 2x between days on the same VM):

- `router_cost_ratio`: the router's CPU per request over a bare ASGI app's (bench/reference_app.py)
  at the top offered rate, one output token per request (`kairos bench-router --phases requests`);
- `decision_total_ratio`: Kairos's decision plus view preparation, mean per request, over
  disagg-least-loaded's, at 8+8 workers (`kairos bench-decision`, `total_mean_us`).

With several runs, the median of the runs' ratios counts. A check fails when a measured ratio
exceeds its baseline by more than the tolerance factor in bench/baseline.json, and again after
as many runs more, judged on all runs together. The tolerance is set from repeated runs on a
2-core machine (BENCHMARKS.md, "bench-check"): wide enough that the machine's own spread never
reaches it, narrow enough that a per-request cost like the one 3c42f7e added (about 1.8x on the
router ratio) fails it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BASELINE = Path(__file__).with_name("baseline.json")
# the short runs: two request rates a router on one core carries easily, 4 s each, plus the reference
ROUTER_ARGS = ["--phases", "requests", "--rates", "100,200", "--step", "4", "--log-level", "warning"]
DECISION_ARGS = ["--workers", "8", "--decisions", "3000", "--repeat", "3"]


def _run(module: str, args: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench-check: `{' '.join(cmd)}` failed (exit {proc.returncode}); its output is above")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _router_run(path: Path) -> tuple[float, float]:
    """One bench-router run: the router's and the reference app's CPU per request (µs) at the top
    offered rate. The top rate, not the run's "sustained" step: that one moves
    between 100/s and 200/s with TTFT noise, and CPU per request differs between the two rates."""
    r = _run("bench.router_throughput", ROUTER_ARGS, path)
    ratios = (r.get("reference") or {}).get("ratios") or []
    top = max(ratios, key=lambda x: x["offered_rate"], default=None)
    if not top or not top.get("router_us_per_request") or not top.get("reference_us_per_request"):
        raise SystemExit("bench-check: bench-router gave no CPU per request at the top rate "
                         "(did the reference app run?)")
    return top["router_us_per_request"], top["reference_us_per_request"]


def _decision_run(path: Path) -> tuple[float, float]:
    """One bench-decision run: Kairos's and disagg-least-loaded's decision plus preparation (µs, mean)."""
    d = _run("bench.decision_cost", DECISION_ARGS, path)
    rows = {row["policy"]: row for row in d["rows"]}
    return rows["kairos"]["total_mean_us"], rows["disagg-least-loaded"]["total_mean_us"]


def measure(runs: int, prior: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each benchmark `runs` times, router and decision runs alternated (added to `prior`'s runs);
    the median of the runs' ratios is what counts. Each ratio's two sides are measured within one
    run, seconds apart, so they share the machine's state of the moment; a shared 2-core VM moves
    absolute costs by a third between minutes."""
    raw: dict[str, list[list[float]]] = {"router": [], "decision": []}
    if prior:
        raw = {k: [list(x) for x in v] for k, v in prior["raw"].items()}
    with tempfile.TemporaryDirectory(prefix="kairos-bench-check-") as tmp:
        for i in range(runs):
            raw["router"].append(list(_router_run(Path(tmp) / f"router-{i}.json")))
            raw["decision"].append(list(_decision_run(Path(tmp) / f"decision-{i}.json")))
    router = [a / b for a, b in raw["router"]]
    decision = [a / b for a, b in raw["decision"]]
    return {"router_cost_ratio": statistics.median(router), "decision_total_ratio": statistics.median(decision),
            "raw": raw, "runs": {"router_cost_ratio": [round(x, 3) for x in router],
                                 "decision_total_ratio": [round(x, 3) for x in decision]}}


def compare(measured: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """The failures: each ratio above baseline x tolerance."""
    tol = float(baseline["tolerance"])
    bad = []
    for key in ("router_cost_ratio", "decision_total_ratio"):
        limit = float(baseline[key]) * tol
        if measured[key] > limit:
            bad.append(f"{key} {measured[key]:.2f} exceeds the baseline {baseline[key]:.2f} x {tol:g} = {limit:.2f}")
    return bad


def _report(measured: dict[str, Any]) -> None:
    measured["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"bench-check: router CPU per request {measured['router_cost_ratio']:.2f}x the reference app, "
          f"decision + preparation {measured['decision_total_ratio']:.2f}x least-loaded, medians "
          f"of {len(measured['raw']['router'])} run(s) (runs: {measured['runs']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1,
                   help="runs of each benchmark; the median counts (default 1)")
    p.add_argument("--baseline", type=Path, default=BASELINE, help="figures to compare with (bench/baseline.json)")
    p.add_argument("--update", action="store_true", help="write what was measured as the new baseline")
    p.add_argument("--out", type=Path, help="also write what was measured here (JSON)")
    args = p.parse_args(argv)
    measured = measure(args.runs)
    _report(measured)
    baseline = {} if args.update else json.loads(args.baseline.read_text())
    bad = [] if args.update else compare(measured, baseline)
    if bad:
        # a regression must show again: as many runs more, judged on all of them together
        print(f"bench-check: over the limit ({'; '.join(bad)}); {args.runs} more run(s) to confirm")
        measured = measure(args.runs, prior=measured)
        _report(measured)
        bad = compare(measured, baseline)
    if args.out:
        args.out.write_text(json.dumps(measured, indent=1) + "\n")
    if args.update:
        old = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
        new = {"router_cost_ratio": round(measured["router_cost_ratio"], 2),
               "decision_total_ratio": round(measured["decision_total_ratio"], 2),
               "tolerance": old.get("tolerance", 1.5), "measured": measured["date"],
               "note": old.get("note", "")}
        args.baseline.write_text(json.dumps(new, indent=1) + "\n")
        print(f"bench-check: baseline written to {args.baseline}")
        return 0
    for line in bad:
        print(f"bench-check: REGRESSION: {line}")
    if bad:
        print("bench-check: a per-request or per-decision cost grew; profile with `kairos bench-router --py-spy 200` "
              "or `kairos bench-decision`, or, if the cost is deliberate, `python -m bench.check --update --runs 3` "
              "and say why in BENCHMARKS.md")
        return 1
    print(f"bench-check: ok (baseline {baseline['router_cost_ratio']}x and {baseline['decision_total_ratio']}x, "
          f"tolerance x{baseline['tolerance']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
