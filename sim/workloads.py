"""The workloads of `python -m sim.fair_eval` (docs/results.md sections 1, 5 and 7): what each
replays, the rate scales its load probe tries, its tune and report slices, its cluster shape
and the policies compared on it.

    code, conv, conv-2p2d   the Azure 2023 traces, trace time [0, 600) s tune, [600, 1200) s report
    long, bursty            synthetic (common/traces.py), seed 0 tune, seed 1 report, 600 s each
    chat, agent             multi-turn sessions with shared prefixes (common/sessions.py, as
                            `kairos sessions --kind chat --rate 2 --duration 900 --seed 0` and
                            `--kind agent --rate 0.5`), prefix caching on; sessions start at 0, so
                            both slices come after the first turns' ramp: [200, 450) s tune,
                            [450, 700) s report, as docs/results.md section 5
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from common.sessions import sessions
from common.traces import LENGTHS, TraceRequest, load_trace, synthetic, trace_path

POLICIES = ("kairos", "conditional-disagg", "disagg-least-loaded", "chunked-prefill")
# the session workloads add kv-aware: Dynamo's KV router cost, the baseline built for prefix reuse
SESSION_POLICIES = ("kairos", "kv-aware", "conditional-disagg", "disagg-least-loaded", "chunked-prefill")
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


def load(w: Workload, which: tuple[float, float] | int, scale: float) -> list[TraceRequest]:
    """One slice of a workload at `scale` x its rate: a seed of a synthetic one, else a window of
    trace time [start, end), re-based on its start."""
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
