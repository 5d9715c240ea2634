"""`kairos tune`: every policy at its best, tuned on one slice of a trace, judged on another.

    kairos tune --trace code --profile a100-dsv2-lite --policy kairos --policy conditional-disagg \\
                --policy disagg-least-loaded --policy chunked-prefill --rate-scale 1 --out tuned.json
    kairos sim  --trace code --start 1200 --duration 600 --tuned tuned.json

Each policy's knobs (its engine's token budgets and its own knobs, see GRIDS; for Kairos also the
decode guard: the decode room on/off and its `decode_beta`, and the third path on/off) and its
split (how many of the --prefill + --decode workers are prefill workers, the total fixed; every
xPyD with x, y >= 1, for every policy that uses prefill workers; --fixed-split holds it) are
searched on the tune slice, and the best setting is then run once on the report slice, which never overlaps the
tune slice: no policy is judged on the data it was tuned on. Kairos goes through the same search.

Objective: the fraction of requests that meet both SLOs (TTFT, and TBT by the largest gap) first;
among equal attainment, the lower P95 TTFT (rejected requests count as infinite). TBT attainment
is part of the objective, and the table shows it on its own so a setting that buys TTFT with TBT
is visible. With --stress 1,2 the tune slice is also replayed at twice its rate (its bursts twice
as dense) and the objective averaged over both, for every policy alike: a tune slice calmer than
the traffic a policy will meet otherwise tunes it for calm traffic. The report slice is untouched.

Search: coordinate descent over a small grid, from the defaults (the given split, the profile's
budgets, the policy's shipped knobs): each knob in turn is set to its best value with the others
fixed, the split first, and the passes repeat until none changes (at most --passes). Every
evaluated setting is cached. A policy that uses no prefill worker runs on the same number of GPUs
as decode workers only. The tuned split is in the file (`cluster`, `split`); `kairos sim --tuned`
runs each policy at it when its worker total is the file's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from common.engines.settings import EngineSettings
from common.errors import ConfigError
from common.perf_model import Profile, load_profile
from common.traces import LENGTHS, TraceRequest, load_trace, synthetic, trace_path
from sim.cli import add_prefix_flags
from sim.cli import build_parser as sim_parser
from sim.core import SimConfig, simulate
from sim.knobs import (
    SIM_POLICIES,
    TUNED_FORMAT,
    Setup,
    add_error_flags,
    build,
    error_settings,
    knob_values,
    shape,
    shipped,
    with_planner,
)
from sim.stats import fmt, json_safe, summarize

ENGINE_KNOBS = ("prefill_token_budget", "decode_token_budget", "decode_chunk")
# The split: how many of the fixed worker total are prefill workers (the rest decode). A cluster
# knob, neither an engine setting nor a policy's; searched for every policy with prefill workers.
SPLIT = "prefill_workers"
SPLIT_POLICIES = ("kairos", "conditional-disagg", "disagg-least-loaded", "disagg-round-robin", "dynamo-planner",
                  "kv-aware")
OBJECTIVE = ("maximize both-SLO attainment (TTFT <= ttft_slo and largest TBT gap <= tbt_slo); "
             "ties: lower P95 TTFT, rejected requests counting as infinite")

# knob -> values searched. Budgets: vLLM's usual max_num_batched_tokens range. The in-place chunk
# cap (decode_chunk) matters only to policies that send no chunk schedule. 1000 x the budget
# queued switches conditional-disagg's load half off, a length threshold of 0 its length half.
GRIDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "kairos": {"prefill_token_budget": (256, 512, 1024, 2048, 4096, 8192),
               "decode_token_budget": (256, 512, 1024, 2048, 4096, 8192),
               "alpha": (1.0, 1.3, 1.6, 2.0, 3.0, 4.0), "beta": (0.4, 0.5, 0.6, 0.8, 0.9, 1.0),
               "max_deflections": (1, 2, 4, 8, 16),
               "candidates": ((2048, 1024, 512, 256, 128), (1024, 768, 512, 384, 256, 128, 64)),
               "late_binding": (False, True), "late_depth": (0.125, 0.25, 0.5, 1.0, 2.0, 4.0),
               "decode_room": (False, True), "decode_beta": (0.85, 0.9, 0.95, 0.98), "retain": (False, True)},
    "conditional-disagg": {"prefill_token_budget": (512, 1024, 2048, 4096, 8192),
                           "decode_token_budget": (128, 256, 512, 1024, 2048, 4096),
                           "decode_chunk": (128, 256, 512, 1024, 2048, 4096),
                           "eff_isl_threshold": (0, 256, 512, 1024, 2048, 4096),
                           "prefill_busy_threshold": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 1000.0)},
    "disagg-least-loaded": {"prefill_token_budget": (256, 512, 1024, 2048, 4096, 8192, 16384)},
    "disagg-round-robin": {"prefill_token_budget": (256, 512, 1024, 2048, 4096, 8192, 16384)},
    "dynamo-planner": {"prefill_token_budget": (256, 512, 1024, 2048, 4096, 8192, 16384)},
    "chunked-prefill": {"decode_token_budget": (128, 256, 512, 1024, 2048, 4096, 8192),
                        "decode_chunk": (128, 256, 512, 1024, 2048, 4096, 8192)},
    "deflect-all": {"decode_token_budget": (128, 256, 512, 1024, 2048, 4096, 8192),
                    "decode_chunk": (128, 256, 512, 1024, 2048, 4096)},
    "kv-aware": {"prefill_token_budget": (256, 512, 1024, 2048, 4096, 8192, 16384),
                 "overlap_weight": (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 1000.0)},
}
# Grid values that switch a mechanism off rather than set a size: a knob there is not "on an edge".
OFF = {"prefill_busy_threshold": 1000.0, "eff_isl_threshold": 0, "overlap_weight": 1000.0}
# Values a knob cannot go past (the policy refuses them): a tuned value there is not "on an edge".
BOUNDS: dict[str, tuple[float | None, float | None]] = {"alpha": (1.0, None), "beta": (None, 1.0)}


def edges(grid: dict[str, tuple[Any, ...]], chosen: dict[str, Any]) -> list[str]:
    """The searched numeric knobs whose tuned value is the smallest or largest of their grid, or
    outside it (the starting value kept): the optimum may lie beyond, so widen that grid."""
    out = []
    for knob, vals in grid.items():
        if knob == SPLIT:  # 1 and total-1 are the only splits there are: never "beyond"
            continue
        nums = sorted(v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and v != OFF.get(knob))
        v = chosen.get(knob)
        lo, hi = BOUNDS.get(knob, (None, None))
        if len(nums) >= 3 and isinstance(v, (int, float)) and not isinstance(v, bool) and v != OFF.get(knob) \
                and ((v <= nums[0] and v != lo) or (v >= nums[-1] and v != hi)):  # on an edge, or beyond
            out.append(knob)
    return out


DEFAULT_POLICIES = ("kairos", "conditional-disagg", "disagg-least-loaded", "chunked-prefill")
DEFAULT_PROFILE: str = sim_parser().get_default("profile")
SHORT = {"prefill_token_budget": "P budget", "decode_token_budget": "D budget", "decode_chunk": "D chunk",
         "max_deflections": "max defl", "eff_isl_threshold": "isl <", "prefill_busy_threshold": "busy >",
         "eff_isl_ratio_threshold": "isl ratio <", "late_binding": "late", "late_depth": "late depth",
         "decode_room": "room", "decode_beta": "room beta", "retain": "retain", SPLIT: "prefill workers"}


class Slices(msgspec.Struct, frozen=True, kw_only=True):
    """The two disjoint slices: trace-time windows of one file, or two seeds of a synthetic trace."""

    tune: tuple[float, float] | int
    report: tuple[float, float] | int

    def __post_init__(self) -> None:
        if isinstance(self.tune, int) != isinstance(self.report, int):
            raise ValueError("both slices must be windows or both seeds")
        if isinstance(self.tune, int):
            if self.tune == self.report:
                raise ValueError(f"the tune and report slices use the same seed {self.tune}")
            return
        assert isinstance(self.report, tuple)
        if not disjoint(self.tune, self.report):
            (a0, a1), (b0, b1) = self.tune, self.report
            raise ConfigError(f"the tune slice [{a0:g}, {a1:g}) s and the report slice [{b0:g}, {b1:g}) s "
                              "overlap: a policy would be judged on data it was tuned on; move --report-start")


def disjoint(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[1] <= b[0] or b[1] <= a[0]


# ------------------------------------------------------------------------------ evaluation


class Job(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    profile: Profile
    sim: SimConfig  # the 2-pool shape the comparison is at; `shape` turns it per policy
    tune_trace: list[TraceRequest]
    report_trace: list[TraceRequest]
    grid: dict[str, tuple[Any, ...]]
    passes: int = 3
    # the tune slice is replayed at each of these multiples of the rate and the objective averaged:
    # > 1 compresses its bursts, so a policy is tuned on bursts larger than the slice's own
    stress: tuple[float, ...] = (1.0,)
    fixed: dict[str, Any] = {}  # policy knobs held at these values (not searched)


def _setup(policy: str, values: dict[str, Any]) -> Setup:
    """The settings `policy` runs with when tuned to `values`: its shipped ones (sim/knobs.py
    SHIPPED, as `kairos sim --tuned` replays a tuned file) under the searched values. Knobs outside
    the search keep what the policy ships with, not its config class's defaults: the fair
    evaluation of 2026-12-07 ran Kairos with `retain_chunk` 512 (the class's) where it ships 64, so
    its tuned Kairos was not the one a tuned file replays (1.19x the best baseline's goodput on
    `shift` against 1.26x)."""
    engine = {k: v for k, v in values.items() if k in ENGINE_KNOBS}
    return shipped(policy, Setup(engine=EngineSettings(**engine),
                                 policy={k: v for k, v in values.items() if k not in ENGINE_KNOBS and k != SPLIT}))


def split_grid(policy: str, workers: int) -> dict[str, tuple[Any, ...]]:
    """The split knob's values for `policy` on `workers` GPUs: every xPyD with x, y >= 1 (first in
    the search, so the other knobs are tuned at the best split); none for a policy that runs
    without prefill workers (chunked-prefill, deflect-all: every GPU a decode worker)."""
    if policy not in SPLIT_POLICIES or workers < 3:
        return {}
    return {SPLIT: tuple(range(1, workers))}


def with_split(policy: str, grid: dict[str, tuple[Any, ...]], workers: int) -> dict[str, tuple[Any, ...]]:
    """`grid` with the split searched first (unless it names its own split values)."""
    if SPLIT in grid:
        return dict(grid)
    return {**split_grid(policy, workers), **grid}


def cluster(job: Job, values: dict[str, Any]) -> tuple[int, int]:
    """The (prefill, decode) workers one setting runs on: its split, the worker total fixed."""
    total = job.sim.prefill + job.sim.decode
    n_p = int(values.get(SPLIT, job.sim.prefill))
    if not 1 <= n_p < total and SPLIT in values:
        raise ConfigError(f"{job.policy}: split of {n_p} prefill workers out of {total}: "
                          "each role needs at least one worker")
    return shape(job.policy, n_p, total - n_p)


def evaluate(job: Job, values: dict[str, Any], trace: Sequence[TraceRequest]) -> dict[str, Any]:
    policy, prof = build(job.policy, _setup(job.policy, {**values, **job.fixed}), job.profile)
    n_p, n_d = cluster(job, values)
    cfg = with_planner(job.policy, msgspec.structs.replace(job.sim, prefill=n_p, decode=n_d))
    res = simulate(trace, prof, policy, cfg)
    s = summarize(res.records, ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo)
    s["prefix_hit_rate"] = res.stats["prefix_hit_rate"]
    return s


def score(s: dict[str, Any]) -> tuple[float, float]:
    """Larger is better: (both-SLO attainment, -P95 TTFT)."""
    p95 = s["ttft_p95"]
    return (s["slo_attainment"] or 0.0, -(math.inf if p95 is None else p95))


def defaults(job: Job) -> dict[str, Any]:
    """The starting point: what the policy ships with (sim/knobs.py SHIPPED, else the profile's
    budgets and the policy's config defaults), for the knobs searched."""
    setup = shipped(job.policy, Setup())
    start = {**msgspec.structs.asdict(setup.engine.resolved(job.profile)), **knob_values(job.policy, setup),
             SPLIT: job.sim.prefill}
    unknown = set(job.grid) - set(start)
    if unknown:
        raise ConfigError(f"{job.policy}: cannot search unknown knob(s) {', '.join(sorted(unknown))}")
    return {k: tuple(start[k]) if isinstance(start[k], list) else start[k] for k in job.grid}


def compress(trace: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests at `factor` x the rate (arrival times divided by it; prompts, and so
    their prefix-cache hits, unchanged)."""
    return [msgspec.structs.replace(r, t=r.t / factor) for r in trace]


def combine(runs: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """One summary for the objective over the stress loads: both-SLO attainment and P95 TTFT
    averaged (a rejected-request infinity stays infinite); the rest is the x1 run's, and each
    load's own summary is under "stress"."""
    base = next((s for m, s in runs if m == 1.0), runs[0][1])
    att = [s["slo_attainment"] or 0.0 for _, s in runs]
    p95 = [math.inf if s["ttft_p95"] is None else s["ttft_p95"] for _, s in runs]
    return {**base, "slo_attainment": sum(att) / len(att), "ttft_p95": sum(p95) / len(p95),
            "stress": {f"x{m:g}": _brief(s) for m, s in runs}}


def tune_one(job: Job) -> dict[str, Any]:
    """Coordinate descent on the tune slice (at each stress load); the winner then runs once on
    the report slice."""
    cache: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
    loads = [(m, job.tune_trace if m == 1.0 else compress(job.tune_trace, m)) for m in job.stress]

    def run(values: dict[str, Any]) -> dict[str, Any]:
        key = tuple(sorted(values.items()))
        if key not in cache:
            if len(loads) == 1 and loads[0][0] == 1.0:
                cache[key] = evaluate(job, values, job.tune_trace)
            else:
                cache[key] = combine([(m, evaluate(job, values, tr)) for m, tr in loads])
        return cache[key]

    best = defaults(job)
    best_s = run(best)
    for _ in range(job.passes):
        changed = False
        for knob, vals in job.grid.items():
            for v in vals:
                if v == best[knob]:
                    continue
                cand = {**best, knob: v}
                s = run(cand)
                if score(s) > score(best_s):
                    best, best_s, changed = cand, s, True
        if not changed:
            break
    report = evaluate(job, best, job.report_trace)
    start = run(defaults(job))
    setup = _setup(job.policy, {**best, **job.fixed})
    out = {"engine": {k: v for k, v in msgspec.structs.asdict(setup.engine).items() if v}, "policy": setup.policy,
           "cluster": "{}P{}D".format(*cluster(job, best)),
           "split": {"prefill": int(best.get(SPLIT, job.sim.prefill)),
                     "decode": job.sim.prefill + job.sim.decode - int(best.get(SPLIT, job.sim.prefill)),
                     "searched": SPLIT in job.grid},
           "tune": _brief(best_s), "report": _brief(report), "defaults_tune": _brief(start),
           "evaluated": len(cache), "edges": edges(job.grid, best)}
    if "stress" in best_s:
        out["tune_stress"] = best_s["stress"]
    return out


KEEP = ("requests", "rejected", "slo_attainment", "slo_attainment_p99", "ttft_slo_attainment", "tbt_slo_attainment",
        "tbt_p99_slo_attainment", "ttft_p50", "ttft_p95", "ttft_p99", "tbt_p99", "deflection_rate", "ttft_pred_mape",
        "prefix_hit_rate")


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in KEEP}


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos tune", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("trace and slices")
    t.add_argument("--trace", default="code",
                   help="a CSV or JSON-lines file, 'code' or 'conv' (the Azure 2023 traces), or 'synthetic' "
                        "(default: code)")
    t.add_argument("--duration", type=float, default=300.0,
                   help="length of each slice, seconds of trace time (default 300)")
    t.add_argument("--tune-start", type=float, default=0.0, help="tune slice start, seconds (default 0)")
    t.add_argument("--report-start", type=float, default=None,
                   help="report slice start, seconds; must not overlap the tune slice (default: right after it)")
    t.add_argument("--rate-scale", type=float, default=1.0, help="time compression, 2 = twice the rate (default 1)")
    t.add_argument("--rate", type=float, default=2.57, help="synthetic: mean requests/s (default 2.57)")
    t.add_argument("--arrival", choices=("gamma", "poisson", "onoff"), default="onoff",
                   help="synthetic: arrival process (default onoff)")
    t.add_argument("--cv", type=float, default=2.2, help="synthetic: inter-arrival CV (default 2.2)")
    t.add_argument("--lengths", choices=tuple(LENGTHS), default="code", help="synthetic: length fit (default code)")
    t.add_argument("--seed", type=int, default=0,
                   help="synthetic: the tune slice's seed; the report slice uses seed+1 (default 0)")
    c = p.add_argument_group("cluster")
    c.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    c.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    c.add_argument("--fixed-split", action="store_true",
                   help="hold the split at --prefill/--decode (default: search every xPyD with the same worker "
                        "total, for every policy that uses prefill workers; the split is tuned first)")
    c.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"performance profile name or .json path (default {DEFAULT_PROFILE}, as kairos sim)")
    c.add_argument("--heartbeat-interval", type=float, default=0.1, help="seconds between heartbeats (default 0.1)")
    c.add_argument("--kv-wait-timeout", type=float, default=30.0,
                   help="seconds a request waits for KV room before rejection (default 30)")
    add_prefix_flags(c)
    add_error_flags(p)  # tune under the model error the policies will be judged in
    s = p.add_argument_group("policies and search")
    s.add_argument("--policy", action="append", choices=SIM_POLICIES, default=None,
                   help=f"repeat for several (default: {', '.join(DEFAULT_POLICIES)})")
    s.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, seconds (default 2.0)")
    s.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds (default 0.1)")
    s.add_argument("--no-prefix-aware", action="store_true",
                   help="kairos prices every prompt whole (prefix_aware false, held, not searched)")
    s.add_argument("--passes", type=int, default=3, help="coordinate-descent passes at most (default 3)")
    s.add_argument("--stress", default="1",
                   help="rate multiples the tune slice is replayed at, comma separated; the objective is averaged "
                        "over them (e.g. 1,2: also with its bursts twice as dense) (default 1)")
    s.add_argument("--jobs", type=int, default=1,
                   help="policies tuned in parallel processes (default 1; more only helps with idle cores)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="tuned.json",
                   help="the tuned settings, for `kairos sim --tuned` (default tuned.json)")
    o.add_argument("--quiet", action="store_true", help="no table on the terminal")
    return p


def load_slices(args: argparse.Namespace) -> tuple[Slices, list[TraceRequest], list[TraceRequest], dict[str, Any]]:
    if args.duration <= 0:
        raise ConfigError("--duration must be positive")
    if args.trace == "synthetic":
        sl = Slices(tune=args.seed, report=args.seed + 1)

        def syn(seed: int) -> list[TraceRequest]:
            base = synthetic(rate=args.rate, duration=args.duration, arrival=args.arrival, cv=args.cv, seed=seed,
                             **LENGTHS[args.lengths])  # type: ignore[arg-type]
            return [msgspec.structs.replace(r, t=r.t / args.rate_scale) for r in base]

        info = {"trace": "synthetic", "rate": args.rate, "arrival": args.arrival, "cv": args.cv,
                "lengths": args.lengths, "duration": args.duration}
        return sl, syn(args.seed), syn(args.seed + 1), info
    report_start = args.tune_start + args.duration if args.report_start is None else args.report_start
    sl = Slices(tune=(args.tune_start, args.tune_start + args.duration),
                report=(report_start, report_start + args.duration))
    path = trace_path(args.trace)
    tune = load_trace(path, start=args.tune_start, duration=args.duration, rate_scale=args.rate_scale)
    report = load_trace(path, start=report_start, duration=args.duration, rate_scale=args.rate_scale)
    if not tune or not report:
        raise ConfigError(f"a slice holds no request (tune {len(tune)}, report {len(report)}): "
                          "check --tune-start, --report-start and --duration against the trace's length")
    return sl, tune, report, {"trace": args.trace, "trace_path": str(path), "duration": args.duration}


def _knobs_text(name: str, entry: dict[str, Any], grid: dict[str, tuple[Any, ...]]) -> str:
    vals = {**entry["engine"], **entry["policy"]}
    if "split" in entry:
        vals[SPLIT] = entry["split"]["prefill"]
    def text(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:g}"
        if isinstance(v, (list, tuple)):
            return "/".join(str(x) for x in v)
        return str(v)
    on_edge = set(entry.get("edges", ())) | set(edges(grid, vals))  # by today's rule, for older results too
    return ", ".join(f"{SHORT.get(k, k)} {text(vals.get(k))}{' (grid edge)' if k in on_edge else ''}" for k in grid)


def _table(out: dict[str, Any], title: str) -> Table:
    tab = Table(title=title, title_justify="left", caption=f"objective: {OBJECTIVE}", caption_justify="left")
    for col in ("policy", "GPUs", "best setting (searched knobs)", "runs", "tune: both", "TTFT p95",
                "report: both", "TTFT p95 s", "TTFT SLO", "TBT max gap", "TBT p99 gap", "rejected"):
        tab.add_column(col, justify="left" if col in ("policy", "best setting (searched knobs)") else "right")
    for name, e in out["policies"].items():
        t, r = e["tune"], e["report"]
        grid = {k: tuple(v) for k, v in out.get("grids", {}).get(name, GRIDS[name]).items()}
        tab.add_row(name, e["cluster"], _knobs_text(name, e, grid), str(e["evaluated"]),
                    fmt(t["slo_attainment"], "%"), fmt(t["ttft_p95"]), fmt(r["slo_attainment"], "%"),
                    fmt(r["ttft_p95"]), fmt(r["ttft_slo_attainment"], "%"), fmt(r["tbt_slo_attainment"], "%"),
                    fmt(r["tbt_p99_slo_attainment"], "%"), str(r["rejected"]))
    return tab


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(quiet=args.quiet)
    if not console.is_terminal:
        console = Console(quiet=args.quiet, width=170)
    try:
        return _run(args, console)
    except (ConfigError, ValueError) as e:
        Console(stderr=True).print(f"[red]kairos tune: {e}[/]")
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.rate_scale <= 0:
        raise ConfigError("--rate-scale must be positive")
    if args.jobs < 1 or args.passes < 1:
        raise ConfigError("--jobs and --passes must be >= 1")
    profile = load_profile(args.profile)
    slices, tune_trace, report_trace, info = load_slices(args)
    sim = SimConfig(prefill=args.prefill, decode=args.decode, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
                    heartbeat_interval=args.heartbeat_interval, kv_wait_timeout=args.kv_wait_timeout,
                    prefix_cache=args.prefix_cache == "on", hash_block_tokens=args.hash_block_tokens,
                    **error_settings(args))
    fixed = {"kairos": {"prefix_aware": False}} if args.no_prefix_aware else {}
    policies = list(dict.fromkeys(args.policy or DEFAULT_POLICIES))
    for name in policies:
        if shape(name, args.prefill, args.decode)[0] == 0 and name in ("disagg-least-loaded", "disagg-round-robin",
                                                                       "dynamo-planner"):
            raise ConfigError(f"policy {name} needs prefill workers: use --prefill 1 or more")
    stress = parse_stress(args.stress)
    workers = args.prefill + args.decode
    grids = {name: GRIDS[name] if args.fixed_split else with_split(name, GRIDS[name], workers) for name in policies}
    jobs = [Job(policy=name, profile=profile, sim=sim, tune_trace=tune_trace, report_trace=report_trace,
                grid=grids[name], passes=args.passes, fixed=fixed.get(name, {}), stress=stress) for name in policies]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
            results = list(pool.map(tune_one, jobs))
    else:
        results = [tune_one(j) for j in jobs]
    out: dict[str, Any] = {
        "format": TUNED_FORMAT, **info, "profile": profile.name, "rate_scale": args.rate_scale,
        "cluster": f"{args.prefill}P{args.decode}D", "ttft_slo": args.ttft_slo, "tbt_slo": args.tbt_slo,
        "heartbeat_interval": args.heartbeat_interval, "kv_wait_timeout": args.kv_wait_timeout,
        "prefix_cache": args.prefix_cache, "hash_block_tokens": args.hash_block_tokens,
        "slices": {"tune": slices.tune, "report": slices.report,
                   "unit": "seed" if isinstance(slices.tune, int) else "seconds of trace time, [start, end)"},
        "requests": {"tune": len(tune_trace), "report": len(report_trace)},
        "objective": OBJECTIVE, "method": f"coordinate descent over GRIDS, at most {args.passes} passes",
        "stress": list(stress), "split_searched": not args.fixed_split,
        "grids": {name: {k: list(v) for k, v in grids[name].items()} for name in policies},
        "date": datetime.date.today().isoformat(),
        "policies": dict(zip(policies, results, strict=True))}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(out), indent=2) + "\n")
    where = "seeds" if isinstance(slices.tune, int) else "s"
    console.print(_table(out, f"{info['trace']} x{args.rate_scale:g}, {args.prefill + args.decode} GPUs, "
                              f"{profile.name}: tuned on {_slice(slices.tune)} {where} ({len(tune_trace)} requests), "
                              f"reported on {_slice(slices.report)} {where} ({len(report_trace)} requests)"))
    console.print(f"wrote {path}; the report slice again, with the tuned settings:\n  {replay_command(args, path)}",
                  soft_wrap=True)
    return 0


def parse_stress(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--stress must be comma-separated rate multiples, got {text!r}") from None
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals):
        raise ConfigError(f"--stress needs positive rate multiples, got {text!r}")
    return vals


def replay_command(args: argparse.Namespace, path: Path) -> str:
    """The `kairos sim` command that reruns the report slice with the tuned settings."""
    if args.trace == "synthetic":
        where = (f"--seed {args.seed + 1} --duration {args.duration:g} --rate {args.rate:g} --arrival {args.arrival} "
                 f"--cv {args.cv:g} --lengths {args.lengths}")
    else:
        start = args.tune_start + args.duration if args.report_start is None else args.report_start
        where = f"--start {start:g} --duration {args.duration:g}"
    policies = " ".join(f"--policy {n}" for n in dict.fromkeys(args.policy or DEFAULT_POLICIES))
    return (f"kairos sim --trace {args.trace} {where} --rate-scale {args.rate_scale:g} --profile {args.profile} "
            f"--prefill {args.prefill} --decode {args.decode} --ttft-slo {args.ttft_slo:g} --tbt-slo {args.tbt_slo:g} "
            f"--heartbeat-interval {args.heartbeat_interval:g} --kv-wait-timeout {args.kv_wait_timeout:g} "
            f"--prefix-cache {args.prefix_cache} --hash-block-tokens {args.hash_block_tokens} "
            f"--tuned {path} {policies}")


def _slice(s: tuple[float, float] | int) -> str:
    return str(s) if isinstance(s, int) else f"[{s[0]:g}, {s[1]:g})"


if __name__ == "__main__":
    sys.exit(main())
