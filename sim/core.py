"""The discrete-event simulator behind `kairos sim`: a virtual clock, the real policies, the
real `Batcher`.

One event per engine step per worker (not per token), one per KV transfer, and the trace's
arrivals merged in from a sorted list. Each step is planned by the worker's `Batcher`, timed by
`PerfModel.step_time` (times an optional lognormal error) and committed when its end event fires.

Model of a request:
    arrival -> policy.decide(view) -> disagg:  prefill worker queue -> chunked prefill ->
                                               KV transfer (PerfModel.xfer_time, "modeled") ->
                                               decode worker (joins as a decode; next step
                                               samples the first token)
                                   -> deflect: decode worker, prefilled in place one chunk of
                                               the router's schedule per step; the step with the
                                               last chunk samples the first token

The engines' side is here; the router side (the routers' views, ledgers and dispatch, the wait
queue, late binding, rejections) is sim/router.py, which reaches the engines only through the
interface its docstring lists (`Engines`; `Simulation` implements it) and hears from them through
`Routers` (heartbeats, held lists, first tokens of deflections, freed KV, finished prefills).

Heartbeats: each worker publishes one every `heartbeat_interval` seconds (phases staggered
across workers), and every router replica gets it. Besides its periodic heartbeats a worker
heartbeats `prompt_beat` seconds after its state changes, as live workers do (common/worker.py:
2 ms, changes in between coalesced into one beat): when work reaches it, when a decode worker
admits a request (a deflection, or a handoff whose KV landed), when a prefill ends, when a
request finishes. So every router sees every dispatch within 2 ms, and the router's wait queue
is retried then. `prompt_beat` < 0: only the periodic heartbeats (the simulator's behaviour
before 2026-12-01); 0: at once. A decode worker's heartbeats list the deflections it holds
(`held_list`): a change in that list reaches the other routers with its next heartbeat (the
prompt beat), as live. With `admission`, a decode worker checks each
deflection against its live state before it starts it (common/policy/admission.py) and the
router decides again without that worker.
A heartbeat is the worker's state at the heartbeat instant; since state only changes at
events, it is captured lazily (just before the first event at or after the instant touches the
worker, or before a router reads or records anything about it: `deliver`), made and received at
the instant (its `busy_s` and the routers' `hb_at` reckoned from it), which is exact and costs
nothing while a worker is idle. `heartbeat_interval = 0` gives the policy perfect,
instantaneous views.

The workers are the live workers' cores (common/worker_core/) in a shell (sim/state.py): work the
router placed on a decode worker whose KV is full is refused ("kv_full", as live) and the router
re-dispatches it; nothing queues at a decode worker.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import msgspec

from common import messages as m
from common.engines.base import Prefilled
from common.engines.batcher import Batcher, StepOutcome, StepPlan
from common.engines.prefix_cache import PrefixCache
from common.engines.step_error import ChunkGuard, StepErrorEstimator, bias_factor
from common.perf_model import Profile
from common.policy import Policy
from common.prefix_hash import chain_ids
from common.router_core.planner import (
    Flip,
    RolePlanner,
    ThresholdPlanner,
    planner_config,
    shipped_planner,
    threshold_config,
)
from common.router_core.ports import NULL_LOG
from common.traces import TraceRequest
from common.worker_core.decode import Outcome
from sim.router import Routers, router_config
from sim.state import DecodeWorker, Level, PrefillWorker, Req, SimConfig, Worker
from sim.stats import RequestTiming

# SimConfig lives in sim/state.py (sim/router.py reads it too); importing it from here goes on working
__all__ = ["SimConfig", "SimResult", "Simulation", "prefix_hit_rate", "simulate", "worker_ids"]

_STEP_P, _STEP_D, _XFER, _RETRY, _GIVE_UP, _BEAT, _PLAN, _REJOIN = 0, 1, 2, 3, 4, 5, 6, 7
W = TypeVar("W", bound=Worker)


class SimResult(msgspec.Struct, kw_only=True):
    records: list[RequestTiming]
    stats: dict[str, Any]


def worker_ids(role: str, n: int) -> list[str]:
    width = len(str(max(n - 1, 0)))
    return [f"{role}-{i:0{width}d}" for i in range(n)]


class Simulation:
    """One run: a trace through one policy on one cluster. Build a fresh one per run."""

    def __init__(self, profile: Profile, policy: Policy, cfg: SimConfig) -> None:
        self.profile = profile
        self.policy = policy
        if cfg.planner is None:  # the router's default for Kairos; the baselines keep their fixed split
            cfg = msgspec.structs.replace(cfg, planner=shipped_planner(policy.name))
        self.cfg = cfg
        model = profile.model
        self.model = model
        n_workers = cfg.prefill + cfg.decode
        h = cfg.heartbeat_interval

        def phase(i: int) -> float:
            return h * i / n_workers if h > 0 else math.inf

        self.prefill = [self._new_prefill(wid, phase(i), None)
                        for i, wid in enumerate(worker_ids("prefill", cfg.prefill))]
        self.decode = [self._new_decode(wid, phase(cfg.prefill + i), None)
                       for i, wid in enumerate(worker_ids("decode", cfg.decode))]
        self._d_by_id = {w.wid: w for w in self.decode}
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._rng = random.Random(cfg.seed)
        error = cfg.step_error()
        self._exact = error.exact
        # each worker's injected error (one shared generator: with noise alone, the same draws as before)
        self._error = {w.wid: error.source(i, self._rng) for i, w in enumerate((*self.prefill, *self.decode))}
        self.steps = 0
        self.decode_steps = 0   # decode steps that carried running decodes
        self.over_slo = [0, 0]  # ... of which took longer than the TBT SLO: [decode only, with a prefill chunk]
        self._q_prefill = Level()
        # the router side: its replicas, their views and ledgers, the wait queue (sim/router.py)
        self.routers = Routers(profile, policy, cfg, self, self.prefill, self.decode)
        for w in (*self.prefill, *self.decode):
            self._snapshot(w, 0.0)  # the state announced at registration: idle
        # the role planner (router 0 decides: common/router_core/planner.py `leader`)
        # (not on a cluster with no prefill worker: its policy uses none, chunked-prefill say)
        # the planner is router 0's core's; it tells a worker to flip with a SetRole (`set_role`)
        if cfg.planner and cfg.prefill > 0:
            # (its settings read from the router's configuration, as the live router's are; the
            # threshold rule is a simulator-only baseline)
            self.planner = (ThresholdPlanner(threshold_config(cfg.ttft_slo, cfg.tbt_slo, frozenset(cfg.planner_pinned)),
                                             log=NULL_LOG)
                            if cfg.planner_rule == "threshold" else
                            RolePlanner(planner_config(router_config(cfg)), log=NULL_LOG))
        self.flipping: tuple[Worker, Flip, float] | None = None  # the worker draining for a flip, since when
        # a flip that keeps running decodes: its drain is over (since then), the worker steps them on
        # in its old role until it rejoins; the swap waits for a step boundary (`_swap_due`)
        self._switching: float | None = None
        self._swap_due = False
        self.flips: list[dict[str, Any]] = []

    @property
    def planner(self) -> RolePlanner | None:
        return self.routers.replicas[0].core.planner

    @planner.setter
    def planner(self, p: RolePlanner | None) -> None:
        self.routers.replicas[0].core.planner = p

    # -- the workers ----------------------------------------------------------------------
    def _cache(self) -> PrefixCache | None:
        bt = self.cfg.hash_block_tokens
        return PrefixCache(bt, self.profile.kv_capacity_tokens // bt) if self.cfg.prefix_cache else None

    def _batcher(self, role: Literal["prefill", "decode"], token_budget: int, default_chunk: int,
                 est: StepErrorEstimator | None) -> tuple[Batcher, StepErrorEstimator | None]:
        """A worker's batcher and its measured step error (`est`: a flipped worker's own, kept);
        the chunk guard where the closed loop is on (on a prefill worker it acts only beside the
        requests it decodes itself, route "retain")."""
        profile, cfg = self.profile, self.cfg
        if est is None:
            est = StepErrorEstimator(target=cfg.overrun_target) if cfg.closed_loop else (
                StepErrorEstimator() if cfg.bias_correction else None)
        return Batcher(role=role, token_budget=token_budget, max_batch=profile.max_batch,
                       kv_capacity_tokens=profile.kv_capacity_tokens, default_chunk=default_chunk,
                       prefix_cache=self._cache(),
                       guard=ChunkGuard(self.model, est) if cfg.closed_loop and est else None), est

    def _new_prefill(self, wid: str, phase: float, est: StepErrorEstimator | None) -> PrefillWorker:
        budget = self.profile.prefill_token_budget
        batcher, est = self._batcher("prefill", budget, budget, est)
        return self._hook(PrefillWorker(wid, batcher, self.model, phase), est)

    def _new_decode(self, wid: str, phase: float, est: StepErrorEstimator | None) -> DecodeWorker:
        batcher, est = self._batcher("decode", self.profile.decode_token_budget, self.profile.decode_default_chunk, est)
        return self._hook(DecodeWorker(wid, batcher, self.model, phase, admission=self.cfg.admission,
                                       list_held=self.cfg.held_list), est)

    def _hook(self, w: W, est: StepErrorEstimator | None) -> W:
        """The core's ports reach the event loop through these; its measured step error: the guard's
        estimator, where there is one (a worker that changes role keeps its own: the same GPU)."""
        w.on_beat = self._beat_soon
        w.on_start = self._start_if_idle
        guard = w.batcher.guard
        w.estimator = guard.estimator if guard is not None else est
        return w

    # -- heartbeats -----------------------------------------------------------------------
    def _touch(self, w: Worker, now: float) -> None:
        """Capture the heartbeat(s) due by `now` before `w` changes (see the module docstring)."""
        if now >= w.next_hb:
            h = self.cfg.heartbeat_interval
            k = math.floor((now - w.phase) / h)
            w.next_hb = w.phase + (k + 1) * h
            self._snapshot(w, min(now, w.phase + k * h))  # made at the last heartbeat instant, as it was then

    def _snapshot(self, w: Worker, now: float) -> None:
        cache = w.batcher.cache
        if cache is not None:  # the heartbeat carries what the prefix cache stored and evicted
            stored, removed = cache.take_events()
        else:
            stored = removed = []
        est = w.estimator
        bias = bias_factor(est.bias()) if est is not None and self.cfg.bias_correction else 1.0
        if bias != w.bias:  # as common/router_core/workers.py: a new model object only when it changes
            w.bias = bias
            w.view_model = w.model.scaled(bias) if bias != 1.0 else w.model
        w.hb = w.heartbeat(now)
        self.routers.heartbeat(w, stored, removed, now)  # every router has it now

    def _soon(self, w: Worker, now: float, at_once: bool = False) -> None:
        """`w`'s state changed: it heartbeats `prompt_beat` later (one beat for every change
        until then), unless prompt beats are off or the views are always fresh anyway. `at_once`
        (a prefill worker took work) with several router replicas: now, as live (common/worker.py),
        without the coalescing delay (the beat already due later then comes now instead). `relay`
        (several replicas only) emulates live's relay (the bus and the processes' wake-ups between
        a worker and the replicas): every prompt beat that much later."""
        d = self.cfg.prompt_beat
        if d < 0 or self.cfg.heartbeat_interval <= 0:
            return
        if self.cfg.routers > 1:  # (relay 0: at once; else live's relay, emulated, on every prompt beat)
            d = self.cfg.relay if at_once else d + self.cfg.relay
        if w.beat_at < 0 or now + d < w.beat_at:
            w.beat_at = now + d
            self._push(w.beat_at, _BEAT, w, None)

    def _beat_soon(self, w: Worker, at_once: bool = False) -> None:
        """The core's `beat_now` port."""
        self._soon(w, w.now, at_once)

    def _start_if_idle(self, w: Worker) -> None:
        """A request joined `w`'s engine (the core's `start` port): it steps, if it was idle."""
        if not w.busy:
            self._start(w, w.now)

    def _beat(self, w: Worker, now: float) -> None:
        if w.retired or w.beat_at != now:  # (not the beat due: an earlier one came instead, `_soon`)
            return
        w.beat_at = -1.0
        self._touch(w, now)
        self._snapshot(w, now)

    # -- engine steps ---------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: Any, extra: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj, extra))

    def _duration(self, w: Worker, plan: StepPlan, now: float) -> tuple[float, float]:
        """(the step's time as executed, as the model predicts it)."""
        pred = w.model.step_time(len(plan.decodes), plan.kv_tokens, [(chi, k) for _, chi, k in plan.chunks])
        if self._exact:
            return pred, pred
        return pred * self._error[w.wid].factor(now), pred

    def _start(self, w: Worker, now: float) -> None:
        plan = w.batcher.plan()
        if plan is None:
            w.busy = False
            return
        w.busy = True
        w.plan = plan
        for seq, _, _ in plan.chunks:
            if seq.prefill_started is None:
                seq.prefill_started = now
                seq.user.prefill_started = now  # type: ignore[attr-defined]
        dt, pred = self._duration(w, plan, now)
        w.until = now + pred  # the end of the step in flight, as the worker predicts it
        w.busy_s += dt
        self.steps += 1
        if isinstance(w, DecodeWorker):
            w.step_s += 0.1 * (dt - w.step_s)
        if plan.decodes:  # a step that delays running decodes: over the SLO, with or without a prefill chunk
            self.decode_steps += 1
            if dt > self.cfg.tbt_slo:
                self.over_slo[bool(plan.chunks)] += 1
        if w.estimator is not None:  # measured when the step ends, before the next plan: the same
            w.estimator.observe(pred, dt)
        self._push(now + dt, _STEP_P if isinstance(w, PrefillWorker) else _STEP_D, w, plan)

    def _prefill_done(self, w: PrefillWorker, plan: StepPlan, now: float) -> None:
        self._touch(w, now)
        out = w.batcher.commit(plan)
        if out.prefilled:
            self._q_prefill.add(now, -len(out.prefilled))
        for seq in out.prefilled:
            r: Req = seq.user  # type: ignore[assignment]
            r.prefilled = now
            r.cached = seq.cached
            lack = seq.prompt_len
            dcache = self._d_by_id[r.decode_worker].batcher.cache
            if dcache is not None and r.hashes:  # only the KV the decode worker lacks moves
                lack -= min(dcache.match(r.hashes) * dcache.block_tokens, seq.prompt_len - 1)
            self._push(now + w.model.xfer_time(lack), _XFER, r, None)
        w.now = now
        for seq in out.prefilled:  # the core: it heartbeats soon; the simulated hand-off always succeeds
            if w.core.on_prefilled(Prefilled(request_id=seq.request_id, attempt=seq.attempt, queue_s=0.0,
                                             prefill_s=0.0)) is not None:
                w.core.forget(seq.request_id)
        if out.prefilled:
            self.routers.prefill_done(w, now)
        if out.tokens:
            self._tokens(w, out, now)
        self._step_boundary(w, now)

    def _tokens(self, w: PrefillWorker | DecodeWorker, out: StepOutcome, now: float) -> None:
        """A step's tokens and finished requests, on a decode worker or on a prefill worker that
        decodes requests itself (route "retain"). A request prefilled where it decodes (deflected,
        or retained) has its first token here; a handed-off one had it when its KV landed."""
        for seq in out.tokens:
            r: Req = seq.user  # type: ignore[assignment]
            if r.ntok:
                r.gaps.append(now - r.last)
            else:
                r.first = now
                if seq.deflected or isinstance(w, PrefillWorker):
                    r.prefilled = now
                    r.cached = seq.cached
                    if isinstance(w, DecodeWorker):
                        # it reserves no step time any more; its next heartbeat lists it no more
                        w.core.prefilled(r.rid)
                        self._soon(w, now)
                    else:  # a request it decodes itself streams: a flip to decode keeps it
                        w.core.first_token(r.rid)
                    self.routers.first_token(w, r, now)
            r.last = now
            r.ntok += 1
        for seq in out.finished:
            seq.user.done = now  # type: ignore[attr-defined]
            w.core.finished(seq.request_id)
            self.routers.finished(w, seq.user, now)  # type: ignore[arg-type]
        if out.finished:
            self._soon(w, now)
            self.routers.kv_freed(w, now)

    def _decode_done(self, w: DecodeWorker, plan: StepPlan, now: float) -> None:
        self._touch(w, now)
        self._tokens(w, w.batcher.commit(plan), now)
        self._step_boundary(w, now)

    def _step_boundary(self, w: PrefillWorker | DecodeWorker, now: float) -> None:
        """`w`'s step ended: a flip under way may end its drain or take its new role (at a step
        boundary: what it keeps moves between steps), else its next step starts."""
        w.busy = False  # (until `_start` plans the next)
        if self.flipping is not None and self.flipping[0] is w:
            if self._swap_due:
                self._swap_due = False
                self._rejoin(w, self._switching or now, now)
                return
            self._drain_check(w, now)
        if not w.retired:
            self._start(w, now)

    def _kv_landed(self, r: Req, now: float) -> None:
        """`r`'s KV reached its decode worker: the core starts the handoff it kept room for."""
        w = self._d_by_id[r.decode_worker]
        self._touch(w, now)
        r.xfer = now
        p = w.core.kv_arrived(r.rid, r.attempt)
        if p is None:
            raise RuntimeError(f"KV of request {r.rid} (attempt {r.attempt}) landed on {w.wid}, "
                               "which does not wait for it")
        w.now = now
        w.reqs[r.rid] = r
        w.core.admit(p.work, "handoff", (), w.model)

    # -- the engines' side of the interface to the routers (sim/router.py, `Engines`) --------
    def deliver(self, w: Worker, now: float) -> None:
        self._touch(w, now)

    def deliver_all(self, now: float) -> None:
        fresh = self.cfg.heartbeat_interval <= 0
        for w in (*self.prefill, *self.decode):
            if fresh:
                self._snapshot(w, now)
            else:
                self._touch(w, now)

    def next_heartbeat(self, w: Worker, now: float) -> float:
        t = w.next_hb if self.cfg.heartbeat_interval > 0 else now
        if 0 <= w.beat_at < t:
            t = w.beat_at
        return t

    def retry_at(self, t: float, replica: int | None = None, turn: bool = False) -> None:
        self._push(t, _RETRY, replica, turn)

    def give_up_at(self, t: float, r: Req) -> None:
        self._push(t, _GIVE_UP, r, None)

    def decode_work(self, w: DecodeWorker, work: m.DecodeWork, r: Req, now: float) -> Outcome:
        """`w`'s core takes `work` (a deflection starts at once, a handoff waits for its KV) or turns
        it away (what it sent the router waits in `w.outbox`)."""
        self._touch(w, now)
        w.now = now
        w.reqs[r.rid] = r
        out = w.core.on_work(work, now, w.load(now), w.model, w.prefix_cached(r) if work.chunk_schedule else None)
        if out != "started":
            w.reqs.pop(r.rid, None)
        return out

    def prefill_work(self, pw: PrefillWorker, work: m.PrefillWork, r: Req, now: float) -> bool:
        """`pw`'s core queues `work`'s prefill (its KV bound for the DecodeWork's worker, which keeps
        room), or, route "retain", keeps it to decode itself; only the latter may be turned away
        (no KV room: False, its RequestFailed in `pw.outbox`)."""
        self._touch(pw, now)
        pw.now = now
        pw.reqs[r.rid] = r
        if not pw.core.on_work(work, pw.load(now)):
            pw.reqs.pop(r.rid, None)
            if work.retain:
                return False
            raise RuntimeError(f"simulated prefill worker {pw.wid} refused {r.rid}: {pw.outbox[-1:]}")
        if not work.retain:  # the prefill queue's level counts the hand-offs (a retained one never leaves it so)
            self._q_prefill.add(now, 1)
        return True

    # -- the role planner ---------------------------------------------------------------
    def _plan(self, now: float) -> None:
        """The planner's tick (every `interval_s`): a flip under way goes on; otherwise router 0
        measures its view of the load and the planner may start one."""
        planner = self.planner
        assert planner is not None
        if self.flipping is not None:
            self._drain_check(self.flipping[0], now)
            return
        self.deliver_all(now)
        rt = self.routers.replicas[0]
        rt.flush(now)
        rt.core.plan_roles(now)
        rt.flush(now)  # its SetRole, if any, reaches the worker (`set_role`)

    def set_role(self, wid: str, msg: m.SetRole, now: float) -> None:
        """Worker `wid` got router 0's SetRole: its core drains for the change (Goodbye "role_change"
        to every router); it rejoins once it holds nothing (`_drain_check`)."""
        planner = self.planner
        w = next(x for x in (*self.prefill, *self.decode) if x.wid == wid)
        self._touch(w, now)
        w.now = now
        bye = w.core.set_role(msg, keep=self.cfg.planner_keep)
        if bye is None or planner is None or planner.pending is None:
            return
        self.flipping = (w, planner.pending, now)
        self.routers.tell(w, bye, now)  # every router: it takes no new work
        self._drain_check(w, now)

    def _drain_check(self, w: Worker, now: float) -> None:
        """The flipping worker holds nothing any more: it leaves its role, and its engine rejoins
        under the other `planner_switch_s` later."""
        if w.retired or self._switching is not None or not w.core.drained(now):
            return  # (retired or switching: drained already, until it rejoins)
        kept = w.core.kept()
        if (len(w.batcher) != len(kept)) if kept else (w.busy or len(w.batcher)):
            return  # (keeping: its engine steps them on meanwhile)
        assert self.flipping is not None and self.flipping[0] is w
        self._touch(w, now)
        w.now = now
        bye = w.core.hand_back()  # holds nothing but what it keeps: hands nothing back
        if kept:  # its running decodes go on; it takes its new role `planner_switch_s` later
            if isinstance(w, PrefillWorker):
                self.routers.handed_off(w, frozenset(rid for rid, _ in kept))
            self.routers.tell(w, bye, now)  # ("role_switch": every router keeps it, draining)
            self._switching = now
            self._push(now + self.cfg.planner_switch_s, _REJOIN, w, now)
            return
        if isinstance(w, PrefillWorker):
            self.routers.handed_off(w)
        self.routers.tell(w, bye, now)
        self._retire(w)
        self._push(now + self.cfg.planner_switch_s, _REJOIN, w, now)

    def _retire(self, w: Worker) -> None:
        """A flipped worker leaves its old role: out of its pool and the routers' tables."""
        w.retired = True
        if isinstance(w, PrefillWorker):
            self.prefill.remove(w)
        elif isinstance(w, DecodeWorker):
            self.decode.remove(w)
            del self._d_by_id[w.wid]
        self.routers.worker_left(w)

    def _rejoin(self, old: Worker, drained_at: float, now: float) -> None:
        """The flipped worker says Hello under its new role: a new core (and batcher, its prefix
        cache empty) on the same engine; what a keeping flip kept moves to it, between steps."""
        assert self.flipping is not None
        _, flip, started = self.flipping
        h = self.cfg.heartbeat_interval
        moved = []
        if not old.retired:  # a flip that kept running decodes: they move to the new role now
            if old.busy:
                self._swap_due = True  # at the end of the step in flight (`_step_boundary`)
                return
            self._touch(old, now)
            kept = old.core.kept()
            if len(kept) != len(old.batcher):
                raise RuntimeError(f"simulated worker {old.wid} switching with {len(old.batcher)} requests "
                                   f"in its engine, {len(kept)} kept")
            for rid, _ in kept:
                seq = old.batcher.remove(rid)
                assert seq is not None
                moved.append(seq)
            self._retire(old)
            self._switching = None
        new: Worker
        if flip.to == "decode":
            new = self._new_decode(old.wid, old.phase, old.estimator)
            self.decode.append(new)
            self._d_by_id[new.wid] = new
        else:
            new = self._new_prefill(old.wid, old.phase, old.estimator)
            self.prefill.append(new)
        if h > 0:  # its heartbeats keep their phase
            new.next_hb = old.phase + (math.floor((now - old.phase) / h) + 1) * h
        new.now = now
        for seq in moved:
            new.batcher.adopt(seq)
            if isinstance(new, DecodeWorker):
                seq.user.decode_worker = new.wid  # type: ignore[attr-defined]
        new.core.adopt(old.core)
        self.routers.worker_joined(new, now)
        self._snapshot(new, now)
        self.flipping = None  # (router 0's planner saw its Hello under the new role: the flip is over)
        self.flips.append({"at": round(started, 3), "worker": new.wid, "to": flip.to, "reason": flip.reason,
                           "drain_s": round(drained_at - started, 3), "out_s": round(now - started, 3),
                           "kept": len(moved),
                           **flip.evidence})
        self.retry_at(now)  # waiting requests may fit on it
        if moved:
            self._start(new, now)

    # -- the loop -------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        wall0 = time.perf_counter()
        bt = self.cfg.hash_block_tokens
        use = self.cfg.prefix_cache
        nr = self.cfg.routers
        reqs = [Req(rid=str(i), arrival=tr.t, prompt=tr.input_length, output=tr.output_length, router=i % nr,
                     hashes=chain_ids(tr.hash_ids[:tr.input_length // bt]) or None if use and tr.hash_ids else None)
                for i, tr in enumerate(trace)]
        if any(b.t < a.t for a, b in itertools.pairwise(trace)):
            raise ValueError("trace must be sorted by arrival time")
        heap = self._heap
        routers = self.routers
        pop = heapq.heappop
        n = len(reqs)
        ai = 0
        events = 0
        now = end = 0.0
        if self.planner is not None:
            self._push(self.planner.cfg.interval_s, _PLAN, None, None)
        while True:
            if heap and (ai >= n or heap[0][0] <= reqs[ai].arrival):
                now, _, kind, obj, plan = pop(heap)
                if (kind == _GIVE_UP and not routers.give_up(obj, now)) or (kind == _RETRY and not routers.waiting):
                    continue  # nothing left to do: not an event of the run
                if kind == _PLAN:  # the planner ticks while anything goes on (not an event of the run)
                    self._plan(now)
                    if ai < n or heap or self.flipping is not None:
                        self._push(now + self.planner.cfg.interval_s, _PLAN, None, None)  # type: ignore[union-attr]
                    continue
                end = now
                if kind == _STEP_D:
                    self._decode_done(obj, plan, now)
                elif kind == _STEP_P:
                    self._prefill_done(obj, plan, now)
                elif kind == _XFER:
                    self._kv_landed(obj, now)
                elif kind == _RETRY:
                    routers.retry(now, obj, plan)
                elif kind == _BEAT:
                    self._beat(obj, now)
                elif kind == _REJOIN:
                    self._rejoin(obj, plan, now)
            elif ai < n:
                now = end = reqs[ai].arrival
                routers.arrive(reqs[ai], now)
                ai += 1
            else:
                break
            events += 1
        stuck = [r.rid for r in reqs if not r.rejected and r.done < 0]  # placed or not: never finished
        if stuck:
            raise RuntimeError(f"simulation ended with {len(stuck)} unfinished requests (first: {stuck[0]})")
        records = [r.timing() for r in reqs]
        span = max((tr.t for tr in trace), default=0.0)
        dec = sorted(routers.decision_ns())
        stats: dict[str, Any] = {
            "events": events,
            "steps": self.steps,
            # where TBT misses come from: decode steps over the SLO, alone or beside a prefill chunk
            "decode_steps_over_tbt_slo": {"decode_steps": self.decode_steps, "decode_only": self.over_slo[0],
                                          "with_prefill_chunk": self.over_slo[1]},
            "makespan_s": end,
            "wall_s": time.perf_counter() - wall0,
            "decision_us_p50": dec[len(dec) // 2] / 1e3 if dec else None,
            "decision_us_p99": dec[min(len(dec) - 1, int(len(dec) * 0.99))] / 1e3 if dec else None,
            "routers": self.cfg.routers,
            "admission_rejected": routers.admission_rejected,
            "prefill_busy": _util([w.busy_s for w in self.prefill], max(span, end)),
            "decode_busy": _util([w.busy_s for w in self.decode], max(span, end)),
            "queues": {"router_kv_wait": routers.queue_report(end), "prefill": self._q_prefill.report(end)},
            "held": sum(r.was_held for r in reqs),  # requests the policy held at the router (late binding)
            "prefix_hit_rate": prefix_hit_rate(reqs) if self.cfg.prefix_cache else None,
            "prefix_index_blocks": routers.index_blocks(),
        }
        if self.planner is not None:
            stats["role_flips"] = self.flips
            stats["final_split"] = f"{len(self.prefill)}P{len(self.decode)}D"
        return SimResult(records=records, stats=stats)



def prefix_hit_rate(reqs: Sequence[Req]) -> float | None:
    """Prompt tokens whose prefill a prefix-cache hit skipped, over the prompt tokens of the
    requests that were prefilled (wherever: prefill worker or decode worker)."""
    done = [r for r in reqs if r.prefilled >= 0]
    total = sum(r.prompt for r in done)
    return sum(r.cached for r in done) / total if total else None


def _util(busy: list[float], span: float) -> float | None:
    if not busy or span <= 0:
        return None
    return sum(busy) / (len(busy) * span)


def simulate(trace: Sequence[TraceRequest], profile: Profile, policy: Policy, cfg: SimConfig) -> SimResult:
    return Simulation(profile, policy, cfg).run(trace)
