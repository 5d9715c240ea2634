"""A review of 76bf95f (work lost on its way to a live worker, docs/benchmarks/transit.md): cases
where its two rules (a skipped dispatch number named in heartbeats, `missed`; work unacknowledged
`lost_dispatch_s` after its send) re-place a healthy request, or miss a lost one."""

from __future__ import annotations

import msgspec
import pytest

from common import config
from common import messages as m
from common import worker as worker_mod
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from common.router_link import MISSED_MAX, RouterLink
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker
from tests.test_migrate import NOW, make_router, work_for
from tests.test_transit_dispatch import beat


@pytest.mark.parametrize("beat_before", [False, True])
def test_a_stale_heartbeat_read_at_a_thaw_before_the_stall_is_excused_is_not_evidence(beat_before: bool) -> None:
    """The live router reads its work socket from a reader callback (common/sockets.py, Inbox:
    up to 256 messages per wakeup, at once), and notices its own stall only when its liveness
    loop's sleep wakes late (services/router/service.py, `liveness_loop`, which then calls
    `excuse_stall`). At a thaw asyncio runs the I/O callback first: the backlog is read before
    the stall is excused. A heartbeat the worker sent just before the work reached it (queued,
    unread, when the router froze) then says the work is unacknowledged 10 s after its send, and
    the healthy request is re-placed; the next heartbeats in the same backlog acknowledge it.
    test_work_sent_just_before_a_router_stall_is_judged_by_fresh_heartbeats_only excuses the
    stall first, which the live order does not do."""
    r, sent = make_router("deflect-all")
    if beat_before:  # the workers beat steadily before (here, one beat of each read just before the send)
        for other in list(r.table.workers):
            r.on_message(other.encode(), beat(other, 1, 0), NOW - 0.05)
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, work = work_for(sent, req.request_id, 0)
    thaw = NOW + 10.0                              # the router froze right after the send
    for e in r.table.workers.values():
        e.last_seen = thaw
    # the reader callback, first: the oldest heartbeat (sent before the work arrived), then fresh ones
    r.on_message(wid.encode(), beat(wid, 2, work.dispatch - 1), thaw)
    r.on_message(wid.encode(), beat(wid, 3, work.dispatch), thaw + 0.001)
    r.membership.excuse_stall(thaw + 0.002, 10.0)  # then the liveness loop wakes, late
    for k, t in enumerate((thaw + 0.1, thaw + 2.0, thaw + 5.0)):
        for e in r.table.workers.values():
            e.last_seen = t                        # (the others beat too)
        r.on_message(wid.encode(), beat(wid, 10 + k, work.dispatch), t)
        r.tick(t)
    assert r.counts["dispatches_lost"] == 0 and req.attempt == 0, "a healthy request was re-placed at a thaw"


def _flipped(monkeypatch: pytest.MonkeyPatch, seen: int) -> tuple[DecodeWorker, PrefillWorker]:
    """A decode worker of one router that had seen dispatches 1..`seen`, flipped to prefill
    (services/roles.py: the next role's service takes over the links; a flip that keeps no decode
    gets a new incarnation)."""
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "router_host": "127.0.0.1", "work_port": 47011, "heartbeat_port": 47012, "kv_transport": "modeled",
        "worker_id": "flipper", "refit_interval": 0})
    old = DecodeWorker(cfg, SimEngine("decode", load_profile("fast"), time_scale=20.0))
    for d in range(1, seen + 1):                  # what its recv loop did for each
        old.links[0].saw(m.DecodeWork(request_id=f"d{d}", attempt=0, dispatch=d, mode="deflect",
                                      prompt_token_ids=[1], sampling=m.Sampling(max_tokens=1), tbt_slo=0.1,
                                      deadline_s=5.0), NOW)
        old.core.saw_dispatch(d)
    new = PrefillWorker(cfg, old.engine, previous=old)
    assert new.links[0] is old.links[0] and new.incarnation != old.incarnation
    return old, new


def test_after_a_role_flip_a_single_router_worker_still_names_the_work_it_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With one router, Hello.last_dispatch is the core's (common/worker.py `hello`: the link's
    only with replicas); a flip makes a new core (last_dispatch 0) and, keeping no decode, a new
    incarnation, so the router numbers the new role's work from 1 (WorkerTable.register) while
    the link, kept across the flip, has seen up to 50: RouterLink.saw takes every new number for
    a late one and never notes a skipped one. A PrefillWork lost on the way (2) is then
    acknowledged by the next one's number (the core's) and its request waits for its deadline,
    the very loss 76bf95f fixes, for the first 50 dispatches of every flipped worker."""
    _, new = _flipped(monkeypatch, seen=50)
    link = new.links[0]
    h = new.hello(link)
    assert h.last_dispatch >= link.last_dispatch, "Hello.last_dispatch below what the link has seen"
    # the router numbers from Hello.last_dispatch; the worker gets the 1st and 3rd, not the 2nd
    first = h.last_dispatch
    for d in (first + 1, first + 3):
        link.saw(m.PrefillWork(request_id=f"p{d}", attempt=0, dispatch=d, prompt_token_ids=[1],
                               sampling=m.Sampling(max_tokens=1), decode_worker="decode-0", deadline_s=5.0), NOW + 1)
    assert link.missed_now(NOW + 1) == [first + 2]


def test_an_old_roles_skipped_number_does_not_make_the_new_roles_work_look_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The other face of the same reset: the old role's link noted a skipped number (7) a moment
    before the flip, and its heartbeats name it for 10 s. The new role's entry numbers from the
    Hello's last_dispatch (0 on main), so its own dispatch 7, healthy and on its way, is in its
    ledger when a heartbeat (sent before it arrived) names 7: the router re-places it."""
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "router_host": "127.0.0.1", "work_port": 47011, "heartbeat_port": 47012, "kv_transport": "modeled",
        "worker_id": "prefill-0", "refit_interval": 0})
    old = DecodeWorker(cfg, SimEngine("decode", load_profile("fast"), time_scale=20.0))
    for d in (*range(1, 7), 8):                   # 7 lost on its way to the old role
        old.links[0].saw(m.DecodeWork(request_id=f"d{d}", attempt=0, dispatch=d, mode="deflect",
                                      prompt_token_ids=[1], sampling=m.Sampling(max_tokens=1), tbt_slo=0.1,
                                      deadline_s=5.0), NOW - 1.0)
        old.core.saw_dispatch(d)
    new = PrefillWorker(cfg, old.engine, previous=old)
    r, sent = make_router("disagg-least-loaded")
    r.on_message(b"prefill-0", new.hello(new.links[0]), NOW)   # the flipped worker: a new incarnation
    reqs = [r.submit(list(range(100 + 50 * k, 140 + 50 * k)), m.Sampling(max_tokens=4), NOW + 0.01 * k)
            for k in range(7)]
    pw = [x for w, x in sent if w == "prefill-0" and isinstance(x, m.PrefillWork)]
    assert [x.dispatch for x in pw][-1] == pw[0].dispatch + 6
    for x in pw[:-1]:                              # the worker has them all but the last, still on its way
        new.links[0].saw(x, NOW + 0.1)
        new.core.saw_dispatch(x.dispatch)
    hb = new.heartbeat()
    hb = msgspec.structs.replace(hb, missed=new.links[0].missed_now(NOW + 0.1))
    r.on_message(b"prefill-0", hb, NOW + 0.1)
    assert r.counts["dispatches_lost"] == 0 and all(q.attempt == 0 for q in reqs), \
        "a dispatch on its way was taken for the old role's skipped number"


def test_the_first_dispatch_a_link_gets_lost_is_named_too() -> None:
    """RouterLink.saw notes skipped numbers only once it has seen one (`0 < last`). The router
    numbers a worker's work from its Hello's last_dispatch, 0 for a link that has seen nothing
    (a worker that just joined, a router replica that never sent it work), so its first work is
    1: when that one is lost on the way and 2 arrives, 1 is skipped as surely as any other, but
    is not named, and the heartbeats' last_dispatch (2) acknowledges it: its request waits for its
    deadline."""
    r, sent = make_router("deflect-all")
    wid = "decode-0"
    for other in ("decode-1",):
        r.table.workers[other].draining = True     # every deflection to decode-0
    reqs = [r.submit(list(range(100 + 50 * k, 140 + 50 * k)), m.Sampling(max_tokens=4), NOW + 0.01 * k)
            for k in range(2)]
    works = [work_for(sent, q.request_id, 0)[1] for q in reqs]
    assert [x.dispatch for x in works] == [1, 2]
    link = RouterLink(0, config.load(config.WorkerConfig, env={}, overrides={"worker_id": wid}))
    link.saw(works[1], NOW + 0.05)                 # 1 was lost on the way, 2 arrived
    hb = msgspec.structs.replace(beat(wid, 1, link.last_dispatch), missed=link.missed_now(NOW + 0.05))
    r.on_message(wid.encode(), hb, NOW + 0.05)
    assert reqs[0].attempt == 1 and reqs[1].attempt == 0, "the first work, lost, was taken as acknowledged"


def test_a_burst_of_lost_work_is_named_up_to_missed_max() -> None:
    """Since Hello.last_dispatch, the router's numbering goes on from what the link has seen, so
    a jump is work lost (or, after a flip that keeps decodes, numbers of the old entry, which the
    router ignores). A router that thaws with a long wait queue dispatches it at once, into
    connections that broke during its stall: 300 to one worker is a large burst, not an impossible
    one. (The first version took a jump of more than 256 for a numbering that started again and
    named nothing: every one of them waited for its deadline.) Beyond MISSED_MAX, the latest."""
    link = RouterLink(0, config.load(config.WorkerConfig, env={}, overrides={}))
    link.saw(m.PrefillWork(request_id="a", attempt=0, dispatch=1, prompt_token_ids=[1],
                           sampling=m.Sampling(max_tokens=1), decode_worker="decode-0", deadline_s=5.0), NOW)
    link.saw(m.PrefillWork(request_id="b", attempt=0, dispatch=302, prompt_token_ids=[1],
                           sampling=m.Sampling(max_tokens=1), decode_worker="decode-0", deadline_s=5.0), NOW)
    assert link.missed_now(NOW) == list(range(2, 302))
    far = 302 + MISSED_MAX + 50
    link.saw(m.PrefillWork(request_id="c", attempt=0, dispatch=far, prompt_token_ids=[1],
                           sampling=m.Sampling(max_tokens=1), decode_worker="decode-0", deadline_s=5.0), NOW + 1)
    named = link.missed_now(NOW + 1)
    assert named == list(range(far - MISSED_MAX, far))


def _pbeat(worker: str, seq: int, last_dispatch: int) -> m.PrefillHeartbeat:
    return m.PrefillHeartbeat(worker_id=worker, incarnation=f"inc-{worker}", seq=seq, queued_tokens=0,
                              queued_requests=0, token_budget=2048, last_dispatch=last_dispatch)


@pytest.mark.parametrize("lost", ["prefill", "decode"])
def test_a_handoff_whose_one_work_was_lost_is_placed_again_once(lost: str) -> None:
    """A hand-off sends two works (DecodeWork to the decode worker, PrefillWork to the prefill
    worker, each with that worker's own number); only one is lost. The request is placed again
    once, as a new attempt not counted as a migration, and the worker that did get its work is
    told to stop (Cancel). (Passes on main: pinned.)"""
    r, sent = make_router("disagg-least-loaded")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    pw, dw = req.prefill_worker, req.decode_worker
    assert pw is not None and dw is not None
    pno = next(x.dispatch for w, x in sent if w == pw and isinstance(x, m.PrefillWork))
    dno = next(x.dispatch for w, x in sent if w == dw and isinstance(x, m.DecodeWork))
    t, k = NOW + 0.05, 1
    while t < NOW + r.membership.lost_dispatch_s + 1.0:
        for e in r.table.workers.values():
            e.last_seen = t
        r.on_message(pw.encode(), _pbeat(pw, k, pno - (lost == "prefill")), t)
        r.on_message(dw.encode(), beat(dw, k, dno - (lost == "decode")), t)
        for other in r.table.workers:
            if other not in (pw, dw):
                r.on_message(other.encode(), beat(other, k, 0), t)
        r.tick(t)
        t, k = t + 0.1, k + 1
    assert req.attempt == 1 and req.migrations == 0 and r.counts["dispatches_lost"] == 1 and not req.done
    stayed = dw if lost == "prefill" else pw
    assert any(isinstance(x, m.Cancel) and x.attempt == 0 for w, x in sent if w == stayed)


@pytest.mark.parametrize("tick_first", [False, True])
def test_work_whose_send_failed_is_placed_again_once_whichever_rule_sees_it_first(tick_first: bool) -> None:
    """A send that failed (core.send: `unsent`, re-placed at the next tick) leaves its number
    skipped; the worker registered again before that tick (same incarnation: `unreachable`
    cleared) and took the next work, so its heartbeat names the number as missed too. One rule
    or the other places it again, never both. (Passes on main: pinned.)"""
    from tests.router_fakes import hello, make_core
    r, box = make_core("deflect-all")
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    r.table.workers["decode-1"].draining = True
    box.unreachable.add("decode-0")
    a = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    assert r.unsent and r.table.workers["decode-0"].unreachable
    box.unreachable.clear()
    r.on_message(b"decode-0", hello("decode-0", "decode", held=[], last_dispatch=0), NOW + 0.01)
    b = r.submit(list(range(200, 240)), m.Sampling(max_tokens=4), NOW + 0.02)
    (_, wb), = [(w, x) for w, x in box.sent if isinstance(x, m.DecodeWork) and x.request_id == b.request_id]
    hb = msgspec.structs.replace(beat("decode-0", 1, wb.dispatch), missed=list(range(1, wb.dispatch)))
    if tick_first:
        r.tick(NOW + 0.03)
    r.on_message(b"decode-0", hb, NOW + 0.04)
    r.tick(NOW + 0.05)
    assert a.attempt == 1 and b.attempt == 0 and not a.done
    assert r.counts["dispatches_lost"] + r.counts["unsent_replaced"] == 1
