"""The role planner: moves one worker at a time between the prefill and decode roles when the
measured load over the last minute says the other role is the bottleneck (issue 44 item 3).

Socket-free and clock-free, like the rest of the router core. The router core holds it
(`RouterCore.planner`, set by the shell that runs it) and ticks it (`RouterCore.plan_roles`,
every `interval_s` seconds, on the router that leads): `measure` builds a `Load` from the
router's worker table and wait queue, `RolePlanner.observe(load, now)` returns the `Flip` to
make, or None, and the core sends the worker a SetRole. The worker drains what the role change
would break, switches and says Hello again under its new role; that Hello ends the flip
(`rejoined`). Every decision, and every flip held back by a rule while the load asked for one,
is a log line with its reason and the figures it was made from (`role_flip`, `role_flip_held`,
`role_flip_done`). The simulator runs this on its router 0; the live router's core runs it on its
tick (`RouterCore.tick`) when RouterConfig.planner is on, with the settings `planner_config` reads
from RouterConfig, the one source of them for both.

The rules (`PlannerConfig`, defaults in brackets):
- Evidence is the samples of the last `window_s` [30 s] taken since the last flip ended (a flip
  changes the load; the planner judges the new shape on its own samples only), and at least
  half a window of them.
- Toward decode when the decode pool is short: requests waited for decode room or KV, or prefill
  workers decoded requests themselves (route retain: no decode worker could take them; nothing
  waits then and the guard keeps the steps short, so this is the shortage's only sign), in at
  least `wait_hi` [20 %] of the samples (a request late binding held for a prefill worker while
  the prefill queues were under `queue_lo` of the TTFT SLO counts as waiting for decode: it was
  held because no decode worker had room to prefill it in place), or the decode step used at
  least `step_hi` [0.9] of the TBT SLO's room above the step's fixed cost (a lone sequence's step:
  the weights read every step, which no batch size changes; the SLO less the router's delivery
  allowance, the budget steps are planned to: `tbt_budget`) on average over the window or over
  its last `recent` [0.34: two of six samples] share (a decode load that rises is judged as it
  is now); and the prefill pool can spare a worker: requests waited for a
  prefill worker in at most `wait_lo` [5 %] of the samples, and the predicted prefill queue,
  scaled to one prefill worker fewer, is at most `queue_lo` [0.25] of the TTFT SLO.
- Toward prefill when the prefill pool is short (the queue at >= `queue_hi` [0.5] of the TTFT
  SLO on average, or prefill waits in >= `wait_hi` of the samples with the queue at >= `queue_lo`
  on average: a burst whose queue is short on average is absorbed by decode workers prefilling in
  place, and a worker moved for it drains its decodes only to be needed back) and the decode pool
  can spare a worker (decode waits, retained decodes included, in <= `wait_lo`, the step, judged
  as above, scaled to one decode worker fewer <= `step_lo` [0.6]).
- The requests a worker moved to prefill kept from its decode role (a flip keeps its running
  decodes) are not counted as retained, no sign of a decode shortage: the fewest it has decoded
  since the flip are its own.
- The gap between each pair of thresholds is the hysteresis; besides it: a worker keeps its
  role at least `min_dwell_s` [60 s] after a role change the planner saw (none before its first),
  flips are `min_gap_s` [30 s] apart at least and one at a time (the worker moved is the one
  whose drain is shortest: a prefill worker with the fewest requests it decodes itself, then the
  shortest queue; a decode worker with the fewest running), each role keeps between
  `min_prefill`/`min_decode` [1] and `max_prefill`/`max_decode` workers, `pinned` workers and
  those whose engine cannot change role in place (Hello.fixed_role: a vLLM worker without
  kv_both) never move, and `enabled` False turns the planner off (it then decides nothing at all).

With several routers one decides at a time: the router whose name (its incarnation) sorts first
among the routers alive (`leader`; a router learns the others from its workers' heartbeats, which
name the routers each worker is registered with); the others measure nothing and flip nothing.
The simulator runs it on router 0.

`ThresholdPlanner` is a baseline, not Kairos's planner: the rule NVIDIA Dynamo's planner
documents, written from that description (no code of Dynamo's), on a fixed number of workers.
Every `THRESHOLD_EVERY_S` [5 s] it compares the estimated TTFT (the mean predicted prefill queue
plus one full-budget prefill step) and ITL (the decode workers' recent step time) of the
samples taken since its last decision (one a second) with their SLAs: a role whose estimate is
above its SLA wants +1 worker, one below 0.8 of it can give one up (-1). With the worker count
fixed, +1 for one role is -1 for the other: a worker moves toward the role that wants more
(prefill +1 / decode 0 or -1, prefill 0 / decode -1, and the mirror images), never below one
worker per role, one flip at a time; no dwell, no hysteresis besides the 0.8-1.0 band. The
simulator runs it with `disagg-least-loaded` routing (`dynamo-planner` in sim/knobs.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from common import messages as m
from common.config import RouterConfig
from common.errors import ConfigError
from common.router_core.ports import Log
from common.router_core.requests import Request
from common.router_core.workers import WorkerTable

PREFILL: m.Role = "prefill"
DECODE: m.Role = "decode"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The planner's settings (see the module docstring)."""

    enabled: bool = False
    interval_s: float = 5.0
    window_s: float = 30.0
    min_dwell_s: float = 60.0
    min_gap_s: float = 30.0
    min_prefill: int = 1
    max_prefill: int = 1 << 20
    min_decode: int = 1
    max_decode: int = 1 << 20
    pinned: frozenset[str] = frozenset()
    wait_hi: float = 0.2
    wait_lo: float = 0.05
    step_hi: float = 0.9
    step_lo: float = 0.6
    queue_hi: float = 0.5
    queue_lo: float = 0.25
    decode_lean: bool = True
    recent: float = 0.34
    ttft_slo: float = 2.0
    tbt_slo: float = 0.1

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError("planner: interval_s must be > 0 and window_s at least interval_s")
        if self.min_dwell_s < 0 or self.min_gap_s < 0:
            raise ValueError("planner: min_dwell_s and min_gap_s must be >= 0")
        if not (0 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode):
            raise ValueError("planner: need 0 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode")
        if not 0 < self.recent <= 1:
            raise ValueError("planner: recent must be in (0, 1] (the share of the window a rising step is judged on)")
        for lo, hi, what in ((self.wait_lo, self.wait_hi, "wait"), (self.step_lo, self.step_hi, "step"),
                             (self.queue_lo, self.queue_hi, "queue")):
            if not 0 <= lo < hi:
                raise ValueError(f"planner: {what}_lo must be below {what}_hi (the gap is the hysteresis)")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One routable worker as the planner sees it: its role and how much it holds (the planner
    moves the least loaded one, whose drain is shortest)."""

    worker_id: str
    role: m.Role
    load: float  # prefill: queued prompt tokens; decode: running sequences
    decodes: int = 0  # prefill: the requests it decodes itself (route retain), which its drain waits for
    fixed: bool = False  # its engine cannot change role in place (Hello.fixed_role): never moved


@dataclass(frozen=True, slots=True)
class Load:
    """One sample of the measured load."""

    prefill_queue_s: float   # mean over prefill workers: predicted wait before a new prompt starts
    decode_step_s: float     # mean over decode workers: recent decode step time
    waits_decode: int        # requests waiting at the router for decode room or KV
    waits_prefill: int       # ... for a prefill worker (held by late binding)
    workers: tuple[WorkerLoad, ...] = ()
    prefill_step_s: float = 0.0  # mean over prefill workers: one full-budget prefill step (ThresholdPlanner)
    retained: int = 0        # requests prefill workers decode themselves (route retain): the decode pool was full
    # mean over decode workers: the recent decode step as the decode guard plans it (the median step
    # times its measured margin over its bias; the step itself with an exact model): what RolePlanner
    # judges, since under step noise the guard keeps the measured step well under the SLO when full
    decode_step_planned_s: float | None = None
    # mean over decode workers: the step of a lone sequence, scaled as the planned step is (the fixed
    # cost every step pays, weights read; 0: unknown). RolePlanner judges the step above it: an idle
    # decode pool on a slow GPU steps at well over half the SLO and is not busy for that
    decode_step_floor_s: float = 0.0

    @property
    def step_judged_s(self) -> float:
        return self.decode_step_s if self.decode_step_planned_s is None else self.decode_step_planned_s


@dataclass(frozen=True, slots=True)
class Flip:
    worker_id: str
    to: m.Role
    reason: str              # decode_short, decode_busy (leaning: see `_want`) or prefill_short
    evidence: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Judged:
    decode_wait: float
    prefill_wait: float
    step: float
    queue: float
    n_prefill: int
    n_decode: int

    def fields(self) -> dict[str, float]:
        return {"decode_wait_share": round(self.decode_wait, 3), "prefill_wait_share": round(self.prefill_wait, 3),
                "decode_step_of_slo": round(self.step, 3), "prefill_queue_of_slo": round(self.queue, 3),
                "prefill_workers": self.n_prefill, "decode_workers": self.n_decode}


def leader(routers: Iterable[str]) -> str:
    """Which router plans, of those alive: the first by name (every router computes the same)."""
    return min(routers, default="")


def movable(w: WorkerLoad, cfg: PlannerConfig) -> bool:
    """Whether a planner may move worker `w`: not pinned, and its engine can change role in place."""
    return w.worker_id not in cfg.pinned and not w.fixed


def shipped_planner(policy: str) -> bool:
    """Whether a router running routing policy `policy` plans roles by default (RouterConfig.planner
    unset): Kairos does; the baselines, compared at fixed splits, never."""
    return policy == "kairos"


def planner_on(cfg: RouterConfig) -> bool:
    """Whether a router with configuration `cfg` plans roles: as set, else its policy's default."""
    return shipped_planner(cfg.policy) if cfg.planner is None else cfg.planner


def planner_config(cfg: RouterConfig, *, enabled: bool | None = None) -> PlannerConfig:
    """The planner's settings from a router's configuration (the live router's and the
    simulator's alike); `enabled` overrides cfg.planner. Bad settings are a ConfigError naming them."""
    try:
        return PlannerConfig(
            enabled=planner_on(cfg) if enabled is None else enabled, interval_s=cfg.planner_interval_s,
            window_s=cfg.planner_window_s, min_dwell_s=cfg.planner_min_dwell_s, min_gap_s=cfg.planner_min_gap_s,
            min_prefill=cfg.planner_min_prefill, max_prefill=cfg.planner_max_prefill,
            min_decode=cfg.planner_min_decode, max_decode=cfg.planner_max_decode,
            pinned=frozenset(w.strip() for w in cfg.planner_pin.split(",") if w.strip()),
            step_hi=cfg.planner_step_hi, step_lo=cfg.planner_step_lo, ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo)
    except ValueError as e:
        raise ConfigError(str(e), key="planner",
                          fix="check the planner_* settings (kairos router --help lists them)") from e


class RolePlanner:
    """See the module docstring."""

    def __init__(self, cfg: PlannerConfig, *, log: Log | None = None) -> None:
        self.cfg = cfg
        self.log: Log = log if log is not None else structlog.get_logger()
        self.samples: deque[tuple[float, Load]] = deque()
        self.since: dict[str, tuple[m.Role, float]] = {}  # worker -> (role, since when)
        self.pending: Flip | None = None  # the flip being carried out
        self.settled_at = -float("inf")   # when the last flip ended (evidence starts then)
        self.last_flip_at = -float("inf")  # when the last flip was decided
        self.flips: dict[str, int] = {}    # by reason
        self._held = ""                   # the last reason a flip was held back (logged once per change)
        # the TBT budget decode steps are planned to now, the SLO less the router's delivery allowance
        # (common/router_core/delivery.py), set by the router core before each tick; None: `cfg.tbt_slo`
        self.tbt_budget: float | None = None
        # prefill worker -> how many of the requests it decodes it kept from its decode role (a flip keeps
        # a worker's running decodes): the least it has held since, which only its own finishing lowers
        self.kept: dict[str, int] = {}

    def _record(self, load: Load, now: float) -> None:
        """Note since when each worker holds its role, and keep the sample (its retained decodes less
        those a worker flipped to prefill kept from its decode role: no sign of a decode shortage)."""
        kept = 0
        for w in load.workers:
            seen = self.since.get(w.worker_id)
            if seen is None:  # the dwell counts from a role change the planner saw, not from its first look
                self.since[w.worker_id] = (w.role, -float("inf"))
            elif seen[0] != w.role:
                self.since[w.worker_id] = (w.role, now)
                if w.role == PREFILL:
                    self.kept[w.worker_id] = _ALL
            if w.worker_id in self.kept:
                k = min(self.kept[w.worker_id], w.decodes) if w.role == PREFILL else 0
                if k > 0:
                    self.kept[w.worker_id] = k
                    kept += k
                else:
                    del self.kept[w.worker_id]
        if kept:
            load = dataclasses.replace(load, retained=max(0, load.retained - kept))
        self.samples.append((now, load))

    def observe(self, load: Load, now: float) -> Flip | None:
        """Take one sample; the flip to make now, if any."""
        cfg = self.cfg
        if not cfg.enabled:
            return None
        self._record(load, now)
        start = max(now - cfg.window_s, self.settled_at)
        while self.samples and self.samples[0][0] < start:
            self.samples.popleft()
        if self.pending is not None:
            return None
        if len(self.samples) < max(1, int(cfg.window_s / cfg.interval_s / 2)):
            return None
        j = self._judge(load)
        to, reason = self._want(j)
        if not to:
            self._held = ""
            return None
        why = self._blocked(to, j, now)
        if why:
            if why != self._held:
                self.log.info("role_flip_held", to=to, reason=reason, held_by=why, **j.fields())
            self._held = why
            return None
        pick = self._pick(load, to, now)
        if pick is None:
            why = "no_movable_worker"
            if why != self._held:
                self.log.info("role_flip_held", to=to, reason=reason, held_by=why, **j.fields())
            self._held = why
            return None
        self._held = ""
        flip = Flip(worker_id=pick.worker_id, to=to, reason=reason, evidence=j.fields())
        self.pending = flip
        self.last_flip_at = now
        self.flips[reason] = self.flips.get(reason, 0) + 1
        self.log.info("role_flip", worker=pick.worker_id, from_role=pick.role, to=to, reason=reason,
                      worker_load=pick.load, **flip.evidence)
        return flip

    def flip_done(self, worker_id: str, role: m.Role, now: float) -> None:
        """The flipped worker is back under `role` (or the flip was abandoned: it keeps its old
        one). New evidence starts now."""
        self.since[worker_id] = (role, now)
        if role == PREFILL:  # what it decodes at its next sample it kept from its decode role
            self.kept[worker_id] = _ALL
        self.pending = None
        self.settled_at = now
        self.samples.clear()
        self.log.info("role_flip_done", worker=worker_id, role=role)

    def rejoined(self, worker_id: str, role: m.Role, now: float) -> None:
        """A worker said Hello: if it is the one being flipped, under its new role, the flip is over."""
        p = self.pending
        if p is not None and p.worker_id == worker_id and p.to == role:
            self.flip_done(worker_id, role, now)

    # -- the rules ---------------------------------------------------------------------------
    def _judge(self, load: Load) -> _Judged:
        cfg = self.cfg
        s = [x for _, x in self.samples]
        n = len(s)

        def prefill_wait(x: Load) -> bool:
            # held for a prefill worker while the prefill queues are short: late binding held it because
            # no decode worker had room to prefill it in place, a decode shortage
            return x.waits_prefill > 0 and x.prefill_queue_s >= cfg.queue_lo * cfg.ttft_slo

        def step(xs: list[Load]) -> float:
            # the share of the step's room above its fixed cost that the decodes use: that part grows
            # with the batch (and shrinks with one decode worker more); the fixed part never does
            above = sum(max(0.0, x.step_judged_s - x.decode_step_floor_s) for x in xs) / len(xs)
            budget = cfg.tbt_slo if self.tbt_budget is None else self.tbt_budget
            room = budget - sum(x.decode_step_floor_s for x in xs) / len(xs)
            if room <= 0:
                # a lone sequence's step (planned with its error margin) already passes the SLO: no
                # split keeps TBT, and a decode worker more would not lower that floor, so the step is
                # no reason to flip (a host too loaded for its engines' steps made every P99/P50
                # margin huge, and the planner moved prefill workers it needed: docker tier, CI)
                return 0.0
            return above / room

        # a decode load that rises is judged on its recent samples (the last `recent` share of the
        # window, two of its six samples by default): an output-heavy phase fills the decode pool
        # within seconds, the window's mean follows late
        recent = max(1, int(len(s) * cfg.recent))
        return _Judged(decode_wait=sum(1 for x in s if x.waits_decode > 0 or x.retained > 0
                                       or (x.waits_prefill and not prefill_wait(x))) / n,
                       prefill_wait=sum(1 for x in s if prefill_wait(x)) / n,
                       step=max(step(s), step(s[-recent:])),
                       queue=sum(x.prefill_queue_s for x in s) / n / cfg.ttft_slo,
                       n_prefill=sum(1 for w in load.workers if w.role == PREFILL),
                       n_decode=sum(1 for w in load.workers if w.role == DECODE))

    def _want(self, j: _Judged) -> tuple[m.Role | None, str]:
        cfg = self.cfg
        decode_short = j.decode_wait >= cfg.wait_hi or j.step >= cfg.step_hi
        # a burst that makes requests wait for a prefill worker while the queue stays short on average
        # is absorbed where it is (decode workers prefill in place); only a queue that lasts takes one
        prefill_short = j.queue >= cfg.queue_hi or (j.prefill_wait >= cfg.wait_hi and j.queue >= cfg.queue_lo)
        if decode_short and not prefill_short:
            return DECODE, "decode_short"
        if prefill_short and not decode_short:
            return PREFILL, "prefill_short"
        if cfg.decode_lean and not prefill_short and j.step >= cfg.step_lo and j.n_prefill > 1 and (
                j.prefill_wait <= cfg.wait_lo and j.queue * j.n_prefill / (j.n_prefill - 1) <= cfg.queue_lo):
            # decode-leaning: a busy decode pool takes a prefill worker the prefill pool can spare before
            # it is short, while that worker's drain is short (it decodes little of its own yet)
            return DECODE, "decode_busy"
        return None, ""

    def _blocked(self, to: m.Role, j: _Judged, now: float) -> str:
        cfg = self.cfg
        if now - self.last_flip_at < cfg.min_gap_s:
            return "min_gap"
        n_from, n_to = (j.n_prefill, j.n_decode) if to == DECODE else (j.n_decode, j.n_prefill)
        lo_from = cfg.min_prefill if to == DECODE else cfg.min_decode
        hi_to = cfg.max_decode if to == DECODE else cfg.max_prefill
        if n_from - 1 < lo_from:
            return f"min_{PREFILL if to == DECODE else DECODE}"
        if n_to + 1 > hi_to:
            return f"max_{to}"
        if to == DECODE and (j.prefill_wait > cfg.wait_lo or _one_fewer(j.queue, n_from) > cfg.queue_lo):
            return "prefill_cannot_spare"  # one prefill worker fewer would make it the bottleneck
        if to == PREFILL and (j.decode_wait > cfg.wait_lo or _one_fewer(j.step, n_from) > cfg.step_lo):
            return "decode_cannot_spare"
        return ""

    def _pick(self, load: Load, to: m.Role, now: float) -> WorkerLoad | None:
        frm = PREFILL if to == DECODE else DECODE
        ok = [w for w in load.workers if w.role == frm and movable(w, self.cfg)
              and now - self.since.get(w.worker_id, (frm, now))[1] >= self.cfg.min_dwell_s]
        # the shortest drain: a prefill worker waits for the requests it decodes itself, then its queue
        return min(ok, key=lambda w: (w.decodes, w.load, w.worker_id)) if ok else None


def measure(table: WorkerTable, waiting: Iterable[Request]) -> Load:
    """The load a router sees now: its worker table's routable workers and its wait queue."""
    q_s: list[float] = []
    full_s: list[float] = []
    step_s: list[float] = []
    planned_s: list[float] = []
    floor_s: list[float] = []
    workers: list[WorkerLoad] = []
    retained = 0
    for e in table.workers.values():
        if e.draining or e.unreachable:
            continue
        hb = e.hb
        if e.role == PREFILL:
            queued = hb.queued_tokens if isinstance(hb, m.PrefillHeartbeat) else 0
            budget = max(e.hello.token_budget, 1)
            full = e.model.step_time(0, 0, [(budget, 0)])  # a full-budget prefill step
            q_s.append(queued / budget * full + (hb.busy_s if hb is not None else 0.0))
            full_s.append(full)
            decodes = hb.decodes if isinstance(hb, m.PrefillHeartbeat) else 0
            retained += decodes
            workers.append(WorkerLoad(e.worker_id, PREFILL, float(queued), decodes, e.hello.fixed_role))
        else:
            batch = hb.batch if isinstance(hb, m.DecodeHeartbeat) else 0
            step = hb.step_ms_p50 / 1000.0 if isinstance(hb, m.DecodeHeartbeat) else 0.0
            step_s.append(step)
            ratio = hb.step_margin / hb.step_bias if isinstance(hb, m.DecodeHeartbeat) and hb.step_bias > 0 else 1.0
            planned_s.append(step * max(1.0, ratio))
            floor_s.append(e.model.step_time(1, 0) * max(1.0, ratio))
            workers.append(WorkerLoad(e.worker_id, DECODE, float(batch), fixed=e.hello.fixed_role))
    waits_d = waits_p = 0
    for r in waiting:
        if r.short == "prefill_busy":
            waits_p += 1
        else:
            waits_d += 1
    return Load(prefill_queue_s=sum(q_s) / len(q_s) if q_s else 0.0,
                decode_step_s=sum(step_s) / len(step_s) if step_s else 0.0,
                waits_decode=waits_d, waits_prefill=waits_p, workers=tuple(workers),
                prefill_step_s=sum(full_s) / len(full_s) if full_s else 0.0, retained=retained,
                decode_step_planned_s=sum(planned_s) / len(planned_s) if planned_s else 0.0,
                decode_step_floor_s=sum(floor_s) / len(floor_s) if floor_s else 0.0)


_ALL = 1 << 30  # RolePlanner.kept before a flipped worker's first sample: all it decodes then

THRESHOLD_EVERY_S = 5.0   # ThresholdPlanner: seconds between decisions
THRESHOLD_LOW = 0.8       # ... an estimate below this share of its SLA can give up a worker


def threshold_config(ttft_slo: float, tbt_slo: float, pinned: frozenset[str] = frozenset()) -> PlannerConfig:
    """The settings `ThresholdPlanner` runs with: a sample a second, decisions every
    THRESHOLD_EVERY_S over that interval's samples, no dwell and no gap between flips."""
    return PlannerConfig(enabled=True, interval_s=1.0, window_s=THRESHOLD_EVERY_S, min_dwell_s=0.0,
                         min_gap_s=0.0, ttft_slo=ttft_slo, tbt_slo=tbt_slo, pinned=pinned)


class ThresholdPlanner(RolePlanner):
    """A Dynamo-style threshold planner (a baseline; see the module docstring)."""

    def __init__(self, cfg: PlannerConfig, *, log: Log | None = None, every_s: float = THRESHOLD_EVERY_S,
                 low: float = THRESHOLD_LOW) -> None:
        super().__init__(cfg, log=log)
        if every_s < cfg.interval_s or not 0.0 < low < 1.0:
            raise ValueError("threshold planner: every_s must be at least interval_s and low in (0, 1)")
        self.every_s = every_s
        self.low = low
        self.decided_at = -float("inf")

    @staticmethod
    def _wants(est: float, sla: float, low: float) -> int:
        return 1 if est > sla else -1 if est < low * sla else 0

    def observe(self, load: Load, now: float) -> Flip | None:
        cfg = self.cfg
        if not cfg.enabled:
            return None
        self._record(load, now)
        while self.samples and self.samples[0][0] <= now - self.every_s:
            self.samples.popleft()
        if self.pending is not None or now - self.decided_at < self.every_s - 1e-9:
            return None
        self.decided_at = now
        s = [x for _, x in self.samples]
        ttft = sum(x.prefill_queue_s + x.prefill_step_s for x in s) / len(s)
        itl = sum(x.decode_step_s for x in s) / len(s)
        want_p, want_d = self._wants(ttft, cfg.ttft_slo, self.low), self._wants(itl, cfg.tbt_slo, self.low)
        n_p = sum(1 for w in load.workers if w.role == PREFILL)
        n_d = sum(1 for w in load.workers if w.role == DECODE)
        evidence = {"ttft_est_s": round(ttft, 4), "itl_est_s": round(itl, 4), "prefill_wants": want_p,
                    "decode_wants": want_d, "prefill_workers": n_p, "decode_workers": n_d}
        if want_p == want_d:
            return None
        to, frm, n_from, lo = ((PREFILL, DECODE, n_d, cfg.min_decode) if want_p > want_d
                               else (DECODE, PREFILL, n_p, max(cfg.min_prefill, 1)))
        if n_from - 1 < lo:
            return None
        ok = [w for w in load.workers if w.role == frm and movable(w, cfg)]
        if not ok:
            return None
        pick = min(ok, key=lambda w: (w.load, w.worker_id))
        reason = f"{to}_short" if (want_p if to == PREFILL else want_d) > 0 else f"{frm}_spare"
        flip = Flip(worker_id=pick.worker_id, to=to, reason=reason, evidence=evidence)
        self.pending = flip
        self.last_flip_at = now
        self.flips[reason] = self.flips.get(reason, 0) + 1
        self.log.info("role_flip_decided", worker=pick.worker_id, frm=frm, to=to, reason=reason,
                      planner="threshold", worker_load=pick.load, **evidence)
        return flip

    def flip_done(self, worker_id: str, role: m.Role, now: float) -> None:
        super().flip_done(worker_id, role, now)
        self.decided_at = now  # the next decision an interval after the new shape starts


def _one_fewer(per_worker: float, n: int) -> float:
    """A pool's load per worker with one worker fewer (n workers now). With one left (a bound of 0
    allows moving it), any load at all is more than none can carry."""
    if n > 1:
        return per_worker * n / (n - 1)
    return math.inf if per_worker > 0 else 0.0
