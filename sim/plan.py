"""`kairos plan`: the fewest GPUs, the split and the settings that meet your SLO on your own traffic.

    kairos plan --trace my-traffic.jsonl --slo ttft=2s,tbt=100ms,attainment=90% --out plan.json
    kairos up --plan plan.json              # or the `kairos up ...` line it prints

Replays the trace (the JSON-lines or CSV format `kairos sim`, `kairos bench` and `kairos sessions`
read and write: common/traces.py) through the simulator, which runs the real router core, on
every candidate shape from the smallest GPU count up, and stops at the first count where a
candidate keeps the SLO: TTFT <= ttft and every inter-token gap <= tbt ("both-SLO") for at least
`attainment` of the requests. Candidates at N GPUs: Kairos at every split xPyD (x = 1 .. N-1),
once per --decode-room value (the decode guard), with its shipped knobs, and a chunked-prefill
pool on all N GPUs (0PnD; no prefill workers). The best --finalists candidates that meet the SLO
at the lowest count (by both-SLO attainment, then TBT attainment, then P95 TTFT) are replayed at
0.5 to 2 times the planned rate (the goodput curve), and the one with the highest goodput, read
off its curve by the fair evaluation's rule (sim/fair_report.py `goodput`: the highest rate
holding the attainment there and at every lower rate), is recommended: the most headroom.

The figures assume the fitted profile (--profile): the engine is taken to run each step in the
time the profile's model says. Give the error you expect (--step-noise 0.1, --step-scale 1.15,
as `kairos sim` takes them) and the plan is made, and the shape recommended, under it.

The result (--out, format "kairos-plan/1") feeds `kairos up --plan FILE`; the command prints the
equivalent `kairos up` flags, the compose variables and the Kubernetes (kustomize) values.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from common.config import ENV_PREFIX, env_text
from common.errors import ConfigError
from common.perf_model import Profile, load_profile
from common.traces import TraceRequest, load_trace, trace_path
from sim.cli import add_prefix_flags
from sim.core import SimConfig, simulate
from sim.fair_report import goodput
from sim.knobs import Setup, add_error_flags, build, error_settings, shipped
from sim.load import lower_bound
from sim.stats import fmt, json_safe, summarize

PLAN_FORMAT = "kairos-plan/1"
DEFAULT_SLO = "ttft=2s,tbt=100ms,attainment=90%"
CURVE = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # goodput curve: rate scales, multiples of the planned rate
PLAN_POLICIES = ("kairos", "chunked-prefill")
KEEP = ("requests", "rejected", "slo_attainment", "ttft_slo_attainment", "tbt_slo_attainment", "ttft_p50",
        "ttft_p95", "ttft_p99", "tbt_p99", "deflection_rate")
ASSUMES = "figures assume the fitted profile {profile} (each step takes what its model says{error}); {advice}"
ADVICE_EXACT = ("the engine departing from it changes them: plan again with --step-noise 0.1 or --step-scale 1.15 "
                "to keep a margin for model error")
ADVICE_ERROR = "the shape recommended meets the SLO under that error, in the simulator"


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    ttft: float        # seconds
    tbt: float         # seconds, every inter-token gap
    attainment: float  # fraction of requests that must meet both


_SLO_KEYS = {"ttft": "ttft", "tbt": "tbt", "attainment": "attainment", "both": "attainment"}
_SLO_SYNTAX = "expected --slo ttft=SECONDS,tbt=SECONDS,attainment=FRACTION, e.g. ttft=2s,tbt=100ms,attainment=90%"


def parse_slo(text: str) -> Slo:
    """`ttft=2s,tbt=100ms,attainment=90%` (units s or ms; attainment a fraction or a percentage;
    keys left out keep DEFAULT_SLO's values). ConfigError naming the syntax otherwise."""
    vals: dict[str, float] = {}
    for given, item in ((True, text), (False, DEFAULT_SLO)):
        for part in item.split(","):
            if not part.strip():
                continue
            key, eq, raw = part.partition("=")
            key, raw = key.strip().lower(), raw.strip().lower()
            if not eq or key not in _SLO_KEYS:
                raise ConfigError(f"--slo {text!r}: {part.strip()!r} is not KEY=VALUE with KEY ttft, tbt or "
                                  f"attainment; {_SLO_SYNTAX}")
            name = _SLO_KEYS[key]
            if name in vals:
                if given:
                    raise ConfigError(f"--slo {text!r}: {name} given twice; {_SLO_SYNTAX}")
                continue
            m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|%)?", raw)
            if m is None:
                raise ConfigError(f"--slo {text!r}: {key}={raw!r} is not a number; {_SLO_SYNTAX}")
            v, unit = float(m.group(1)), m.group(2)
            if name == "attainment":
                if unit in ("ms", "s"):
                    raise ConfigError(f"--slo {text!r}: attainment is a fraction or a percentage; {_SLO_SYNTAX}")
                v = v / 100.0 if unit == "%" or v > 1.0 else v
                if not 0.0 < v <= 1.0:
                    raise ConfigError(f"--slo {text!r}: attainment must be in (0, 100 %]; {_SLO_SYNTAX}")
            else:
                if unit == "%":
                    raise ConfigError(f"--slo {text!r}: {key} is a time (s or ms); {_SLO_SYNTAX}")
                v = v / 1000.0 if unit == "ms" else v
                if not (v > 0 and math.isfinite(v)):
                    raise ConfigError(f"--slo {text!r}: {key} must be a positive time; {_SLO_SYNTAX}")
            vals[name] = v
    return Slo(**vals)


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    prefill: int
    decode: int
    setup: Setup

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        room = self.setup.policy.get("decode_room")
        extra = "" if room is None else f", decode room {'on' if room else 'off'}"
        return f"{self.prefill}P{self.decode}D {self.policy}{extra}"


def candidates(gpus: int, policies: Sequence[str], decode_room: Sequence[bool]) -> list[Candidate]:
    """Every shape and setting tried at `gpus` GPUs: Kairos at each split, once per decode-room
    value; the chunked-prefill pool on them all."""
    out: list[Candidate] = []
    if "kairos" in policies:
        for room in decode_room:
            setup = shipped("kairos", Setup(policy={"decode_room": room}))
            out += [Candidate(policy="kairos", prefill=p, decode=gpus - p, setup=setup) for p in range(1, gpus)]
    if "chunked-prefill" in policies:
        pool = shipped("chunked-prefill", Setup())
        out.append(Candidate(policy="chunked-prefill", prefill=0, decode=gpus, setup=pool))
    return out


class Job(msgspec.Struct, frozen=True, kw_only=True):
    cand: Candidate
    trace: list[TraceRequest]
    profile: Profile
    sim: SimConfig
    rate_scale: float  # for the record only: the trace is already scaled
    seeds: tuple[int, ...] = ()  # model-error seeds, each run: the worst counts (empty: sim.seed alone)


def run_job(job: Job) -> dict[str, Any]:
    """One candidate on one (scaled) trace: the summary keys `KEEP`; with several seeds, the
    worst run's (by `rank`), and "seeds" the number of runs."""
    c = job.cand
    worst: dict[str, Any] | None = None
    for seed in job.seeds or (job.sim.seed,):
        policy, prof = build(c.policy, c.setup, job.profile)
        cfg = msgspec.structs.replace(job.sim, prefill=c.prefill, decode=c.decode, seed=seed)
        res = simulate(job.trace, prof, policy, cfg)
        s = summarize(res.records, ttft_slo=job.sim.ttft_slo, tbt_slo=job.sim.tbt_slo)
        if worst is None or rank(s) < rank(worst):
            worst = s
    assert worst is not None
    return {**{k: worst[k] for k in KEEP}, "seeds": len(job.seeds) or 1}


def pmap(fn: Callable[[Job], dict[str, Any]], items: list[Job], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ProcessPoolExecutor(max_workers=min(jobs, len(items))) as pool:
        return list(pool.map(fn, items))


def rank(s: dict[str, Any]) -> tuple[float, float, float]:
    """Higher is better: both-SLO attainment, then TBT attainment, then lower P95 TTFT."""
    p95 = s["ttft_p95"]
    return (s["slo_attainment"] or 0.0, s["tbt_slo_attainment"] or 0.0, -(math.inf if p95 is None else p95))


def meets(s: dict[str, Any], slo: Slo) -> bool:
    return (s["slo_attainment"] or 0.0) >= slo.attainment


def curve_scales(rate_scale: float) -> list[float]:
    return sorted({round(rate_scale * m, 6) for m in CURVE})


def plan(trace_at: Callable[[float], list[TraceRequest]], profile: Profile, sim: SimConfig, slo: Slo, *,
         rate_scale: float = 1.0, gpus: Sequence[int] = range(1, 9), policies: Sequence[str] = PLAN_POLICIES,
         decode_room: Sequence[bool] = (False, True), finals: int = 3, seeds: Sequence[int] = (), jobs: int = 1,
         log: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    """The search: GPU counts in order, every candidate at each, stop at the first count where
    one meets the SLO; then the goodput curves of the best `finals` candidates that meet it there,
    and the one with the highest goodput is chosen (ties: the ranking at the planned rate).
    `trace_at(x)` is the trace at rate scale x. Returns the plan's body (chosen None when no
    count tried meets the SLO)."""
    sim = msgspec.structs.replace(sim, ttft_slo=slo.ttft, tbt_slo=slo.tbt)
    trace = trace_at(rate_scale)
    if not trace:
        raise ConfigError("the trace (or the slice of it selected) holds no request")
    lb = lower_bound(trace, profile, ttft_slo=slo.ttft, tbt_slo=slo.tbt)
    counts: list[dict[str, Any]] = []
    finalists: list[tuple[Candidate, dict[str, Any]]] = []
    for n in sorted(set(gpus)):
        cands = candidates(n, policies, decode_room)
        if not cands:
            continue
        outs = pmap(run_job, [Job(cand=c, trace=trace, profile=profile, sim=sim, rate_scale=rate_scale,
                                  seeds=tuple(seeds)) for c in cands], jobs)
        rows = sorted(zip(cands, outs, strict=True), key=lambda co: rank(co[1]), reverse=True)
        best_c, best_s = rows[0]
        counts.append({"gpus": n, "best": entry(best_c, best_s), "meets": meets(best_s, slo),
                       "candidates": [entry(c, s) for c, s in rows]})
        log(f"{n} GPUs: best {best_c.name}, both-SLO {fmt(best_s['slo_attainment'], '%')}"
            f"{' (meets the SLO)' if meets(best_s, slo) else ''}")
        if meets(best_s, slo):
            finalists = [(c, s) for c, s in rows if meets(s, slo)][:max(1, finals)]
            break
    body: dict[str, Any] = {"requests": len(trace), "span_s": trace[-1].t - trace[0].t, "lower_bound": lb,
                            "per_gpu_count": counts, "chosen": None, "finalists": []}
    if not finalists:
        return body
    # the goodput curve of each finalist: the one that holds the SLO to the highest rate wins
    scales = curve_scales(rate_scale)
    here = round(rate_scale, 6)
    todo = [(i, x) for i in range(len(finalists)) for x in scales if x != here]
    log(f"goodput curves of {len(finalists)} shape(s) meeting the SLO at {finalists[0][0].gpus} GPUs: "
        f"rate x{', x'.join(f'{x:g}' for x in scales)}")
    outs = pmap(run_job, [Job(cand=finalists[i][0], trace=trace_at(x), profile=profile, sim=sim, rate_scale=x,
                              seeds=tuple(seeds)) for i, x in todo], jobs)
    done: list[dict[str, Any]] = []
    for i, (c, at_rate) in enumerate(finalists):
        by_scale = {x: o for (j, x), o in zip(todo, outs, strict=True) if j == i} | {here: at_rate}
        sweep = [{"rate_scale": x, "policies": {"this": by_scale[x]}} for x in scales]
        gp, _ = goodput({"sweep": sweep}, "this")
        done.append({**entry(c, at_rate), "goodput_rate_scale": gp,
                     "curve": [{"rate_scale": x, **by_scale[x]} for x in scales]})
    order = sorted(range(len(done)), key=lambda i: (done[i]["goodput_rate_scale"] or 0.0, rank(finalists[i][1])),
                   reverse=True)
    body["chosen"] = done[order[0]]
    body["finalists"] = [done[i] for i in order]
    return body


def entry(c: Candidate, s: dict[str, Any]) -> dict[str, Any]:
    return {"name": c.name, "gpus": c.gpus, "prefill": c.prefill, "decode": c.decode, "policy": c.policy,
            "engine": {k: v for k, v in msgspec.structs.asdict(c.setup.engine).items() if v},
            "knobs": dict(c.setup.policy), "summary": s}


# ------------------------------------------------------------------------------ what the plan feeds


def up_args(chosen: dict[str, Any], profile: str) -> list[str]:
    """The `kairos up` flags that run the chosen shape and settings (the shipped ones left implicit)."""
    args = ["--prefill", str(chosen["prefill"]), "--decode", str(chosen["decode"]), "--policy", chosen["policy"],
            "--profile", profile]
    room = chosen["knobs"].get("decode_room")
    if room is not None:
        args += ["--decode-room", "on" if room else "off"]
    return args


def plan_setup(chosen: dict[str, Any]) -> Setup:
    """The chosen candidate's engine settings and knobs, as `kairos up --plan` applies them."""
    try:
        return msgspec.convert({"engine": chosen.get("engine", {}), "policy": chosen.get("knobs", {})}, Setup)
    except (msgspec.ValidationError, ValueError, AttributeError) as e:
        raise ConfigError(f"the plan's settings are not valid: {e}") from e


def load_plan(path: str) -> dict[str, Any]:
    """A file `kairos plan --out` wrote, with a recommended shape; ConfigError otherwise."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read plan {p}: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"{p} is not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ConfigError(f"{p} is not a file written by `kairos plan --out` (format {PLAN_FORMAT})")
    chosen = data.get("chosen")
    if not isinstance(chosen, dict):
        raise ConfigError(f"{p} recommends no shape: no GPU count tried met the SLO (plan again with more "
                          "--gpus or a looser --slo)")
    for key, typ in (("prefill", int), ("decode", int), ("policy", str)):
        if not isinstance(chosen.get(key), typ):
            raise ConfigError(f"{p}: chosen.{key} is missing or not a {typ.__name__}")
    plan_setup(chosen)
    return data


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def deploy_text(chosen: dict[str, Any], profile: str) -> dict[str, list[str]]:
    """What to put where for compose and Kubernetes: the `.env` lines, the compose override's
    environment entries, and the kustomize replicas and TOML lines."""
    plan_setup(chosen)  # bad values: a clear error now
    knobs = chosen["knobs"]
    engine = chosen["engine"]
    env = [f"KAIROS_POLICY={chosen['policy']}", f"KAIROS_PROFILE={profile}"]
    router_env = [f"{ENV_PREFIX}{k.upper()}: {json.dumps(env_text(v))}" for k, v in knobs.items()]
    worker_env = [f"{ENV_PREFIX}{k.upper()}: {json.dumps(env_text(v))}" for k, v in engine.items()]
    p, d = chosen["prefill"], chosen["decode"]
    compose = ["# docker-compose.override.yml (Compose merges it with docker-compose.yml)", "services:",
               "  router:", "    environment:", *[f"      {e}" for e in router_env]]
    for name in [f"prefill-{i}" for i in range(min(p, 2))] + [f"decode-{i}" for i in range(min(d, 2))]:
        if worker_env:
            compose += [f"  {name}:", "    environment:", *[f"      {e}" for e in worker_env]]
    if (p, d) != (2, 2):
        compose += [f"# the compose files run 2 prefill + 2 decode workers; this plan is {p}P{d}D: "
                    "run it with `kairos up` or Kubernetes, or add/remove worker services (each new worker id "
                    "needs its bus key: docs/deployment.md, \"Bus keys\")"]
    kustomize = ["# kustomization.yaml of your overlay (new worker ids need bus keys first: docs/deployment.md, "
                 "\"Scale a pool\")", "replicas:", "  - name: prefill", f"    count: {p}", "  - name: decode",
                 f"    count: {d}",
                 "# router.toml", f"policy = \"{chosen['policy']}\"", f"profile = \"{profile}\"",
                 *[f"{k} = {_toml(v)}" for k, v in knobs.items()],
                 "# worker.toml", f"profile = \"{profile}\"", *[f"{k} = {_toml(v)}" for k, v in engine.items()]]
    return {"env": env, "compose_override": compose, "kustomize": kustomize}


# ------------------------------------------------------------------------------ CLI


def _gpus(text: str) -> list[int]:
    """`1-8`, `4`, or `2,4,6`."""
    out: list[int] = []
    try:
        for part in text.split(","):
            if not part.strip():
                continue
            lo, dash, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    except ValueError:
        raise ConfigError(f"--gpus must be a count, a range or a list (e.g. 1-8, 4, 2,4,6), got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--gpus must list GPU counts >= 1, got {text!r}")
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos plan", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("your traffic")
    t.add_argument("--trace", required=True,
                   help="your trace: JSON lines (timestamp ms, input_length, output_length, optional hash_ids: what "
                        "`kairos sessions` writes and `kairos bench` replays) or an Azure-style CSV; or the name of a "
                        "bundled Azure 2023 trace: code or conv")
    t.add_argument("--start", type=float, default=0.0, help="slice start, seconds of trace time (default 0)")
    t.add_argument("--duration", type=float, default=None, help="slice length, seconds (default: to the end)")
    t.add_argument("--rate-scale", type=float, default=1.0,
                   help="plan for the trace at this multiple of its rate, e.g. 1.5 for 50 %% growth (default 1)")
    s = p.add_argument_group("the target")
    s.add_argument("--slo", default=DEFAULT_SLO,
                   help=f"TTFT and TBT (largest gap) targets and the share of requests that must meet both "
                        f"(default {DEFAULT_SLO.replace('%', '%%')})")
    c = p.add_argument_group("the search")
    c.add_argument("--gpus", default="1-8",
                   help="worker counts tried, lowest first, as a range (1-8), one count (4) or a list (2,4,6) "
                        "(default 1-8); the plan calls them GPUs, but each is one engine of --profile "
                        "(h100-llama2-70b-tp4: four H100s with tensor parallel size 4)")
    c.add_argument("--policy", action="append", choices=PLAN_POLICIES, default=None,
                   help="kairos at every split xPyD and/or chunked-prefill on all GPUs (0PnD); repeat (default both)")
    c.add_argument("--decode-room", default="off,on",
                   help="kairos's decode guard values tried: on, off or both as off,on (default off,on)")
    c.add_argument("--profile", default="h100-llama2-70b-tp4",
                   help="performance profile name or .json path: the engine the plan is for (default "
                        "h100-llama2-70b-tp4)")
    c.add_argument("--finalists", type=int, default=3, metavar="K",
                   help="shapes meeting the SLO at the lowest GPU count whose goodput curves are compared (default 3)")
    c.add_argument("--seed", type=int, default=0, help="--step-noise seed (default 0)")
    c.add_argument("--noise-seeds", type=int, default=1, metavar="N",
                   help="with --step-noise (or stragglers, slow periods): run every candidate with N seeds from "
                        "--seed and judge it by its worst run, so the plan holds beyond one draw of the noise "
                        "(N times the time; default 1)")
    c.add_argument("--jobs", type=int, default=max(1, min(4, len(os.sched_getaffinity(0)))),
                   help="simulations in parallel processes (default: the CPUs, at most 4)")
    add_prefix_flags(c)
    add_error_flags(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="write the plan here (JSON, for `kairos up --plan FILE`)")
    o.add_argument("--quiet", action="store_true", help="no tables on the terminal")
    return p


def _rooms(text: str) -> tuple[bool, ...]:
    vals = [x.strip().lower() for x in text.split(",") if x.strip()]
    if not vals or any(v not in ("on", "off") for v in vals):
        raise ConfigError(f"--decode-room must be on, off or off,on, got {text!r}")
    return tuple(dict.fromkeys(v == "on" for v in vals))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(quiet=args.quiet)
    if not console.is_terminal:
        console = Console(quiet=args.quiet, width=160)
    try:
        return _run(args, console)
    except (ConfigError, ValueError) as e:
        print(f"kairos plan: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    t0 = time.monotonic()
    slo = parse_slo(args.slo)
    gpus = _gpus(args.gpus)
    rooms = _rooms(args.decode_room)
    if args.jobs < 1 or args.finalists < 1 or args.noise_seeds < 1:
        raise ConfigError("--jobs, --finalists and --noise-seeds must be >= 1")
    if args.rate_scale <= 0 or not math.isfinite(args.rate_scale):
        raise ConfigError("--rate-scale must be a positive number")
    path = trace_path(args.trace)
    profile = load_profile(args.profile)
    err = error_settings(args)
    sim = SimConfig(ttft_slo=slo.ttft, tbt_slo=slo.tbt, seed=args.seed, prefix_cache=args.prefix_cache == "on",
                    hash_block_tokens=args.hash_block_tokens, **err)
    policies = list(dict.fromkeys(args.policy or PLAN_POLICIES))
    random_error = err["step_noise"] > 0 or err["straggler_p"] > 0 or err["slow_every_s"] > 0
    if args.noise_seeds > 1 and not random_error:
        raise ConfigError("--noise-seeds needs random model error (--step-noise, --straggler-p or --slow-every): "
                          "without it every seed gives the same run")
    seeds = tuple(range(args.seed, args.seed + args.noise_seeds)) if args.noise_seeds > 1 else ()

    def trace_at(x: float) -> list[TraceRequest]:
        return load_trace(path, start=args.start, duration=args.duration, rate_scale=x)

    def log(msg: str) -> None:
        console.print(f"[dim][{time.monotonic() - t0:5.0f} s][/] {msg}")

    body = plan(trace_at, profile, sim, slo, rate_scale=args.rate_scale, gpus=gpus, policies=policies,
                decode_room=rooms, finals=args.finalists, seeds=seeds, jobs=args.jobs, log=log)
    error_text = ", ".join(f"{k} {v}" for k, v in err.items()
                           if k in ("step_noise", "step_scale", "worker_speed", "straggler_p", "slow_every_s")
                           and v not in (0.0, 1.0, ()))
    if seeds:
        error_text += f", each candidate judged by the worst of {len(seeds)} seeds"
    assumes = ASSUMES.format(profile=profile.name, error=f", times the injected error: {error_text}" if error_text
                             else "; no model error injected", advice=ADVICE_ERROR if error_text else ADVICE_EXACT)
    result: dict[str, Any] = {
        "format": PLAN_FORMAT, "trace": args.trace, "start": args.start, "duration": args.duration,
        "rate_scale": args.rate_scale, "profile": profile.name,
        "slo": msgspec.structs.asdict(slo), "model_error": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in err.items()},
        "seed": args.seed, "noise_seeds": args.noise_seeds, "prefix_cache": args.prefix_cache, "gpus_tried": gpus,
        "policies": policies,
        "decode_room": list(rooms), "curve_multiples": list(CURVE), "assumes": assumes,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), **body}
    chosen = body["chosen"]
    if chosen is not None:
        result["kairos_up"] = "kairos up " + " ".join(up_args(chosen, profile.name))
        result["deploy"] = deploy_text(chosen, profile.name)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    _report(console, result, slo)
    if args.out:
        console.print(f"wrote {args.out}" + (f"; start it with: kairos up --plan {args.out}" if chosen else ""))
    return 0 if chosen is not None else 1


def _pct(x: float | None) -> str:
    return fmt(x, "%")


def _report(console: Console, res: dict[str, Any], slo: Slo) -> None:
    head = (f"{res['trace']} x{res['rate_scale']:g}: {res['requests']} requests over {res['span_s']:.0f} s, "
            f"{res['profile']}; SLO: TTFT <= {slo.ttft:g} s and every gap <= {slo.tbt * 1000:g} ms for "
            f"{slo.attainment:.0%} of requests")
    tab = Table(title=head + "\nbest shape per GPU count", title_justify="left")
    for col in ("GPUs", "best shape and settings", "both SLOs", "TTFT SLO", "TBT SLO", "TTFT p95 s", "rejected",
                "meets"):
        tab.add_column(col, justify="left" if col == "best shape and settings" else "right")
    for row in res["per_gpu_count"]:
        s = row["best"]["summary"]
        tab.add_row(str(row["gpus"]), row["best"]["name"], _pct(s["slo_attainment"]), _pct(s["ttft_slo_attainment"]),
                    _pct(s["tbt_slo_attainment"]), fmt(s["ttft_p95"]), str(s["rejected"]),
                    "yes" if row["meets"] else "no")
    console.print(tab)
    lb = res["lower_bound"]
    chosen = res["chosen"]
    if chosen is None:
        tried = res["gpus_tried"]
        console.print(f"[red]no shape of {tried[0]}-{tried[-1]} GPUs meets the SLO[/] (an idle cluster would meet "
                      f"the TTFT SLO for {_pct(lb['ttft_slo_attainment'])} of these prompts); try more --gpus or "
                      "a looser --slo")
        console.print(f"note: {res['assumes']}")
        return
    curve = Table(title=f"goodput curve of {chosen['name']} (rate scale: multiples of the trace's own rate)",
                  title_justify="left")
    for col in ("rate x", "both SLOs", "TTFT SLO", "TBT SLO", "TTFT p95 s", "TBT p99 ms", "rejected"):
        curve.add_column(col, justify="right")
    for pt in chosen["curve"]:
        curve.add_row(f"{pt['rate_scale']:g}", _pct(pt["slo_attainment"]), _pct(pt["ttft_slo_attainment"]),
                      _pct(pt["tbt_slo_attainment"]), fmt(pt["ttft_p95"]), fmt(pt["tbt_p99"], "ms"),
                      str(pt["rejected"]))
    console.print(curve)
    if len(res["finalists"]) > 1:
        console.print(f"shapes meeting the SLO on {chosen['gpus']} GPUs, by goodput: " + "; ".join(
            f"{f['name']} " + ("below the lowest rate" if f["goodput_rate_scale"] is None
                               else f"x{f['goodput_rate_scale']:g}")
            for f in res["finalists"]), soft_wrap=True)
    gp = chosen["goodput_rate_scale"]
    console.print(f"recommended: {chosen['name']} ({chosen['gpus']} GPUs): both SLOs for "
                  f"{_pct(chosen['summary']['slo_attainment'])} of requests at x{res['rate_scale']:g}; goodput "
                  + ("below the lowest rate tried" if gp is None else f"x{gp:g}")
                  + f" (the highest rate of the curve holding {slo.attainment:.0%} there and below)")
    nxt = [pt for pt in chosen["curve"] if pt["rate_scale"] > res["rate_scale"]]
    if nxt and (gp is None or gp <= res["rate_scale"]):
        up = nxt[0]
        more = up["rate_scale"] / res["rate_scale"] - 1.0
        console.print(f"[yellow]headroom under {more:.0%}:[/] at x{up['rate_scale']:g} it keeps "
                      f"{_pct(up['slo_attainment'])}; "
                      f"plan with --rate-scale {up['rate_scale']:g} for a shape that keeps the SLO under that "
                      "much more traffic", soft_wrap=True)
    console.print(f"note: {res['assumes']}")
    console.print("\nkairos up:\n  " + res["kairos_up"], soft_wrap=True)
    d = res["deploy"]
    console.print("\ncompose (.env beside docker-compose.yml):\n  " + "\n  ".join(d["env"]), soft_wrap=True)
    console.print("  " + "\n  ".join(d["compose_override"]), soft_wrap=True, markup=False)
    console.print("\nKubernetes (kustomize):\n  " + "\n  ".join(d["kustomize"]), soft_wrap=True, markup=False)


if __name__ == "__main__":
    sys.exit(main())
