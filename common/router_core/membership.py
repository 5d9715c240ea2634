"""Worker membership on the router: who is registered, who is alive, who left.

Hello (refused with a reason, or welcomed and told which held requests to drop), Goodbye (a
drain begins; "drained": it leaves), heartbeats (each refreshes the worker's view; one from a
worker the router does not know, or an old incarnation of it, gets a Reregister), liveness (a
worker silent past the liveness window is removed and what it held is re-dispatched or migrated:
`expire`, called by the core's `tick`) and telemetry (worker state and router counters to the
monitor: `telemetry`, called once a second by the shell).

`Membership` owns who was asked to say Hello again; it changes the worker table and reaches the
rest of the router only through `core`, the few things it asks of it (`Router` below;
common/router_core/core.py builds it with the core, which is one). It reads no clock: every entry takes `now`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from common import messages as m
from common.config import RouterConfig
from common.logging import Throttle
from common.router_core.ports import Hooks, Log, Metrics, Outbox
from common.router_core.prefix import RouterPrefix
from common.router_core.requests import Request
from common.router_core.trust import Gate, refusal
from common.router_core.workers import WorkerEntry, WorkerTable
from common.sockets import fingerprint
from common.wait_queue import WaitQueue


class Router(Protocol):
    """What membership asks of the rest of the router core (core.py's RouterCore is one): the
    requests in flight and the wait queue (read only), and four actions."""

    requests: dict[str, Request]   # in flight, by the router's request id
    kv_waiting: WaitQueue[Request]
    unsent: dict[str, tuple[int, str]]  # request -> (attempt, worker) whose work could not be sent to it
    relays_unsent: dict[str, list[m.KvWant | m.KvTarget]]  # worker -> KV handshake relays that failed

    def send(self, w: WorkerEntry, msg: m.Msg) -> bool:
        """To a registered worker (marked unreachable if it fails: False)."""

    def redispatch(self, req: Request, why: str, bad_worker: str | None, now: float, *,
                   never_ran: bool = False) -> None:
        """Place again (or fail) a request its worker no longer holds."""

    def retry_waiting(self, now: float, heartbeat: bool = False) -> None:
        """Room may have opened: decide the waiting requests again."""

    def drop_frame(self, source: str, event: str, **fields: object) -> None:
        """Count and log (rate-limited) a frame that cannot be used."""


# work a live worker has not acknowledged this long after it was sent is taken as lost (at least)
LOST_DISPATCH_MIN_S = 2.0
# after a stall of this router: how long a worker whose connection broke may take to be heard
# again (its first Hello on the new connection unanswered for 1 s, then it dials again)
STALL_REDIAL_S = 1.5


@dataclass(eq=False)
class Membership:
    """Worker membership (see the module docstring)."""

    cfg: RouterConfig
    incarnation: str
    core: Router
    table: WorkerTable
    prefix: RouterPrefix
    gate: Gate
    counts: Counter[str]
    dropped: Throttle              # rate limit of repeated log lines
    outbox: Outbox                 # to any bus peer (registered or not) and to the monitor
    metrics: Metrics
    hooks: Hooks                   # views_changed, worker_joined
    wall_offset: float = 0.0       # wall-clock time = now + wall_offset
    asked_hello: dict[str, float] = field(default_factory=dict)  # worker id -> when last asked to Hello again
    excused_until: float = 0.0     # no worker is judged silent before this (`excuse_stall`)
    # the earliest time a message being read now can have been sent, router clock (the shell's
    # Inbox.drained_at: a backlog on its socket makes a heartbeat older than its reading); None:
    # read as it comes (the simulator)
    sent_after: Callable[[], float] | None = None
    log: Log = field(default_factory=structlog.get_logger)

    @property
    def liveness_s(self) -> float:
        """A worker silent this long is lost."""
        return self.cfg.liveness * self.cfg.heartbeat_interval

    def on_hello(self, identity: bytes, h: m.Hello, now: float) -> None:
        reason = refusal(identity, h, self.table, served_model=self.cfg.served_model_name)
        if reason:
            self.refuse(identity, h, reason)
            return
        known = self.table.workers.get(h.worker_id)
        is_new = known is None or known.incarnation != h.incarnation or known.role != h.role
        entry, old = self.table.register(h, identity, now)
        entry.key = self.gate.key  # under CURVE: the key it registered with, the only one it may speak with
        if old is not None and old.incarnation == h.incarnation:
            self.role_changed(old, entry, h, now)
        elif old is not None:
            self.log.warning("worker_restarted", worker=h.worker_id, old_incarnation=old.incarnation,
                        incarnation=h.incarnation)
            self.worker_gone(old, "restarted", now)
        if is_new:
            self.log.info("worker_joined", worker=h.worker_id, role=h.role, engine=h.engine, incarnation=h.incarnation,
                     token_budget=h.token_budget, kv_capacity_tokens=h.kv_capacity_tokens,
                     kv_transport=h.kv_transport)
        if not is_new:
            self.ends_unheard(entry, h, now)
        # What the worker holds that we do not track (we restarted, or re-dispatched it): drop it.
        drop = [rid for rid in h.held if not self._tracks(rid, h.worker_id)]
        if drop:
            self.log.info("worker_told_to_drop", worker=h.worker_id, requests=len(drop))
        self.core.send(entry, m.Welcome(router_incarnation=self.incarnation,
                                   heartbeat_interval_s=self.cfg.heartbeat_interval, drop=drop))
        if h.worker_id in self.core.relays_unsent:
            self.resend_relays(entry, resend=not is_new)
        if not entry.draining:
            self.hooks.worker_joined()  # requests held at admission try again

    def ends_unheard(self, w: WorkerEntry, h: m.Hello, now: float) -> None:
        """A registered worker says Hello again (its bus connection broke and came back, or our
        answers were late): a request of ours it no longer holds, though it streamed tokens of
        this attempt or had seen this attempt's work (its number is at most `h.last_dispatch`),
        ended there, or was refused, and that word was lost in transit with the connection (or the
        work itself was: a later dispatch arrived): without this it would wait for its deadline.
        Resumed from the last token the client has (migrate.py), finished if every token is out,
        or placed again. Messages on one connection arrive in order, so an end the worker sent
        before this Hello was read before it; work not yet seen (in flight) is left alone."""
        still = set(h.held)
        wid = w.worker_id
        for rid in [r for r in w.holding if r not in still]:
            req = self.core.requests.get(rid)
            if req is None or req.done:
                continue
            streaming = req.decode_worker == wid and req.n_out > req.resume_from
            if not streaming and not 0 < req.dispatched.get(wid, 0) <= h.last_dispatch:
                continue  # not streaming from it, and its work may not have reached it yet
            self.counts["ends_unheard"] += 1
            self.log.warning("request_end_lost_in_transit", request_id=rid, attempt=req.attempt, worker=wid,
                             sent_tokens=req.n_out, action="resume from the client's last token (or place it again)")
            self.core.redispatch(req, f"{wid} no longer holds it and its end never arrived (lost in "
                                      "transit: its bus connection broke?)", None, now)

    def resend_relays(self, w: WorkerEntry, *, resend: bool) -> None:
        """The KV handshake messages (KvWant, KvTarget) whose relay to `w` failed (its connection
        had broken: core.py, `send`), sent now that it said Hello again, after the Welcome, for
        each request still on that attempt with `w` as one of its two workers. Without this the
        hand-off waited for the prefill worker's `kv_timeout` (10 s) and the decode worker then
        prefilled it in place. Dropped (`resend` False) when it comes back as another incarnation
        or another role: what it held was placed again."""
        for msg in self.core.relays_unsent.pop(w.worker_id, []):
            req = self.core.requests.get(msg.request_id)
            if not resend or req is None or req.done or req.attempt != msg.attempt or \
                    w.worker_id not in (req.prefill_worker, req.decode_worker):
                continue
            self.counts["relays_resent"] += 1
            self.core.send(w, msg)

    def role_changed(self, old: WorkerEntry, entry: WorkerEntry, h: m.Hello, now: float) -> None:
        """The same worker (same incarnation) says Hello under its other role: a role flip whose
        worker kept its running decodes (they go on streaming from it; `h.held` names them). Each
        of them the router still tracks on this worker moves to the new entry, and its record
        says it decodes here, past its prefill; whatever else the old entry held is re-dispatched
        (the worker no longer has it). Nothing is counted lost: the worker left one role for the other."""
        held = set(h.held)
        # only what it decodes itself (a retained request, a decode): Hello.held also names the
        # requests whose messages wait in its hold (a PrefillDone of a hand-off to another worker)
        kept = [rid for rid in old.holding if rid in held and self._tracks(rid, h.worker_id)
                and self.core.requests[rid].decode_worker == h.worker_id]
        for rid in kept:
            entry.holding.add(rid)
            req = self.core.requests[rid]
            req.decode_worker = h.worker_id
            req.prefill_done = h.role == "decode" or req.prefill_done
        old.holding.difference_update(kept)
        self.prefix.forget(old.worker_id)
        self.metrics.observe_departed(old.role)
        self.log.info("worker_role_changed", worker=h.worker_id, role=h.role, old_role=old.role, kept=len(kept),
                      redispatched=len(old.holding))
        self.requeue_held(old, f"changed role to {h.role}", now)

    def refuse(self, identity: bytes, h: m.Hello, reason: str) -> None:
        self.counts["workers_refused"] += 1
        self.metrics.observe_refused(reason.split(":", 1)[0])
        held = self.dropped.admit(("worker_refused", h.worker_id, reason))  # a worker asks again and again
        if held is not None:
            self.log.error("worker_refused", worker=h.worker_id, role=h.role, engine=h.engine, model=h.model,
                      kv_transport=h.kv_transport, reason=reason, suppressed_since_last=held,
                      **({"key": fingerprint(self.gate.key)} if self.gate.key else {}))
        self.outbox.send(identity, m.Refused(router_incarnation=self.incarnation, reason=reason))

    def _tracks(self, request_id: str, worker_id: str) -> bool:
        req = self.core.requests.get(request_id)
        return req is not None and worker_id in (req.prefill_worker, req.decode_worker)

    def on_goodbye(self, g: m.Goodbye, w: WorkerEntry, now: float) -> None:
        if w.incarnation != g.incarnation:
            return
        if g.reason == "drained":  # the drain is over and it is leaving: a departure, not a loss
            self.table.remove(w.worker_id)
            self.prefix.forget(w.worker_id)
            self.metrics.observe_departed(w.role)
            self.log.info("worker_departed", worker=w.worker_id, role=w.role, holding=len(w.holding))
            self.outbox.publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason="departed",
                                             at=now + self.wall_offset))
            self.requeue_held(w, "departed", now)
            return
        w.draining = True
        w.touch()
        self.log.info("worker_draining", worker=g.worker_id, holding=len(w.holding), reason=g.reason)

    def on_heartbeat(self, identity: bytes, hb: m.PrefillHeartbeat | m.DecodeHeartbeat, now: float) -> None:
        """A heartbeat, taken only from the sender's own connection: the worker it is about must be
        the one that registered on this connection (its ZeroMQ identity, bound at Hello), so a peer
        that learned another worker's id and incarnation (from telemetry, say) cannot speak for it."""
        if identity != hb.worker_id.encode():
            self.gate.drop(identity, "heartbeat_for_another_worker", hb)
            return
        w = self.table.workers.get(hb.worker_id)
        if w is not None and w.identity != identity:
            self.gate.drop(identity, "heartbeat_from_another_connection", hb)
            return
        # the router clock of this worker's previous heartbeat (or of its registration: none yet)
        prev_at = (w.hb_at if w.hb is not None else w.joined) if w is not None and w.incarnation == hb.incarnation \
            else None
        try:
            entry = self.table.heartbeat(hb, now)
        except Exception as e:  # e.g. coefficients no model can be built from
            self.core.drop_frame("heartbeats", "bad_heartbeat_dropped", worker=hb.worker_id,
                            error=f"{type(e).__name__}: {e}"[:200])
            return
        if entry is None:
            # unknown worker or old incarnation: the router restarted, or declared it dead
            w = self.table.workers.get(hb.worker_id)
            if w is None or w.incarnation != hb.incarnation:
                self.ask_hello(hb.worker_id, now)
            return
        if prev_at is not None and now - prev_at > self.liveness_s / 2:
            # the first heartbeat after a silence (this router stalled, or the worker or its
            # connection did): what it and those read with it say may be old, sent before work
            # since reached the worker. At a thaw the work socket's backlog is read before the
            # liveness loop wakes to excuse the stall (services/router/service.py), so that excuse
            # comes too late for them: judge no silence until heartbeats come in a steady stream
            entry.steady_at = now + self.liveness_s
        if entry.ledger:
            lost = [no for no in hb.missed if no in entry.ledger]
            # unacknowledged for lost_dispatch_s, counted to when this heartbeat can have been sent
            # at the earliest: one that waited in this router's backlog (a busy loop reads a batch
            # of hundreds) says nothing of work sent while it waited (a burst's false losses, each
            # request placed again until its retries ran out: stranded.md)
            sent = now if self.sent_after is None else min(now, self.sent_after())
            if now >= max(self.excused_until, entry.steady_at) and \
                    sent - next(iter(entry.ledger.values())).at > self.lost_dispatch_s:
                lost += [no for no, le in entry.ledger.items() if sent - le.at > self.lost_dispatch_s]
            if lost:
                self.lost_dispatches(entry, lost, now)
        self.prefix.on_heartbeat(hb)
        if self.core.kv_waiting:
            self.core.retry_waiting(now, heartbeat=True)  # its view may show room now (KV, a shorter prefill queue)
        self.hooks.views_changed()

    @property
    def lost_dispatch_s(self) -> float:
        """Work a live worker's heartbeats have not acknowledged this long after it was sent never
        reached it (`lost_dispatches`)."""
        return max(LOST_DISPATCH_MIN_S, 3.0 * self.cfg.zmq_heartbeat_s, 2.0 * self.liveness_s)

    def lost_dispatches(self, w: WorkerEntry, numbers: list[int], now: float) -> None:
        """Work sent to `w` that never reached it: the dispatch `numbers` its heartbeat says it
        skipped (`missed`: a later number arrived, so these were lost on the way; common/router_link.py,
        `RouterLink.saw`), or that its heartbeats still do not acknowledge `lost_dispatch_s` after
        it was sent while they keep coming (the last work sent into a broken connection: no later
        number shows the hole). A send into a connection that had already broken (the worker
        dialled again; ZeroMQ drops what the old one held, and the send did not fail: the router's
        side of it had not closed yet) loses it without a word; without this the request waited for
        its deadline (a frozen router, tests/chaos/stranded.py). Each request still waiting on
        that work is placed again, away from `w` if another worker can take it, without spending a
        migration. Should the work arrive after all, the new attempt's Cancel follows it on the
        same connection."""
        for no in dict.fromkeys(numbers):
            le = w.ledger.pop(no, None)
            if le is None:
                continue
            req = self.core.requests.get(le.request_id)
            if req is None or req.done or req.dispatched.get(w.worker_id) != no:
                continue  # ended, or placed again since
            self.counts["dispatches_lost"] += 1
            self.log.warning("dispatch_lost_in_transit", request_id=req.request_id, attempt=req.attempt,
                             worker=w.worker_id, dispatch=no, acknowledged=w.hb.last_dispatch if w.hb else 0,
                             sent_s_ago=round(now - le.at, 3), action="place it again")
            self.core.redispatch(req, f"its work (dispatch {no}) never reached {w.worker_id}: lost in transit "
                                      "(its bus connection broke?)", w.worker_id, now, never_ran=True)
        w.touch()

    def ask_hello(self, worker_id: str, now: float) -> None:
        last = self.asked_hello
        if now - last.get(worker_id, 0.0) < 0.5:
            return
        if self.outbox.send(worker_id.encode(), m.Reregister(router_incarnation=self.incarnation,
                                                                 reason="unknown worker")):
            last[worker_id] = now  # not yet reachable (reconnecting): ask again at its next heartbeat

    def excuse_stall(self, now: float, late_s: float) -> None:
        """This router did not run for a while (a pause, CPU starvation): a stall past the bus's
        ZeroMQ heartbeat timeout broke the workers' connections, and a worker's new connection may
        go unheard until it dials again (common/sockets.py, WorkerBus.reconnect: one unanswered
        Hello after the reconnection, a second). Judge no worker silent before then, or every
        worker is declared lost and every stream migrated for a pause the workers did not cause.
        A shorter stall (`late_s` under the heartbeat timeout, 3 x zmq_heartbeat_s) broke nothing
        and is not excused."""
        if self.cfg.zmq_heartbeat_s <= 0 or late_s < 3.0 * self.cfg.zmq_heartbeat_s:
            return
        self.excused_until = max(self.excused_until, now + self.liveness_s + STALL_REDIAL_S)

    def expire(self, now: float) -> None:
        """Remove the workers silent past the liveness window; what they held is re-dispatched or
        migrated (a worker that said Goodbye and went quiet holding nothing has left)."""
        if now < self.excused_until:
            return
        for w in self.table.expired(self.liveness_s, now):
            self.table.remove(w.worker_id)
            self.prefix.forget(w.worker_id)
            if w.draining and not w.holding:  # said Goodbye, then went quiet: it left
                self.metrics.observe_departed(w.role)
                self.log.info("worker_departed", worker=w.worker_id, role=w.role, silent_s=round(now - w.last_seen, 3))
                self.outbox.publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason="departed",
                                                 at=now + self.wall_offset))
                continue
            why = "unreachable" if w.unreachable else "heartbeat timeout"
            self.log.warning("worker_lost", worker=w.worker_id, role=w.role, reason=why,
                        silent_s=round(now - w.last_seen, 3), holding=len(w.holding))
            self.worker_gone(w, why, now)

    def worker_gone(self, w: WorkerEntry, why: str, now: float) -> None:
        self.core.relays_unsent.pop(w.worker_id, None)
        self.metrics.observe_worker_lost(w.role)
        self.prefix.forget(w.worker_id)
        self.outbox.publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason=why, at=now + self.wall_offset))
        self.requeue_held(w, why, now)

    def requeue_held(self, w: WorkerEntry, why: str, now: float) -> None:
        """Re-dispatch (or fail, if already streaming) what a worker that left was holding."""
        for rid in list(w.holding):
            req = self.core.requests.get(rid)
            if req is None or req.done:
                continue
            if w.role == "prefill" and (req.prefill_done or req.prefill_worker != w.worker_id) \
                    and req.decode_worker != w.worker_id:  # (a request it decodes itself: route retain)
                continue
            never_ran = self.core.unsent.get(rid, (-1, ""))[0] == req.attempt  # its work was not sent
            self.core.redispatch(req, f"{w.role} worker {w.worker_id} {why}", w.worker_id, now, never_ran=never_ran)

    def telemetry(self, now: float, loop_lag_ms: float = 0.0, delivery_allowance_ms: float = 0.0) -> None:
        """Each worker's state and the router's counters (and its event loop's lag, the shell's
        measure), to the monitor."""
        at = now + self.wall_offset
        for w in self.table.workers.values():
            hb = w.hb
            state: dict[str, float] = {}
            if isinstance(hb, m.PrefillHeartbeat):
                state = {"queued_tokens": hb.queued_tokens, "queued_requests": hb.queued_requests,
                         "step_ms_p50": hb.step_ms_p50}
            elif isinstance(hb, m.DecodeHeartbeat):
                state = {"batch": hb.batch, "kv_tokens": hb.kv_tokens,
                         "kv_used": 1.0 - hb.kv_free_tokens / max(hb.kv_capacity_tokens, 1),
                         "deflections": hb.deflections, "step_ms_p50": hb.step_ms_p50,
                         "step_ms_max": hb.step_ms_max,
                         "tbt_slack_ms": hb.tbt_slack_ms if hb.tbt_slack_ms is not None else -1.0,
                         "waiting_kv": hb.waiting_kv, "resident_prefill_tokens": hb.resident_prefill_tokens}
            if hb is not None:
                state["loop_lag_ms"] = hb.loop_lag_ms
                if hb.step_err_p50 is not None:
                    state["step_err_p50"] = hb.step_err_p50
                if hb.step_err_p90 is not None:
                    state["step_err_p90"] = hb.step_err_p90
            state["draining"] = float(w.draining)
            state["holding"] = len(w.holding)
            self.outbox.publish(m.WorkerSeen(worker_id=w.worker_id, role=w.role, incarnation=w.incarnation,
                                             engine=w.hello.engine, state=state, at=at))
        self.metrics.set_in_flight(len(self.core.requests))
        self.metrics.set_workers(self.table.count("prefill"), self.table.count("decode"))
        self.metrics.set_worker_roles({w.worker_id: w.role for w in self.table.workers.values()})
        self.outbox.publish(m.RouterStats(at=at, in_flight=len(self.core.requests), accepted=self.counts["accepted"],
                                          completed=self.counts["completed"], failed=self.counts["failed"],
                                          rejected=self.counts["rejected"], loop_lag_ms=loop_lag_ms,
                                          delivery_allowance_ms=delivery_allowance_ms))
