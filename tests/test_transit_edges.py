"""Edges of the transit rules (docs/benchmarks/transit.md), each found by a review of the first
version and failing on it (0586bc4):

- a draining worker whose connection breaks still says Hello, so the router's Welcome releases
  what it held across the break;
- a replayed token batch counts its KV fallbacks once;
- a role flip (prefill -> decode, same incarnation) keeps only what the worker decodes itself,
  not a request named in Hello.held because its PrefillDone waits in the hold;
- a refusal lost in a break: work the worker had seen (Hello.last_dispatch) and no longer holds
  is placed again, work still on the way is not;
- only a router stall past the ZeroMQ heartbeat timeout (which can break a connection) suspends
  worker liveness; shorter, recurring stalls do not;
- prefill results are kept and sent again after a break too, and the router starts a request's
  KV hand-off once however many times its PrefillDone arrives.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from common import config
from common import messages as m
from common.router_link import RouterLink
from tests.router_fakes import hello
from tests.test_migrate import NOW, make_router, work_for
from tests.test_replica_links import Fake
from tests.test_transit_hold import _until, positions, start_long, worker_of
from tests.test_transit_loss import batch, item


@pytest.mark.parametrize("hold", [True, False])
async def test_a_draining_worker_whose_connection_broke_still_streams_to_its_router(
        monkeypatch: pytest.MonkeyPatch, hold: bool) -> None:
    """SIGTERM (a rolling restart), then the router freezes past the ZeroMQ heartbeat timeout (or
    a network blip): the draining worker reconnects and, holding what it sent across the break,
    says Hello all the same, so the router's Welcome releases its hold and its streams go on.
    (In the first version a draining worker said no Hello: its tokens waited in the hold until
    the process exited and were thrown away; the router resumed each stream elsewhere at
    Goodbye("drained"), a migration each.) Without the hold (hold=False) the tokens flow again
    on the new connection as soon as it is up."""
    ctx = zmq.asyncio.Context()
    a = Fake(ctx, "A")
    w = worker_of(a, monkeypatch, hold=hold, drain_timeout=30.0)
    link = w.links[0]
    task = asyncio.create_task(w.run())
    b: Fake | None = None
    try:
        await start_long(a)
        w.signalled.set()                                      # SIGTERM: the drain begins ...
        await a.until(lambda x: isinstance(x, m.Goodbye))
        a.close()                                              # ... and the connection breaks
        await _until(lambda: not link.connected)
        b = Fake(ctx, "B", like=a)                             # the router is back, same port
        await _until(lambda: link.connected)
        # "long" still has seconds of tokens to go (400 steps of tens of ms): they must reach the
        # router (which, like a real one, welcomes a Hello)
        def longs(x: m.Msg) -> bool:
            return isinstance(x, m.TokenBatch) and any(i.request_id == "long" for i in x.items)
        first = await b.until(lambda x: isinstance(x, m.Hello) or longs(x), timeout=3.0)
        if isinstance(first, m.Hello):
            await b.send(m.Welcome(router_incarnation="A", heartbeat_interval_s=0.1))
            await b.until(longs, timeout=3.0)
        assert positions(b.got, "long")
    finally:
        w.stop.set()
        w.core.drop("long")  # the drain then ends at once
        await asyncio.wait_for(task, 40)
        a.close()
        if b is not None:
            b.close()
        ctx.term()


async def test_a_replayed_token_batch_does_not_count_its_kv_fallback_twice() -> None:
    """RouterLink.on_break holds the last replay_s of token batches again and sends them after
    the break; the router drops their repeated items by position, but not their `kv_fallback`
    list (common/router_core/inbound.py `_on_tokens`): kv_fallbacks (counts, /v1/kairos/stats,
    kairos_router_kv_fallbacks_total) counts each such fallback twice."""
    r, sent = make_router("disagg-least-loaded")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=8), NOW)
    rid = req.request_id
    d, _ = work_for(sent, rid, 0)
    b = m.TokenBatch(worker_id=d, items=[item(rid, 0, 0, 2)], kv_fallback=[rid], kv_fallback_reasons=["kv_timeout"])
    r.on_message(d.encode(), b, NOW)
    assert r.counts["kv_fallbacks"] == 1
    r.on_message(d.encode(), b, NOW)    # the same batch again: the worker's replay after a break
    assert r.counts["tokens_repeated"] == 1 and req.n_out == 2
    assert r.counts["kv_fallbacks"] == 1, "one fallback, counted twice"


def test_a_prefill_done_held_across_a_break_names_its_request_in_hello_held() -> None:
    """(Passes: the mechanism.) The worker side of the next test: RouterLink.hold notes the request of any held message
    (PrefillDone included) in held_rids, which WorkerService.hello adds to Hello.held."""
    link = RouterLink(0, config.load(config.WorkerConfig, env={}, overrides={}))
    link.broken = True
    pd = m.PrefillDone(request_id="r1", attempt=0, worker_id="prefill-0", queue_s=0.0, prefill_s=0.01,
                       kv=m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=40))
    assert link.hold(b"x", pd)
    assert "r1" in link.held_rids


async def test_a_role_flip_does_not_take_a_request_whose_prefill_done_is_held_for_a_kept_decode() -> None:
    """Prefill worker P prefills R (a hand-off to decode worker D) and is told to flip to decode
    (sim engine: keeps its decodes, same incarnation). Its connection breaks during the drain:
    R's PrefillDone waits in the hold, so P's Hello under the decode role names R in `held`
    (link.held_rids, previous test). The router (membership `role_changed`) takes every request of
    `held` it tracks on P for a decode P keeps: R's decode_worker becomes P, prefill_done True.
    The held PrefillDone then sends KvReady to P (which never had R's DecodeWork), D's tokens for
    R are dropped ("not_assigned") and D is told to cancel: R is never streamed and waits for its
    deadline (request_timeout, 300 s)."""
    r, sent = make_router("disagg-least-loaded")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    rid = req.request_id
    assert req.prefill_worker == "prefill-0" and req.decode_worker in ("decode-0", "decode-1")
    d = req.decode_worker
    p = "prefill-0"
    r.on_message(p.encode(), m.Goodbye(worker_id=p, incarnation=f"inc-{p}", reason="role_change"), NOW)
    # P's Hello as a decode worker, same incarnation (a flip that keeps its decodes); it keeps
    # no decode of its own, but R's PrefillDone waits in its hold, so held_rids names R
    r.on_message(p.encode(), hello(p, "decode", incarnation=f"inc-{p}", held=[rid]), NOW)
    sent.clear()
    # the hold is released: R's PrefillDone arrives; then D, which got the KV, streams R to its end
    r.on_message(p.encode(), m.PrefillDone(request_id=rid, attempt=0, worker_id=p, queue_s=0.0, prefill_s=0.01,
                                           kv=m.KvHandle(transport="modeled", source_worker=p, tokens=40)), NOW)
    kv_ready_to = [wid for wid, msg in sent if isinstance(msg, m.KvReady)]
    r.on_message(d.encode(), batch(d, item(rid, 0, 0, 4, "length")), NOW)
    cancels = [wid for wid, msg in sent if isinstance(msg, m.Cancel)]
    # either R streamed from D to its end, or it was placed again (the flip's hand-back); not
    # left on P, which never had its DecodeWork
    stranded = not req.done and req.decode_worker == p and req.n_out == 0
    assert not stranded, (
        f"R hangs: decode_worker={req.decode_worker} (was {d}), attempt {req.attempt}, KvReady sent to "
        f"{kv_ready_to}, Cancel sent to {cancels}, n_out={req.n_out}")
    assert req.done or req.attempt > 0


@pytest.mark.parametrize("seen", [True, False])
async def test_a_refusal_lost_in_a_break_does_not_leave_the_request_to_its_deadline(seen: bool) -> None:
    """Only token batches are sent again after a break (RouterLink.recent); any other message sent
    in the seconds before the worker noticed it (a RequestFailed: "kv_full", "overloaded", a
    rejected deflection) is lost with the connection. The worker's next Hello says the highest
    dispatch number it has seen (`Hello.last_dispatch`): work it had seen and no longer holds ended
    or was refused there, and is placed again. Work it has not seen (still in flight) is left alone."""
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    w, work = work_for(sent, req.request_id, 0)
    # the worker refused it (kv_full) just before its connection broke: the RequestFailed is lost;
    # it says Hello again on the new connection, not holding it
    r.on_message(w.encode(), hello(w, "decode", held=[], last_dispatch=work.dispatch - (0 if seen else 1)), NOW + 1.0)
    for k in range(2, 60):  # a minute of ticks, the worker heard all along
        for wid in list(r.table.workers):
            r.table.workers[wid].last_seen = NOW + k
        r.tick(NOW + k)
    if seen:
        assert req.attempt > 0 or req.done, "a minute later, still waiting on a worker that does not hold it"
    else:
        assert req.attempt == 0 and not req.done  # its work may still be on the way: not placed twice


async def test_a_short_router_stall_does_not_suspend_worker_liveness() -> None:
    """`router_stalled` fires for any stall over half the liveness window (0.5 s by default),
    and `excuse_stall` then judges no worker for liveness + 1.5 s (2.5 s). A stall that short
    cannot have broken a connection (the ZeroMQ heartbeat timeout is 3 s), yet a worker that
    died meanwhile is declared lost 1.5 s later than otherwise; stalls recurring within 2.5 s
    (CPU starvation) keep every dead worker registered, holding its requests, indefinitely."""
    r, _ = make_router("deflect-all")
    live = r.liveness_s
    t = NOW
    for _ in range(20):                 # 0.6 s stalls every 2 s, for 40 s; the workers died at NOW
        t += 2.0
        r.membership.excuse_stall(t, 0.6)
        r.tick(t + 1.0)
    assert t + 1.0 - NOW > 10 * live
    assert not r.table.workers, f"dead for {t + 1.0 - NOW:.0f} s, still registered: {sorted(r.table.workers)}"


def test_a_worker_sends_token_batches_and_prefill_results_again_after_a_break() -> None:
    from common.router_link import RouterLink

    link = RouterLink(0, config.load(config.WorkerConfig, env={}, overrides={}))
    tb = m.TokenBatch(worker_id="w", items=[m.TokenItem("a", 0, [1], pos=0)])
    kv = m.KvHandle(transport="modeled", source_worker="w", tokens=40)
    pd = m.PrefillDone(request_id="b", attempt=0, worker_id="w", kv=kv, queue_s=0.0, prefill_s=0.1)
    rf = m.RequestFailed(request_id="c", attempt=0, worker_id="w", reason="kv_full", retryable=True)
    for i, msg in enumerate((tb, pd, rf)):
        link.sent(100.0 + i * 0.1, f"payload-{i}".encode(), msg)
    link.on_break()
    assert list(link.held_out) == [b"payload-0", b"payload-1"] and link.held_rids == {"a", "b"}
    assert link.holding_out and link.release() == [b"payload-0", b"payload-1"] and not link.holding_out


async def test_a_prefill_result_sent_again_starts_the_kv_handoff_once() -> None:
    r, sent = make_router("disagg-least-loaded")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    pw = req.prefill_worker
    assert pw is not None
    kv = m.KvHandle(transport="modeled", source_worker=pw, tokens=40)
    pd = m.PrefillDone(request_id=req.request_id, attempt=0, worker_id=pw, kv=kv, queue_s=0.0, prefill_s=0.1)
    sent.clear()
    r.on_message(pw.encode(), pd, NOW)
    r.on_message(pw.encode(), pd, NOW)  # the same, again after a break
    assert len([msg for _, msg in sent if isinstance(msg, m.KvReady)]) == 1
    assert r.counts["prefill_done_repeated"] == 1
