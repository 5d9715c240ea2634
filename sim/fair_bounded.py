"""`python -m sim.fair_bounded`: the fair evaluation's tuned baselines on the shifting workloads, bounded.

    nice -n 10 python -m sim.fair_bounded --workload shift --workload shift-code \\
        --condition exact --condition noise --out results/tuned-baselines.json
    nice -n 10 python -m sim.fair_bounded --profile a100-llama2-70b-tp4 --rate 0.35 \\
        --condition exact --out results/a100-exact.json

Issue 44's must-show compares Kairos as shipped (2P2D, no tuning) against every baseline at its
best split, tuned as in the fair evaluation (`python -m sim.fair_eval`: `kairos tune`'s search on
the TUNE slice, judged on the REPORT slice). The full evaluation is hours of CPU; this is the same
search, reduced so that it fits in about an hour on a shared 2-CPU host:

- one coordinate-descent pass (the fair evaluation: 2), starting from each policy's defaults;
- the tune slice at x1 only (the fair evaluation also replays it at x2, `--stress 1,2`);
- smaller grids (BOUNDED below, against sim/tune.py GRIDS); the split is the first knob, so every
  other knob is tuned at the best split (prefill workers 1..3 of 4, the worker total fixed);
- the regime load fixed (as the fair evaluation fixes it for these workloads): x1 on the H100
  profile, --rate for another (the A100's regime is x0.35); both slices at that scale; no sweep,
  no probe, no ablation.

For each condition, policy by policy (ORDER) and for each workload, it tunes the baseline under
that condition and runs its winner on the REPORT slice at that load, and runs Kairos at its shipped
settings on 2P2D (not tuned) there; it writes every row as JSON as it goes (--out), so a run cut
short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.perf_model import load_profile
from sim.core import SimConfig
from sim.fair_eval import CONDITIONS, Run, execute, timed_tune
from sim.knobs import Setup, shipped
from sim.stats import json_safe
from sim.tune import GRIDS, OBJECTIVE, OFF, SPLIT, Job, _brief, defaults, evaluate, score
from sim.workloads import WORKLOADS, load

# The reduced grids: besides each policy's default (evaluated first; the profile's budgets 8192 /
# 768 / chunk 512, conditional-disagg's isl 2048 and busy 2), a few values of its full grid: the
# budgets' neighbours, conditional-disagg's two halves switched off (isl 0, busy 1000) and smaller
# decode steps. Ordered: the strongest baseline of the untuned tables first.
BOUNDED: dict[str, dict[str, tuple[Any, ...]]] = {
    "chunked-prefill": {"decode_token_budget": (512, 1024), "decode_chunk": (256, 1024)},
    "disagg-least-loaded": {SPLIT: (1, 2, 3), "prefill_token_budget": (2048, 16384)},
    "dynamo-planner": {SPLIT: (1, 2, 3), "prefill_token_budget": (2048,)},
    "conditional-disagg": {SPLIT: (1, 2, 3), "eff_isl_threshold": (0,), "prefill_busy_threshold": (1000.0,),
                           "decode_token_budget": (512,), "decode_chunk": (256,)},
}
BASELINES = tuple(BOUNDED)
# the run's order: the baselines strongest in the untuned tables first, then Kairos as shipped
ORDER = ("chunked-prefill", "disagg-least-loaded", "kairos", "dynamo-planner", "conditional-disagg")
DEFAULT_PROFILE = "h100-llama2-70b-tp4"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.fair_bounded", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None,
                   help=f"performance profile (default {DEFAULT_PROFILE}; with --edges, RESULT's)")
    p.add_argument("--rate", type=float, default=None,
                   help="rate scale of both slices, the regime load: the tune slice is tuned and the report slice "
                        "judged at it (default 1, the H100 profile's regime; the A100's is 0.35; with --edges, "
                        "RESULT's)")
    p.add_argument("--workload", action="append", choices=("shift", "shift-code"), default=None,
                   help="repeat for both (default shift and shift-code)")
    p.add_argument("--condition", action="append", choices=tuple(CONDITIONS), default=None,
                   help="model error each baseline is tuned and judged under; repeat (default exact)")
    p.add_argument("--policy", action="append", choices=BASELINES, default=None,
                   help=f"baselines to tune; repeat (default all: {', '.join(BASELINES)})")
    p.add_argument("--passes", type=int, default=1, help="coordinate-descent passes at most (default 1)")
    p.add_argument("--no-kairos", action="store_true", help="leave out the shipped Kairos 2P2D row")
    p.add_argument("--out", required=True, help="JSON file for the rows, rewritten after each policy")
    p.add_argument("--edges", metavar="RESULT.json", default=None,
                   help="run nothing else: for each tuned row of RESULT (this tool's output), try one value past "
                        "each knob whose tuned value is the smallest or largest tried (the next one of the full "
                        "grid, sim/tune.py GRIDS) on the tune slice, and where one scores better, report it on the "
                        "report slice; writes the rows to --out")
    return p


def beyond(policy: str, knob: str, value: Any, tried: set[Any]) -> list[Any]:
    """The full grid's next value past `value` where it is the smallest or largest tried. `value`
    need not be in the full grid: a profile's own default (the A100's decode budget 320, chunk
    192) steps to the full grid's nearest value beyond it (256, 128)."""
    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v != OFF.get(knob)

    full = sorted(v for v in GRIDS[policy].get(knob, ()) if num(v))
    nums = sorted(v for v in tried if num(v))
    if not num(value) or not nums:
        return []
    out = []
    below, above = [v for v in full if v < value], [v for v in full if v > value]
    if value <= nums[0] and below:
        out.append(below[-1])
    if value >= nums[-1] and above:
        out.append(above[0])
    return [v for v in out if v not in tried]


def edges_pass(result: dict[str, Any], profile: Any, log: Any, rate: float = 1.0) -> list[dict[str, Any]]:
    """One step past the reduced grid's edges for every tuned row of `result` (see --edges), both
    slices at rate scale `rate`."""
    rows = []
    for r in result["rows"]:
        if not r.get("tuned"):
            continue
        pol, name, cond = r["policy"], r["workload"], r["condition"]
        w = WORKLOADS[name]
        sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1, **CONDITIONS[cond])
        job = Job(policy=pol, profile=profile, sim=sim, tune_trace=load(w, w.tune, rate),
                  report_trace=load(w, w.report, rate), grid=BOUNDED[pol], passes=1, stress=(1.0,))
        best = {**defaults(job), **r["engine"], **r["knobs"], SPLIT: r["split"]["prefill"]}
        best_s, tried_more = r["tune"], []
        start = defaults(job)
        for knob, vals in BOUNDED[pol].items():
            if knob == SPLIT:
                continue
            for v in beyond(pol, knob, best[knob], {*vals, start[knob]}):
                cand = {**best, knob: v}
                s = evaluate(job, cand, job.tune_trace)
                tried_more.append({"knob": knob, "value": v, "tune": _brief(s)})
                if score(s) > score(best_s):
                    best, best_s = cand, _brief(s)
        row = {"workload": name, "condition": cond, "policy": pol, "tried": tried_more,
               "before": {"tune": r["tune"], "report": r["report"]}}
        if best_s is not r["tune"]:
            row.update(setting={k: v for k, v in best.items()}, tune=best_s,
                       report=_brief(evaluate(job, best, job.report_trace)))
        rows.append(row)
        tried_text = [(t["knob"], t["value"], round(t["tune"]["slo_attainment"], 4)) for t in tried_more]
        better = (f"better: {row['setting']} report {row['report']['slo_attainment']}" if "setting" in row
                  else "none better")
        log(f"{name} {cond} {pol}: tried {tried_text}; {better}")
    return rows


def same(flag: str, given: Any, recorded: Any, default: Any) -> Any:
    """A setting --edges takes from its RESULT (`recorded`, None if RESULT has none): given and
    recorded must agree; else whichever there is, else `default`."""
    if given is not None and recorded is not None and given != recorded:
        raise ConfigError(f"{flag} {given} differs from the {recorded} the --edges result was run at")
    return given if given is not None else recorded if recorded is not None else default


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = json.loads(Path(args.edges).read_text()) if args.edges else {}
        profile = load_profile(same("--profile", args.profile, res.get("profile"), DEFAULT_PROFILE))
        rate = float(same("--rate", args.rate, res.get("rate_scale"), 1.0))
        if args.passes < 1:
            raise ConfigError("--passes must be >= 1")
        if not rate > 0:
            raise ConfigError(f"--rate must be > 0 (got {rate})")
    except (ConfigError, ValueError, OSError) as e:
        print(f"fair_bounded: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    if args.edges:
        rows = edges_pass(res, profile, log, rate)
        _write(Path(args.out), {"command": "python -m sim.fair_bounded " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
                                "from": args.edges, "profile": profile.name, "rate_scale": rate, "rows": rows,
                                "wall_s": time.monotonic() - t0})
        return 0

    out: dict[str, Any] = {
        "command": "python -m sim.fair_bounded " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "profile": profile.name,
        "objective": OBJECTIVE, "passes": args.passes, "stress": [1.0], "rate_scale": rate,
        "grids": {p: {k: list(v) for k, v in BOUNDED[p].items()} for p in BASELINES},
        "full_grids": {p: {k: list(v) for k, v in GRIDS[p].items()} for p in BASELINES},
        "loadavg_start": os.getloadavg(), "rows": []}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for cond in args.condition or ["exact"]:
        sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1, **CONDITIONS[cond])
        names = args.workload or ["shift", "shift-code"]
        traces = {n: (load(WORKLOADS[n], WORKLOADS[n].tune, rate), load(WORKLOADS[n], WORKLOADS[n].report, rate))
                  for n in names}
        order = [p for p in ORDER if p in (args.policy or BASELINES) or (p == "kairos" and not args.no_kairos)]
        for pol in order:  # policy first: a run cut short has the strongest baselines on both workloads
            for name in names:
                w = WORKLOADS[name]
                if pol == "kairos":
                    t1 = time.monotonic()
                    s = execute(Run(w, w.report, rate, "kairos", shipped("kairos", Setup()), profile, sim))
                    out["rows"].append({"workload": name, "condition": cond, "policy": "kairos", "tuned": False,
                                        "cluster": s["cluster"], "report": {k: s.get(k) for k in (
                                            "requests", "rejected", "slo_attainment", "ttft_slo_attainment",
                                            "tbt_slo_attainment", "ttft_p95", "tbt_p99")},
                                        "wall_s": time.monotonic() - t1})
                    log(f"{name} {cond} kairos (shipped, 2P2D): both {s['slo_attainment']:.4f} "
                        f"TBT {s['tbt_slo_attainment']:.4f}")
                else:
                    job = Job(policy=pol, profile=profile, sim=sim, tune_trace=traces[name][0],
                              report_trace=traces[name][1], grid=BOUNDED[pol], passes=args.passes, stress=(1.0,))
                    r = timed_tune(job)
                    out["rows"].append({**r, "workload": name, "condition": cond, "policy": pol, "tuned": True,
                                        "knobs": r["policy"]})
                    log(f"{name} {cond} {pol}: {r['cluster']} {r['engine']} {r['policy']} tune both "
                        f"{r['tune']['slo_attainment']:.4f}; report both {r['report']['slo_attainment']:.4f} "
                        f"TBT {r['report']['tbt_slo_attainment']:.4f} ({r['evaluated']} runs, {r['wall_s']:.0f} s)")
                _write(path, out)
    out["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.monotonic() - t0
    _write(path, out)
    log(f"wrote {path}")
    return 0


def _write(path: Path, out: dict[str, Any]) -> None:
    path.write_text(json.dumps(json_safe(out), indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
