"""Work lost on its way to a live worker (docs/benchmarks/transit.md): a send into a connection
that had already broken does not fail (the router's side of it had not closed yet) and ZeroMQ
drops what it held when the worker dials again. The worker's heartbeats say the highest dispatch
number it has seen (`last_dispatch`); work they still do not acknowledge `lost_dispatch_s` after
it was sent is placed again, without spending a migration. Found by tests/chaos/stranded.py
(4 of 50 requests waited for their 40 s deadline after a 10 s router freeze)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from common import messages as m
from common.router_core.core import RouterCore
from tests.router_fakes import hello
from tests.test_migrate import NOW, make_router, work_for
from tests.test_replica_links import Fake, work
from tests.test_transit_hold import welcome, worker_of


def beat(worker: str, seq: int, last_dispatch: int) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=worker, incarnation=f"inc-{worker}", seq=seq, batch=0, kv_tokens=0,
                             kv_free_tokens=100_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                             deflections=0, strictest_tbt_slo=None, token_budget=2048, last_dispatch=last_dispatch)


def beats(r: RouterCore, worker: str, last_dispatch: int, start: float, end: float, step: float = 0.1) -> None:
    """The worker's heartbeats from `start` to `end`, each acknowledging `last_dispatch` (the
    other workers heard all along)."""
    k, t = 1, start
    while t <= end:
        for w in r.table.workers.values():
            w.last_seen = t
        r.on_message(worker.encode(), beat(worker, k, last_dispatch), t)
        r.tick(t)
        k, t = k + 1, t + step


@pytest.mark.parametrize("arrived", [False, True])
def test_work_a_live_worker_never_acknowledges_is_placed_again(arrived: bool) -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, work = work_for(sent, req.request_id, 0)
    lost_s = r.membership.lost_dispatch_s
    # the worker goes on beating; its heartbeats acknowledge the work, or never do
    beats(r, wid, work.dispatch if arrived else work.dispatch - 1, NOW + 0.05, NOW + lost_s + 1.0)
    if arrived:
        assert req.attempt == 0 and r.counts["dispatches_lost"] == 0
        return
    assert req.attempt == 1, "a request whose work never arrived was left to its deadline"
    assert r.counts["dispatches_lost"] == 1 and req.migrations == 0
    again = [(w, x) for w, x in sent if isinstance(x, m.DecodeWork) and x.attempt == 1]
    assert len(again) == 1 and again[0][0] != wid  # away from the worker it never reached
    cancels = [x for w, x in sent if w == wid and isinstance(x, m.Cancel) and x.request_id == req.request_id]
    assert cancels  # should it arrive after all, its Cancel follows it


def test_work_sent_just_before_a_router_stall_is_judged_by_fresh_heartbeats_only() -> None:
    """The router froze right after sending: the heartbeats queued meanwhile (sent before the
    work arrived, read after the thaw) acknowledge nothing, yet the work did arrive. They are not
    evidence: no dispatch is judged lost while the stall is excused."""
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, work = work_for(sent, req.request_id, 0)
    thaw = NOW + 10.0
    r.membership.excuse_stall(thaw, 10.0)
    for k in range(5):  # the backlog, read at the thaw
        r.on_message(wid.encode(), beat(wid, k + 1, work.dispatch - 1), thaw + 0.001 * k)
    r.on_message(wid.encode(), beat(wid, 10, work.dispatch), thaw + 0.2)  # fresh: it did arrive
    beats(r, wid, work.dispatch, thaw + 0.3, thaw + 5.0)
    assert req.attempt == 0 and r.counts["dispatches_lost"] == 0


def test_heartbeats_read_from_a_busy_routers_backlog_do_not_judge_work_sent_while_they_waited() -> None:
    """A router busy for seconds reads its socket in batches of hundreds: the heartbeats it reads
    were sent before the work it sent meanwhile arrived, steadily, with no gap to excuse. Work is
    judged against the earliest time a heartbeat being read can have been sent (`sent_after`, the
    socket's last drained read), not its reading. Found by a second burst of 400 long prompts: 88
    requests failed after three false losses each (stranded.md)."""
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, work = work_for(sent, req.request_id, 0)
    lost_s = r.membership.lost_dispatch_s
    drained = [NOW - 0.01]  # the socket last read empty just before the work was sent
    r.membership.sent_after = lambda: drained[0]
    beats(r, wid, work.dispatch - 1, NOW + 0.05, NOW + 3 * lost_s)  # the backlog, read as it comes
    assert req.attempt == 0 and r.counts["dispatches_lost"] == 0
    # the backlog read to the end: heartbeats read from now on are read as they come, and still
    # do not acknowledge it, so it never arrived after all
    r.membership.sent_after = None
    beats(r, wid, work.dispatch - 1, NOW + 3 * lost_s + 0.1, NOW + 4 * lost_s + 0.5)
    assert req.attempt == 1 and r.counts["dispatches_lost"] == 1


def test_a_worker_that_said_hello_again_is_still_judged_on_its_heartbeats() -> None:
    """The case the chaos run found: the worker's connection broke, the work went into the old
    one, the worker registered again on a new connection (its Hello's last_dispatch below the lost
    work: ends_unheard leaves it alone, as it may be on its way) and beats on."""
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, work = work_for(sent, req.request_id, 0)
    r.on_message(wid.encode(), hello(wid, "decode", held=[], last_dispatch=work.dispatch - 1), NOW + 1.0)
    assert req.attempt == 0
    beats(r, wid, work.dispatch - 1, NOW + 1.05, NOW + r.membership.lost_dispatch_s + 1.0)
    assert req.attempt == 1 and r.counts["dispatches_lost"] == 1


def test_a_dispatch_number_the_worker_skipped_is_placed_again_at_once() -> None:
    """The chaos run's case: the lost work's number is below work that arrived later on the new
    connection, so `last_dispatch` covers it; the heartbeat's `missed` names it and the router
    places it again at once, not `lost_dispatch_s` later."""
    r, sent = make_router("deflect-all")
    first = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    wid, lost = work_for(sent, first.request_id, 0)
    r.table.workers[wid].deflecting.clear()  # so that the next one goes to the same worker
    second = r.submit(list(range(200, 240)), m.Sampling(max_tokens=4), NOW + 0.01)
    same = [x for w, x in sent if w == wid and isinstance(x, m.DecodeWork) and x.request_id == second.request_id]
    assert same, "deflect-all placed the second request elsewhere: the test needs both on one worker"
    hb = beat(wid, 1, same[0].dispatch)
    r.on_message(wid.encode(), msgspec.structs.replace(hb, missed=[lost.dispatch]), NOW + 0.05)
    assert first.attempt == 1 and second.attempt == 0
    assert r.counts["dispatches_lost"] == 1
    # the same report again (every heartbeat repeats it for a while) changes nothing
    r.on_message(wid.encode(), msgspec.structs.replace(hb, seq=2, missed=[lost.dispatch]), NOW + 0.1)
    assert first.attempt == 1 and r.counts["dispatches_lost"] == 1


def test_a_worker_link_names_the_dispatch_numbers_it_skipped() -> None:
    from common import config
    from common.router_link import MISSED_REPORT_S, RouterLink
    cfg = config.load(config.WorkerConfig, env={}, overrides={"worker_id": "decode-r"})
    link = RouterLink(0, cfg)
    for d in (1, 2, 5):
        link.saw(m.DecodeWork(request_id=f"r{d}", attempt=0, dispatch=d, mode="deflect", prompt_token_ids=[1],
                              sampling=m.Sampling(max_tokens=1), tbt_slo=0.1, deadline_s=1.0), 10.0)
    assert link.last_dispatch == 5 and link.missed_now(10.0) == [3, 4]
    link.saw(m.DecodeWork(request_id="r3", attempt=0, dispatch=3, mode="deflect", prompt_token_ids=[1],
                          sampling=m.Sampling(max_tokens=1), tbt_slo=0.1, deadline_s=1.0), 10.5)
    assert link.missed_now(11.0) == [4]          # 3 came late after all
    assert link.missed_now(10.0 + MISSED_REPORT_S + 0.1) == []  # named for a while, then dropped
    link.saw(m.Cancel(request_id="r1", attempt=0, reason="x"), 30.0)  # no dispatch number: nothing
    assert link.last_dispatch == 5 and link.missed_now(30.0) == []


async def test_a_real_worker_names_the_work_that_never_reached_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode worker that gets dispatches 1 and 3 (2 lost on the way) says so in its heartbeats."""
    ctx = zmq.asyncio.Context()
    a = Fake(ctx, "A")
    w = worker_of(a, monkeypatch, hold=True, drain_timeout=1.0)
    task = asyncio.create_task(w.run())
    try:
        await welcome(a, heartbeat_interval_s=0.05)
        await a.send(work("one", dispatch=1))
        await a.send(work("three", dispatch=3))
        hb = await a.beat_until(lambda x: x.last_dispatch == 3, timeout=5.0)
        assert isinstance(hb, m.DecodeHeartbeat) and hb.missed == [2]
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 20)
        a.close()
        ctx.term()


@pytest.mark.parametrize("back_as", ["same", "restarted"])
def test_a_kv_handshake_relay_that_failed_is_sent_again_after_the_workers_hello(back_as: str) -> None:
    """The prefill worker's KvWant reaches the router while the decode worker's connection is
    broken: the relay fails (unroutable). When the decode worker says Hello again (same
    incarnation) the router sends it the KvWant after the Welcome, instead of leaving the hand-off
    to the prefill worker's kv_timeout (10 s) and a prefill in place. A worker back as another
    incarnation gets nothing: what it held is placed again."""
    from tests.router_fakes import FakeOutbox, make_core
    box = FakeOutbox()
    r, _ = make_core("disagg-least-loaded", box)
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    assert req.prefill_worker == "prefill-0" and req.decode_worker == "decode-0"
    box.unreachable.add("decode-0")
    want = m.KvWant(request_id=req.request_id, attempt=req.attempt, tokens=40)
    r.on_message(b"prefill-0", want, NOW + 0.1)
    box.unreachable.clear()
    box.take()
    inc = "" if back_as == "same" else "inc-decode-0-again"
    r.on_message(b"decode-0", hello("decode-0", "decode", held=[req.request_id], last_dispatch=1,
                                    incarnation=inc), NOW + 1.0)
    to_decode = [type(x).__name__ for w, x in box.take() if w == "decode-0"]
    if back_as == "same":
        assert to_decode == ["Welcome", "KvWant"]
    else:
        assert "KvWant" not in to_decode
