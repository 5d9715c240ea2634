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

What the policy sees is what the live router sees: per-worker views built from heartbeats that
each worker publishes every `heartbeat_interval` seconds (phases staggered across workers), so
they are stale in between, plus, unless switched off, the router's ledger of work it has
dispatched to the worker since that worker's last heartbeat. With `routers` > 1 the requests
go round-robin to that many routers, each with its own policy object and its own ledger (it
knows only what it dispatched itself); every heartbeat reaches all of them. With `held_list`,
a decode worker's heartbeats also list the deflections it holds and which router sent each, and
each router adds the others' ones to its view; a live worker heartbeats at once when it admits
a deflection and when one finishes its prefill, so the simulated routers see those changes at
once. Besides its periodic heartbeats a worker heartbeats `prompt_beat` seconds after its state
changes, as live workers do (common/worker.py: 2 ms, changes in between coalesced into one
beat): when work reaches it, when a decode worker admits a request (a deflection, or a handoff
whose KV landed), when a prefill ends, when a request finishes. So every router sees every
dispatch within 2 ms, and the router's wait queue is retried then. `prompt_beat` < 0: only the
periodic heartbeats (the simulator's behaviour before 2026-12-01); 0: at once. With `admission`, a decode worker checks
each deflection against its live state before it starts it (common/policy/admission.py) and
the router decides again without that worker.
A heartbeat is the worker's state at the heartbeat instant; since state only changes at
events, it is captured lazily (just before the first event at or after the instant touches the
worker), which is exact and costs nothing while a worker is idle. `heartbeat_interval = 0`
gives the policy perfect, instantaneous views.

Overload, as engines behave: a request the policy cannot place (no decode worker has KV room in
the router's view) waits in the router's FIFO queue, and the queue is retried whenever a decode
worker's finished requests become visible (at its next heartbeat; at once without heartbeats).
A request that has waited `kv_wait_timeout` seconds, or finds `kv_wait_max` requests already
waiting, is rejected: it produces no token and `summarize` counts it (see sim/stats.py). Work
the router did place but that finds the worker's KV full queues on that worker until KV frees.

Late binding (Kairos's `late_binding`): a request the policy holds (`Hold`: the prefill queues are
deep, no decode worker can take it in place) waits in the same queue. Held requests do not block
the queue: a later arrival is still decided at once, and a retry walks the waiting requests in
arrival order (up to `wait_queue.SCAN` of them), stopping at one that waits for KV room. Retries also
run when a prefill worker's shorter queue becomes visible (its next heartbeat) and when a
deflection's first token frees its slot (the ledger: at once).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from common.engines.batcher import Batcher, Seq, StepPlan
from common.engines.prefix_cache import PrefixCache
from common.engines.replay import Tail, drain
from common.engines.step_error import ChunkGuard, StepError, StepErrorEstimator, bias_factor
from common.perf_model import Profile
from common.policy import ClusterView, Decision, DecodeView, Hold, NoWorkers, Policy, PrefillView, RequestSpec
from common.policy.admission import accepted_entry, check_deflection, decide_without
from common.policy.kairos import Kairos, latest_start, retry_order
from common.policy.prefix_index import PrefixIndex
from common.policy.schedule import reserved_step_cost
from common.prefix_hash import chain_ids
from common.traces import TraceRequest
from common.wait_queue import Outcome, WaitQueue
from sim.state import DecodeWorker, Level, PrefillWorker, Req, Worker
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
    bias_correction: bool = True  # routers scale each worker's model by its measured step bias (heartbeats)
    seed: int = 0
    kv_wait_timeout: float = 30.0  # seconds a request may wait for KV room before it is rejected
    kv_wait_max: int = 1024        # requests waiting for KV room before new ones are rejected at once (as the router)
    prefix_cache: bool = True      # per-worker prefix caches and the router's prefix index (traces with hash_ids)
    hash_block_tokens: int = 512   # prompt tokens per trace hash_ids entry: the cache's block size
    routers: int = 1               # router replicas, requests assigned round-robin, each with its own ledger
    admission: bool = True         # decode workers check every deflection against their live state
    held_list: bool = True         # decode heartbeats list the deflections held, by router (routers add the others')
    prompt_beat: float = 0.002  # a worker also heartbeats this long after its state changes (live: 2 ms); < 0: never

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
        self.step_error()  # validates

    def step_error(self) -> StepError:
        return StepError(noise=self.step_noise, scale=self.step_scale, speeds=self.worker_speed,
                         slow_every_s=self.slow_every_s, slow_for_s=self.slow_for_s, slow_factor=self.slow_factor,
                         straggler_p=self.straggler_p, straggler_factor=self.straggler_factor)




_STEP_P, _STEP_D, _XFER, _RETRY, _GIVE_UP, _BEAT = 0, 1, 2, 3, 4, 5


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
        # one policy object per router (they keep per-router state: caches, counters, rates)
        self.policies = [policy, *(copy.deepcopy(policy) for _ in range(cfg.routers - 1))]
        self.cfg = cfg
        model = profile.model
        self.model = model
        n_workers = cfg.prefill + cfg.decode
        h = cfg.heartbeat_interval

        def phase(i: int) -> float:
            return h * i / n_workers if h > 0 else math.inf

        bt = cfg.hash_block_tokens

        def cache() -> PrefixCache | None:
            return PrefixCache(bt, profile.kv_capacity_tokens // bt) if cfg.prefix_cache else None

        self.prefill = [
            PrefillWorker(wid, Batcher(role="prefill", token_budget=profile.prefill_token_budget,
                                  max_batch=profile.max_batch, kv_capacity_tokens=profile.kv_capacity_tokens,
                                  default_chunk=profile.prefill_token_budget, prefix_cache=cache()), model, phase(i),
                     cfg.routers)
            for i, wid in enumerate(worker_ids("prefill", cfg.prefill))]
        self.decode = [
            DecodeWorker(wid, Batcher(role="decode", token_budget=profile.decode_token_budget,
                                 max_batch=profile.max_batch, kv_capacity_tokens=profile.kv_capacity_tokens,
                                 default_chunk=profile.decode_default_chunk, prefix_cache=cache(),
                                 guard=ChunkGuard(model, StepErrorEstimator()) if cfg.closed_loop else None), model,
                    phase(cfg.prefill + i), cfg.routers)
            for i, wid in enumerate(worker_ids("decode", cfg.decode))]
        for w in (*self.prefill, *self.decode):  # measured step error: the guard's estimator, where there is one
            guard = w.batcher.guard
            w.estimator = guard.estimator if guard is not None else (
                StepErrorEstimator() if cfg.bias_correction else None)
        self.index = PrefixIndex()  # the router's: fed by heartbeats' summaries and by dispatches
        if cfg.prefix_cache:
            for w in (*self.prefill, *self.decode):
                self.index.join(w.wid, bt)
        self._p_by_id = {w.wid: w for w in self.prefill}
        self._d_by_id = {w.wid: w for w in self.decode}
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._clusters: list[ClusterView | None] = [None] * cfg.routers
        self.admission_rejected = 0
        self._rng = random.Random(cfg.seed)
        error = cfg.step_error()
        self._exact = error.exact
        # each worker's injected error (one shared generator: with noise alone, the same draws as before)
        self._error = {w.wid: error.source(i, self._rng) for i, w in enumerate((*self.prefill, *self.decode))}
        self.steps = 0
        self.decision_ns: list[int] = []
        # the router's FIFO of requests waiting for KV room or held: the router's own class
        self._waiting: WaitQueue[Req] = WaitQueue(self.cfg.kv_wait_max)
        self._waiting_kv = 0  # of which waiting for KV room
        self._holding = 0     # of which held by the policy (late binding)
        self._late = policy.cfg if isinstance(policy, Kairos) and policy.cfg.late_binding else None
        self._q_wait, self._q_prefill, self._q_admit = Level(), Level(), Level()
        for w in (*self.prefill, *self.decode):
            self._snapshot(w, 0.0)  # the state announced at registration: idle

    # -- heartbeats and views -------------------------------------------------------------
    def _touch(self, w: Worker, now: float) -> None:
        """Capture the heartbeat(s) due by `now` before `w` changes (see the module docstring)."""
        if now >= w.next_hb:
            h = self.cfg.heartbeat_interval
            w.next_hb = w.phase + (math.floor((now - w.phase) / h) + 1) * h
            self._snapshot(w, now)

    def _snapshot(self, w: Worker, now: float) -> None:
        cache = w.batcher.cache
        if cache is not None:  # the heartbeat carries what the prefix cache stored and evicted
            stored, removed = cache.take_events()
            if removed:
                self.index.removed(w.wid, removed)
            if stored:
                self.index.stored(w.wid, stored)
        est = w.estimator
        bias = bias_factor(est.bias()) if est is not None and self.cfg.bias_correction else 1.0
        if bias != w.bias:  # as services/router/workers.py: a new model object only when it changes
            w.bias = bias
            w.view_model = w.model.scaled(bias) if bias != 1.0 else w.model
        if isinstance(w, PrefillWorker):
            backlog, busy = self._backlog(w)
            b = w.batcher
            tail = drain(w.model, b.token_budget, b.max_batch, busy, backlog)  # the worker's replay, its model
            if w.bias != 1.0:  # routers stretch it by its measured bias, from the heartbeat on (as live)
                tail = Tail(now + (tail.start - now) * w.bias, tail.chunks, tail.used, now + (tail.end - now) * w.bias)
            w.hb = (w.queued_tokens, w.queued_reqs, backlog, busy, tail)
            for pl in w.led:
                pl.tokens = pl.reqs = 0
                pl.q = []
        else:
            assert isinstance(w, DecodeWorker)
            batch = kv = res = defl = 0
            slo = math.inf
            for s in w.batcher.running:
                if s.computed < s.prompt_len:
                    res += s.prompt_len - s.computed
                    defl += 1
                else:
                    batch += 1
                    kv += s.computed + s.generated
                if s.tbt_slo < slo:
                    slo = s.tbt_slo
            pending = w.waiting_kv + len(w.admit_wait)
            free = w.batcher.kv_free() - w.waiting_kv_tokens - sum(s.kv_reserve for s in w.admit_wait)
            guard = w.batcher.guard
            w.hb = (batch, kv, free, res, defl, slo, pending, self._busy_until(w), w.step_s,
                    (guard.estimator.margin() if guard is not None else 1.0) / w.bias)
            for dl in w.led:
                dl.res = dl.kv = dl.pending = 0
        w.views = [None] * len(w.views)
        self._clusters = [None] * len(self._clusters)

    def _busy_until(self, w: Worker) -> float:
        """When the step in flight ends, as the worker predicts it (its model, without noise)."""
        return w.until if w.busy else 0.0

    def _backlog(self, w: PrefillWorker) -> tuple[tuple[tuple[int, int], ...], float]:
        """What a prefill heartbeat reports for the replay predictor: each held request's
        (prompt tokens, tokens done) in FIFO order once the step in flight ends, and that time
        (the worker also replays it: `drain`)."""
        b = w.batcher
        inflight = {id(seq): chi for seq, chi, _ in w.plan.chunks} if w.busy and w.plan else {}
        q = []
        for seq in itertools.chain(b.running, b.waiting):
            done = seq.computed + inflight.get(id(seq), 0)
            if done < seq.prompt_len:
                q.append((seq.prompt_len, done))
        return tuple(q), self._busy_until(w)

    def _prefill_view(self, w: PrefillWorker, router: int) -> PrefillView:
        q, n, backlog, busy, tail = w.hb
        led = w.led[router]
        return PrefillView(worker_id=w.wid, queued_tokens=q + led.tokens, queued_requests=n + led.reqs,
                           token_budget=w.batcher.token_budget, model=w.view_model, backlog=backlog, busy_until=busy,
                           drain=tail, ledger=tuple(led.q), max_batch=w.batcher.max_batch)

    def _decode_view(self, w: DecodeWorker, router: int) -> DecodeView:
        """As services/router/workers.py builds it: with the ledger, the deflection count and the
        reserved step cost come from the router's own exact record of deflections in flight (with
        several routers, of the ones it sent itself)."""
        batch, kv, free, res, defl, slo, pending, busy, step_s, margin = w.hb
        led = w.led[router]
        reserved = 0.0
        reserved_tokens = 0
        inflight: tuple[tuple[float, float, int], ...] = ()
        if self.cfg.ledger:
            defl = len(led.deflecting)
            for cost, tokens, _ in led.deflecting.values():
                reserved += cost
                reserved_tokens += tokens
            inflight = tuple((end, cost, tokens) for cost, tokens, end in led.deflecting.values())
            for rid, (rt, tokens) in w.accepted_from.items():  # the other routers' deflections (see _held_changed)
                if rt != router and self.cfg.held_list:
                    defl += 1
                    reserved += w.accepted[rid].reserved_s
                    reserved_tokens += tokens
        return DecodeView(worker_id=w.wid, batch=batch, kv_tokens=kv, kv_free_tokens=max(free - led.kv, 0),
                          kv_capacity_tokens=w.batcher.kv_capacity, resident_prefill_tokens=res + led.res,
                          deflections=defl, strictest_tbt_slo=None if slo == math.inf else slo,
                          token_budget=w.batcher.token_budget, model=w.view_model, reserved_step_s=reserved,
                          pending=pending + led.pending, reserved_tokens=reserved_tokens, busy_until=busy,
                          inflight=inflight, step_s=step_s, step_margin=margin)

    def _view(self, now: float, router: int = 0) -> ClusterView:
        fresh = self.cfg.heartbeat_interval <= 0
        for w in self.prefill:
            if fresh:
                self._snapshot(w, now)
            else:
                self._touch(w, now)
        for d in self.decode:
            if fresh:
                self._snapshot(d, now)
            else:
                self._touch(d, now)
        cluster = self._clusters[router]
        if cluster is None:
            for w in self.prefill:
                if w.views[router] is None:
                    w.views[router] = self._prefill_view(w, router)
            for d in self.decode:
                if d.views[router] is None:
                    d.views[router] = self._decode_view(d, router)
            cluster = self._clusters[router] = ClusterView(tuple(w.views[router] for w in self.prefill),
                                                           tuple(d.views[router] for d in self.decode))
        return cluster

    def _held_changed(self, w: DecodeWorker, router: int) -> None:
        """A deflection sent by `router` started or finished its prefill on `w`: the other
        routers see it at once, as the live worker heartbeats at once on both (its heartbeats
        list the deflections it holds and who sent them). Their ledgers never hold it."""
        if self.cfg.ledger and self.cfg.held_list:
            for i in range(len(self._clusters)):
                if i != router:
                    self._ledger_changed(w, i)

    def _ledger_changed(self, w: Worker, router: int) -> None:
        w.views[router] = None
        self._clusters[router] = None

    def _soon(self, w: Worker, now: float) -> None:
        """`w`'s state changed: it heartbeats `prompt_beat` later (one beat for every change
        until then), unless prompt beats are off or the views are always fresh anyway."""
        d = self.cfg.prompt_beat
        if d >= 0 and self.cfg.heartbeat_interval > 0 and w.beat_at < 0:
            w.beat_at = now + d
            self._push(w.beat_at, _BEAT, w, None)

    def _beat(self, w: Worker, now: float) -> None:
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
        if w.estimator is not None:  # measured when the step ends, before the next plan: the same
            w.estimator.observe(pred, dt)
        self._push(now + dt, _STEP_P if isinstance(w, PrefillWorker) else _STEP_D, w, plan)

    def _prefill_done(self, w: PrefillWorker, plan: StepPlan, now: float) -> None:
        self._touch(w, now)
        out = w.batcher.commit(plan)
        w.queued_tokens -= sum(chi for _, chi, _ in plan.chunks)
        w.queued_reqs -= len(out.prefilled)
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
        if out.prefilled:
            self._soon(w, now)
        if out.prefilled and self._holding:
            self._retry_at_heartbeat(w, now)  # its shorter queue shows at its next heartbeat
        self._start(w, now)

    def _decode_done(self, w: DecodeWorker, plan: StepPlan, now: float) -> None:
        self._touch(w, now)
        out = w.batcher.commit(plan)
        for seq in out.tokens:
            r: Req = seq.user  # type: ignore[assignment]
            if r.ntok:
                r.gaps.append(now - r.last)
            else:
                r.first = now
                if seq.deflected:
                    r.prefilled = now
                    r.cached = seq.cached
                    w.accepted.pop(r.rid, None)
                    if w.accepted_from.pop(r.rid, None) is not None:
                        self._held_changed(w, r.router)
                    self._soon(w, now)
                    w.led[r.router].deflecting.pop(r.rid, None)
                    if self.cfg.ledger:
                        self._ledger_changed(w, r.router)
                        if self._holding:
                            self._push(now, _RETRY, None, None)  # a deflection slot freed, seen at once
            r.last = now
            r.ntok += 1
        for seq in out.finished:
            seq.user.done = now  # type: ignore[attr-defined]
        if out.finished:
            self._soon(w, now)
            if w.admit_wait:
                self._drain_admissions(w, now)
            if self._waiting:  # the router sees the freed KV at this worker's next heartbeat
                self._retry_at_heartbeat(w, now)
        self._start(w, now)

    def _retry_at_heartbeat(self, w: Worker, now: float) -> None:
        t = w.next_hb if self.cfg.heartbeat_interval > 0 else now
        if 0 <= w.beat_at < t:
            t = w.beat_at
        if t != w.retry_at:
            w.retry_at = t
            self._push(t, _RETRY, None, None)

    def _admit(self, w: DecodeWorker, seq: Seq, now: float) -> None:
        if w.admit_wait or not w.batcher.can_admit(seq):
            w.admit_wait.append(seq)
            self._q_admit.add(now, 1)
        else:
            w.batcher.add(seq)
        if not w.busy:
            self._start(w, now)

    def _drain_admissions(self, w: DecodeWorker, now: float) -> None:
        while w.admit_wait and w.batcher.can_admit(w.admit_wait[0]):
            w.batcher.add(w.admit_wait.popleft())
            self._q_admit.add(now, -1)

    def _kv_landed(self, r: Req, now: float) -> None:
        w = self._d_by_id[r.decode_worker]
        self._touch(w, now)
        r.xfer = now
        w.waiting_kv -= 1
        w.waiting_kv_tokens -= r.prompt + r.output
        seq = Seq(request_id=r.rid, attempt=0, prompt_len=r.prompt, max_tokens=r.output,
                  tbt_slo=self.cfg.tbt_slo, computed=r.prompt, arrived=r.arrival, user=r, hashes=r.hashes)
        self._admit(w, seq, now)
        self._soon(w, now)

    # -- arrivals and the router's wait queue -----------------------------------------------
    def _arrive(self, r: Req, now: float) -> None:
        # FIFO: nobody overtakes a request waiting for KV room; held requests (late binding) do
        # not block the queue, so a new arrival is decided at once unless one waits for KV
        if self._waiting_kv or not self._dispatch(r, now):
            if self._waiting.full():
                self._reject(r, f"rejected: {len(self._waiting)} requests already waiting for a worker")
                return
            self._waiting.append(r)
            self._count_wait(r, 1)
            self._q_wait.add(now, 1)
            self._push(now + self.cfg.kv_wait_timeout, _GIVE_UP, r, None)

    def _count_wait(self, r: Req, delta: int) -> None:
        if r.held:
            self._holding += delta
        else:
            self._waiting_kv += delta

    def _retry(self, now: float) -> None:
        """Decide the waiting requests again (common/wait_queue.py, as the router): the first
        `SCAN`, in the policy's `retry_order` (arrival order but with late binding), past the held
        ones, stopping at the first that still waits for KV room."""
        slo = self.cfg.ttft_slo
        pm, pb = self.model, self.profile.prefill_token_budget

        def order(head: list[Req]) -> list[int]:
            for r in head:
                if self._late is not None and math.isnan(r.latest):
                    r.latest = latest_start(r.arrival, slo, pm.prefill_exec(r.prompt, pb))
            return retry_order(self._late, [r.latest for r in head], now)

        def place(r: Req) -> Outcome:
            self._count_wait(r, -1)
            if self._dispatch(r, now):
                r.waited = now - r.arrival
                self._q_wait.add(now, -1)
                return Outcome.PLACED
            self._count_wait(r, 1)
            return Outcome.HELD if r.held else Outcome.NO_ROOM

        self._waiting.retry(order, place)

    def _give_up(self, r: Req, now: float) -> bool:
        if r.route is not None or r.rejected:
            return False  # placed in time
        self._waiting.remove(r)
        self._count_wait(r, -1)
        self._q_wait.add(now, -1)
        r.waited = now - r.arrival
        what = "a worker to take it" if r.held else "KV room"
        self._reject(r, f"rejected: waited {self.cfg.kv_wait_timeout:g} s for {what} ({r.reason})")
        return True

    @staticmethod
    def _reject(r: Req, reason: str) -> None:
        r.rejected = True
        r.reason = reason

    def _dispatch(self, r: Req, now: float) -> bool:
        """Ask the policy and send the request on its way; False (and why in `r.reason`) if it
        cannot be placed now."""
        cfg = self.cfg
        cached: tuple[tuple[str, int], ...] = ()
        if r.hashes:
            bt = cfg.hash_block_tokens
            cached = tuple((w, n * bt) for w, n in self.index.hits(r.hashes).items())
        spec = RequestSpec(request_id=r.rid, prompt_tokens=r.prompt, max_tokens=r.output,
                           ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo, cached=cached)
        ri = r.router
        view = self._view(now, ri)
        policy = self.policies[ri]
        t0 = time.perf_counter_ns()
        try:
            d = policy.decide(spec, view, now)
        except NoWorkers as e:
            r.reason = str(e)
            r.held = isinstance(e, Hold)
            r.was_held = r.was_held or r.held
            return False
        finally:
            self.decision_ns.append(time.perf_counter_ns() - t0)
        dw = self._d_by_id[d.decode_worker]
        self._touch(dw, now)
        closed: frozenset[str] = frozenset()
        while d.route == "deflect" and cfg.admission and self._admission(dw, d):
            closed = closed | {d.decode_worker}
            try:
                d2 = decide_without(policy, spec, view, now, closed)  # the worker said no at once
            except NoWorkers:
                break  # no prefill worker to fall back to: the deflection goes ahead (as the live router)
            self.admission_rejected += 1
            d = d2
            dw = self._d_by_id[d.decode_worker]
            self._touch(dw, now)
        r.route = d.route
        r.reason = d.reason
        r.decode_worker = d.decode_worker
        led = dw.led[ri]
        need = r.prompt + r.output
        uncached = r.prompt - d.cached_tokens  # as the router expects it
        if r.hashes:  # the prompt will be cached where it goes: the router's index need not wait
            self.index.stored(dw.wid, r.hashes)
            if d.prefill_worker is not None:
                self.index.stored(d.prefill_worker, r.hashes)
        if d.route == "deflect":
            r.ttft_pred = _from_arrival(d.ttft_decode_pred, r, now)
            seq = Seq(request_id=r.rid, attempt=0, prompt_len=r.prompt, max_tokens=r.output, tbt_slo=cfg.tbt_slo,
                      schedule=deque(d.chunk_schedule) if d.chunk_schedule else None, deflected=True,
                      arrived=now, user=r, hashes=r.hashes)
            led.deflecting[r.rid] = (reserved_step_cost(dw.view_model, d.chunk_schedule, dw.batcher.token_budget,
                                                        d.cached_tokens),
                                     max(d.chunk_schedule, default=0), now + (d.ttft_decode_pred or 0.0))
            dw.accepted[r.rid] = accepted_entry(dw.view_model, d.chunk_schedule, d.step_budget_s,
                                                dw.batcher.token_budget, d.cached_tokens)
            dw.accepted_from[r.rid] = (ri, max(d.chunk_schedule, default=0))
            self._held_changed(dw, ri)
            if cfg.ledger:
                led.res += uncached
                led.kv += need
                self._ledger_changed(dw, ri)
            self._admit(dw, seq, now)
            self._soon(dw, now)
            return True
        assert d.prefill_worker is not None
        r.ttft_pred = _from_arrival(d.ttft_prefill_pred, r, now)
        pw = self._p_by_id[d.prefill_worker]
        self._touch(pw, now)
        pseq = Seq(request_id=r.rid, attempt=0, prompt_len=r.prompt, max_tokens=r.output,
                   tbt_slo=cfg.tbt_slo, arrived=now, user=r, hashes=r.hashes)
        pw.batcher.add(pseq)
        pw.queued_tokens += pseq.remaining_prompt
        pw.queued_reqs += 1
        self._q_prefill.add(now, 1)
        dw.waiting_kv += 1
        dw.waiting_kv_tokens += need
        if cfg.ledger:
            pled = pw.led[ri]
            pled.tokens += uncached
            pled.reqs += 1
            pled.q.append((uncached, now))
            led.pending += 1
            led.kv += need
            self._ledger_changed(pw, ri)
            self._ledger_changed(dw, ri)
        if not pw.busy:
            self._start(pw, now)
        self._soon(pw, now)
        self._soon(dw, now)
        return True

    def _admission(self, w: DecodeWorker, d: Decision) -> str:
        """The decode worker's check of a deflection against its live state ('' when it fits)."""
        batch = kv = 0
        slo = math.inf
        for s in w.batcher.running:
            if s.computed >= s.prompt_len:
                batch += 1
                kv += s.computed + s.generated
            if s.tbt_slo < slo:
                slo = s.tbt_slo
        # the model the router planned with (the worker's, times the bias the router took: DecodeWork.model_bias)
        return check_deflection(w.view_model, batch=batch, kv_tokens=kv, schedule=d.chunk_schedule,
                                budget_s=d.step_budget_s, tbt_slo=self.cfg.tbt_slo, accepted=w.accepted.values(),
                                strictest_tbt_slo=None if slo == math.inf else slo, cached=d.cached_tokens)

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
        pop = heapq.heappop
        n = len(reqs)
        ai = 0
        events = 0
        now = end = 0.0
        while True:
            if heap and (ai >= n or heap[0][0] <= reqs[ai].arrival):
                now, _, kind, obj, plan = pop(heap)
                if (kind == _GIVE_UP and not self._give_up(obj, now)) or (kind == _RETRY and not self._waiting):
                    continue  # nothing left to do: not an event of the run
                end = now
                if kind == _STEP_D:
                    self._decode_done(obj, plan, now)
                elif kind == _STEP_P:
                    self._prefill_done(obj, plan, now)
                elif kind == _XFER:
                    self._kv_landed(obj, now)
                elif kind == _RETRY:
                    self._retry(now)
                elif kind == _BEAT:
                    self._beat(obj, now)
            elif ai < n:
                now = end = reqs[ai].arrival
                self._arrive(reqs[ai], now)
                ai += 1
            else:
                break
            events += 1
        stuck = [r.rid for r in reqs if r.route is not None and r.done < 0]
        if stuck:
            raise RuntimeError(f"simulation ended with {len(stuck)} unfinished requests (first: {stuck[0]})")
        records = [self._timing(r) for r in reqs]
        span = max((tr.t for tr in trace), default=0.0)
        dec = sorted(self.decision_ns)
        stats: dict[str, Any] = {
            "events": events,
            "steps": self.steps,
            "makespan_s": end,
            "wall_s": time.perf_counter() - wall0,
            "decision_us_p50": dec[len(dec) // 2] / 1e3 if dec else None,
            "decision_us_p99": dec[min(len(dec) - 1, int(len(dec) * 0.99))] / 1e3 if dec else None,
            "routers": self.cfg.routers,
            "admission_rejected": self.admission_rejected,
            "prefill_busy": _util([w.busy_s for w in self.prefill], max(span, end)),
            "decode_busy": _util([w.busy_s for w in self.decode], max(span, end)),
            "queues": {"router_kv_wait": self._q_wait.report(end), "prefill": self._q_prefill.report(end),
                       "decode_admit": self._q_admit.report(end)},
            "held": sum(r.was_held for r in reqs),  # requests the policy held at the router (late binding)
            "prefix_hit_rate": prefix_hit_rate(reqs) if self.cfg.prefix_cache else None,
            "prefix_index_blocks": len(self.index),
        }
        return SimResult(records=records, stats=stats)

    @staticmethod
    def _timing(r: Req) -> RequestTiming:
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


def _from_arrival(pred: float | None, r: Req, now: float) -> float | None:
    """A TTFT predicted at dispatch, from the request's arrival (it may have waited at the router)."""
    return None if pred is None else pred + (now - r.arrival)


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
