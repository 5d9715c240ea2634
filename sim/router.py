"""The router side of the simulator: what the live router core owns (common/router_core/), run on the
simulator's clock. sim/core.py runs the engines (steps, KV transfers, heartbeats) and calls in
here; this module never touches an engine's state except through the `Engines` interface below,
which is the seam where the live router's core is to be plugged in later.

`SimRouter` is one router replica: its policy object (policies keep per-router state: caches,
counters, rates), its worker table (the live router's `WorkerTable`, common/router_core/workers.py:
each worker's Hello and last heartbeat, the ledger of what this replica dispatched to it that the
heartbeat did not acknowledge yet, its exact record of the deflections it sent that have not
produced their first token, and the views built from them, the ledger left out when `ledger` is
off), and dispatch: deciding, the decode worker's admission check (and deciding again without that
worker, as the live router does on a rejection), the ledger entries and deflection records (as
common/router_core/dispatch.py makes them) and the prefix index's updates. `Routers` holds the
replicas, the requests arrive round-robin at them (`Req.router`), and what the simulator keeps
once for all of them: the wait queue (common/wait_queue.py) with its retry, give-up and reject
rules, and the prefix index. (A live replica has its own wait queue and its own index; sharing
them here is the simulator's model, kept as it was before this module was split out.)

What the policy sees is what the live router sees: views built from heartbeats that each worker
publishes every `heartbeat_interval` seconds (plus its prompt beats, see sim/core.py), so they
are stale in between, plus the replica's ledger. Every heartbeat reaches every replica; with
`held_list`, a decode worker's heartbeats also list the deflections it holds and which router
sent each, and each replica adds the others' ones to its view (a change in that list reaches
them with the worker's next heartbeat: its prompt beat, 2 ms later, as live).

Overload, as engines behave: a request the policy cannot place (no decode worker has KV room in
the router's view) waits in the router's FIFO queue, and the queue is retried whenever a decode
worker's finished requests become visible (at its next heartbeat; at once without heartbeats).
A request that has waited `kv_wait_timeout` seconds, or finds `kv_wait_max` requests already
waiting, is rejected: it produces no token and `summarize` counts it (see sim/stats.py).

Late binding (Kairos's `late_binding`): a request the policy holds (`Hold`: the prefill queues are
deep, no decode worker can take it in place) waits in the same queue. Held requests do not block
the queue: a later arrival is still decided at once, and a retry walks the waiting requests in
arrival order (up to `wait_queue.SCAN` of them), stopping at one that waits for KV room. Retries also
run when a prefill worker's shorter queue becomes visible (its next heartbeat) and when a
deflection's first token frees its slot (the ledger: at once).

The interface, router to engines (`Engines`, implemented by sim/core.py's `Simulation`):
    deliver(w, now)                 W's heartbeats due by `now` reach the routers (the engines take
                                    them lazily; a router asks before it reads or records anything
                                    about W)
    deliver_all(now)                every worker's, for a view (heartbeat_interval 0: the live state)
    check_deflection(w, d)          decode worker W's admission check of deflection `d` ('' = fits)
    admit_deflection(w, r, d, now)  W takes deflection `d` of request `r` (prefills it in place)
    queue_prefill(p, w, r, now)     prefill worker P queues `r`'s prefill, its KV bound for W
    next_heartbeat(w, now)          when W's next heartbeat (periodic or prompt) reaches the routers
    retry_at(t), give_up_at(t, r)   timers: retry the wait queue; give up on `r` if still waiting
and what a router reads of a worker: its id, its Hello (`hello()`: its settings) and its last
heartbeat (`hb`: a `PrefillHeartbeat` / `DecodeHeartbeat` as the live worker fills it, the held
list in it; each router sets `last_dispatch` to the dispatches it sent before it was made).
Engines to routers (`Routers`): heartbeat(w, stored, removed, now) (a heartbeat made at `now`, with
the prefix cache's changes), first_token(w, r, now) (a deflection's first token),
kv_freed(w, now) (requests finished on decode worker W), prefill_done(w, now).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec

from common.perf_model import PerfModel, Profile
from common.policy import ClusterView, Decision, Hold, NoWorkers, Policy, RequestSpec
from common.policy.admission import decide_without
from common.policy.kairos import Kairos, latest_start, retry_order
from common.policy.prefix_index import PrefixIndex
from common.router_core.workers import WorkerTable
from common.wait_queue import Outcome, WaitQueue
from sim.state import DecodeWorker, Level, PrefillWorker, Req, SimConfig, Worker, router_name


class Engines(Protocol):
    """What the router side may ask of the simulated engines (see the module docstring)."""

    def deliver(self, w: Worker, now: float) -> None: ...
    def deliver_all(self, now: float) -> None: ...
    def check_deflection(self, w: DecodeWorker, d: Decision) -> str: ...
    def admit_deflection(self, w: DecodeWorker, r: Req, d: Decision, now: float) -> None: ...
    def queue_prefill(self, p: PrefillWorker, w: DecodeWorker, r: Req, now: float) -> None: ...
    def next_heartbeat(self, w: Worker, now: float) -> float: ...
    def retry_at(self, t: float) -> None: ...
    def give_up_at(self, t: float, r: Req) -> None: ...


class SimRouter:
    """One router replica: its policy, its worker table (the live router's: heartbeats, ledger,
    deflections, views), its dispatch."""

    def __init__(self, i: int, policy: Policy, cfg: SimConfig, engines: Engines, index: PrefixIndex,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker], tier: Routers,
                 model: PerfModel) -> None:
        self.i = i
        self.policy = policy
        self.cfg = cfg
        self.engines = engines
        self.index = index
        self.tier = tier
        self._p_by_id = {w.wid: w for w in prefill}
        self._d_by_id = {w.wid: w for w in decode}
        self.table = WorkerTable(model, bias_correction=cfg.bias_correction, me=router_name(i))
        for w in (*prefill, *decode):
            self.table.register(w.hello(), b"", 0.0)
        self.decision_ns: list[int] = []
        self.admission_rejected = 0

    # -- views ----------------------------------------------------------------------------
    def heartbeat(self, w: Worker, now: float) -> None:
        """`w`'s heartbeat (`w.hb`) arrived, acknowledging every dispatch this router sent it before."""
        hb = w.hb
        assert hb is not None
        e = self.table.workers[w.wid]
        if e.dispatch_no:
            hb = msgspec.structs.replace(hb, last_dispatch=e.dispatch_no)
        self.table.heartbeat(hb, now)

    def view(self, now: float) -> ClusterView:
        """What the policy sees now (the table rebuilds only what a heartbeat or the ledger changed)."""
        self.engines.deliver_all(now)
        return self.table.view(use_ledger=self.cfg.ledger)

    def first_token(self, w: DecodeWorker, r: Req, now: float) -> None:
        """Deflection `r` on `w` produced its first token: its slot is free in the ledger."""
        self.table.workers[w.wid].end_deflection(r.rid)
        if self.cfg.ledger and self.tier.holding:
            self.engines.retry_at(now)  # a deflection slot freed, seen at once

    # -- dispatch -------------------------------------------------------------------------
    def dispatch(self, r: Req, now: float) -> bool:
        """Ask the policy and send the request on its way; False (and why in `r.reason`) if it
        cannot be placed now."""
        cfg = self.cfg
        eng = self.engines
        cached: tuple[tuple[str, int], ...] = ()
        if r.hashes:
            bt = cfg.hash_block_tokens
            cached = tuple((w, n * bt) for w, n in self.index.hits(r.hashes).items())
        spec = RequestSpec(request_id=r.rid, prompt_tokens=r.prompt, max_tokens=r.output,
                           ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo, cached=cached)
        view = self.view(now)
        policy = self.policy
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
        eng.deliver(dw, now)
        closed: frozenset[str] = frozenset()
        while d.route == "deflect" and cfg.admission and eng.check_deflection(dw, d):
            closed = closed | {d.decode_worker}
            try:
                d2 = decide_without(policy, spec, view, now, closed)  # the worker said no at once
            except NoWorkers:
                break  # no prefill worker to fall back to: the deflection goes ahead (as the live router)
            self.admission_rejected += 1
            d = d2
            dw = self._d_by_id[d.decode_worker]
            eng.deliver(dw, now)
        r.route = d.route
        r.reason = d.reason
        r.decode_worker = d.decode_worker
        pw = self._p_by_id[d.prefill_worker] if d.prefill_worker is not None else None
        if pw is not None:
            eng.deliver(pw, now)  # its heartbeats due by now first: they acknowledge only earlier dispatches
        self.table.record_dispatch(d, r.rid, r.prompt, r.prompt + r.output, now)  # the ledger, as live
        if r.hashes:  # the prompt will be cached where it goes: the router's index need not wait
            self.index.stored(dw.wid, r.hashes)
            if d.prefill_worker is not None:
                self.index.stored(d.prefill_worker, r.hashes)
        if d.route == "deflect":
            r.ttft_pred = _from_arrival(d.ttft_decode_pred, r, now)
            eng.admit_deflection(dw, r, d, now)
            return True
        assert pw is not None
        r.ttft_pred = _from_arrival(d.ttft_prefill_pred, r, now)
        eng.queue_prefill(pw, dw, r, now)
        return True


class Routers:
    """The router replicas, and the wait queue and prefix index the simulator keeps once for all."""

    def __init__(self, profile: Profile, policy: Policy, cfg: SimConfig, engines: Engines,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker]) -> None:
        self.cfg = cfg
        self.engines = engines
        self.profile = profile
        self.index = PrefixIndex()  # fed by heartbeats' summaries and by dispatches
        if cfg.prefix_cache:
            for w in (*prefill, *decode):
                self.index.join(w.wid, cfg.hash_block_tokens)
        # one policy object per router (they keep per-router state: caches, counters, rates)
        policies = [policy, *(copy.deepcopy(policy) for _ in range(cfg.routers - 1))]
        self.replicas = [SimRouter(i, p, cfg, engines, self.index, prefill, decode, self, profile.model)
                         for i, p in enumerate(policies)]
        # the FIFO of requests waiting for KV room or held: the live router's own class
        self.waiting: WaitQueue[Req] = WaitQueue(cfg.kv_wait_max)
        self.waiting_kv = 0  # of which waiting for KV room
        self.holding = 0     # of which held by the policy (late binding)
        self.late = policy.cfg if isinstance(policy, Kairos) and policy.cfg.late_binding else None
        self.q_wait = Level()
        self._retry_at: dict[str, float] = {}  # per worker: the heartbeat at which a retry is already due

    @property
    def admission_rejected(self) -> int:
        return sum(rt.admission_rejected for rt in self.replicas)

    def decision_ns(self) -> list[int]:
        return [ns for rt in self.replicas for ns in rt.decision_ns]

    # -- from the engines -----------------------------------------------------------------
    def heartbeat(self, w: Worker, stored: Sequence[int], removed: Sequence[int], now: float) -> None:
        if removed:
            self.index.removed(w.wid, removed)
        if stored:
            self.index.stored(w.wid, stored)
        for rt in self.replicas:
            rt.heartbeat(w, now)

    def first_token(self, w: DecodeWorker, r: Req, now: float) -> None:
        self.replicas[r.router].first_token(w, r, now)

    def kv_freed(self, w: DecodeWorker, now: float) -> None:
        if self.waiting:  # the router sees the freed KV at this worker's next heartbeat
            self._retry_at_heartbeat(w, now)

    def prefill_done(self, w: PrefillWorker, now: float) -> None:
        if self.holding:
            self._retry_at_heartbeat(w, now)  # its shorter queue shows at its next heartbeat

    def _retry_at_heartbeat(self, w: Worker, now: float) -> None:
        t = self.engines.next_heartbeat(w, now)
        if t != self._retry_at.get(w.wid, -1.0):
            self._retry_at[w.wid] = t
            self.engines.retry_at(t)

    # -- arrivals and the wait queue ------------------------------------------------------
    def arrive(self, r: Req, now: float) -> None:
        # FIFO: nobody overtakes a request waiting for KV room; held requests (late binding) do
        # not block the queue, so a new arrival is decided at once unless one waits for KV
        if self.waiting_kv or not self.replicas[r.router].dispatch(r, now):
            if self.waiting.full():
                _reject(r, f"rejected: {len(self.waiting)} requests already waiting for a worker")
                return
            self.waiting.append(r)
            self._count_wait(r, 1)
            self.q_wait.add(now, 1)
            self.engines.give_up_at(now + self.cfg.kv_wait_timeout, r)

    def _count_wait(self, r: Req, delta: int) -> None:
        if r.held:
            self.holding += delta
        else:
            self.waiting_kv += delta

    def retry(self, now: float) -> None:
        """Decide the waiting requests again (common/wait_queue.py, as the router): the first
        `SCAN`, in the policy's `retry_order` (arrival order but with late binding), past the held
        ones, stopping at the first that still waits for KV room."""
        slo = self.cfg.ttft_slo
        pm, pb = self.profile.model, self.profile.prefill_token_budget

        def order(head: list[Req]) -> list[int]:
            for r in head:
                if self.late is not None and math.isnan(r.latest):
                    r.latest = latest_start(r.arrival, slo, pm.prefill_exec(r.prompt, pb))
            return retry_order(self.late, [r.latest for r in head], now)

        def place(r: Req) -> Outcome:
            self._count_wait(r, -1)
            if self.replicas[r.router].dispatch(r, now):
                r.waited = now - r.arrival
                self.q_wait.add(now, -1)
                return Outcome.PLACED
            self._count_wait(r, 1)
            return Outcome.HELD if r.held else Outcome.NO_ROOM

        self.waiting.retry(order, place)

    def give_up(self, r: Req, now: float) -> bool:
        if r.route is not None or r.rejected:
            return False  # placed in time
        self.waiting.remove(r)
        self._count_wait(r, -1)
        self.q_wait.add(now, -1)
        r.waited = now - r.arrival
        what = "a worker to take it" if r.held else "KV room"
        _reject(r, f"rejected: waited {self.cfg.kv_wait_timeout:g} s for {what} ({r.reason})")
        return True


def _reject(r: Req, reason: str) -> None:
    r.rejected = True
    r.reason = reason


def _from_arrival(pred: float | None, r: Req, now: float) -> float | None:
    """A TTFT predicted at dispatch, from the request's arrival (it may have waited at the router)."""
    return None if pred is None else pred + (now - r.arrival)
