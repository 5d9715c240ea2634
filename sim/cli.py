"""`kairos sim`: replay a trace through the routing policies on a simulated cluster.

    kairos sim --trace code --prefill 2 --decode 2 --profile h100-llama2-70b-tp4 \\
               --policy kairos --policy disagg-least-loaded --rate-scale 0.5,1,2 --out results.json

Every policy sees the same trace (and, with --step-noise, the same noise seed) on the same
number of GPUs: a policy without prefill workers (chunked-prefill) gets them all as decode
workers (2P2D -> 0P4D). Engine settings and policy knobs come from the flags, or per policy
from a `kairos tune` file (--tuned; a knob flag given explicitly overrides the file).

results.json:
    {"config": {..., "settings": {NAME: {"cluster", "engine", "policy"}}}, "lower_bound": {...},
     "policies": {NAME: {summary keys, "sim": {..., "queues": {POOL: {"max", "mean"}}}}},
     "sweep": [{"rate_scale": X, "prefill_load": RHO, "requests": N, "lower_bound": {...},
                "policies": {...}}, ...]}
The top-level "lower_bound" and "policies" are those of the first --rate-scale value; "sweep"
holds every value. Summary keys and their definitions: sim/stats.py. With several --routers
values or --admission both, each policy runs once per setting, named "NAME R=2" (and
"NAME R=2 no-admission" for the runs without decode-side admission).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from common.config import DEFAULT_PROFILE
from common.errors import ConfigError
from common.perf_model import load_profile
from common.traces import LENGTHS, TraceRequest, find_bursty_window, load_trace, synthetic, trace_path
from sim.core import SimConfig, simulate
from sim.knobs import (
    SIM_POLICIES,
    Setup,
    add_engine_flags,
    add_error_flags,
    add_policy_flags,
    build,
    error_settings,
    knob_values,
    load_tuned,
    setups_from_flags,
    shape,
    shipped,
    with_planner,
)
from sim.load import fastest_prefill, lower_bound, prefill_load
from sim.stats import fmt, json_safe, summarize

DEFAULT_POLICIES = ("kairos", "disagg-least-loaded", "disagg-round-robin", "conditional-disagg", "chunked-prefill")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos sim", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("trace")
    t.add_argument("--trace", default="code",
                   help="a CSV or JSON-lines file, 'code' or 'conv' (the Azure 2023 traces shipped with Kairos), "
                        "or 'synthetic' (default: code)")
    t.add_argument("--start", type=float, default=0.0, help="slice start, seconds of trace time (default 0)")
    t.add_argument("--duration", type=float, default=None,
                   help="slice length, seconds of trace time (default: to the end; synthetic: 600)")
    t.add_argument("--bursty", type=float, default=None, metavar="S",
                   help="replay the S-second window with the most prompt tokens (overrides --start/--duration)")
    t.add_argument("--rate-scale", default="1",
                   help="time compression, 2 = twice the request rate; a comma list runs a sweep (default 1)")
    t.add_argument("--rate", type=float, default=2.57, help="synthetic: mean requests/s (default 2.57)")
    t.add_argument("--arrival", choices=("gamma", "poisson", "onoff"), default="onoff",
                   help="synthetic: arrival process (default onoff, the code trace's bursts)")
    t.add_argument("--cv", type=float, default=2.2, help="synthetic: inter-arrival CV (inside bursts for onoff)")
    t.add_argument("--lengths", choices=tuple(LENGTHS), default="code",
                   help="synthetic: lognormal prompt/output lengths fitted to this trace, or long (prompts of 4k "
                        "to 32k tokens, median 9k) (default code)")
    t.add_argument("--seed", type=int, default=0, help="synthetic trace and --step-noise seed (default 0)")
    c = p.add_argument_group("cluster")
    c.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    c.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    c.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"performance profile name or .json path (default {DEFAULT_PROFILE}, measured)")
    c.add_argument("--heartbeat-interval", type=float, default=0.1,
                   help="seconds between worker heartbeats; 0 = the policy sees the live state (default 0.1)")
    c.add_argument("--no-ledger", action="store_true",
                   help="the policy sees heartbeats only, not the router's ledger of work dispatched since")
    c.add_argument("--routers", default="1",
                   help="router replicas, requests assigned round-robin, each with its own ledger and stale view; "
                        "a comma list runs each (default 1)")
    c.add_argument("--admission", choices=("on", "off", "both"), default="on",
                   help="decode workers check every deflection against their live state and reject what does not "
                        "fit (the router then takes the disaggregated path); both: run each (default on)")
    c.add_argument("--no-held-list", action="store_true",
                   help="with several routers, each sees only its own deflections in flight (decode heartbeats do "
                        "not list the deflections they hold)")
    c.add_argument("--replica-stagger-ms", type=float, default=3.0, metavar="MS",
                   help="with several routers, milliseconds between their turns at the room a worker's heartbeat "
                        "shows (each decides after the others' dispatches show, as one router would); 0: all "
                        "at once, each blind to the others' (the simulator before 2026-12-06) (default 3)")
    c.add_argument("--prompt-beat", type=float, default=0.002, metavar="SECONDS",
                   help="besides every --heartbeat-interval, a worker heartbeats this long after its state changes "
                        "(work arrives, a request is admitted, a prefill ends, a request finishes), as live workers "
                        "do (default 0.002, their coalescing delay); -1: only the periodic heartbeats")
    c.add_argument("--relay-ms", type=float, default=0.0, metavar="MS",
                   help="with several routers, a worker's heartbeat at once (it took work) reaches the replicas MS "
                        "later: live's relay (the bus and the processes' wake-ups; P50 2-8 ms, P90 4-11 ms on a "
                        "loaded 2-core host) emulated; default 0 (at once)")
    c.add_argument("--kv-wait-timeout", type=float, default=30.0,
                   help="seconds a request that finds no KV room waits in the router's queue before it is "
                        "rejected (default 30; 0: reject at once)")
    c.add_argument("--kv-wait-max", type=int, default=1024,
                   help="requests waiting for KV room before new ones are rejected at once (default 1024)")
    c.add_argument("--queue-budget", type=float, default=-1.0, metavar="SECONDS",
                   help="the router's admission shedding (queue_budget, common/router_core/admission.py): a request "
                        "predicted to wait past it is refused on arrival, one let wait is refused once it can no "
                        "longer make it (both count as rejected); 0: each request's TTFT SLO, what the live router "
                        "ships; default -1: off, so that a run measures what queueing does to every request")
    c.add_argument("--planner", choices=("on", "off"), default=None,
                   help="the role planner (common/router_core/planner.py): router 0 moves workers between the prefill "
                        "and decode roles when measured load says the other role is short; a flip drains the worker, "
                        "keeps it out --planner-switch-s and rejoins it with an empty prefix cache (default: on for "
                        "kairos, as the router ships it; off for the baselines, which keep their split; on/off: every "
                        "policy)")
    c.add_argument("--planner-switch-s", type=float, default=2.0, metavar="SECONDS",
                   help="seconds a flipped worker's engine is out between its drain and its rejoin (default 2)")
    c.add_argument("--planner-pin", action="append", default=[], metavar="WORKER",
                   help="a worker the planner never moves (e.g. prefill-0); repeat for several")
    c.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                   help="the same scenario K times slower, as `kairos up --time-scale K` runs it live: every "
                        "modeled step and KV transfer x K (as on the live simulated engine), the TTFT and TBT SLOs, "
                        "--heartbeat-interval, --kv-wait-timeout, --planner-switch-s, --slow-every, --slow-for and "
                        "the role planner's periods x K, the trace's arrivals K times further apart (--rate-scale / "
                        "K); reported times are the slowed ones (default 1)")
    c.add_argument("--tbt-delivery-allowance-ms", type=float, default=0.0, metavar="MS",
                   help="the router's configured TBT delivery allowance (KAIROS_TBT_DELIVERY_ALLOWANCE_MS): "
                        "decode steps are planned to the TBT SLO less this many milliseconds; give the value a "
                        "live router runs with to compare with it (its measured part is 0 here: no HTTP layer). "
                        "Not scaled by --time-scale (a wall-clock delay; default 0)")
    add_prefix_flags(c)
    add_engine_flags(p)
    add_error_flags(p)
    s = p.add_argument_group("policies and SLOs")
    s.add_argument("--policy", action="append", choices=SIM_POLICIES, default=None,
                   help=f"repeat for several (default: {', '.join(DEFAULT_POLICIES)}); dynamo-planner: "
                        "disagg-least-loaded with a Dynamo-style threshold planner moving workers between roles "
                        "every 5 s (simulator only)")
    s.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, seconds (default 2.0)")
    s.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds (default 0.1)")
    s.add_argument("--tuned", metavar="FILE", default=None,
                   help="per-policy engine settings, knobs and split from `kairos tune --out FILE` (a tuned "
                        "split is used when --prefill + --decode is the worker total it was tuned on)")
    add_policy_flags(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="write results JSON here")
    o.add_argument("--plot", default=None, metavar="DIR", help="write TTFT CDFs and attainment vs load here")
    o.add_argument("--quiet", action="store_true", help="no table on the terminal")
    return p


def add_prefix_flags(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="per-worker prefix caches and the router's prefix index, for traces with hash_ids "
                        "(default on; off: every prompt is prefilled whole, as before prefix caching)")
    c.add_argument("--hash-block-tokens", type=int, default=512, metavar="N",
                   help="prompt tokens per hash_ids entry of the trace, the prefix cache's block size (default 512)")


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"{what} is empty")
    return vals


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise ConfigError(f"{what} must list numbers >= 1, got {text!r}")
    return out


def _variants(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """(name suffix, routers, admission) of each run per policy."""
    routers = list(dict.fromkeys(_ints(args.routers, "--routers")))
    adm = {"on": [True], "off": [False], "both": [True, False]}[args.admission]
    if len(routers) == 1 and len(adm) == 1:
        return [("", routers[0], adm[0])]
    return [(f" R={r}" + ("" if a else " no-admission"), r, a) for r in routers for a in adm]


def _load(args: argparse.Namespace, rate_scale: float) -> tuple[list[TraceRequest], dict[str, Any]]:
    info: dict[str, Any] = {"trace": args.trace}
    if args.trace == "synthetic":
        duration = args.duration or 600.0
        base = synthetic(rate=args.rate, duration=duration, arrival=args.arrival, cv=args.cv, seed=args.seed,
                         **LENGTHS[args.lengths])  # type: ignore[arg-type]
        reqs = [TraceRequest(t=r.t / rate_scale, input_length=r.input_length, output_length=r.output_length)
                for r in base]
        info.update(rate=args.rate, arrival=args.arrival, cv=args.cv, lengths=args.lengths, seed=args.seed,
                    start=0.0, duration=duration)
        return reqs, info
    path = trace_path(args.trace)
    start, duration = args.start, args.duration
    if args.bursty is not None:
        start = find_bursty_window(load_trace(path), args.bursty)
        duration = args.bursty
    info.update(trace_path=str(path), start=start, duration=duration)
    return load_trace(path, start=start, duration=duration, rate_scale=rate_scale), info


TABLE_NOTE = ("TTFT percentiles count rejected requests as infinite; TBT SLO: max gap = every gap "
              "<= SLO, p99 gap = the request's P99 gap <= SLO; both: TTFT and max-gap TBT; lower bound: "
              "every prompt prefilled whole on an idle worker (prefix-cache hits can beat it)")


def _table(point: dict[str, Any], title: str, clusters: dict[str, str]) -> Table:
    tab = Table(title=title, title_justify="left", caption=TABLE_NOTE, caption_justify="left")
    for col in ("policy", "GPUs", "deflect", "hits", "TTFT p50 s", "p95 s", "p99 s", "TBT p99 ms", "TTFT SLO",
                "TBT max gap", "p99 gap", "both", "rejected", "pred err"):
        tab.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    lb = point["lower_bound"]
    tab.add_row("[dim]lower bound[/]", "-", "-", "-", fmt(lb["ttft_p50"]), fmt(lb["ttft_p95"]), fmt(lb["ttft_p99"]),
                "-", fmt(lb["ttft_slo_attainment"], "%"), "-", "-", "-", "-", "-", style="dim")
    for name, s in point["policies"].items():
        tab.add_row(name, clusters[name], fmt(s["deflection_rate"], "%"), fmt(s["prefix_hit_rate"], "%"),
                    fmt(s["ttft_p50"]), fmt(s["ttft_p95"]),
                    fmt(s["ttft_p99"]), fmt(s["tbt_p99"], "ms"), fmt(s["ttft_slo_attainment"], "%"),
                    fmt(s["tbt_slo_attainment"], "%"), fmt(s["tbt_p99_slo_attainment"], "%"),
                    fmt(s["slo_attainment"], "%"), str(s["rejected"]), fmt(s["ttft_pred_mape"], "%"))
    return tab


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(quiet=args.quiet)
    if not console.is_terminal:
        console = Console(quiet=args.quiet, width=150)  # logs and pipes: do not squeeze the table
    err = Console(stderr=True)
    try:
        return _run(args, console)
    except (ConfigError, ValueError) as e:
        err.print(f"[red]kairos sim: {e}[/]")
        return 2


def stretched(args: argparse.Namespace) -> None:
    """--time-scale K: turn the flags into the same scenario K times slower (in place): the SLOs,
    the heartbeat interval, the KV wait timeout, the flip's engine-out time and the slow periods'
    spacing and length x K, the arrival
    rates / K. The steps and KV transfers (the profile's model, `PerfModel.slowed`) and the router's periods
    (SimConfig.time_scale) are scaled where they are built. Not scaled, as live: the workers' 2 ms
    state beat (--prompt-beat; live, a real coalescing delay) and the step-error estimator's 120 s
    window (common/prediction_error.py, live and simulated alike)."""
    k = args.time_scale
    if not k > 0:
        raise ConfigError("--time-scale must be positive (1: the profile's own timing)")
    if k == 1.0:
        return
    args.ttft_slo *= k
    args.tbt_slo *= k
    args.heartbeat_interval *= k
    args.kv_wait_timeout *= k
    if args.queue_budget > 0:  # 0 (each request's TTFT SLO, scaled above) and -1 (off) mean the same at any K
        args.queue_budget *= k
    args.planner_switch_s *= k
    args.slow_every *= k
    args.slow_for *= k
    args.rate_scale = ",".join(repr(x / k) for x in _floats(args.rate_scale, "--rate-scale"))


def _run(args: argparse.Namespace, console: Console) -> int:
    stretched(args)
    profile = load_profile(args.profile)
    if args.time_scale != 1.0:
        profile = msgspec.structs.replace(profile, model=profile.model.slowed(args.time_scale))
    scales = _floats(args.rate_scale, "--rate-scale")
    if any(x <= 0 for x in scales):
        raise ConfigError("--rate-scale values must be positive")
    base = SimConfig(prefill=args.prefill, decode=args.decode, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
                     heartbeat_interval=args.heartbeat_interval, ledger=not args.no_ledger,
                     **error_settings(args), seed=args.seed, kv_wait_timeout=args.kv_wait_timeout,
                     kv_wait_max=args.kv_wait_max, queue_budget=args.queue_budget,
                     prefix_cache=args.prefix_cache == "on",
                     hash_block_tokens=args.hash_block_tokens, held_list=not args.no_held_list,
                     replica_stagger_ms=args.replica_stagger_ms,
                     prompt_beat=args.prompt_beat, relay=args.relay_ms / 1000.0,
                     planner=None if args.planner is None else args.planner == "on",
                     planner_switch_s=args.planner_switch_s, planner_pinned=tuple(args.planner_pin),
                     time_scale=args.time_scale, tbt_delivery_allowance_ms=args.tbt_delivery_allowance_ms)
    policies = list(dict.fromkeys(args.policy or DEFAULT_POLICIES))
    setups = resolve_setups(args, policies)
    if args.tuned:
        _tuned_note(console, args, profile.name, policies)
    clusters: dict[str, str] = {}
    cfgs: dict[str, SimConfig] = {}
    shapes: dict[str, str] = {}
    runs: list[tuple[str, str]] = []  # (label, policy)
    variants = _variants(args)
    splits = tuned_splits(args.tuned, args.prefill + args.decode) if args.tuned else {}
    for name in policies:
        n_p, n_d = shape(name, *splits.get(name, (args.prefill, args.decode)))
        if n_p == 0 and name in ("disagg-least-loaded", "disagg-round-robin", "dynamo-planner"):
            raise ConfigError(f"policy {name} needs prefill workers: use --prefill 1 or more")
        shapes[name] = f"{n_p}P{n_d}D"
        for suffix, routers, admission in variants:
            label = name + suffix
            cfgs[label] = with_planner(name, msgspec.structs.replace(base, prefill=n_p, decode=n_d, routers=routers,
                                                                     admission=admission))
            clusters[label] = shapes[name]
            runs.append((label, name))
    settings = {name: {"cluster": shapes[name],
                       "engine": msgspec.structs.asdict(setups[name].engine.resolved(profile)),
                       "policy": knob_values(name, setups[name])} for name in policies}
    sweep: list[dict[str, Any]] = []
    cdfs: list[tuple[float, dict[str, list[float]]]] = []
    info: dict[str, Any] = {}
    for scale in scales:
        trace, info = _load(args, scale)
        if not trace:
            raise ConfigError("the selected trace slice holds no request")
        point: dict[str, Any] = {
            "rate_scale": scale, "requests": len(trace), "span_s": trace[-1].t - trace[0].t,
            "prefill_load": prefill_load(trace, profile, args.prefill),
            "lower_bound": lower_bound(trace, profile, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo),
            "policies": {}}
        ttfts: dict[str, list[float]] = {}
        for label, name in runs:
            policy, prof = build(name, setups[name], profile)
            res = simulate(trace, prof, policy, cfgs[label])
            summary = summarize(res.records, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo)
            summary["prefix_hit_rate"] = res.stats["prefix_hit_rate"]
            summary["sim"] = res.stats
            point["policies"][label] = summary
            ttfts[label] = [r.ttft for r in res.records if r.ttft is not None]
        ttfts["lower bound"] = [fastest_prefill(profile.model, r.input_length) for r in trace]
        sweep.append(point)
        cdfs.append((scale, ttfts))
        load = point["prefill_load"]
        console.print(_table(point, f"{info['trace']} x{scale:g}: {len(trace)} requests over {point['span_s']:.0f} s, "
                                    f"{args.prefill + args.decode} GPUs ({args.prefill}P{args.decode}D unless "
                                    f"listed), {profile.name}, offered prefill load "
                                    f"{'-' if load is None else f'{load:.2f}'}", clusters))
    config: dict[str, Any] = {
        **info, "rate_scales": scales, "prefill": args.prefill, "decode": args.decode, "profile": profile.name,
        "policies": policies, "ttft_slo": args.ttft_slo, "tbt_slo": args.tbt_slo,
        "tbt_slo_definition": "tbt_slo_attainment: the request's largest inter-token gap <= tbt_slo; "
                              "tbt_p99_slo_attainment: its P99 gap <= tbt_slo",
        "ttft_percentiles": "over every request; one that got no token (rejected) counts as infinite (null here)",
        "heartbeat_interval": args.heartbeat_interval, "ledger": not args.no_ledger,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in error_settings(args).items()},
        "routers": _ints(args.routers, "--routers"), "admission": args.admission, "held_list": not args.no_held_list,
        "replica_stagger_ms": args.replica_stagger_ms,
        "prompt_beat": args.prompt_beat, "relay_ms": args.relay_ms,
        "planner": args.planner, "planner_switch_s": args.planner_switch_s, "planner_pinned": args.planner_pin,
        "time_scale": args.time_scale,
        "kv_wait_timeout": args.kv_wait_timeout, "kv_wait_max": args.kv_wait_max, "queue_budget": args.queue_budget,
        "tuned": args.tuned,
        "prefix_cache": args.prefix_cache, "hash_block_tokens": args.hash_block_tokens,
        "settings": settings, "date": datetime.date.today().isoformat()}
    result = {"config": config, "lower_bound": sweep[0]["lower_bound"], "policies": sweep[0]["policies"],
              "sweep": sweep}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    if args.plot:
        _plots(Path(args.plot), sweep, cdfs, config, trace_name=str(info["trace"]))
    return 0


def resolve_setups(args: argparse.Namespace, policies: list[str]) -> dict[str, Setup]:
    """Per policy: its shipped defaults, under the tuned file's settings (if any), under the flags given."""
    flags = setups_from_flags(args, policies)
    tuned = load_tuned(args.tuned) if args.tuned else {}
    return {name: shipped(name, flags[name], tuned.get(name)) for name in policies}


def tuned_splits(path: str, workers: int) -> dict[str, tuple[int, int]]:
    """Per policy, the (prefill, decode) split `kairos tune` chose for it, where it searched the
    split on `workers` GPUs in all (a file tuned at a fixed split, or on another worker total,
    gives none: the run's --prefill/--decode hold)."""
    meta = json.loads(Path(path).read_text())  # load_tuned has checked it
    out: dict[str, tuple[int, int]] = {}
    for name, entry in meta["policies"].items():
        sp = entry.get("split") if isinstance(entry, dict) else None
        if isinstance(sp, dict) and sp.get("searched") and sp.get("prefill", 0) + sp.get("decode", 0) == workers:
            out[name] = (int(sp["prefill"]), int(sp["decode"]))
    return out


def _tuned_note(console: Console, args: argparse.Namespace, profile: str, policies: list[str]) -> None:
    """Say which policies the tuned file covers, and where it was tuned for another setting."""
    meta = json.loads(Path(args.tuned).read_text())  # load_tuned has checked it
    covered = [n for n in policies if n in meta["policies"]]
    rest = [n for n in policies if n not in covered]
    console.print(f"tuned settings from {args.tuned} for: {', '.join(covered) or 'none'}"
                  + (f"; flags and defaults for: {', '.join(rest)}" if rest else ""))
    cluster = f"{args.prefill}P{args.decode}D"
    splits = tuned_splits(args.tuned, args.prefill + args.decode)
    for key, here in (("profile", profile), ("cluster", cluster), ("trace", args.trace)):
        there = meta.get(key)
        if key == "cluster" and there is not None and splits:
            there = None if sum(int(x) for x in there.rstrip("D").split("P")) == args.prefill + args.decode else there
        if there is not None and there != here:
            console.print(f"[yellow]note: {args.tuned} was tuned for {key} {there}, this run uses {here}[/]")
    moved = {n: f"{p}P{d}D" for n, (p, d) in splits.items() if n in policies and (p, d) != (args.prefill, args.decode)}
    if moved:
        console.print("tuned splits (same worker total): " + ", ".join(f"{n} {c}" for n, c in moved.items()))


def _plots(folder: Path, sweep: list[dict[str, Any]], cdfs: list[tuple[float, dict[str, list[float]]]],
           config: dict[str, Any], *, trace_name: str) -> None:
    from sim import plots  # matplotlib is slow to import; only when asked

    folder.mkdir(parents=True, exist_ok=True)
    shape = f"{config['prefill']}P{config['decode']}D {config['profile']}"
    for scale, ttfts in cdfs:
        plots.ttft_cdf(ttfts, folder / f"ttft_cdf_x{scale:g}.png",
                       title=f"TTFT CDF, {trace_name} x{scale:g}, {shape}", ttft_slo=config["ttft_slo"])
    plots.attainment_vs_load(sweep, folder / "attainment_vs_load.png", title=f"{trace_name}, {shape}")


if __name__ == "__main__":
    sys.exit(main())
