"""Worker membership on the router: who is registered, who is alive, who left.

Hello (refused with a reason, or welcomed and told which held requests to drop), Goodbye (a
drain begins; "drained": it leaves), heartbeats (each refreshes the worker's view; one from a
worker the router does not know, or an old incarnation of it, gets a Reregister), the liveness
loop (a worker silent past the liveness window is removed and what it held is re-dispatched or
migrated; it also retries parked and KV-waiting requests and enforces request deadlines) and
the telemetry loop (worker state and router counters to the monitor, once a second). The
functions take the `Router` whose state they change; services/router/service.py calls them.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from common import codec
from common import messages as m
from common.sockets import fingerprint
from services.router import metrics
from services.router.trust import refusal
from services.router.workers import WorkerEntry

if TYPE_CHECKING:
    from services.router.service import Router

log = structlog.get_logger()


def on_hello(router: Router, identity: bytes, h: m.Hello) -> None:
    reason = refusal(identity, h, router.table, served_model=router.cfg.served_model_name)
    if reason:
        refuse(router, identity, h, reason)
        return
    known = router.table.workers.get(h.worker_id)
    is_new = known is None or known.incarnation != h.incarnation or known.role != h.role
    entry, old = router.table.register(h, identity)
    entry.key = router.gate.key  # under CURVE: the key it registered with, the only one it may speak with
    if old is not None:
        log.warning("worker_restarted", worker=h.worker_id, old_incarnation=old.incarnation,
                    incarnation=h.incarnation)
        worker_gone(router, old, "restarted")
    if is_new:
        log.info("worker_joined", worker=h.worker_id, role=h.role, engine=h.engine, incarnation=h.incarnation,
                 token_budget=h.token_budget, kv_capacity_tokens=h.kv_capacity_tokens,
                 kv_transport=h.kv_transport)
    # What the worker holds that we do not track (we restarted, or re-dispatched it): drop it.
    drop = [rid for rid in h.held if not _tracks(router, rid, h.worker_id)]
    if drop:
        log.info("worker_told_to_drop", worker=h.worker_id, requests=len(drop))
    router._send(entry, m.Welcome(router_incarnation=router.incarnation,
                                  heartbeat_interval_s=router.cfg.heartbeat_interval, drop=drop))
    if not entry.draining:
        _wake_held(router)


def refuse(router: Router, identity: bytes, h: m.Hello, reason: str) -> None:
    router.counts["workers_refused"] += 1
    metrics.observe_refused(reason.split(":", 1)[0])
    held = router._dropped.admit(("worker_refused", h.worker_id, reason))  # a worker asks again and again
    if held is not None:
        log.error("worker_refused", worker=h.worker_id, role=h.role, engine=h.engine, model=h.model,
                  kv_transport=h.kv_transport, reason=reason, suppressed_since_last=held,
                  **({"key": fingerprint(router.gate.key)} if router.gate.key else {}))
    router._work_send([identity, codec.encode(m.Refused(router_incarnation=router.incarnation, reason=reason))])


def _tracks(router: Router, request_id: str, worker_id: str) -> bool:
    req = router.requests.get(request_id)
    return req is not None and worker_id in (req.prefill_worker, req.decode_worker)


def _wake_held(router: Router) -> None:
    """A worker registered: requests held at admission try again."""
    joined, router._workers_joined = router._workers_joined, asyncio.Event()
    joined.set()


def on_goodbye(router: Router, g: m.Goodbye, w: WorkerEntry) -> None:
    if w.incarnation != g.incarnation:
        return
    if g.reason == "drained":  # the drain is over and it is leaving: a departure, not a loss
        router.table.remove(w.worker_id)
        router.prefix.forget(w.worker_id)
        metrics.observe_departed(w.role)
        log.info("worker_departed", worker=w.worker_id, role=w.role, holding=len(w.holding))
        router._publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason="departed", at=time.time()))
        requeue_held(router, w, "departed")
        return
    w.draining = True
    w.touch()
    log.info("worker_draining", worker=g.worker_id, holding=len(w.holding), reason=g.reason)


def on_heartbeat(router: Router, identity: bytes, hb: m.PrefillHeartbeat | m.DecodeHeartbeat) -> None:
    """A heartbeat, taken only from the sender's own connection: the worker it is about must be
    the one that registered on this connection (its ZeroMQ identity, bound at Hello), so a peer
    that learned another worker's id and incarnation (from telemetry, say) cannot speak for it."""
    if identity != hb.worker_id.encode():
        router.gate.drop(identity, "heartbeat_for_another_worker", hb)
        return
    w = router.table.workers.get(hb.worker_id)
    if w is not None and w.identity != identity:
        router.gate.drop(identity, "heartbeat_from_another_connection", hb)
        return
    try:
        entry = router.table.heartbeat(hb)
    except Exception as e:  # e.g. coefficients no model can be built from
        router.drop_frame("heartbeats", "bad_heartbeat_dropped", worker=hb.worker_id,
                          error=f"{type(e).__name__}: {e}"[:200])
        return
    if entry is None:
        # unknown worker or old incarnation: the router restarted, or declared it dead
        w = router.table.workers.get(hb.worker_id)
        if w is None or w.incarnation != hb.incarnation:
            ask_hello(router, hb.worker_id)
        return
    router.prefix.on_heartbeat(hb)
    if router.kv_waiting:
        router._retry_kv_waiting()  # its view may show room now (KV, a shorter prefill queue)
    router.prepare_soon()


def ask_hello(router: Router, worker_id: str) -> None:
    assert router.bus is not None
    now = time.monotonic()
    last = router.asked_hello
    if now - last.get(worker_id, 0.0) < 0.5:
        return
    if router._work_send([worker_id.encode(), codec.encode(
            m.Reregister(router_incarnation=router.incarnation, reason="unknown worker"))]):
        last[worker_id] = now  # not yet reachable (reconnecting): ask again at its next heartbeat


async def liveness_loop(router: Router) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(router.cfg.heartbeat_interval)
        now = time.monotonic()
        late, last = now - last - router.cfg.heartbeat_interval, now
        if late > router.liveness_s / 2:
            # this process did not run for a while (CPU starvation, a pause): the heartbeats
            # of that time may still be unread, so judge no worker before reading them
            log.warning("router_stalled", late_s=round(late, 3))
            continue
        for w in router.table.expired(router.liveness_s):
            router.table.remove(w.worker_id)
            router.prefix.forget(w.worker_id)
            if w.draining and not w.holding:  # said Goodbye, then went quiet: it left
                metrics.observe_departed(w.role)
                log.info("worker_departed", worker=w.worker_id, role=w.role,
                         silent_s=round(time.monotonic() - w.last_seen, 3))
                router._publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason="departed",
                                             at=time.time()))
                continue
            why = "unreachable" if w.unreachable else "heartbeat timeout"
            log.warning("worker_lost", worker=w.worker_id, role=w.role, reason=why,
                        silent_s=round(time.monotonic() - w.last_seen, 3), holding=len(w.holding))
            worker_gone(router, w, why)
        router.migration.retry_parked()
        now = time.monotonic()
        if router.kv_waiting:
            router.waiting.expire(now)
        for req in [r for r in router.requests.values() if now > r.deadline]:
            router._fail(req, f"deadline of {router.cfg.request_timeout:.0f}s exceeded", code="deadline_exceeded")


def worker_gone(router: Router, w: WorkerEntry, why: str) -> None:
    metrics.observe_worker_lost(w.role)
    router.prefix.forget(w.worker_id)
    router._publish(m.WorkerLost(worker_id=w.worker_id, role=w.role, reason=why, at=time.time()))
    requeue_held(router, w, why)


def requeue_held(router: Router, w: WorkerEntry, why: str) -> None:
    """Re-dispatch (or fail, if already streaming) what a worker that left was holding."""
    for rid in list(w.holding):
        req = router.requests.get(rid)
        if req is None or req.done:
            continue
        if w.role == "prefill" and (req.prefill_done or req.prefill_worker != w.worker_id):
            continue
        router._redispatch(req, f"{w.role} worker {w.worker_id} {why}", w.worker_id)


async def telemetry_loop(router: Router) -> None:
    while True:
        await asyncio.sleep(1.0)
        now = time.time()
        for w in router.table.workers.values():
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
            state["draining"] = float(w.draining)
            state["holding"] = len(w.holding)
            router._publish(m.WorkerSeen(worker_id=w.worker_id, role=w.role, incarnation=w.incarnation,
                                         engine=w.hello.engine, state=state, at=now))
        metrics.set_in_flight(len(router.requests))
        metrics.set_workers(router.table.count("prefill"), router.table.count("decode"))
        router._publish(m.RouterStats(at=now, in_flight=len(router.requests), accepted=router.counts["accepted"],
                                      completed=router.counts["completed"], failed=router.counts["failed"],
                                      rejected=router.counts["rejected"]))
