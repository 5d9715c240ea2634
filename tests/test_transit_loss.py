"""Tokens lost between a worker and the router never leave a hole in a client's stream.

A ZeroMQ connection that breaks (a router frozen past the bus heartbeat timeout, a network
blip) drops the messages that were in flight on it; the worker reconnects and goes on. Before
`TokenItem.pos`, a stream then went on past the hole and ended with finish_reason "length" and
tokens missing (found live: a decode worker killed, then the router frozen 5 s; every stream
lost 7-21 tokens in half of the runs, 2026-12-07; tests/chaos/transit.py replays it).
Now the router checks each token item's position against the stream's, and a hole resumes the
request from the last token the client has (as a migration); a repeat is dropped; a request
whose end was lost is resumed when its worker says Hello again without it.

The router core runs without sockets or clock; the continuation runs on a real SimEngine, so the
client's text is the engine's own.
"""

from __future__ import annotations

from common import messages as m
from common.engines.base import EngineRequest
from common.engines.sim import synthetic_token
from tests.router_fakes import hello
from tests.test_migrate import NOW, decode_on_sim, drain, make_router, run_on_sim, work_for


def item(rid: str, attempt: int, pos: int, n: int = 1, finish: str | None = None) -> m.TokenItem:
    return m.TokenItem(rid, attempt, [synthetic_token(rid, p) for p in range(pos, pos + n)], finish, pos=pos)


def batch(worker: str, *items: m.TokenItem) -> m.TokenBatch:
    return m.TokenBatch(worker_id=worker, items=list(items))


def streamed(req_events: list) -> list[int]:  # type: ignore[type-arg]
    return [t for ev in req_events for t in (ev.token_ids or [])]


async def test_a_hole_in_the_stream_resumes_it_from_the_last_token_the_client_has() -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=12), NOW)
    rid = req.request_id
    w, _ = work_for(sent, rid, 0)
    r.on_message(w.encode(), batch(w, item(rid, 0, 0, 3)), NOW)
    sent.clear()
    r.on_message(w.encode(), batch(w, item(rid, 0, 6)), NOW)  # tokens 3..5 were lost on the way
    assert req.n_out == 3 and r.counts["token_gaps"] == 1
    cancels = [msg for _, msg in sent if isinstance(msg, m.Cancel)]
    assert [(c.request_id, c.attempt) for c in cancels] == [(rid, 0)]  # the old attempt stops there
    w1, work1 = work_for(sent, rid, 1)
    assert work1.resume_tokens == 3 and work1.sampling.max_tokens == 9
    r.on_message(w.encode(), batch(w, item(rid, 0, 7)), NOW)  # the old attempt's late tokens: dropped
    for it in await decode_on_sim(work1):
        r.on_message(w1.encode(), batch(w1, it), NOW)
    events = drain(req)
    assert streamed(events) == [synthetic_token(rid, p) for p in range(12)]  # none missing, none twice
    assert [ev.finish_reason for ev in events if ev.finish_reason] == ["length"]
    assert req.done and req.outcome == "ok" and req.migrations == 1


async def test_a_lost_first_token_redispatches_a_request_the_client_saw_nothing_of() -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    rid = req.request_id
    w, _ = work_for(sent, rid, 0)
    r.on_message(w.encode(), batch(w, item(rid, 0, 1)), NOW)  # token 0 lost
    _, work1 = work_for(sent, rid, 1)
    assert work1.resume_tokens == 0 and work1.sampling.max_tokens == 4
    assert not drain(req) and r.counts["redispatched"] == 1 and req.migrations == 0


async def test_a_repeated_item_is_dropped_and_the_stream_goes_on() -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=5), NOW)
    rid = req.request_id
    w, _ = work_for(sent, rid, 0)
    r.on_message(w.encode(), batch(w, item(rid, 0, 0, 3)), NOW)
    r.on_message(w.encode(), batch(w, item(rid, 0, 1, 2)), NOW)  # again
    r.on_message(w.encode(), batch(w, item(rid, 0, 3, 2, "length")), NOW)
    assert streamed(drain(req)) == [synthetic_token(rid, p) for p in range(5)]
    assert req.done and req.outcome == "ok" and r.counts["tokens_repeated"] == 1 and req.attempt == 0


async def test_an_item_without_a_position_is_taken_as_before() -> None:
    """An older worker reports no position (pos -1): nothing is checked."""
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=3), NOW)
    rid = req.request_id
    w, _ = work_for(sent, rid, 0)
    r.on_message(w.encode(), batch(w, m.TokenItem(rid, 0, [1, 2])), NOW)
    r.on_message(w.encode(), batch(w, m.TokenItem(rid, 0, [3], "length")), NOW)
    assert streamed(drain(req)) == [1, 2, 3] and req.done and not r.counts["token_gaps"]


async def test_a_lost_end_is_resumed_when_the_worker_says_hello_without_the_request() -> None:
    r, sent = make_router("deflect-all")
    a = r.submit(list(range(100, 140)), m.Sampling(max_tokens=6), NOW)   # streaming; its end is lost
    b = r.submit(list(range(200, 240)), m.Sampling(max_tokens=6), NOW)   # streaming, still held there
    wa, _ = work_for(sent, a.request_id, 0)
    wb, _ = work_for(sent, b.request_id, 0)
    r.on_message(wa.encode(), batch(wa, item(a.request_id, 0, 0, 2)), NOW)
    r.on_message(wb.encode(), batch(wb, item(b.request_id, 0, 0, 2)), NOW)
    c = r.submit(list(range(300, 340)), m.Sampling(max_tokens=6), NOW)   # dispatched, nothing streamed yet
    wc, _ = work_for(sent, c.request_id, 0)
    sent.clear()
    for wid in {wa, wb, wc}:  # each says Hello again (its connection came back) holding only b
        r.on_message(wid.encode(), hello(wid, "decode", held=[b.request_id]), NOW)
    assert r.counts["ends_unheard"] == 1
    w1, work1 = work_for(sent, a.request_id, 1)
    assert work1.resume_tokens == 2 and a.migrations == 1
    assert b.attempt == 0 and c.attempt == 0  # b is held; c may not have reached its worker yet
    welcome = [msg for wid, msg in sent if isinstance(msg, m.Welcome) and wid == wb]
    assert welcome and b.request_id not in welcome[0].drop
    for it in await decode_on_sim(work1):
        r.on_message(w1.encode(), batch(w1, it), NOW)
    assert streamed(drain(a)) == [synthetic_token(a.request_id, p) for p in range(6)] and a.done


async def test_a_lost_end_of_a_request_with_every_token_out_just_finishes_it() -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=3), NOW)
    w, _ = work_for(sent, req.request_id, 0)
    r.on_message(w.encode(), batch(w, item(req.request_id, 0, 0, 3)), NOW)  # the finish_reason was lost
    r.on_message(w.encode(), hello(w, "decode", held=[]), NOW)
    events = drain(req)
    assert req.done and req.outcome == "ok" and [ev.finish_reason for ev in events if ev.finish_reason] == ["length"]


async def test_the_simulated_engine_reports_positions_across_a_resume() -> None:
    fresh = await run_on_sim("decode", EngineRequest(request_id="r1", attempt=0, prompt_token_ids=list(range(50)),
                                                     sampling=m.Sampling(max_tokens=5), mode="deflect"))
    assert [it.pos for it in fresh if it.token_ids] == [0, 1, 2, 3, 4]
    resumed = await run_on_sim("decode", EngineRequest(request_id="r1", attempt=1, prompt_token_ids=list(range(53)),
                                                       sampling=m.Sampling(max_tokens=2), mode="deflect",
                                                       resume_tokens=3))
    assert [it.pos for it in resumed if it.token_ids] == [3, 4]


async def test_after_a_stall_of_the_router_no_worker_is_judged_before_it_could_redial() -> None:
    """The router slept past the heartbeat timeout: the workers' connections broke, and a new one
    may go unheard until the worker dials again (1 s). Before this grace every worker was declared
    lost 1 s after the router woke and every stream migrated (tests/chaos/transit.py, 2026-12-07)."""
    from common.router_core.membership import STALL_REDIAL_S
    r, _ = make_router("deflect-all")
    live = r.liveness_s
    r.membership.excuse_stall(NOW + 10.0, 10.0)                      # woke at NOW + 10, workers last heard at NOW
    r.tick(NOW + 10.0 + live + 0.1)
    assert set(r.table.workers) == {"prefill-0", "decode-0", "decode-1"}
    r.tick(NOW + 10.0 + live + STALL_REDIAL_S + 0.1)            # still silent past the grace: lost
    assert not r.table.workers


async def test_work_that_could_not_be_sent_is_placed_again_without_spending_a_migration() -> None:
    """A resumed attempt whose work never reached a worker (the send failed) is placed again as
    the same migration: before, kill + freeze failed streams with "already resumed 2 times"."""
    r, sent = make_router("deflect-all", max_migrations=1)
    r.on_message(b"decode-2", hello("decode-2", "decode"), NOW)
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=8), NOW)
    rid = req.request_id
    w, _ = work_for(sent, rid, 0)
    r.on_message(w.encode(), batch(w, item(rid, 0, 0, 2)), NOW)
    r.outbox.unreachable.update(x for x in ("decode-0", "decode-1", "decode-2") if x != w)  # type: ignore[attr-defined]
    lost = r.table.remove(w)
    assert lost is not None
    r.membership.worker_gone(lost, "heartbeat timeout", NOW)   # migration 1 of 1; its send fails
    assert req.migrations == 1 and not req.done and r.unsent
    r.outbox.unreachable.clear()  # type: ignore[attr-defined]
    sent.clear()
    r.tick(NOW)                                                 # placed again: no second migration
    assert not req.done and req.migrations == 1   # (placed by the liveness tick: its worker is unreachable)
    w2, work = work_for(sent, rid, req.attempt)
    assert w2 != w and work.resume_tokens == 2
