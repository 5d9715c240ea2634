"""`python -m sim.shipped_eval`: policies as shipped (nothing tuned) on a workload's report slice,
at fixed cluster splits, under the fair evaluation's model-error conditions.

    python -m sim.shipped_eval --workload shift --split 2P2D --split 1P3D --condition exact \\
        --policy kairos --policy chunked-prefill --rate 1 --out results/shift.json

Every (policy, split, condition, rate) is one simulation of the workload's REPORT slice (the tune
slice with --slice tune: to diagnose on, never to report; sim/workloads.py). A policy that uses
no prefill worker (chunked-prefill) runs every GPU of the split as a decode worker (2P2D -> 0P4D),
once per GPU count. Settings: each policy's shipped ones (sim/knobs.py SHIPPED; the profile's
budgets for the others), under a `kairos tune` / fair_eval file with --tuned, under the knob
flags of `kairos sim` (--decode-room off, ...). With several --rate values, each row's goodput is
the highest rate at which it keeps --goodput-at (default 90 %) both-SLO attainment. Prints a
markdown table (and writes JSON with --out): both-SLO and TBT attainment (TBT over the requests
served, by each one's largest gap), P95 TTFT, requests rejected; the JSON rows also count where
the misses are (`misses`: TTFT only, TBT only, both, rejected; by route) and the decode steps
that ran past the TBT SLO.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.perf_model import load_profile
from common.policy import NO_PREFILL_POLICIES
from common.router_core.planner import shipped_planner
from sim.core import SimConfig, simulate
from sim.fair_eval import CONDITIONS
from sim.knobs import (
    SIM_POLICIES,
    Setup,
    add_engine_flags,
    add_policy_flags,
    build,
    load_tuned,
    routing,
    setups_from_flags,
    shipped,
    with_planner,
)
from sim.stats import json_safe, summarize
from sim.workloads import EVAL_WORKLOADS as WORKLOADS
from sim.workloads import load


@dataclass(frozen=True)
class Cell:
    workload: str
    policy: str
    prefill: int
    decode: int
    condition: str
    rate: float
    profile: str
    setup: Setup
    planner: bool = False
    slice: str = "report"


def misses(records: list[Any], ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """Where a run's requests missed: TTFT only, TBT only (largest gap), both, rejected (never
    served), in all and by route (the route a served request took; "none" for the rejected)."""
    out: dict[str, Any] = {"ttft": 0, "tbt": 0, "both": 0, "rejected": 0, "by_route": {}}
    for r in records:
        if r.rejected or r.ttft is None:
            kind = "rejected"
        else:
            late = r.ttft > ttft_slo
            gap = len(r.tbt_gaps) > 0 and max(r.tbt_gaps) > tbt_slo
            if not late and not gap:
                continue
            kind = "both" if late and gap else "ttft" if late else "tbt"
        out[kind] += 1
        by = out["by_route"].setdefault(r.route or "none", {})
        by[kind] = by.get(kind, 0) + 1
    return out


def parse_split(text: str) -> tuple[int, int]:
    """'2P2D' -> (2, 2)."""
    t = text.strip().upper()
    p, _, d = t.partition("P")
    try:
        n_p, n_d = int(p), int(d.rstrip("D"))
    except ValueError:
        raise ConfigError(f"--split takes NPMD, e.g. 2P2D or 1P3D (got {text!r})") from None
    if n_p < 0 or n_d < 1 or not d.endswith("D"):
        raise ConfigError(f"--split takes NPMD with N >= 0 and M >= 1 (got {text!r})")
    return n_p, n_d


def slice_arg(text: str) -> str:
    """--slice: 'report', 'tune' or a seed."""
    if text in ("report", "tune") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(f"report, tune or a seed (an integer), not {text!r}")


def run_cell(c: Cell) -> dict[str, Any]:
    w = WORKLOADS[c.workload]
    reqs = load(w, w.tune if c.slice == "tune" else w.report if c.slice == "report" else int(c.slice), c.rate)
    prof_obj = load_profile(c.profile)
    policy, prof = build(c.policy, c.setup, prof_obj)
    sim = with_planner(c.policy, SimConfig(prefill=c.prefill, decode=c.decode, ttft_slo=2.0, tbt_slo=0.1,
                                           planner=c.planner, **CONDITIONS[c.condition]))
    res = simulate(reqs, prof, policy, sim)
    s = summarize(res.records, ttft_slo=sim.ttft_slo, tbt_slo=sim.tbt_slo)
    held = res.stats.get("held")
    return {"workload": c.workload, "slice": c.slice, "policy": c.policy,
            "cluster": f"{c.prefill}P{c.decode}D" + ("+planner" if c.planner else ""),
            "condition": c.condition, "rate": c.rate, "requests": s["requests"],
            "rejected": s["rejected"],
            "slo_attainment": s["slo_attainment"], "tbt_slo_attainment": s["tbt_slo_attainment"],
            "ttft_slo_attainment": s["ttft_slo_attainment"], "ttft_p95": s["ttft_p95"], "tbt_p99": s["tbt_p99"],
            "deflection_rate": s.get("deflection_rate"), "held": held, "routes": s.get("routes", {}),
            "role_flips": len(res.stats.get("role_flips", [])), "final_split": res.stats.get("final_split"),
            "misses": misses(res.records, sim.ttft_slo, sim.tbt_slo),
            "decode_steps_over_tbt_slo": res.stats["decode_steps_over_tbt_slo"]}


def cells(args: argparse.Namespace, tuned: dict[str, Setup]) -> list[Cell]:
    out: list[Cell] = []
    flags = setups_from_flags(args, list(args.policy))
    for wname in args.workload:
        for cond in args.condition:
            for policy in args.policy:
                setup = shipped(policy, flags[policy], tuned.get(policy))
                splits = dict.fromkeys((0, p + d) if routing(policy) in NO_PREFILL_POLICIES else (p, d)
                                       for p, d in args.split)
                for n_p, n_d in splits:
                    for x in args.rate:
                        on = shipped_planner(routing(policy)) if args.planner is None else args.planner == "on"
                        out.append(Cell(wname, policy, n_p, n_d, cond, x, args.profile, setup,
                                        planner=on and n_p > 0, slice=args.slice))
    return out


def goodput(rows: list[dict[str, Any]], at: float) -> dict[tuple[str, ...], float | None]:
    """Per (workload, policy, cluster, condition): the highest rate at which both-SLO attainment
    is at least `at` (None if at none)."""
    best: dict[tuple[str, ...], float | None] = {}
    for r in rows:
        k = (r["workload"], r["policy"], r["cluster"], r["condition"])
        best.setdefault(k, None)
        got = best[k]
        if (r["slo_attainment"] or 0) >= at and (got is None or r["rate"] > got):
            best[k] = r["rate"]
    return best


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _flips(r: dict[str, Any]) -> str:
    """'-' without the planner; else the flips and the split at the end."""
    return "-" if r.get("final_split") is None else f"{r['role_flips']} (ends {r['final_split']})"


def table(rows: list[dict[str, Any]], gp: dict[tuple[str, ...], float | None] | None) -> str:
    head = "| workload | condition | policy | cluster | rate | both-SLO % | TBT % | P95 TTFT s | rejected | flips |"
    lines = [head + (" goodput |" if gp else ""), "|" + "---|" * (10 + (1 if gp else 0))]
    for r in rows:
        p95 = r["ttft_p95"]
        sl = str(r.get("slice", "report"))
        wl = r["workload"] + (" (tune slice)" if sl == "tune" else f" (seed {sl})" if sl.isdigit() else "")
        cell = (f"| {wl} | {r['condition']} | {r['policy']} | {r['cluster']} | x{r['rate']:g} | "
                f"{_pct(r['slo_attainment'])} | {_pct(r['tbt_slo_attainment'])} | "
                f"{'inf' if p95 is None or p95 == float('inf') else f'{p95:.2f}'} | {r['rejected']} | "
                f"{_flips(r)} |")
        if gp:
            g = gp[(r["workload"], r["policy"], r["cluster"], r["condition"])]
            cell += f" {'none' if g is None else f'x{g:g}'} |"
        lines.append(cell)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.shipped_eval", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", action="append", choices=tuple(WORKLOADS), required=True, help="repeat for several")
    p.add_argument("--policy", action="append", choices=SIM_POLICIES, required=True,
                   help="repeat for several; dynamo-planner: disagg-least-loaded with a Dynamo-style threshold "
                        "planner moving workers between roles (simulator only, sim/knobs.py PLANNED)")
    p.add_argument("--split", action="append", type=parse_split, default=None,
                   help="cluster split NPMD, repeat for several (default 2P2D)")
    p.add_argument("--condition", action="append", choices=tuple(CONDITIONS), default=None,
                   help="model error (sim/fair_eval.py CONDITIONS), repeat for several (default exact)")
    p.add_argument("--rate", action="append", type=float, default=None,
                   help="rate scale of the report slice, repeat for several (default 1)")
    p.add_argument("--slice", type=slice_arg, default="report",
                   help="which slice of each workload: report (the default, what results are quoted on), "
                        "tune (to diagnose or tune on, never to report), or a seed (an integer: another "
                        "draw of a synthetic or shifting workload, neither slice)")
    p.add_argument("--profile", default="h100-llama2-70b-tp4", help="performance profile (default h100-llama2-70b-tp4)")
    p.add_argument("--tuned", default=None, help="settings from `kairos tune` or fair_eval instead of the shipped ones")
    p.add_argument("--goodput-at", type=float, default=0.9,
                   help="goodput: the highest --rate with at least this both-SLO attainment (default 0.9)")
    p.add_argument("--planner", choices=("on", "off"), default=None,
                   help="the role planner in every run with prefill workers (common/router_core/planner.py; "
                        "rows then say how many flips and the split at the end) (default: on for kairos, as the "
                        "router ships it, off for the baselines, which keep their split; on/off: every policy)")
    p.add_argument("--jobs", type=int, default=2, help="parallel simulation processes (default 2)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    add_engine_flags(p)
    add_policy_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.split = args.split or [(2, 2)]
        args.condition = args.condition or ["exact"]
        args.rate = args.rate or [1.0]
        if args.slice.isdigit():
            bad = [w for w in args.workload if not isinstance(WORKLOADS[w].report, int)]
            if bad:
                raise ConfigError(f"--slice {args.slice}: a seed is a slice of a synthetic or shifting workload "
                                  f"only, not of {', '.join(bad)} (use report or tune)")
        tuned = load_tuned(args.tuned) if args.tuned else {}
        load_profile(args.profile)
    except (ConfigError, ValueError, OSError) as e:
        print(f"shipped_eval: {e}", file=sys.stderr)
        return 2
    todo = cells(args, tuned)
    if args.jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(todo))) as pool:
            rows = list(pool.map(run_cell, todo))
    else:
        rows = [run_cell(c) for c in todo]
    gp = goodput(rows, args.goodput_at) if len(args.rate) > 1 else None
    print(table(rows, gp))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(json_safe({"command": "python -m sim.shipped_eval " + " ".join(
            sys.argv[1:] if argv is None else argv), "rows": rows,
            "goodput": {"/".join(k): v for k, v in (gp or {}).items()}}), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
