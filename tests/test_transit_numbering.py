"""The transit rules must not re-place a healthy request (docs/benchmarks/transit.md): a resent
PrefillDone of an older attempt changes nothing, and `Hello.last_dispatch` never covers work still
on its way, across the resets of the router's dispatch numbering (a role flip under router
replicas, a router restart, a worker declared lost and back: a newly registered worker's numbers
start above what it has seen). Found by a review; each test fails at 4386378."""

from __future__ import annotations

from common import config
from common import messages as m
from common.router_link import RouterLink
from tests.router_fakes import hello
from tests.test_migrate import NOW, make_router


def test_a_replayed_prefill_done_of_an_old_attempt_does_not_unhold_the_current_one() -> None:
    """4386378 replays PrefillDone after a break. Attempt 0's PrefillDone was read; the request is
    then placed again (attempt 1) on the same prefill worker (the only one here); a break makes
    the worker send attempt 0's PrefillDone again (RouterLink.recent). _on_prefill_done's guard
    only catches a repeat of the current attempt; a stale attempt passes `_assigned` (same worker)
    and `pw.holding.discard` runs before the attempt check: attempt 1, which the worker is
    prefilling now, is no longer held by it (a loss of the worker, or ends_unheard, misses it)."""
    r, _ = make_router("disagg-least-loaded")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    pw, dw = req.prefill_worker, req.decode_worker
    assert pw is not None and dw is not None
    kv = m.KvHandle(transport="modeled", source_worker=pw, tokens=40)
    pd0 = m.PrefillDone(request_id=req.request_id, attempt=0, worker_id=pw, kv=kv, queue_s=0.0, prefill_s=0.1)
    r.on_message(pw.encode(), pd0, NOW)
    # the decode side fails it (retryable): attempt 1, prefilled on the same prefill worker again
    r.on_message(dw.encode(), m.RequestFailed(request_id=req.request_id, attempt=0, worker_id=dw,
                                              reason="kv_full", retryable=True), NOW + 0.1)
    assert req.attempt == 1 and req.prefill_worker == pw
    assert req.request_id in r.table.workers[pw].holding
    r.on_message(pw.encode(), pd0, NOW + 0.2)  # attempt 0's, sent again after a break
    assert req.request_id in r.table.workers[pw].holding, "a stale replay un-held the current attempt"


def test_a_role_flip_under_router_replicas_does_not_make_new_work_look_seen() -> None:
    """A worker serving several routers reports `link.last_dispatch` in Hello (common/worker.py
    `hello`); the links survive a role flip (WorkerService: `self.links = previous.links`) and
    RouterLink.saw only ever raises the number. The router numbers the new role's entry from 1
    (WorkerTable.register makes a new WorkerEntry). So after a flip the worker's Hello says
    last_dispatch = its old role's highest number, above every new dispatch: at a re-Hello after
    a break, a DecodeWork still on its way (not seen, not held) passes `0 < dispatched <=
    last_dispatch` and is cancelled and placed again."""
    link = RouterLink(0, config.load(config.WorkerConfig, env={}, overrides={}))
    for d in range(1, 6):                      # prefill role: dispatches 1..5 from this router
        link.saw(m.PrefillWork(request_id=f"p{d}", attempt=0, dispatch=d, prompt_token_ids=[1],
                               sampling=m.Sampling(max_tokens=1), decode_worker="decode-0", deadline_s=5.0), NOW)
    stale = link.last_dispatch                 # kept across the flip to decode (same link object)
    assert stale == 5
    r, sent = make_router("deflect-all")
    w = "flipper"
    r.on_message(w.encode(), hello(w, "prefill", last_dispatch=0), NOW)
    r.table.workers[w].dispatch_no = stale     # this router sent its prefill role dispatches 1..5
    r.on_message(w.encode(), hello(w, "decode", last_dispatch=stale), NOW + 1.0)  # the flip
    for other in ("decode-0", "decode-1"):      # only the flipped worker takes deflections
        r.table.workers[other].draining = True
    sent.clear()
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW + 2.0)
    assert req.decode_worker == w
    # the connection breaks before the DecodeWork arrives; the worker says Hello again
    r.on_message(w.encode(), hello(w, "decode", held=[], last_dispatch=stale), NOW + 2.1)
    assert req.attempt == 0, "work still on its way was taken for seen and placed again"


def test_a_replayed_prefill_done_of_an_old_attempt_does_not_orphan_a_retained_stream() -> None:
    """The same stale replay where attempt 1 is retained on that prefill worker (route "retain"):
    it is held by no worker afterwards, so the router's audit takes a healthy, streaming request
    for an orphan and cancels and places it again (a migration)."""
    from common.policy import Decision, Policy
    from common.router_core.core import RouterCore
    from tests.router_fakes import FakeOutbox
    from tests.test_migrate import tokens

    class HandoffThenRetain(Policy):
        name = "handoff-then-retain"
        retain = False

        def decide(self, req, view, now):  # type: ignore[no-untyped-def]
            p = view.prefill[0].worker_id
            if self.retain:
                return Decision(route="retain", decode_worker=p, prefill_worker=p, reason="test")
            return Decision(route="disagg", decode_worker=view.decode[0].worker_id, prefill_worker=p,
                            reason="test")

    pol = HandoffThenRetain()
    r = RouterCore(config.load(config.RouterConfig, env={}, overrides={"profile": "fast"}), FakeOutbox(), policy=pol)
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=10), NOW)
    rid = req.request_id
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=40)
    pd0 = m.PrefillDone(request_id=rid, attempt=0, worker_id="prefill-0", kv=kv, queue_s=0.0, prefill_s=0.1)
    r.on_message(b"prefill-0", pd0, NOW)
    pol.retain = True
    r.on_message(b"decode-0", m.RequestFailed(request_id=rid, attempt=0, worker_id="decode-0", reason="kv_full",
                                              retryable=True), NOW + 0.1)
    assert req.attempt == 1 and req.decode_worker == "prefill-0"
    r.on_message(b"prefill-0", tokens("prefill-0", rid, 1, [7, 8]), NOW + 0.2)  # it streams
    r.on_message(b"prefill-0", pd0, NOW + 0.3)   # attempt 0's PrefillDone, sent again after a break
    r.audit(NOW + 0.4)
    assert req.attempt == 1 and r.counts["orphaned"] == 0, "a healthy retained stream was placed again"


def test_after_a_router_restart_new_work_does_not_look_seen() -> None:
    """The worker's dispatch number (WorkerCore.last_dispatch, RouterLink.last_dispatch) is never
    reset when its router restarts; the restarted router numbers its dispatches from 1. At the
    worker's next re-Hello (a later break), Hello.last_dispatch is the old router's highest number,
    so work of the new router still on its way (neither seen nor held) is cancelled and placed
    again."""
    r, _ = make_router("deflect-all")            # the restarted router
    w = "survivor"
    r.on_message(w.encode(), hello(w, "decode", last_dispatch=500), NOW)  # saw 500 from the old one
    for other in ("decode-0", "decode-1"):
        r.table.workers[other].draining = True
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW + 1.0)
    assert req.decode_worker == w
    # its connection breaks before that DecodeWork arrives; it says Hello again
    r.on_message(w.encode(), hello(w, "decode", held=[], last_dispatch=500), NOW + 1.1)
    assert req.attempt == 0, "work still on its way was taken for seen and placed again"


def test_a_worker_declared_lost_and_back_does_not_make_new_work_look_seen() -> None:
    """The same with one router: a worker silent past liveness (a partition) is removed, comes
    back with the same incarnation and is registered anew, numbered from 1 again, while its core
    keeps the highest number it saw before (3 here)."""
    from tests.test_migrate import lose

    r, _ = make_router("deflect-all")
    for other in ("decode-0", "decode-1"):
        r.table.workers[other].draining = True
    w = "partitioned"
    r.on_message(w.encode(), hello(w, "decode"), NOW)
    for _ in range(3):
        r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    assert r.table.workers[w].dispatch_no == 3
    lose(r, w)
    r.on_message(w.encode(), hello(w, "decode", held=[], last_dispatch=3), NOW + 5.0)  # back
    req = r.submit(list(range(200, 240)), m.Sampling(max_tokens=4), NOW + 5.1)
    assert req.decode_worker == w
    r.on_message(w.encode(), hello(w, "decode", held=[], last_dispatch=3), NOW + 5.2)  # a break
    assert req.attempt == 0, "work still on its way was taken for seen and placed again"
