"""`python -m sim.fair_eval`: the fair comparison of docs/results.md, in one command.

    python -m sim.fair_eval --profile h100-llama2-70b-tp4 --out results/fair-eval

For each workload (sim/workloads.py: the Azure code and conv traces, a long-context synthetic one
with prompts of 4k to 32k tokens, a bursty on/off synthetic one, multi-turn chat sessions and
agentic loops with shared prefixes, prefix caching on, and two whose mix shifts every 150 s
(shift: prompt-heavy, output-heavy and code-like bursty phases; shift-code: the code trace's
windows alternating with output-heavy phases; regime fixed at x1, seeds 10 tune, 11 report)) it
  1. probes the load: replays the tune slice with `disagg-least-loaded` (stock disaggregation, the
     profile's settings) at several rate scales and picks the regime load: the lowest probed scale
     at which bursts saturate the prefill pool (that baseline meets the TTFT SLO for at most 95 %
     of requests, its busiest 10 s offer the prefill pool at least its capacity) while the decode
     pool still holds its TBT SLO (at least 99 % of requests keep every gap within it);
     --regime NAME=X overrides the choice; chat and agent have a regime fixed in advance
     (x0.75, x0.25: the rates of docs/results/sessions.md), since the rule counts whole prompts
     while their caches skip most prefill work, and on chat it lands past the cliff;
  2. tunes every policy at that load on the tune slice (`kairos tune`'s search, sim/tune.py),
     the objective averaged over the slice at that load and at twice it (--stress 1,2: the tune
     slices hold smaller bursts than the report slices, so a policy tuned on them alone is tuned
     for calm traffic);
  3. replays the disjoint report slice at the regime load and around it (SWEEP x the regime) with
     each policy at its tuned best, on the same GPU count, and Kairos's tuned setting once more
     with late binding off (nothing retuned: how much of its result is late binding's; `--ablate
     RESULT.json` adds that to a result written before it existed);
  4. writes everything as JSON, a `kairos-tuned/1` file per workload (for `kairos sim --tuned`),
     and the markdown tables of docs/results.md.
Shape: 2P2D (conv: 1P3D, see WORKLOADS), chunked-prefill on the same GPUs as decode workers.
The slices: trace-time windows [0, 600) s (tune) and [600, 1200) s (report) of the Azure traces;
seeds 0 (tune) and 1 (report), 600 s each, of the synthetic ones; [200, 450) s (tune) and
[450, 700) s (report) of the session traces. Policies: POLICIES; chat and agent add kv-aware, shift and
shift-code dynamo-planner (disagg-least-loaded with a Dynamo-style threshold role planner, sim/knobs.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from common.errors import ConfigError
from common.perf_model import Profile, load_profile
from common.traces import TraceRequest
from sim.core import SimConfig, simulate
from sim.fair_report import ABLATION, markdown, not_a_result
from sim.knobs import TUNED_FORMAT, Setup, build, knob_values, shape, with_planner
from sim.load import peak_load, prefill_load
from sim.stats import RequestTiming, _pct_with_unserved, json_safe, summarize
from sim.tune import GRIDS, OBJECTIVE, Job, _setup, parse_stress, tune_one, with_split
from sim.workloads import ALL_POLICIES, POLICIES, WORKLOADS, Workload, load

PROBE_POLICY = "disagg-least-loaded"
REGIME_TTFT = 0.95   # the baseline meets the TTFT SLO for at most this fraction: prefill queues hurt
REGIME_TBT = 0.99    # ... while at least this fraction keep every gap within the TBT SLO
SWEEP = (0.5, 1.0, 1.5, 2.0)  # report rates, multiples of the regime rate scale
# Model error the engine has and the policies do not know (sim/state.py SimConfig; the sizes are
# assumptions, not measurements: docs/cost-model.md, "Model error"). Every policy is tuned and
# judged under the same one.
CONDITIONS: dict[str, dict[str, Any]] = {
    "exact": {},                                            # every step takes what the model says
    "noise": {"step_noise": 0.1},                           # 10 % lognormal error per step
    "slow": {"step_scale": 1.15},                           # the engine 15 % slower than its profile
    "hetero": {"worker_speed": (0.85, 1.15, 0.95, 1.05)},   # a fleet whose workers differ (P0 P1 D0 D1)
}


# ------------------------------------------------------------------------------ one simulation


@dataclass(frozen=True)
class Run:
    workload: Workload
    which: tuple[float, float] | int
    scale: float
    policy: str
    setup: Setup
    profile: Profile
    sim: SimConfig


def by_route(records: Sequence[RequestTiming], reqs: Sequence[TraceRequest]) -> dict[str, dict[str, Any]]:
    """Per route: share of requests, prompt lengths, P95 TTFT, prediction error (MAPE)."""
    out: dict[str, dict[str, Any]] = {}
    for route in ("disagg", "deflect", "retain"):
        idx = [i for i, r in enumerate(records) if r.route == route]
        if not idx:
            continue
        ttft = np.array([records[i].ttft for i in idx if records[i].ttft is not None])
        err = [abs(records[i].ttft_pred - records[i].ttft) / records[i].ttft for i in idx  # type: ignore[operator]
               if records[i].ttft_pred is not None and records[i].ttft]
        prompts = np.array([reqs[i].input_length for i in idx])
        out[route] = {"share": len(idx) / len(records), "prompt_mean": float(prompts.mean()),
                      "prompt_p50": float(np.percentile(prompts, 50)),
                      "ttft_p95": float(np.percentile(ttft, 95)) if ttft.size else None,
                      "ttft_slo_attainment": float((ttft <= 2.0).sum() / len(idx)) if len(idx) else None,
                      "ttft_pred_mape": float(np.mean(err)) if err else None}
    return out


def by_reason(records: Sequence[RequestTiming], reqs: Sequence[TraceRequest], ttft_slo: float
              ) -> dict[str, dict[str, Any]]:
    """Per routing reason (Kairos's, conditional-disagg's): how many, how long their prompts, how
    their TTFT went, and for those that missed the TTFT SLO, what the policy predicted."""
    out: dict[str, dict[str, Any]] = {}
    for reason in sorted({r.reason for r in records if r.reason}):
        idx = [i for i, r in enumerate(records) if r.reason == reason]
        got = [records[i].ttft for i in idx]
        ttft = np.array([np.inf if t is None else t for t in got])
        served = np.sort(ttft[np.isfinite(ttft)])  # rejected requests count as infinite, as in sim/stats.py
        missed = [i for i, t in zip(idx, ttft.tolist(), strict=True) if t > ttft_slo]
        pred = np.array([p for i in missed if (p := records[i].ttft_pred) is not None])
        out[reason] = {"requests": len(idx), "route": records[idx[0]].route,
                       "prompt_p50": float(np.median([reqs[i].input_length for i in idx])),
                       "ttft_p50": _pct_with_unserved(served, len(idx), 50),
                       "ttft_p95": _pct_with_unserved(served, len(idx), 95),
                       "missed_ttft": len(missed),
                       "missed_ttft_p50": float(np.median(ttft[ttft > ttft_slo])) if missed else None,
                       "missed_pred_p50": float(np.median(pred)) if pred.size else None}
    return out


def execute(run: Run) -> dict[str, Any]:
    w = run.workload
    reqs = load(w, run.which, run.scale)
    policy, prof = build(run.policy, run.setup, run.profile)
    n_p, n_d = shape(run.policy, run.sim.prefill, run.sim.decode)
    res = simulate(reqs, prof, policy, with_planner(run.policy, msgspec.structs.replace(run.sim, prefill=n_p,
                                                                                        decode=n_d)))
    s = summarize(res.records, ttft_slo=run.sim.ttft_slo, tbt_slo=run.sim.tbt_slo)
    s["by_route"] = by_route(res.records, reqs)
    s["by_reason"] = by_reason(res.records, reqs, run.sim.ttft_slo)
    s["sim"] = res.stats
    s["cluster"] = f"{n_p}P{n_d}D"
    s["prefill_load"] = prefill_load(reqs, run.profile, run.sim.prefill)
    s["peak_load"] = peak_load(reqs, run.profile, run.sim.prefill)
    return s


def timed_tune(job: Job) -> dict[str, Any]:
    t0 = time.monotonic()
    out = tune_one(job)
    out["wall_s"] = time.monotonic() - t0
    return out


def pmap(fn: Callable[[Any], dict[str, Any]], items: list[Any], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ProcessPoolExecutor(max_workers=min(jobs, len(items))) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------------------ the stages


def choose_regime(probe: list[dict[str, Any]]) -> float:
    """The lowest probed scale in the regime; if none is, the highest whose decode pool holds TBT."""
    for p in probe:
        if p["in_regime"]:
            return float(p["rate_scale"])
    holding = [p for p in probe if (p["tbt_slo_attainment"] or 0) >= REGIME_TBT]
    return float((holding or probe)[-1]["rate_scale"])


def evaluate_workload(w: Workload, profile: Profile, sim: SimConfig, args: argparse.Namespace,
                      log: Callable[[str], None]) -> dict[str, Any]:
    t0 = time.monotonic()
    sim = msgspec.structs.replace(sim, prefill=w.prefill, decode=w.decode)
    probes = pmap(execute, [Run(w, w.tune, x, PROBE_POLICY, Setup(), profile, sim) for x in w.probe], args.jobs)
    probe = []
    for x, s in zip(w.probe, probes, strict=True):
        ok = ((s["ttft_slo_attainment"] or 0) <= REGIME_TTFT and (s["tbt_slo_attainment"] or 0) >= REGIME_TBT
              and s["peak_load"] >= 1.0)
        probe.append({"rate_scale": x, "requests": s["requests"], "prefill_load": s["prefill_load"],
                      "peak_load": s["peak_load"], "ttft_slo_attainment": s["ttft_slo_attainment"],
                      "ttft_p95": s["ttft_p95"], "tbt_slo_attainment": s["tbt_slo_attainment"],
                      "tbt_p99": s["tbt_p99"], "decode_busy": s["sim"]["decode_busy"],
                      "prefill_busy": s["sim"]["prefill_busy"],
                      "in_regime": ok})
    fixed = w.fixed_regime(profile.name)
    chosen_by = "flag" if w.name in args.regime else "fixed" if fixed is not None else "rule"
    regime = round(args.regime.get(w.name) or fixed or choose_regime(probe), 4)
    policies = workload_policies(w, args.policy)
    log(f"{w.name}: regime x{regime:g} ({chosen_by}; {time.monotonic() - t0:.0f} s); tuning {', '.join(policies)}")
    tune_trace, report_trace = load(w, w.tune, regime), load(w, w.report, regime)
    search_split = getattr(args, "search_split", False)
    jobs = [Job(policy=p, profile=profile, sim=sim, tune_trace=tune_trace, report_trace=report_trace,
                grid=with_split(p, GRIDS[p], w.prefill + w.decode) if search_split else GRIDS[p],
                passes=args.passes, stress=args.stress) for p in policies]
    tuned = dict(zip(policies, pmap(timed_tune, jobs, args.jobs), strict=True))
    log(f"{w.name}: tuned ({time.monotonic() - t0:.0f} s); report sweep")
    setups = {p: _setup(p, {**e["engine"], **e["policy"]}) for p, e in tuned.items()}
    scales = sorted({round(regime * m, 4) for m in (w.sweep or SWEEP)})
    runs = [Run(w, w.report, x, p, setups[p], profile, tuned_sim(sim, tuned[p])) for x in scales for p in policies]
    outs = pmap(execute, runs, args.jobs)
    sweep: list[dict[str, Any]] = []
    for x in scales:
        pols = {r.policy: o for r, o in zip(runs, outs, strict=True) if r.scale == x}
        first = next(iter(pols.values()))
        sweep.append({"rate_scale": x, "prefill_load": first["prefill_load"], "peak_load": first["peak_load"],
                      "policies": pols})
    ablate(w, profile, sim, tuned, sweep, args.jobs)
    at_regime: dict[str, dict[str, Any]] = next(pt for pt in sweep if pt["rate_scale"] == regime)["policies"]
    log(f"{w.name}: done ({time.monotonic() - t0:.0f} s)")
    return {"title": w.title, "trace": w.trace, "synthetic": w.synth or None, "cluster": f"{w.prefill}P{w.decode}D",
            "slices": {"tune": w.tune, "report": w.report,
                       "unit": "seed (600 s)" if isinstance(w.tune, int) else "seconds of trace time, [start, end)"},
            "probe": probe, "regime": regime, "regime_chosen_by": chosen_by,
            "regime_why": w.regime_why if chosen_by == "fixed" else "",
            "tuned": tuned, "settings": {p: {"engine": tuned[p]["engine"], "policy": knob_values(p, setups[p])}
                                         for p in policies},
            "sweep_multiples": w.sweep or SWEEP, "sweep": sweep, "must_show": must_show(at_regime),
            "wall_s": time.monotonic() - t0}


def tuned_sim(sim: SimConfig, entry: dict[str, Any]) -> SimConfig:
    """`sim` at the split the tuner chose for one policy (`entry`: its tune_one result), where it
    searched one; else `sim` as it is."""
    sp = entry.get("split")
    if not sp or not sp.get("searched"):
        return sim
    return msgspec.structs.replace(sim, prefill=int(sp["prefill"]), decode=int(sp["decode"]))


# what an ablation row keeps of a run's summary (the report's columns and the goodput)
_ABLATION_KEPT = ("requests", "rejected", "slo_attainment", "ttft_slo_attainment", "tbt_slo_attainment",
                  "ttft_p50", "ttft_p95", "ttft_p99", "deflection_rate")


def ablate(w: Workload, profile: Profile, sim: SimConfig, tuned: dict[str, Any], sweep: list[dict[str, Any]],
           jobs: int) -> None:
    """Kairos's tuned setting with late binding switched off and nothing retuned, replayed at
    every swept rate: each sweep point gets `ablation[ABLATION]`. When the tuner left late binding
    off, the row would be Kairos's own, so none is added (the report says so)."""
    k = tuned.get("kairos")
    if k is None or not knob_values("kairos", _setup("kairos", {**k["engine"], **k["policy"]})).get("late_binding"):
        return
    setup = _setup("kairos", {**k["engine"], **k["policy"], "late_binding": False})
    runs = [Run(w, w.report, pt["rate_scale"], "kairos", setup, profile, tuned_sim(sim, k)) for pt in sweep]
    for pt, o in zip(sweep, pmap(execute, runs, jobs), strict=True):
        pt.setdefault("ablation", {})[ABLATION] = {key: o.get(key) for key in _ABLATION_KEPT}


def ablate_result(path: Path, jobs: int, log: Callable[[str], None]) -> None:
    """--ablate: add the late-binding ablation to a result written without it, in place (its
    .md beside it too), from the tuned settings it holds."""
    res = json.loads(path.read_text())
    missing = not_a_result(res) or next((k for k in ("ttft_slo", "tbt_slo") if k not in res), None)
    if missing:
        raise ValueError(f"not a result of python -m sim.fair_eval (no {missing!r})")
    profile = load_profile(res["profile"])
    base = SimConfig(prefill=2, decode=2, ttft_slo=res["ttft_slo"], tbt_slo=res["tbt_slo"],
                     **CONDITIONS[res.get("condition", "exact")])
    for name, wr in res["workloads"].items():
        w = WORKLOADS[name]
        sim = msgspec.structs.replace(base, prefill=w.prefill, decode=w.decode)
        ablate(w, profile, sim, wr["tuned"], wr["sweep"], jobs)
        log(f"{path.name}: {name} ablated")
    path.write_text(json.dumps(json_safe(res), indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(res))


def workload_policies(w: Workload, given: list[str] | None) -> list[str]:
    """The policies compared on `w`: its own list, or those of --policy it has (Kairos first)."""
    return list(w.policies) if not given else [p for p in given if p in w.policies]


def must_show(pols: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """At the regime load: Kairos's both-SLO attainment >= every baseline's, and its P95 TTFT
    (rejected requests: infinite) below every baseline's. The P95 comparison is always made; a
    lower P95 counts against Kairos unless that baseline kept the TBT SLO for over a point fewer
    of its served requests (it bought its TTFT with its decodes' gaps). TBT attainment is over
    served requests, so rejections never excuse anything."""
    if "kairos" not in pols or len(pols) < 2:
        return None
    k = pols["kairos"]
    inf = float("inf")
    rows = {}
    for name, s in pols.items():
        if name == "kairos":
            continue
        worse_tbt = (s["tbt_slo_attainment"] or 0) < (k["tbt_slo_attainment"] or 0) - 0.01
        p95_lower = (k["ttft_p95"] or inf) < (s["ttft_p95"] or inf)
        rows[name] = {"attainment_ok": (k["slo_attainment"] or 0) >= (s["slo_attainment"] or 0),
                      "p95_lower": p95_lower, "baseline_tbt_worse": worse_tbt,
                      "p95_ok": p95_lower or worse_tbt}
    return {"baselines": rows, "holds": all(r["attainment_ok"] and r["p95_ok"] for r in rows.values())}


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.fair_eval", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="append", default=None,
                   help="performance profile; repeat for several (default h100-llama2-70b-tp4)")
    p.add_argument("--workload", action="append", choices=tuple(WORKLOADS), default=None,
                   help=f"repeat for several (default: all of {', '.join(WORKLOADS)})")
    p.add_argument("--policy", action="append", choices=ALL_POLICIES, default=None,
                   help=f"repeat for several (default: each workload's: {', '.join(POLICIES)}; the session "
                        "workloads chat and agent add kv-aware, shift and shift-code dynamo-planner)")
    p.add_argument("--regime", action="append", default=[], metavar="WORKLOAD=X",
                   help="use rate scale X as WORKLOAD's regime load instead of the probe's choice")
    p.add_argument("--condition", choices=tuple(CONDITIONS), default="exact",
                   help="model error every policy is tuned and judged under: exact, noise (10 %% per step), slow "
                        "(engine 15 %% slower than its profile), hetero (worker speeds 0.85-1.15) (default exact)")
    p.add_argument("--passes", type=int, default=2, help="coordinate-descent passes at most (default 2)")
    p.add_argument("--stress", default="1,2",
                   help="tune at these multiples of the regime load on the tune slice, objective averaged "
                        "(`kairos tune --stress`; default 1,2: bursts twice as dense as the slice's own)")
    p.add_argument("--search-split", action="store_true",
                   help="also tune each policy's split (xPyD, the workload's worker total fixed; `kairos tune`'s "
                        "default) and report it there; default: every policy at the workload's split, as the "
                        "published tables")
    p.add_argument("--jobs", type=int, default=2, help="parallel simulation processes (default 2)")
    p.add_argument("--out", default="results/fair-eval",
                   help="folder for results JSON, tuned files and tables.md (default results/fair-eval)")
    p.add_argument("--ablate", action="append", default=None, metavar="RESULT.json",
                   help="run nothing else: add Kairos's late-binding ablation (its tuned setting with late "
                        "binding off, at every swept rate) to a result written without it, in place; repeat "
                        "for several")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        regime: dict[str, float] = {}
        for item in args.regime:
            name, _, x = item.partition("=")
            if name not in WORKLOADS:
                raise ConfigError(f"--regime {item!r}: unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
            regime[name] = float(x)
        args.regime = regime
        args.policy = list(dict.fromkeys(args.policy)) if args.policy else None
        for name in args.workload or WORKLOADS:
            if not workload_policies(WORKLOADS[name], args.policy):
                raise ConfigError(f"workload {name} compares none of the policies given "
                                  f"(its policies: {', '.join(WORKLOADS[name].policies)})")
        args.stress = parse_stress(args.stress)
        profiles = [load_profile(p) for p in dict.fromkeys(args.profile or ["h100-llama2-70b-tp4"])]
    except (ConfigError, ValueError) as e:
        print(f"fair_eval: {e}", file=sys.stderr)
        return 2
    if args.ablate:
        t_a = time.monotonic()
        for path in args.ablate:
            try:
                ablate_result(Path(path), args.jobs,
                              lambda msg: print(f"[{time.monotonic() - t_a:6.0f} s] {msg}", flush=True))
            except (OSError, ValueError, KeyError) as e:
                print(f"fair_eval: --ablate {path}: {e}", file=sys.stderr)
                return 2
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1, **CONDITIONS[args.condition])
    stem = "" if args.condition == "exact" else f"-{args.condition}"
    t0 = time.monotonic()
    load0 = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    cmd = "python -m sim.fair_eval " + " ".join(sys.argv[1:] if argv is None else argv)
    for profile in profiles:
        result: dict[str, Any] = {
            "command": cmd.strip(), "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                       f"Python {platform.python_version()}",
            "loadavg_start": load0, "profile": profile.name, "profile_description": profile.description,
            "cluster": "per workload (chunked-prefill: all GPUs as decode workers)",
            "ttft_slo": sim.ttft_slo, "tbt_slo": sim.tbt_slo,
            "condition": args.condition, "model_error": CONDITIONS[args.condition],
            "objective": OBJECTIVE, "passes": args.passes, "sweep_multiples": SWEEP,
            "split_searched": args.search_split,
            "tune_stress": list(args.stress),
            "regime_rule": {"ttft_at_most": REGIME_TTFT, "tbt_at_least": REGIME_TBT, "peak_load_at_least": 1.0,
                            "probe_policy": PROBE_POLICY},
            "workloads": {}}
        for name in args.workload or WORKLOADS:
            result["workloads"][name] = evaluate_workload(WORKLOADS[name], profile, sim, args, log)
            wr = result["workloads"][name]
            tuned_file = {"format": TUNED_FORMAT, "trace": WORKLOADS[name].trace, "profile": profile.name,
                          "cluster": wr["cluster"], "rate_scale": wr["regime"], "objective": OBJECTIVE,
                          "slices": wr["slices"], "policies": wr["tuned"]}
            tuned_path = out / f"tuned-{profile.name}{stem}-{name}.json"
            tuned_path.write_text(json.dumps(json_safe(tuned_file), indent=2) + "\n")
            result["loadavg_end"] = os.getloadavg()
            result["wall_s"] = time.monotonic() - t0
            (out / f"{profile.name}{stem}.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")
            (out / f"{profile.name}{stem}.md").write_text(markdown(result))
        log(f"wrote {out / (profile.name + stem)}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
