"""The simulator's settings (`SimConfig`) and its state of each request and worker (sim/core.py
runs the events on them, sim/router.py the router side): what a request went through, each
worker's engine (the real batching class) and step in flight.

Each simulated worker is a shell around the live worker's own core (common/worker_core/:
`DecodeCore`, `PrefillCore`), as services/*_worker/ are live: the core composes its Hello and
heartbeats, admits or refuses its work and keeps its ledgers; the shell implements the core's
ports on the simulated engine (`start`: the request joins the `Batcher`; `beat_now`: a prompt
heartbeat; `send`: a RequestFailed goes back to the router replica that sent the work) and
reports the engine's load (`EngineLoad`) from the `Batcher`, as common/engines/sim.py does live."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from common import messages as m
from common.engines.base import EngineLoad, EngineRequest
from common.engines.batcher import Batcher, Seq, StepPlan
from common.engines.step_error import TARGET, StepError, StepErrorEstimator
from common.perf_model import PerfModel
from common.worker_core import DecodeCore, EngineInfo, PrefillCore, WorkerCore
from sim.stats import RequestTiming


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    prefill: int = 2
    decode: int = 2
    ttft_slo: float = 2.0
    tbt_slo: float = 0.1
    heartbeat_interval: float = 0.1
    ledger: bool = True
    step_noise: float = 0.0   # sigma of a mean-1 lognormal factor on every executed step time
    step_scale: float = 1.0   # every executed step takes this times the model's time (the engine slower or faster)
    worker_speed: tuple[float, ...] = ()  # per-worker factors (prefill workers first, then decode; cycled)
    slow_every_s: float = 0.0  # mean seconds between a worker's slow periods (0: none; common/engines/step_error.py)
    slow_for_s: float = 1.0    # mean length of a slow period
    slow_factor: float = 1.5   # step time factor in a slow period
    straggler_p: float = 0.0   # fraction of steps that straggle
    straggler_factor: float = 3.0  # step time factor of a straggler
    closed_loop: bool = True   # decode workers measure their step error and cut chunks to it (ChunkGuard)
    overrun_target: float = TARGET  # ... the margin read at this chance (steps beside chunks: DECODE_TARGET at most)
    bias_correction: bool = True  # routers scale each worker's model by its measured step bias (heartbeats)
    seed: int = 0
    kv_wait_timeout: float = 30.0  # seconds a request may wait for KV room before it is rejected
    kv_wait_max: int = 1024        # requests waiting for KV room before new ones are rejected at once (as the router)
    # the router's admission shedding (RouterConfig.queue_budget; common/router_core/admission.py): off by
    # default here, so that a run measures what queueing does to every request of the trace
    queue_budget: float = -1.0
    prefix_cache: bool = True      # per-worker prefix caches and the router's prefix index (traces with hash_ids)
    hash_block_tokens: int = 512   # prompt tokens per trace hash_ids entry: the cache's block size
    routers: int = 1               # router replicas, requests assigned round-robin, each with its own ledger
    admission: bool = True         # decode workers check every deflection against their live state
    held_list: bool = True         # decode heartbeats list the deflections held, by router (routers add the others')
    # several routers take turns this far apart at room a heartbeat shows (RouterConfig.replica_stagger_ms); 0: at once
    replica_stagger_ms: float = 3.0
    prompt_beat: float = 0.002  # a worker also heartbeats this long after its state changes (live: 2 ms); < 0: never
    # with several routers, a worker's heartbeat "at once" (it took work) comes this much later: live's
    # relay (replica -> worker -> heartbeat -> replica: the bus and two processes' wake-ups on a loaded
    # host, P50 2-8 ms and P90 4-11 ms on the shared 2-core VM, docs/results/router-replicas.md); 0: at once
    relay: float = 0.0
    # the role planner (common/router_core/planner.py), run by router 0: workers move between the
    # prefill and decode roles as the load asks; a flip drains the worker (it takes no new work and
    # finishes what it holds), then its engine is out `planner_switch_s` seconds and rejoins under the
    # new role with an empty prefix cache (its measured step error kept: the same GPU). None: as the
    # router ships it (RouterConfig.planner, on) for Kairos, off for the baselines (fixed splits);
    # True / False: on / off whatever the policy
    planner: bool | None = None
    # which: "roles" (Kairos's, RolePlanner) or "threshold" (a Dynamo-style baseline, ThresholdPlanner)
    planner_rule: str = "roles"
    planner_switch_s: float = 2.0
    # a flip keeps the worker's running decodes (common/worker_core `set_role(keep=True)`): they go on
    # stepping through the drain and the switch and the new role's core takes them over; the drain
    # waits only for what the new role cannot do, and for `planner_switch_s` after it the worker
    # takes no new work (False: it finishes them first, and its engine is out meanwhile)
    planner_keep: bool = True
    planner_pinned: tuple[str, ...] = ()
    # the router's own periods x this: the role planner's interval, window, dwell, gap between flips
    # and flip timeout (RouterConfig.planner_*_s). `kairos sim --time-scale K` sets it with the rest of a
    # scenario K times slower (steps, SLOs, arrivals, heartbeats: sim/cli.py `stretched`), as
    # `bench.live_vs_sim --time-scale K` sets the live router's
    time_scale: float = 1.0
    # the router's configured TBT delivery allowance (RouterConfig.tbt_delivery_allowance_ms;
    # common/router_core/delivery.py): steps are planned to the TBT SLO less it. The measured part
    # is 0 here (no HTTP layer writes tokens), so a run compares with a live router given the same
    # configured allowance. Not scaled by time_scale (a wall-clock delay)
    tbt_delivery_allowance_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("need at least one decode worker and a non-negative number of prefill workers")
        if self.heartbeat_interval < 0 or self.step_noise < 0:
            raise ValueError("heartbeat_interval and step_noise must be >= 0")
        if self.kv_wait_timeout < 0 or self.kv_wait_max < 0:
            raise ValueError("kv_wait_timeout and kv_wait_max must be >= 0")
        if self.hash_block_tokens < 1:
            raise ValueError("hash_block_tokens must be >= 1")
        if self.routers < 1:
            raise ValueError("need at least one router")
        if self.planner_rule not in ("roles", "threshold"):
            raise ValueError(f"planner_rule must be roles or threshold (got {self.planner_rule!r})")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not self.tbt_delivery_allowance_ms >= 0:
            raise ValueError("tbt_delivery_allowance_ms must be >= 0")
        if self.planner_switch_s < 0:
            raise ValueError("planner_switch_s must be >= 0")
        if not 0.0 < self.overrun_target < 0.5:
            raise ValueError("overrun_target must be in (0, 0.5)")
        self.step_error()  # validates

    def step_error(self) -> StepError:
        return StepError(noise=self.step_noise, scale=self.step_scale, speeds=self.worker_speed,
                         slow_every_s=self.slow_every_s, slow_for_s=self.slow_for_s, slow_factor=self.slow_factor,
                         straggler_p=self.straggler_p, straggler_factor=self.straggler_factor)


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    arrival: float
    prompt: int
    output: int
    route: str | None = None
    reason: str = ""
    decode_worker: str = ""
    router: int = 0               # which router replica it arrived at
    attempt: int = 0              # its router's attempt number (a worker's refusal makes another)
    ttft_pred: float | None = None
    waited: float = -1.0          # arrival to leaving the router's KV wait queue (-1: never waited)
    waiting: bool = False         # in its router's wait queue now
    was_held: bool = False        # the policy held it at the router at some point (late binding)
    rejected: bool = False
    prefill_started: float = -1.0
    prefilled: float = -1.0
    xfer: float = -1.0
    first: float = -1.0
    last: float = -1.0
    done: float = -1.0
    ntok: int = 0
    hashes: list[int] | None = None  # the prompt's block hashes (from the trace's hash_ids)
    cached: int = 0                  # prompt tokens its prefill skipped (prefix-cache hit)
    gaps: array = field(default_factory=lambda: array("d"))  # type: ignore[type-arg]

    def timing(self) -> RequestTiming:
        """What the run reports of it."""
        r = self
        if r.route is None or r.first < 0:
            return RequestTiming(ttft=None, route=r.route, reason=r.reason, prompt_tokens=r.prompt,
                                 rejected=r.rejected, wait_s=r.waited if r.waited >= 0 else None)
        return RequestTiming(
            ttft=r.first - r.arrival, tbt_gaps=r.gaps, route=r.route, reason=r.reason, prompt_tokens=r.prompt,
            output_tokens=r.ntok, e2e=r.done - r.arrival,
            queue_s=r.prefill_started - r.arrival if r.prefill_started >= 0 else None,
            prefill_s=r.prefilled - r.prefill_started if r.prefill_started >= 0 and r.prefilled >= 0 else None,
            xfer_s=r.xfer - r.prefilled if r.xfer >= 0 else None, ttft_pred=r.ttft_pred,
            wait_s=r.waited if r.waited >= 0 else None)


INCARNATION = "sim"  # every simulated worker's incarnation: none restarts


def router_name(i: int) -> str:
    """Router replica `i`'s incarnation, as decode workers' held lists name it."""
    return f"router-{i}"


MODEL = "sim"  # the served model name every simulated worker registers with


def _no_beat(w: Worker, at_once: bool = False) -> None:
    return None


def _no_start(w: Worker) -> None:
    return None


class Worker:
    """A simulated worker: the live worker's core, and the shell that runs it on the simulated
    engine (see the module docstring). The core's ports are this object's `send`, `start`,
    `abort`, `beat_now`, `router_of` and `release_kv`."""

    __slots__ = ("batcher", "beat_at", "bias", "busy", "busy_s", "core", "estimator", "hb", "kv_capacity",
                 "max_batch", "model", "next_hb", "now", "on_beat", "on_start", "outbox", "phase", "plan", "reqs",
                 "retired", "token_budget", "until", "view_model", "wid")

    core: WorkerCore

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float) -> None:
        self.wid = wid
        self.batcher = batcher
        self.model = model
        # what its Hello tells the routers (its engine's settings; the router side reads these, not the engine)
        self.token_budget = batcher.token_budget
        self.max_batch = batcher.max_batch
        self.kv_capacity = batcher.kv_capacity
        self.now = 0.0  # the simulated clock at the call into the core in progress
        self.outbox: list[m.Msg] = []  # what the core sent (RequestFailed), for the router shell to deliver
        self.reqs: dict[str, Req] = {}  # work the core may start, by request id
        # the simulation's prompt heartbeat (sim/core.py), and whether without the coalescing delay
        self.on_beat: Callable[[Worker, bool], None] = _no_beat
        self.on_start: Callable[[Worker], None] = _no_start  # ... and its step loop, when a request joins
        self.busy = False
        self.busy_s = 0.0
        self.phase = phase
        self.next_hb = phase
        self.hb: m.PrefillHeartbeat | m.DecodeHeartbeat | None = None  # its last (sim/core.py _snapshot), each
        # router acknowledging its own dispatches in it (`last_dispatch`, sim/router.py)
        self.plan: StepPlan | None = None  # the step in flight
        self.until = 0.0  # when it ends, as the worker's model predicts (without the noise)
        self.beat_at = -1.0   # a prompt heartbeat due then (-1: none)
        self.estimator: StepErrorEstimator | None = None  # its measured step error (None: not measured)
        # the bias its last heartbeat reported, as routers take it (bias_factor), and its model scaled by
        # it: what a deflection's DecodeWork carries (`model_bias`), the worker's admission check plans with
        self.bias = 1.0
        self.view_model = model
        self.retired = False  # it changed role: this object is gone (sim/core.py `_rejoin` made its successor)

    def info(self) -> EngineInfo:
        return EngineInfo(engine="sim", token_budget=self.token_budget, kv_capacity_tokens=self.kv_capacity,
                          max_batch=self.max_batch)

    def hello(self) -> m.Hello:
        """What it registers with (the core's Hello). No coefficients: routers predict it with the profile."""
        return self.core.hello()

    @property
    def role(self) -> m.Role:
        return self.core.role

    # -- the core's ports -----------------------------------------------------------------
    def send(self, msg: m.Msg) -> None:
        self.outbox.append(msg)

    def take_sent(self) -> list[m.Msg]:
        sent, self.outbox = self.outbox, []
        return sent

    def start(self, req: EngineRequest) -> bool:
        r = self.reqs.pop(req.request_id)
        handoff = req.mode == "handoff"
        seq = Seq(request_id=req.request_id, attempt=req.attempt, prompt_len=r.prompt, max_tokens=r.output,
                  tbt_slo=req.tbt_slo, schedule=deque(req.chunk_schedule) if req.chunk_schedule else None,
                  deflected=req.mode == "deflect", computed=r.prompt if handoff else 0,
                  arrived=r.arrival if handoff else self.now, user=r, hashes=r.hashes, retain=req.mode == "retain")
        # the core admitted it: there is room
        if (self.role == "decode" or seq.retain) and not self.batcher.can_admit(seq):
            raise RuntimeError(f"simulated {self.role} worker {self.wid} started {req.request_id} without KV room")
        self.batcher.add(seq)
        self.on_start(self)
        return True

    def abort(self, request_id: str) -> None:
        self.batcher.remove(request_id)

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        return self.batcher.lower_tbt_slo(request_id, tbt_slo)

    def beat_now(self, at_once: bool = False) -> None:
        self.on_beat(self, at_once)

    def router_of(self, request_id: str) -> str:
        r = self.reqs.get(request_id)
        if r is None:
            seq = self.batcher.get(request_id)
            r = seq.user if seq is not None else None  # type: ignore[assignment]
        return router_name(r.router) if r is not None else ""

    def release_kv(self, key: str) -> None:
        """Simulated KV lands without reserved blocks."""

    def busy_for(self, now: float) -> float:
        """Until the step in flight ends, as heartbeats report it (0 when idle)."""
        return max(0.0, self.until - now) if self.busy else 0.0

    def step_bias(self) -> float:
        return self.estimator.bias() if self.estimator is not None else 1.0

    def heartbeat(self, now: float) -> m.PrefillHeartbeat | m.DecodeHeartbeat:
        """Its heartbeat at `now`, the core's (`last_dispatch` is each router's, set as it reaches it)."""
        raise NotImplementedError

    def load(self, now: float) -> EngineLoad:
        """The simulated engine's report of itself at `now`, as common/engines/sim.py makes it live
        (its recent step time: a moving average here, the median of its last steps live)."""
        raise NotImplementedError


class PrefillWorker(Worker):
    __slots__ = ()

    core: PrefillCore

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float) -> None:
        super().__init__(wid, batcher, model, phase)
        self.core = PrefillCore(wid, INCARNATION, self.info(), self, model=MODEL)

    def load(self, now: float) -> EngineLoad:
        guard = self.batcher.guard  # its retained decodes' chunk guard (route "retain"), when it has one
        return self.batcher.load(kv_capacity_tokens=self.kv_capacity, inflight=self.plan if self.busy else None,
                                 busy_s=self.busy_for(now), step_bias=self.step_bias(),
                                 step_margin=guard.estimator.margin() if guard is not None else 1.0)

    def heartbeat(self, now: float) -> m.PrefillHeartbeat:
        """The core's: its queue, and its own replay of it (its model)."""
        return self.core.heartbeat(self.load(now), self.model)


class DecodeWorker(Worker):
    __slots__ = ("step_s",)

    core: DecodeCore

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float, *, admission: bool = True,
                 list_held: bool = True) -> None:
        super().__init__(wid, batcher, model, phase)
        # admission: it checks each deflection against its live state (SimConfig.admission); list_held: its
        # heartbeats list the deflections it holds (SimConfig.held_list). The simulated KV always lands, so
        # a handoff's KV deadline (kv_handoff_timeout) never passes.
        self.core = DecodeCore(wid, INCARNATION, self.info(), self, model=MODEL, deflect_admission=admission,
                               list_held=list_held)
        self.step_s = 0.0  # recent step time (moving average), as heartbeats report it

    def prefix_cached(self, r: Req) -> int:
        """Prompt tokens of `r` its prefix cache holds now, as the `Batcher` finds them when it is added."""
        cache = self.batcher.cache
        if cache is None or not r.hashes:
            return 0
        return max(0, min(cache.match(r.hashes) * cache.block_tokens, r.prompt - 1))

    def load(self, now: float) -> EngineLoad:
        guard = self.batcher.guard
        return self.batcher.load(kv_capacity_tokens=self.kv_capacity, inflight=self.plan if self.busy else None,
                                 busy_s=self.busy_for(now), step_ms_p50=self.step_s * 1000.0,
                                 # without the closed loop (no chunk guard) it plans with no margin, and says so
                                 step_margin=guard.estimator.margin() if guard is not None else 1.0,
                                 step_bias=self.step_bias())

    def heartbeat(self, now: float) -> m.DecodeHeartbeat:
        """The core's: the engine's load, the KV kept for handoffs whose KV has not landed, the
        deflections it holds."""
        return self.core.heartbeat(self.load(now))


class Level:
    """A queue's length over time: its maximum and its time-weighted mean."""

    __slots__ = ("area", "max", "n", "t")

    def __init__(self) -> None:
        self.n = self.max = 0
        self.area = self.t = 0.0

    def add(self, now: float, delta: int) -> None:
        self.area += self.n * (now - self.t)
        self.t = now
        self.n += delta
        if self.n > self.max:
            self.max = self.n

    def report(self, end: float) -> dict[str, float]:
        area = self.area + self.n * (end - self.t)
        return {"max": self.max, "mean": area / end if end > 0 else 0.0}
