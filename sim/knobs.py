"""Each policy's settings as one value: the engine settings (token budgets) and the policy's own
knobs, plus the cluster shape it runs on. `kairos sim` builds them from flags or from a file
written by `kairos tune` (`--tuned`), and the same code turns them into a policy and a profile.

A tuned file (JSON):
    {"format": "kairos-tuned/1", "trace": ..., "profile": ..., "rate_scale": ..., "objective": ...,
     "slices": {"tune": [start, end], "report": [start, end]},
     "policies": {NAME: {"engine": {"decode_token_budget": 640, ...},
                         "policy": {"alpha": 1.3, ...},
                         "tune": {summary}, "report": {summary}, "evaluated": N}}}
Only "policies" -> NAME -> "engine" and "policy" are read back; the rest is the record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec

from common.engines.settings import EngineSettings
from common.engines.step_error import TARGET
from common.errors import ConfigError
from common.perf_model import PerfModel, Profile
from common.policy import (
    NO_PREFILL_POLICIES,
    POLICIES,
    ConditionalConfig,
    KairosConfig,
    KvAwareConfig,
    Policy,
    make_policy,
)
from sim.state import SimConfig

TUNED_FORMAT = "kairos-tuned/1"

# the config type of each policy that has knobs of its own (the others have only engine settings)
POLICY_KNOBS: dict[str, type[msgspec.Struct]] = {"kairos": KairosConfig, "conditional-disagg": ConditionalConfig,
                                                 "kv-aware": KvAwareConfig}


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    engine: EngineSettings = EngineSettings()
    policy: dict[str, Any] = {}

    def merged(self, over: Setup) -> Setup:
        """`over`'s settings where it sets them, else these."""
        e = msgspec.structs.asdict(self.engine)
        e.update({k: v for k, v in msgspec.structs.asdict(over.engine).items() if v})
        return Setup(engine=EngineSettings(**e), policy={**self.policy, **over.policy})


# Simulator-only baselines: a routing policy of the registry run with a role planner on router 0
# (the live router runs no planner). name -> (routing policy, SimConfig.planner_rule).
PLANNED: dict[str, tuple[str, str]] = {
    # NVIDIA Dynamo's documented planner rule (common/router_core/planner.py ThresholdPlanner) over
    # Dynamo-style disaggregated least-loaded routing
    "dynamo-planner": ("disagg-least-loaded", "threshold"),
}
SIM_POLICIES: tuple[str, ...] = (*POLICIES, *PLANNED)


def routing(name: str) -> str:
    """The registry policy that routes for `name` (itself, or a planned baseline's)."""
    return PLANNED[name][0] if name in PLANNED else name


def planner_rule(name: str) -> str | None:
    """The role planner a planned baseline runs with (None: none of its own)."""
    return PLANNED[name][1] if name in PLANNED else None


def with_planner(name: str, sim: SimConfig) -> SimConfig:
    """`sim` with the planner a planned baseline runs with (unchanged for any other policy)."""
    rule = planner_rule(name)
    return msgspec.structs.replace(sim, planner=True, planner_rule=rule) if rule else sim


def shape(policy: str, prefill: int, decode: int) -> tuple[int, int]:
    """The cluster a policy runs on for a comparison at the same GPU count: a policy that uses
    no prefill worker gets every worker as a decode worker (2P2D -> 0P4D)."""
    if routing(policy) in NO_PREFILL_POLICIES:
        return 0, prefill + decode
    return prefill, decode


def policy_config(name: str, knobs: dict[str, Any]) -> msgspec.Struct | None:
    cls = POLICY_KNOBS.get(name)
    if cls is None:
        if knobs:
            raise ConfigError(f"policy {name!r} has no knobs of its own (got {', '.join(sorted(knobs))}); "
                              "tune it with the token budgets")
        return None
    unknown = set(knobs) - set(cls.__struct_fields__)
    if unknown:
        raise ConfigError(f"{name}: unknown knob(s) {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(cls.__struct_fields__)}")
    try:
        return msgspec.convert({**msgspec.structs.asdict(cls()), **knobs}, cls)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"{name}: invalid knob value: {e}") from e


def build(name: str, setup: Setup, profile: Profile, default_model: PerfModel | None = None
          ) -> tuple[Policy, Profile]:
    """The policy object and the profile (with the engine settings applied) of one setup."""
    cfg = policy_config(name, setup.policy)
    try:
        policy = make_policy(routing(name), kairos=cfg if isinstance(cfg, KairosConfig) else None,
                             conditional=cfg if isinstance(cfg, ConditionalConfig) else None,
                             kv_aware=cfg if isinstance(cfg, KvAwareConfig) else None,
                             default_model=default_model or profile.model)
        return policy, setup.engine.apply(profile)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from e


def knob_values(name: str, setup: Setup) -> dict[str, Any]:
    """Every knob of the policy as it will run (defaults included), for reports."""
    cfg = policy_config(name, setup.policy)
    if cfg is None:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in msgspec.structs.asdict(cfg).items()}


def load_tuned(path: str) -> dict[str, Setup]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read tuned settings {p}: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"{p} is not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != TUNED_FORMAT or not isinstance(data.get("policies"), dict):
        raise ConfigError(f"{p} is not a file written by `kairos tune` (format {TUNED_FORMAT})")
    out: dict[str, Setup] = {}
    for name, entry in data["policies"].items():
        try:
            setup = msgspec.convert({"engine": entry.get("engine", {}), "policy": entry.get("policy", {})}, Setup)
        except (msgspec.ValidationError, ValueError, AttributeError) as e:
            raise ConfigError(f"{p}: policy {name!r}: {e}") from e
        policy_config(name, setup.policy)  # unknown knobs: a clear error now
        out[name] = setup
    return out


# ------------------------------------------------------------------------------ flags
# shared by `kairos sim` and `kairos up`


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine settings (default: the profile's)")
    e.add_argument("--prefill-token-budget", type=int, default=None, metavar="N",
                   help="prefill workers: tokens per step (vLLM max_num_batched_tokens)")
    e.add_argument("--decode-token-budget", type=int, default=None, metavar="N",
                   help="decode workers: tokens per step, decodes plus in-place prefill chunks")
    e.add_argument("--decode-chunk", type=int, default=None, metavar="N",
                   help="decode workers: largest chunk of one in-place prefill per step when the router gives "
                        "no chunk schedule (conditional-disagg, chunked-prefill; vLLM long_prefill_token_threshold)")


def add_error_flags(p: argparse.ArgumentParser) -> None:
    """Model error injected into the simulated engine (common/engines/step_error.py): the policy
    predicts with the profile, the engine runs otherwise."""
    e = p.add_argument_group("model error: how the simulated engine departs from its profile (default: not at all)")
    e.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA",
                   help="sigma of a mean-1 lognormal error on every executed step, e.g. 0.1 for ~10%% (default 0)")
    e.add_argument("--step-scale", type=float, default=1.0, metavar="F",
                   help="every step takes F x the profile's time: 1.15 = an engine 15%% slower than profiled")
    e.add_argument("--worker-speed", default="", metavar="F,F,...",
                   help="per-worker step time factors, prefill workers first, then decode (cycled): a mixed fleet")
    e.add_argument("--slow-every", type=float, default=0.0, metavar="S",
                   help="mean seconds between a worker's slow periods (0: none)")
    e.add_argument("--slow-for", type=float, default=1.0, metavar="S", help="mean length of a slow period (default 1)")
    e.add_argument("--slow-factor", type=float, default=1.5, metavar="F", help="step time factor when slow (1.5)")
    e.add_argument("--straggler-p", type=float, default=0.0, metavar="P", help="fraction of steps that straggle")
    e.add_argument("--straggler-factor", type=float, default=3.0, metavar="F",
                   help="step time factor of a straggling step (default 3)")
    e.add_argument("--closed-loop", choices=("on", "off"), default="on",
                   help="decode workers measure their step error and cut in-place chunks to keep gaps within the "
                        "TBT SLO (default on; off: the router's plan alone, as before)")
    e.add_argument("--overrun-target", type=float, default=TARGET, metavar="P",
                   help="the chance of a step over the TBT SLO a worker reads its measured error margin at "
                        "(default %(default)g); a step beside an in-place prefill chunk is planned for the smaller "
                        "of this and 2e-5, as a decode-only step: it holds every running decode (issue 44)")
    e.add_argument("--bias-correction", choices=("on", "off"), default="on",
                   help="routers scale each worker's model by the median step error its heartbeats report, so "
                        "TTFT predictions and chunk costs follow what the engine really does (default on)")


def error_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SimConfig fields of `add_error_flags`; ConfigError for bad values."""
    from common.engines.step_error import StepError, parse_speeds

    try:
        out: dict[str, Any] = {
            "step_noise": args.step_noise, "step_scale": args.step_scale,
            "worker_speed": parse_speeds(args.worker_speed), "slow_every_s": args.slow_every,
            "slow_for_s": args.slow_for, "slow_factor": args.slow_factor, "straggler_p": args.straggler_p,
            "straggler_factor": args.straggler_factor}
        StepError(noise=out["step_noise"], scale=out["step_scale"], speeds=out["worker_speed"],
                  slow_every_s=out["slow_every_s"], slow_for_s=out["slow_for_s"], slow_factor=out["slow_factor"],
                  straggler_p=out["straggler_p"], straggler_factor=out["straggler_factor"])
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not 0.0 < args.overrun_target < 0.5:
        raise ConfigError(f"--overrun-target must be in (0, 0.5), got {args.overrun_target}")
    out["closed_loop"] = args.closed_loop == "on"
    out["overrun_target"] = args.overrun_target
    out["bias_correction"] = args.bias_correction == "on"
    return out


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    k = p.add_argument_group("kairos knobs (defaults: as shipped, what compose and Kubernetes run)")
    k.add_argument("--alpha", type=float, default=None, help="deflect iff TTFT_D <= alpha x TTFT_P (default 1.6)")
    k.add_argument("--beta", type=float, default=None, help="TBT budget = beta x strictest TBT SLO (default 0.9)")
    k.add_argument("--candidates", default=None,
                   help="chunk candidates, comma separated (default 2048,1024,512,256,128)")
    k.add_argument("--no-transfer-term", action="store_true", default=None, help="leave T_xfer out of TTFT_P")
    k.add_argument("--max-deflections", type=int, default=None,
                   help="concurrent in-place prefills per decode worker (default 4; the paper's is 1)")
    k.add_argument("--predictor", choices=("replay", "paper"), default=None,
                   help="TTFT prediction: replay (the workers' known queues through their batching rule) or paper "
                        "(Equation 1 and Algorithm 1's step sum as printed) (default replay)")
    k.add_argument("--no-budget-fit", action="store_true", default=None,
                   help="chunk schedules ignore the decode token budget taken by deflections in flight")
    k.add_argument("--share-expect", action="store_true", default=None,
                   help="replay predictor: count the tokens later requests add to a prompt's last prefill step")
    k.add_argument("--late-binding", choices=("on", "off"), default=None,
                   help="hold a request at the router while the prefill queues are deep and no decode worker can "
                        "take it, and dispatch it when one frees room (default on)")
    k.add_argument("--decode-room", choices=("on", "off"), default=None,
                   help="keep a request at the router while every decode worker's decode step, with it added, "
                        "would pass the less of --decode-beta x its residents' TBT SLO and that SLO / the "
                        "worker's measured margin, on both paths (default on)")
    k.add_argument("--decode-beta", type=float, default=None, metavar="F",
                   help="decode room: plan decode-only steps to F x the strictest resident TBT SLO, or less where the "
                        "worker's measured margin asks for less (default 0.95)")
    k.add_argument("--retain", choices=("on", "off"), default=None,
                   help="the third path: a request no decode worker has room for is decoded by a prefill worker "
                        "itself, its prefill chunks cut to its decodes' TBT SLO (default on)")
    k.add_argument("--late-depth", type=float, default=None, metavar="N",
                   help="late binding: hold while the chosen prefill worker has N token budgets queued (default 1)")
    k.add_argument("--late-order", choices=("short", "slack", "fifo"), default=None,
                   help="late binding: decide waiting requests again first those that can still meet the TTFT SLO, "
                        "the shortest prefill first among them (short), those first by arrival (slack), or all by "
                        "arrival (fifo) (default short)")
    k.add_argument("--no-prefix-aware", action="store_true", default=None,
                   help="price every prompt whole, ignoring the prefix-cache hits the router knows of")
    k.add_argument("--overlap-weight", type=float, default=None,
                   help="kv-aware: weight of a worker's uncached prompt tokens against its load (default 1)")
    c = p.add_argument_group("conditional-disagg knobs: prefill locally iff short prompt OR busy prefill worker")
    c.add_argument("--isl-threshold", type=int, default=None, metavar="TOKENS",
                   help="a prompt below this many uncached tokens is short (default 2048; 0: that half off)")
    c.add_argument("--isl-ratio-threshold", type=float, default=None, metavar="R",
                   help="... and only if uncached/prompt < R (Dynamo's 0.7 needs prefix-cache hits; default 1: off)")
    c.add_argument("--prefill-busy-threshold", type=float, default=None, metavar="X",
                   help="a prefill worker is busy above X token budgets queued (default 2)")
    c.add_argument("--decode-busy-threshold", type=float, default=None, metavar="F",
                   help="never prefill on a decode worker whose KV is more than F used (default 0.9)")


# What a policy runs with when nothing is given: its shipped engine settings and knobs (the
# profile's and the config class's for the others; RouterConfig's defaults match these knobs).
# Kairos's come from the evaluation under model error (docs/results.md, "Defaults"): its
# decode workers need token budget beside their decodes for in-place chunks, and smaller prefill
# steps keep the prefill queues' TTFT predictable.
SHIPPED: dict[str, Setup] = {"kairos": Setup(engine=EngineSettings(prefill_token_budget=2048, decode_token_budget=2048),
                                             policy={"alpha": 1.6, "late_binding": True, "decode_room": True,
                                                     "decode_beta": 0.95, "retain": True, "retain_chunk": 64})}


def setups_from_flags(args: argparse.Namespace, policies: list[str]) -> dict[str, Setup]:
    """The settings each policy gets from the command line (only what was given; `shipped` adds the rest)."""
    engine = EngineSettings(prefill_token_budget=args.prefill_token_budget or 0,
                            decode_token_budget=args.decode_token_budget or 0, decode_chunk=args.decode_chunk or 0)
    given = {
        "kairos": {"alpha": args.alpha, "beta": args.beta, "max_deflections": args.max_deflections,
                   "candidates": None if args.candidates is None else
                   parse_candidates(args.candidates),
                   "transfer_term": None if args.no_transfer_term is None else not args.no_transfer_term,
                   "predictor": args.predictor,
                   "budget_fit": None if args.no_budget_fit is None else not args.no_budget_fit,
                   "share_expect": args.share_expect,
                   "late_binding": None if args.late_binding is None else args.late_binding == "on",
                   "late_depth": args.late_depth, "late_order": args.late_order,
                   "decode_room": None if args.decode_room is None else args.decode_room == "on",
                   "decode_beta": args.decode_beta,
                   "retain": None if args.retain is None else args.retain == "on",
                   "prefix_aware": None if args.no_prefix_aware is None else not args.no_prefix_aware},
        "kv-aware": {"overlap_weight": args.overlap_weight},
        "conditional-disagg": {"eff_isl_threshold": args.isl_threshold,
                               "eff_isl_ratio_threshold": args.isl_ratio_threshold,
                               "prefill_busy_threshold": args.prefill_busy_threshold,
                               "decode_busy_threshold": args.decode_busy_threshold}}
    return {name: Setup(engine=engine, policy={k: v for k, v in given.get(name, {}).items() if v is not None})
            for name in policies}


def shipped(name: str, flags: Setup, tuned: Setup | None = None) -> Setup:
    """What policy `name` runs with: its shipped defaults, under a tuned file's settings, under
    the flags given."""
    base = SHIPPED.get(name, Setup())
    if tuned is not None:
        base = base.merged(tuned)
    return base.merged(flags)


def parse_candidates(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--candidates must be comma-separated token counts, got {text!r}") from None
    if not vals:
        raise ConfigError("--candidates is empty")
    return vals
