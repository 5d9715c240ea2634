"""The router side of the simulator: the live router's own core (common/router_core/,
`RouterCore`), one per router replica, run in-process on the simulator's clock, as vLLM's
`InprocClient` runs `EngineCore`. sim/core.py runs the engines (steps, KV transfers, heartbeats)
and calls in here; this module reaches the engines only through the `Engines` interface below.

What a replica runs is the live router's: its request lifecycle (`submit`), worker table and
ledger, dispatch and its bookkeeping, the wait queue with its retry, timeout and reject rules,
the prefix index, the held lists of other replicas' deflections, and the re-decision after a
decode worker's admission says no. Each replica has its own wait queue and prefix index, as
live. `SimRouter` is the shell around one core, as services/router/service.py is live:

- workers register with a Hello and report with heartbeats (the `Worker.hello()` and `hb` a
  live worker would send; each replica acknowledges its own dispatches in them, `last_dispatch`,
  and a heartbeat carries the prefix cache's stored and evicted blocks);
- a request arrives with `submit`: its prompt is `prompt` token ids (zeros: the simulator has no
  text) and the trace's block hashes (`block_hashes`, so that the index and the engines' caches
  agree without hashing token ids);
- what the core sends goes to an outbox (`SimOutbox`); the shell hands it to the engines before
  the core decides anything else (`Hooks.before_view`) and after each call: a DecodeWork goes to
  the decode worker's core (common/worker_core/decode.py, as live), which starts a deflection,
  keeps room for a handoff's KV, or turns the work away (a deflection that does not fit:
  "deflect_rejected"; work that does not fit its free KV: "kv_full"); what it turned away comes
  back to the router core as the worker's RequestFailed, as live (the router decides again, or
  re-dispatches the request as a new attempt; work of a replaced attempt still in the outbox is
  dropped); a PrefillWork goes to the prefill worker's core, which queues the prefill (its KV
  bound for the DecodeWork's worker); the rest (Welcome, Cancel, ...) has no simulated effect;
- the engines report a deflection's first token and every request's end as TokenBatches.

What is the simulator's own is time: when heartbeats reach the routers (periodically and 2 ms
after a change; each is made at its instant and taken when the engines or a router next look,
see sim/core.py), and so when the wait queue is decided again. The core's `room` hook (room may
have opened: at every heartbeat, deflection first token and request end live) is not used;
the wait queue is retried when what frees room becomes visible: a decode worker's finished
requests at its next heartbeat, a prefill worker's finished prefill at its next heartbeat (if
the policy holds requests), a deflection's first token at once (its ledger slot, if held
requests wait; that replica's queue only, out of turn; with replicas, every replica's at its
turn at the worker's next heartbeat too). At a heartbeat every replica hears, the replicas take
turns as live (common/router_core/waiting.py, `replica_turn`): each replica's `QueueHead` reaches
the decode workers' cores at once and their heartbeats echo it; a replica whose turn is later
retries `replica_stagger_ms` later (`Routers.retry`), when the workers' prompt heartbeats
(2 ms) show what the turns before it sent. A request that has waited `kv_wait_timeout` seconds is failed by the core
(`Waiting.expire`, at its timeout) and counted as rejected, as one the queue had no room for
(`kv_wait_max`: HTTP 503 live).

The interface, router to engines (`Engines`, implemented by sim/core.py's `Simulation`):
    deliver(w, now)                 W's heartbeats due by `now` reach the routers (the engines take
                                    them lazily; a router asks before it reads or records anything
                                    about W)
    deliver_all(now)                every worker's, for a view (heartbeat_interval 0: the live state)
    decode_work(w, work, r, now)    decode worker W's core takes DecodeWork `work` of request `r`, or
                                    turns it away (its RequestFailed then waits in `w.outbox`)
    prefill_work(p, work, r, now)   prefill worker P's core queues PrefillWork `work` of `r`
    next_heartbeat(w, now)          when W's next heartbeat (periodic or prompt) reaches the routers
    retry_at(t, i, turn), give_up_at(t, r)  timers: retry the wait queues (replica i's, at its turn
                                    or not; None: each replica's at its turn); give up on `r` if
                                    still waiting
    set_role(wid, msg, now)         worker WID got a SetRole (router 0's role planner): it drains to change role
Engines to routers (`Routers`): heartbeat(w, stored, removed, now) (a heartbeat made at `now`, with
the prefix cache's changes), first_token(w, r, now) (a deflection's first token), finished(w, r,
now) (a request's last token), kv_freed(w, now) (requests finished on decode worker W),
prefill_done(w, now).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import msgspec

from common import messages as m
from common.config import RouterConfig
from common.errors import NoWorkerYet, Overloaded, RequestError, Unavailable
from common.perf_model import Profile
from common.policy import ClusterView, Decision, Hold, Policy
from common.router_core.core import RouterCore
from common.router_core.ports import Hooks, NullLog
from common.router_core.requests import Request
from sim.state import MODEL, DecodeWorker, Level, PrefillWorker, Req, SimConfig, Worker, router_name

_SAMPLING: dict[int, m.Sampling] = {}


class Engines(Protocol):
    """What the router side may ask of the simulated engines (see the module docstring)."""

    def deliver(self, w: Worker, now: float) -> None: ...
    def deliver_all(self, now: float) -> None: ...
    def decode_work(self, w: DecodeWorker, work: m.DecodeWork, r: Req, now: float) -> str: ...
    def prefill_work(self, p: PrefillWorker, work: m.PrefillWork, r: Req, now: float) -> bool: ...
    def next_heartbeat(self, w: Worker, now: float) -> float: ...
    def retry_at(self, t: float, replica: int | None = None, turn: bool = False) -> None: ...
    def give_up_at(self, t: float, r: Req) -> None: ...
    def set_role(self, wid: str, msg: m.SetRole, now: float) -> None: ...


WAIT_TIMEOUTS = ("kv_wait_timeout", "prefill_wait_timeout", "decode_wait_timeout")  # common/router_core/waiting.py
BUDGET_TIMEOUTS = ("prefill_busy", "decode_busy", "kv_full")  # a wait past its budget (queue_budget >= 0): a 429


def router_config(cfg: SimConfig) -> RouterConfig:
    """The live router's settings for a simulated replica: the simulation's SLOs, ledger, wait
    queue, prefix index, bias correction and replicas; no limit on requests in flight or their duration
    (a run's load is the trace's), liveness never checked (simulated workers do not fail)."""
    rc = RouterConfig(served_model_name=MODEL, ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo,
                      replicas=cfg.routers, replica_stagger_ms=cfg.replica_stagger_ms,
                      heartbeat_interval=cfg.heartbeat_interval or 0.1, ledger=cfg.ledger,
                      kv_wait_timeout=cfg.kv_wait_timeout, kv_wait_max=cfg.kv_wait_max,
                      prefix_cache=cfg.prefix_cache, bias_correction=cfg.bias_correction,
                      max_in_flight=1 << 30, request_timeout=1e12, queue_budget=cfg.queue_budget, client_share=1.0,
                      planner=bool(cfg.planner), planner_pin=",".join(cfg.planner_pinned),
                      tbt_delivery_allowance_ms=cfg.tbt_delivery_allowance_ms, tbt_delivery_measured=False)
    return msgspec.structs.replace(rc, **router_periods(cfg.time_scale)) if cfg.time_scale != 1.0 else rc


def router_periods(k: float) -> dict[str, float]:
    """The router's wall-clock periods that belong to the scenario, as RouterConfig settings, `k`
    times their defaults: the role planner's sampling interval, evidence window, dwell, gap
    between flips and flip timeout. A scenario run K times slower (every step, SLO, arrival gap
    and heartbeat x K) is the same scenario only if these stretch too; `bench.live_vs_sim
    --time-scale` gives the live router the same values (as KAIROS_* variables)."""
    d = RouterConfig()
    return {name: float(getattr(d, name)) * k for name in ROUTER_PERIODS}


ROUTER_PERIODS = ("planner_interval_s", "planner_window_s", "planner_min_dwell_s", "planner_min_gap_s",
                  "planner_flip_timeout_s")


class _StrictLog(NullLog):
    """The core's log in the simulator: warnings and below dropped; an error (the core caught an
    exception of its own or of the simulator's shell, and would fail the request and go on, as
    live) stops the run instead, so a bug cannot pass as a result."""

    def error(self, event: str, **fields: object) -> None:
        raise RuntimeError(f"the router core logged an error in the simulator: {event} {fields}")

    exception = critical = error


STRICT_LOG = _StrictLog()


class SimOutbox:
    """What a replica's core sends: kept in order until its shell hands it to the engines."""

    def __init__(self) -> None:
        self.sent: deque[tuple[bytes, m.Msg]] = deque()
        self.decision_us: list[float] = []

    def send(self, identity: bytes, msg: m.Msg) -> bool:
        self.sent.append((identity, msg))
        return True

    def publish(self, msg: m.Msg) -> None:
        if isinstance(msg, m.DecisionRecord):
            self.decision_us.append(msg.decision_us)


class SimRouter:
    """One router replica: the live router's core, and the shell that runs it on the simulator's
    clock (see the module docstring)."""

    def __init__(self, i: int, policy: Policy, cfg: SimConfig, engines: Engines, profile: Profile,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker]) -> None:
        self.i = i
        self.cfg = cfg
        self.engines = engines
        self.out = SimOutbox()
        self.p_by_id = {w.wid: w for w in prefill}
        self.d_by_id = {w.wid: w for w in decode}
        self.reqs: dict[str, Req] = {}  # in flight at this replica, by request id
        self.creqs: dict[str, Request] = {}  # ... the core's request of each
        self.q_wait = Level()
        self.core = RouterCore(router_config(cfg), self.out, hooks=Hooks(request_done=self._done,
                                                                          room=_no_retry,
                                                                          before_view=self._before_view),
                               incarnation=router_name(i), policy=policy, profile=profile, log=STRICT_LOG)
        for w in (*prefill, *decode):
            self.core.on_message(w.wid.encode(), w.hello(), 0.0)
        self.out.sent.clear()  # the Welcomes

    @property
    def waiting(self) -> int:
        return len(self.core.kv_waiting)

    def holding(self, now: float) -> bool:
        """Does the policy hold a request the next retry could place (among those it decides again:
        `Waiting.head`)?"""
        return any(r.held for r in self.core.waiting.head(now))

    def view(self, now: float) -> ClusterView:
        """What the policy would see now."""
        self.engines.deliver_all(now)
        return self.core.table.view(use_ledger=self.cfg.ledger)

    # -- from the engines -----------------------------------------------------------------
    def heartbeat(self, w: Worker, summary: m.PrefixSummary | None, now: float) -> None:
        """`w`'s heartbeat (`w.hb`) arrived, acknowledging every dispatch this router sent it before."""
        hb = w.hb
        assert hb is not None
        e = self.core.table.workers[w.wid]
        if e.dispatch_no or summary is not None:
            hb = msgspec.structs.replace(hb, last_dispatch=e.dispatch_no, prefix=summary)
        self.core.on_message(w.wid.encode(), hb, now)

    def first_token(self, w: Worker, r: Req, now: float) -> None:
        """Deflection `r` on `w` produced its first token: its slot is free in the ledger."""
        creq = self.creqs[r.rid]
        self.core.on_message(w.wid.encode(), m.TokenBatch(worker_id=w.wid, items=[
            m.TokenItem(r.rid, creq.attempt, [0])]), now)
        if self.cfg.ledger and self.holding(now):
            self.engines.retry_at(now, self.i)  # a deflection slot freed, seen at once (by this router)

    def finished(self, w: Worker, r: Req, now: float) -> None:
        creq = self.creqs.get(r.rid)
        if creq is not None:
            self.core.on_message(w.wid.encode(), m.TokenBatch(worker_id=w.wid, items=[
                m.TokenItem(r.rid, creq.attempt, [0], "length")]), now)

    # -- requests -------------------------------------------------------------------------
    def submit(self, r: Req, now: float) -> None:
        sampling = _SAMPLING.get(r.output)
        if sampling is None:
            sampling = _SAMPLING[r.output] = m.Sampling(max_tokens=r.output)
        # the trace's block hashes (none: no prefix reuse; the zeros of `prompt` must not hash alike)
        known = (self.cfg.hash_block_tokens, r.hashes or [])
        self.reqs[r.rid] = r
        try:
            creq = self.core.submit([0] * r.prompt, sampling, now, rid=r.rid, block_hashes=known)
        except Unavailable as e:  # no room, and the wait queue is full
            r.was_held = isinstance(e.__cause__, Hold)  # the policy held it (counted as held, then refused)
            _reject(r, f"rejected: {self.waiting} requests already waiting for a worker")
        except (RequestError, Overloaded, NoWorkerYet) as e:
            _reject(r, f"rejected: {e}")
        else:
            self.creqs[r.rid] = creq
            if creq.kv_wait_until > 0:  # not placed: it waits
                self._waits(r, creq, now)
        self.flush(now)
        if r.rejected:
            self.reqs.pop(r.rid, None)

    def retry(self, now: float, turn: bool = False) -> None:
        """Decide the waiting requests again (the core's wait queue); `turn`: at this replica's turn
        at room a heartbeat showed (`RouterCore.retry_now`)."""
        self.engines.deliver_all(now)
        self.core.retry_now(now, turn=turn)
        self.flush(now)
        for creq in self.core.waiting.head(now):
            if creq.held:
                self.reqs[creq.request_id].was_held = True

    def give_up(self, r: Req, now: float) -> bool:
        """`r`'s wait timeout: False if it is not waiting any more (placed, or rejected)."""
        creq = self.creqs.get(r.rid)
        if creq is None or creq.done or not r.waiting:
            return False
        if creq.kv_wait_until > now:  # it waits again since (put back first in line): its new timeout
            self.engines.give_up_at(creq.kv_wait_until, r)
            return False
        self.core.waiting.expire(now)
        self.core.tell_queue(now)
        self.flush(now)
        return True

    def _waits(self, r: Req, creq: Request, now: float) -> None:
        r.waiting = True
        r.was_held = r.was_held or creq.held
        self.q_wait.add(now, 1)
        self.engines.give_up_at(creq.kv_wait_until, r)

    def _done(self, creq: Request, finished_reason: str | None, rec: m.RequestRecord) -> None:
        """The core ended a request: completed (the engines have it), or failed waiting."""
        r = self.reqs.pop(creq.request_id)
        self.creqs.pop(creq.request_id, None)
        if finished_reason is None:
            # nothing else fails a request in the simulator: it waited too long (its wait timeout, or
            # with queue_budget >= 0 past where it could make its budget), or every worker it was sent
            # to turned it away (kv_full) as many times as the router tries
            if creq.outcome not in (*WAIT_TIMEOUTS, *BUDGET_TIMEOUTS, "retries_exhausted"):
                raise RuntimeError(f"the router core failed request {creq.request_id} in the simulator: "
                                   f"{creq.outcome}")
            now = rec.at
            if r.waiting:
                r.waiting = False
                self.q_wait.add(now, -1)
            r.waited = now - r.arrival
            if creq.outcome == "retries_exhausted":
                _reject(r, f"rejected: turned away by every decode worker it was sent to ({creq.attempt + 1} attempts)")
                return
            if creq.outcome in BUDGET_TIMEOUTS:
                _reject(r, f"rejected: could no longer make its budget waiting ({creq.outcome}: {creq.wait_reason})")
                return
            what = "a worker to take it" if creq.held else "KV room"
            _reject(r, f"rejected: waited {self.cfg.kv_wait_timeout:g} s for {what} ({creq.wait_reason})")

    # -- what the core sent, to the engines -----------------------------------------------
    def _before_view(self, now: float) -> None:
        self.flush(now)
        self.engines.deliver_all(now)

    def flush(self, now: float) -> None:
        """Hand what the core sent to the engines, in order; a rejected deflection goes back to
        the core as the worker's RequestFailed (which may send more)."""
        sent = self.out.sent
        eng = self.engines
        while sent:
            to, msg = sent.popleft()
            if isinstance(msg, m.SetRole):  # the role planner's (router 0)
                eng.set_role(to.decode(), msg, now)
                continue
            if isinstance(msg, m.QueueHead):  # its oldest waiting request, echoed by the decode worker's heartbeats
                qw = self.d_by_id.get(to.decode())
                if qw is not None:
                    eng.deliver(qw, now)
                    qw.core.on_queue_head(msg)
                continue
            if isinstance(msg, m.PlanBudget):  # the delivery allowance moved (only a configured one here: constant)
                bw = self.d_by_id.get(to.decode()) or self.p_by_id.get(to.decode())
                if bw is not None:
                    eng.deliver(bw, now)
                    bw.core.on_plan_budget(msg)
                continue
            if not isinstance(msg, (m.DecodeWork, m.PrefillWork)):
                continue
            creq = self.creqs.get(msg.request_id)
            if creq is None or creq.done or creq.attempt != msg.attempt:
                continue  # an attempt a worker's refusal replaced (or ended) meanwhile
            d = creq.decision
            assert d is not None
            r = self.reqs[msg.request_id]
            r.attempt = msg.attempt
            if isinstance(msg, m.DecodeWork):
                dw = self.d_by_id[d.decode_worker]
                eng.deliver(dw, now)
                if eng.decode_work(dw, msg, r, now) in ("refused", "rejected"):
                    for f in dw.take_sent():  # the worker's RequestFailed: the router decides again
                        assert isinstance(f, m.RequestFailed)
                        self.core.on_message(dw.wid.encode(), f, now)
                    if not creq.done and creq.kv_wait_until > 0 and not r.waiting:  # no room elsewhere: it waits
                        self._waits(r, creq, now)
                    continue
                if msg.mode == "deflect":  # placed (a handoff is placed with its PrefillWork, next)
                    self._placed(msg.request_id, d, now)
                    r.ttft_pred = _from_arrival(d.ttft_decode_pred, r, now)
            else:
                assert d.prefill_worker is not None
                pw = self.p_by_id[d.prefill_worker]
                if msg.retain:
                    eng.deliver(pw, now)
                    if not eng.prefill_work(pw, msg, r, now):  # no KV room there: decided again, as above
                        for f in pw.take_sent():
                            assert isinstance(f, m.RequestFailed)
                            self.core.on_message(pw.wid.encode(), f, now)
                        if not creq.done and creq.kv_wait_until > 0 and not r.waiting:
                            self._waits(r, creq, now)
                        continue
                    self._placed(msg.request_id, d, now)
                    r.ttft_pred = _from_arrival(d.ttft_prefill_pred, r, now)
                    continue
                self._placed(msg.request_id, d, now)
                r.ttft_pred = _from_arrival(d.ttft_prefill_pred, r, now)
                eng.prefill_work(pw, msg, r, now)

    def _placed(self, rid: str, d: Decision, now: float) -> Req:
        r = self.reqs[rid]
        r.route, r.reason, r.decode_worker = d.route, d.reason, d.decode_worker
        if r.waiting:
            r.waiting = False
            r.waited = now - r.arrival
            self.q_wait.add(now, -1)
        return r


class Routers:
    """The router replicas; requests arrive at them round-robin (`Req.router`)."""

    def __init__(self, profile: Profile, policy: Policy, cfg: SimConfig, engines: Engines,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker]) -> None:
        self.cfg = cfg
        self.engines = engines
        # one policy object per router (they keep per-router state: caches, counters, rates)
        policies = [policy, *(copy.deepcopy(policy) for _ in range(cfg.routers - 1))]
        self.replicas = [SimRouter(i, p, cfg, engines, profile, prefill, decode) for i, p in enumerate(policies)]
        self._bt = cfg.hash_block_tokens
        self._retry_at: dict[str, float] = {}  # per worker: the heartbeat at which a retry is already due

    @property
    def admission_rejected(self) -> int:
        return sum(rt.core.counts["deflect_rejected"] for rt in self.replicas)

    @property
    def waiting(self) -> int:
        return sum(rt.waiting for rt in self.replicas)

    def holding(self, now: float) -> bool:
        return any(rt.holding(now) for rt in self.replicas)

    def decision_ns(self) -> list[int]:
        return [int(us * 1e3) for rt in self.replicas for us in rt.out.decision_us]

    def queue_report(self, end: float) -> dict[str, float]:
        """The routers' wait queues' length over the run (their sum)."""
        if len(self.replicas) == 1:
            return self.replicas[0].q_wait.report(end)
        reports = [rt.q_wait.report(end) for rt in self.replicas]
        return {"max": sum(x["max"] for x in reports), "mean": sum(x["mean"] for x in reports)}

    def index_blocks(self) -> int:
        """Blocks in the first replica's prefix index (each replica keeps its own)."""
        return len(self.replicas[0].core.prefix.index)

    # -- from the engines -----------------------------------------------------------------
    def heartbeat(self, w: Worker, stored: Sequence[int], removed: Sequence[int], now: float) -> None:
        summary = m.PrefixSummary(block_tokens=self._bt, stored=list(stored), removed=list(removed)) \
            if self.cfg.prefix_cache else None
        for rt in self.replicas:
            rt.heartbeat(w, summary, now)

    def first_token(self, w: Worker, r: Req, now: float) -> None:
        self.replicas[r.router].first_token(w, r, now)
        if len(self.replicas) > 1 and self.holding(now) and self.replicas[r.router].core.waiting.turn_delay(now) > 0.0:
            # an older request waits at another replica: the replica that heard of the freed
            # deflection slot at once places none of its own past it (waiting.py); the slot shows
            # to every replica at `w`'s next heartbeat, which, as live (every heartbeat retries at
            # the replica's turn), the replicas take their turns at
            self._retry_at_heartbeat(w, now)

    def finished(self, w: Worker, r: Req, now: float) -> None:
        self.replicas[r.router].finished(w, r, now)

    def kv_freed(self, w: Worker, now: float) -> None:
        if self.waiting:  # the router sees the freed KV at this worker's next heartbeat
            self._retry_at_heartbeat(w, now)

    def prefill_done(self, w: PrefillWorker, now: float) -> None:
        if self.holding(now):
            self._retry_at_heartbeat(w, now)  # its shorter queue shows at its next heartbeat

    def _retry_at_heartbeat(self, w: Worker, now: float) -> None:
        t = self.engines.next_heartbeat(w, now)
        if t != self._retry_at.get(w.wid, -1.0):
            self._retry_at[w.wid] = t
            self.engines.retry_at(t)  # every replica, each at its turn (`retry`)

    # -- a worker changing role (the role planner, sim/core.py) ------------------------------
    def tell(self, w: Worker, msg: m.Goodbye, now: float) -> None:
        """`w` sends `msg` (a Goodbye) to every router."""
        for rt in self.replicas:
            rt.core.on_message(w.wid.encode(), msg, now)
            rt.flush(now)

    def handed_off(self, w: PrefillWorker, keep: frozenset[str] = frozenset()) -> None:
        """Prefill worker `w` holds nothing: what its entry on a router still holds are prefills it
        finished, which the simulator tells no router of (no PrefillDone: the hand-off is modelled
        engine-side); the PrefillDone each would have sent takes it off the entry, as live, so
        that its departure re-dispatches nothing. `keep`: the requests it decodes itself and keeps
        across a role flip (they stay)."""
        for rt in self.replicas:
            e = rt.core.table.workers.get(w.wid)
            if e is not None:
                e.holding.intersection_update(keep)

    def worker_left(self, w: Worker) -> None:
        for rt in self.replicas:
            rt.p_by_id.pop(w.wid, None)
            rt.d_by_id.pop(w.wid, None)

    def worker_joined(self, w: Worker, now: float) -> None:
        """`w` says Hello to every router (under its new role)."""
        for rt in self.replicas:
            if isinstance(w, PrefillWorker):
                rt.p_by_id[w.wid] = w
            elif isinstance(w, DecodeWorker):
                rt.d_by_id[w.wid] = w
            rt.core.on_message(w.wid.encode(), w.hello(), now)
            rt.flush(now)

    # -- arrivals and the wait queues -----------------------------------------------------
    def arrive(self, r: Req, now: float) -> None:
        self.replicas[r.router].submit(r, now)

    def retry(self, now: float, replica: int | None = None, turn: bool = False) -> None:
        """Decide the wait queues again: replica `replica`'s, or (None: at a heartbeat that may show
        room, which every replica hears at once) each replica's at its turn (common/router_core/
        waiting.py, `replica_turn`: the replica with the oldest waiting request first, the next
        `replica_stagger_ms` later, when the workers' prompt heartbeats show what the first sent).
        `turn`: replica `replica`'s retry is its turn at such a heartbeat (else room only it heard
        of: `Waiting.retry`)."""
        if replica is not None:
            if self.replicas[replica].waiting:
                self.replicas[replica].retry(now, turn=turn)
            return
        if len(self.replicas) > 1:
            self.engines.deliver_all(now)
        for rt in self.replicas:
            if not rt.waiting:
                continue
            delay = rt.core.waiting.turn_delay(now)
            if delay > 0.0:
                self.engines.retry_at(now + delay, rt.i, turn=True)
            else:
                rt.retry(now, turn=True)

    def give_up(self, r: Req, now: float) -> bool:
        return self.replicas[r.router].give_up(r, now)


def _no_retry(now: float) -> None:
    """The core's `room` hook: the simulator retries at its own times (see the module docstring)."""


def _reject(r: Req, reason: str) -> None:
    r.rejected = True
    r.reason = reason


def _from_arrival(pred: float | None, r: Req, now: float) -> float | None:
    """A TTFT predicted at dispatch, from the request's arrival (it may have waited at the router)."""
    return None if pred is None else pred + (now - r.arrival)
