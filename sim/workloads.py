"""The workloads of `python -m sim.fair_eval` (docs/results/: method.md, sessions.md, model-error.md): what each
replays, the rate scales its load probe tries, its tune and report slices, its cluster shape
and the policies compared on it.

    code, conv, conv-2p2d   the Azure 2023 traces, trace time [0, 600) s tune, [600, 1200) s report
    long, bursty            synthetic (common/traces.py), seed 0 tune, seed 1 report, 600 s each
    chat, agent             multi-turn sessions with shared prefixes (common/sessions.py, as
                            `kairos sessions --kind chat --rate 2 --duration 900 --seed 0` and
                            `--kind agent --rate 0.5`), prefix caching on; sessions start at 0, so
                            both slices come after the first turns' ramp: [200, 450) s tune,
                            [450, 700) s report, as docs/results/sessions.md
    shift, shift-code       traffic whose mix shifts every PHASE_S seconds (`shifting` below):
                            shift: synthetic phases (prompt-heavy, output-heavy, code-like
                            bursts) in an order drawn from the seed, seed 10 tune, seed 11 report;
                            shift-code: the Azure code trace's own windows alternating with
                            output-heavy phases, trace time [0, 600) s (seed 10) tune,
                            [600, 1200) s (seed 11) report; both 600 s, 2P2D

Held out (UNSEEN below; `python -m sim.shipped_eval` runs them, `make fair-eval` does not): two
shifting workloads made after issue 44's tuning to check its claim on traffic it never saw
(`scheduled` below; docs/results/decode-bottleneck.md, "Unseen shifting workloads"):

    shift-ramp              synthetic phases of 60, 120 and 300 s in a fixed order not in
                            `shift`, with a 300 s output-heavy phase whose rate ramps from
                            x0.3 to x1.3 and a phase mixing prompt- and output-heavy traffic;
                            seed 20 tune, seed 21 report
    shift-conv              the Azure conv trace's windows (x2 its rate) spliced with output-heavy
                            phases of 60 and 180 s (the second a ramp); conv trace time from
                            1200 s (seed 20) tune, from 2400 s (seed 21) report (the conv
                            workloads use [0, 1200) s; any other seed: from 0 s)
"""

from __future__ import annotations

import bisect
import functools
import random
from dataclasses import dataclass, field
from typing import Any

from common.sessions import sessions
from common.traces import LENGTHS, TraceRequest, load_trace, synthetic, trace_path

POLICIES = ("kairos", "conditional-disagg", "disagg-least-loaded", "chunked-prefill")
# the session workloads add kv-aware: Dynamo's KV router cost, the baseline built for prefix reuse
SESSION_POLICIES = ("kairos", "kv-aware", "conditional-disagg", "disagg-least-loaded", "chunked-prefill")
# the shifting workloads add the Dynamo-style threshold planner (sim/knobs.py PLANNED): the baseline
# that moves workers between roles as the mix shifts
SHIFT_POLICIES = (*POLICIES, "dynamo-planner")
ALL_POLICIES = (*SESSION_POLICIES, "dynamo-planner")  # every policy some workload compares
SYNTH_DURATION = 600.0


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    trace: str                       # code, conv, synthetic or sessions
    probe: tuple[float, ...]         # rate scales probed for the regime
    synth: dict[str, Any] = field(default_factory=dict)  # synthetic: rate, arrival, cv, lengths; sessions: kind,
    #                                                     rate, duration, seed
    tune: tuple[float, float] | int = (0.0, 600.0)
    report: tuple[float, float] | int = (600.0, 1200.0)
    prefill: int = 2                 # the disaggregated shape; chunked-prefill gets prefill + decode
    decode: int = 2
    policies: tuple[str, ...] = POLICIES
    # a regime load fixed in advance (used unless --regime sets one), where the probe's rule does
    # not fit the workload; None: the probe's rule
    regime: float | None = None
    regime_by_profile: tuple[tuple[str, float], ...] = ()  # ... for a profile whose steps are slower
    regime_why: str = ""
    # the report rates, multiples of the regime (fair_eval's SWEEP unless set; 1 must be among them)
    sweep: tuple[float, ...] | None = None

    def fixed_regime(self, profile: str) -> float | None:
        """The regime fixed in advance for this profile (None: the probe's rule decides)."""
        return dict(self.regime_by_profile).get(profile, self.regime)


def _session(kind: str, rate: float, probe: tuple[float, ...], regime: float, a100: float, title: str) -> Workload:
    return Workload(kind, title, "sessions", probe, {"kind": kind, "rate": rate, "duration": 900.0, "seed": 0},
                    tune=(200.0, 450.0), report=(450.0, 700.0), policies=SESSION_POLICIES, regime=regime,
                    # the A100's steps are slower: about a third of the H100's rate, as for the code trace
                    # (docs/results.md 7.5; at the H100's rates every policy keeps at most 5.6 % there)
                    regime_by_profile=(("a100-llama2-70b-tp4", a100),),
                    # finer than SWEEP: these workloads go from served to overloaded within x1.5 the regime
                    sweep=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
                    regime_why="section 5's rate: the highest tried there at which no policy rejected a request with "
                               "its default settings; the probe's rule counts whole prompts, not the cache hits")


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("code", "Azure code trace (bursty)", "code", (0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0)),
    # conv's outputs (median 150 tokens) load the decode pool: on 2P2D it reaches its TBT limit at
    # the load where the prefill pool saturates (x3), so the regime is on 1P3D; 2P2D is kept
    Workload("conv", "Azure conv trace (near-Poisson), 1P3D", "conv", (1.0, 1.5, 2.0, 2.5, 3.0), prefill=1, decode=3),
    Workload("conv-2p2d", "Azure conv trace (near-Poisson), 2P2D", "conv", (1.0, 2.0, 2.5, 2.75, 3.0, 4.0)),
    Workload("long", "long-context synthetic (prompts 4k-32k, Poisson, 0.5 req/s at x1)", "synthetic",
             (0.25, 0.5, 0.75, 1.0, 1.5, 2.0), {"rate": 0.5, "arrival": "poisson", "cv": 1.0, "lengths": "long"},
             tune=0, report=1),
    Workload("bursty", "bursty synthetic (on/off MMPP, code lengths, 2.57 req/s at x1)", "synthetic",
             (0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0), {"rate": 2.57, "arrival": "onoff", "cv": 2.2, "lengths": "code"},
             tune=0, report=1),
    # the mix shifts every PHASE_S: output-heavy phases load the decode pool past what two decode
    # workers step within the TBT SLO, prompt-heavy ones the prefill pool; the regime is fixed
    # (the probe's rule looks at the prefill pool alone, which is not what these phases stress)
    Workload("shift", "shifting mix (phases of long prompts, long answers, code bursts), 2P2D", "shift",
             (0.5, 0.75, 1.0, 1.25), {"phases": ("prompt", "output", "burst"), "seeds": (10, 11)},
             tune=10, report=11, regime=1.0, sweep=(0.5, 0.75, 1.0, 1.25, 1.5), policies=SHIFT_POLICIES,
             regime_why="fixed: the synthetic phases' rates are set so that x1 loads each pool at its "
                        "phase (sim/workloads.py PHASES)"),
    Workload("shift-code", "Azure code trace windows alternating with output-heavy phases, 2P2D", "shift",
             (0.5, 0.75, 1.0, 1.25), {"phases": ("code", "output"), "seeds": (10, 11)},
             tune=10, report=11, regime=1.0, sweep=(0.5, 0.75, 1.0, 1.25, 1.5), policies=SHIFT_POLICIES,
             regime_why="fixed: as shift; the code windows at x0.35 (the code workload's H100 regime)"),
    _session("chat", 2.0, (0.375, 0.5, 0.75, 1.0), 0.75, 0.25,
             "multi-turn chat sessions (2 sessions/s at x1, prefix caching on)"),
    _session("agent", 0.5, (0.125, 0.25, 0.375, 0.5), 0.25, 0.08,
             "agentic loops (0.5 loops/s at x1, contexts up to 32k, prefix caching on)"),
)}


@functools.lru_cache(maxsize=4)
def session_trace(kind: str, rate: float, duration: float, seed: int) -> tuple[TraceRequest, ...]:
    """`kairos sessions`'s trace, with its times rounded as its file stores them (milliseconds to
    three decimals), so that replaying the file and this give the same requests."""
    return tuple(TraceRequest(t=round(r.t * 1000.0, 3) / 1000.0, input_length=r.input_length,
                              output_length=r.output_length, hash_ids=r.hash_ids)
                 for r in sessions(kind, rate=rate, duration=duration, seed=seed))


# Phases of the shifting workloads at x1: (requests/s, arrival, cv, lengths). Output-heavy: short
# prompts (median ~400 tokens), long answers (mean ~500): at 8 req/s about 4,000 output tokens/s,
# more than two decode workers step within a 100 ms TBT on the H100 profile (~190 decodes of
# ~1k context each: ~1,900 tokens/s per worker), less than three or four. Prompt-heavy: prompts
# of 2k-16k tokens (median ~4k), answers of ~20, bursty (gamma, cv 2).
PHASES: dict[str, tuple[float, str, float, dict[str, float]]] = {
    "prompt": (2.0, "gamma", 2.0, {"prompt_mu": 8.3, "prompt_sigma": 0.5, "min_prompt": 2048, "max_prompt": 16384,
                                   "output_mu": 3.0, "output_sigma": 0.7, "max_output": 256}),
    "output": (8.0, "poisson", 1.0, {"prompt_mu": 6.0, "prompt_sigma": 0.8, "max_prompt": 4096,
                                     "output_mu": 6.1, "output_sigma": 0.5, "max_output": 2000}),
    "burst": (2.57, "onoff", 2.2, dict(LENGTHS["code"])),
}
PHASE_S = 150.0
# trace phases: the Azure trace's own requests at this multiple of its rate (code: its H100 regime)
TRACE_PHASES = {"code": 0.35, "conv": 2.0}


def shifting(phases: tuple[str, ...], seed: int, *, duration: float = SYNTH_DURATION, phase_s: float = PHASE_S,
             window: tuple[float, float] | None = None) -> list[TraceRequest]:
    """A trace whose mix changes every `phase_s` seconds, deterministic from `seed`: each phase is
    one of `phases` (PHASES, or a trace in TRACE_PHASES: that Azure trace's own requests from
    trace time `window`'s start on, at its TRACE_PHASES multiple of its rate). With a trace among
    them the kinds alternate in the order given; otherwise each phase's kind is drawn from the
    seed, never the same twice in a row. Each synthetic phase is its own synthetic trace (seed x 1000 + phase index)."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    n = int(duration // phase_s)
    kind = ""
    cursor = {k: (window or (0.0, duration))[0] for k in TRACE_PHASES}
    for i in range(n):
        if any(k in TRACE_PHASES for k in phases):
            kind = phases[i % len(phases)]
        else:
            kind = rng.choice([k for k in phases if k != kind])
        t0 = i * phase_s
        if kind in TRACE_PHASES:
            # phase_s seconds of the trace's own traffic at x`scale`: phase_s x scale seconds of trace
            # time, from the first request at or after where the trace's last phase ended (the
            # traces have quiet minutes: a phase never falls in one)
            x = TRACE_PHASES[kind]
            whole = _whole_trace(kind)
            j = bisect.bisect_left([r.t for r in whole], cursor[kind])
            start = whole[j].t if j < len(whole) else cursor[kind]
            cursor[kind] = start + phase_s * x
            got = [TraceRequest(t=(r.t - start) / x, input_length=r.input_length, output_length=r.output_length)
                   for r in whole[j:] if r.t < cursor[kind]]
        else:
            rate, arrival, cv, lengths = PHASES[kind]
            got = synthetic(rate=rate, duration=phase_s, arrival=arrival, cv=cv, seed=seed * 1000 + i,
                            **lengths)  # type: ignore[arg-type]
        out += [TraceRequest(t=t0 + r.t, input_length=r.input_length, output_length=r.output_length) for r in got]
    return out


# A held-out workload's schedule: (kind, seconds, rate multiple at the phase's start, at its end).
# kind: a PHASES kind, a TRACE_PHASES trace, or "a+b" (both superposed). A multiple that changes
# over the phase is a linear ramp (arrivals thinned from the phase's peak rate).
Schedule = tuple[tuple[str, float, float, float], ...]
RAMP_SCHEDULE: Schedule = (("burst", 60.0, 1.0, 1.0), ("output", 300.0, 0.3, 1.3), ("prompt", 60.0, 1.0, 1.0),
                           ("prompt+output", 120.0, 0.6, 0.6), ("output", 60.0, 1.0, 1.0))
CONV_SCHEDULE: Schedule = (("conv", 120.0, 1.0, 1.0), ("output", 60.0, 1.0, 1.0), ("conv", 60.0, 1.0, 1.0),
                           ("output", 180.0, 0.5, 1.2), ("conv", 180.0, 1.0, 1.0))


def scheduled(schedule: Schedule, seed: int, *, trace_start: float = 0.0) -> list[TraceRequest]:
    """A trace whose phases follow `schedule` (kind, seconds, rate multiple at start, at end),
    deterministic from `seed`. A synthetic phase i is PHASES[kind] (seed x 1000 + i; a second kind
    of the same phase seed x 1000 + 500 + i) at the multiple, a ramp thinned from the phase's peak
    multiple with a linearly changing keep probability. A trace phase is that Azure trace's own
    requests at its TRACE_PHASES multiple, continuing from `trace_start` (trace time) phase after
    phase, as in `shifting` (no ramp: its multiple must be 1)."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    cursor = dict.fromkeys(TRACE_PHASES, trace_start)
    t0 = 0.0
    for i, (kind, secs, m0, m1) in enumerate(schedule):
        got: list[TraceRequest] = []
        for j, part in enumerate(kind.split("+")):
            if part in TRACE_PHASES:
                if m0 != 1.0 or m1 != 1.0:
                    raise ValueError(f"a trace phase ({part}) takes no rate multiple")
                x = TRACE_PHASES[part]
                whole = _whole_trace(part)
                k = bisect.bisect_left([r.t for r in whole], cursor[part])
                start = whole[k].t if k < len(whole) else cursor[part]
                cursor[part] = start + secs * x
                got += [TraceRequest(t=(r.t - start) / x, input_length=r.input_length,
                                     output_length=r.output_length) for r in whole[k:] if r.t < cursor[part]]
                continue
            rate, arrival, cv, lengths = PHASES[part]
            peak = max(m0, m1)
            drawn = synthetic(rate=rate * peak, duration=secs, arrival=arrival, cv=cv, seed=seed * 1000 + 500 * j + i,
                              **lengths)  # type: ignore[arg-type]
            got += [r for r in drawn if rng.random() < (m0 + (m1 - m0) * r.t / secs) / peak]
        got.sort(key=lambda r: r.t)
        out += [TraceRequest(t=t0 + r.t, input_length=r.input_length, output_length=r.output_length) for r in got]
        t0 += secs
    return out


@functools.lru_cache(maxsize=2)
def _whole_trace(name: str) -> tuple[TraceRequest, ...]:
    return tuple(load_trace(trace_path(name)))


def load(w: Workload, which: tuple[float, float] | int, scale: float) -> list[TraceRequest]:
    """One slice of a workload at `scale` x its rate: a seed of a synthetic one, else a window of
    trace time [start, end), re-based on its start. A shifting workload's slice is a seed (its
    code windows: the tune slice [0, 600) s of trace time, the report slice [600, 1200) s)."""
    if w.trace == "scheduled":
        seed = int(which) if isinstance(which, int) else int(which[0])
        sched: Schedule = w.synth["schedule"]
        start = w.synth["trace_start"][w.synth["seeds"].index(seed)] if seed in w.synth["seeds"] else 0.0
        return [TraceRequest(t=r.t / scale, input_length=r.input_length, output_length=r.output_length)
                for r in scheduled(sched, seed, trace_start=start)]
    if w.trace == "shift":
        seed = int(which) if isinstance(which, int) else int(which[0])
        window = (0.0, SYNTH_DURATION) if seed == w.synth["seeds"][0] else (SYNTH_DURATION, 2 * SYNTH_DURATION)
        return [TraceRequest(t=r.t / scale, input_length=r.input_length, output_length=r.output_length)
                for r in shifting(tuple(w.synth["phases"]), seed, window=window)]
    if isinstance(which, int):
        base = synthetic(rate=w.synth["rate"], duration=SYNTH_DURATION, arrival=w.synth["arrival"],
                         cv=w.synth["cv"], seed=which, **LENGTHS[w.synth["lengths"]])  # type: ignore[arg-type]
        return [TraceRequest(t=r.t / scale, input_length=r.input_length, output_length=r.output_length)
                for r in base]
    start, end = which
    if w.trace == "sessions":
        s = w.synth
        return [TraceRequest(t=(r.t - start) / scale, input_length=r.input_length, output_length=r.output_length,
                             hash_ids=r.hash_ids)
                for r in session_trace(s["kind"], s["rate"], s["duration"], s["seed"]) if start <= r.t < end]
    return load_trace(trace_path(w.trace), start=start, duration=end - start, rate_scale=scale)


# Held out: not in WORKLOADS, so `make fair-eval` and every committed result are as before.
UNSEEN: dict[str, Workload] = {w.name: w for w in (
    Workload("shift-ramp", "unseen: phases of 60-300 s, an output ramp x0.3 -> x1.3, a mixed phase, 2P2D", "scheduled",
             (0.5, 0.75, 1.0, 1.25), {"schedule": RAMP_SCHEDULE, "seeds": (20, 21), "trace_start": (0.0, 0.0)},
             tune=20, report=21, regime=1.0, sweep=(0.5, 0.75, 1.0, 1.25, 1.5), policies=SHIFT_POLICIES,
             regime_why="fixed nominally; the held-out check picks its load from the baselines"),
    Workload("shift-conv", "unseen: Azure conv trace windows (x2) spliced with output-heavy phases, 2P2D",
             "scheduled", (0.5, 0.75, 1.0, 1.25),
             {"schedule": CONV_SCHEDULE, "seeds": (20, 21), "trace_start": (1200.0, 2400.0)},
             tune=20, report=21, regime=1.0, sweep=(0.5, 0.75, 1.0, 1.25, 1.5), policies=SHIFT_POLICIES,
             regime_why="fixed nominally; the held-out check picks its load from the baselines"),
)}
EVAL_WORKLOADS: dict[str, Workload] = {**WORKLOADS, **UNSEEN}  # what `python -m sim.shipped_eval` can run
