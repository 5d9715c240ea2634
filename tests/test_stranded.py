"""Nothing stranded (issue 48): work whose send to a worker failed is placed again whatever the
worker's registration does meanwhile, and every request in flight has an owner. The router core,
driven with explicit time (tests/router_fakes.py)."""

from __future__ import annotations

from typing import Any

from common import config
from common import messages as m
from common.router_core.core import RouterCore
from tests.router_fakes import Clock, FakeOutbox, hello

SAMPLING = m.Sampling(max_tokens=4, ignore_eos=True)


class Log:
    """A structlog-like logger that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _log(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    debug = info = warning = error = _log

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for e, kw in self.events if e == event]


def done(worker: str, work: m.DecodeWork) -> m.TokenBatch:
    """The worker's answer to work: every token at once."""
    return m.TokenBatch(worker_id=worker, items=[m.TokenItem(work.request_id, work.attempt, [1, 2, 3, 4], "length")])


def make_core(policy: str, **overrides: Any) -> tuple[RouterCore, FakeOutbox, Log]:
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": policy, "profile": "fast", **overrides})
    box, log = FakeOutbox(), Log()
    return RouterCore(cfg, box, log=log), box, log


def heartbeat(worker_id: str, seq: int) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=worker_id, incarnation=f"inc-{worker_id}", seq=seq, batch=0, kv_tokens=0,
                             kv_free_tokens=10**6, kv_capacity_tokens=10**6, resident_prefill_tokens=0,
                             deflections=0, strictest_tbt_slo=None, token_budget=2048)


def test_work_whose_send_failed_is_sent_again_after_the_worker_reregisters() -> None:
    """The issue's sequence: the send fails (the worker is reconnecting), the worker says Hello
    again under the same incarnation before the next liveness tick (which clears the mark), and
    the request must still reach a worker at the next tick, not wait for its deadline."""
    core, box, log = make_core("deflect-all", heartbeat_interval=0.1, liveness=10)
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0", "decode"), clock.now)
    box.take()
    box.unreachable.add("decode-0")
    req = core.submit([1, 2, 3], SAMPLING, clock.now)
    assert req.decode_worker == "decode-0" and not box.take()  # nothing reached it
    failed = log.named("send_to_worker_failed")
    assert failed and failed[0]["request_id"] == req.request_id
    box.unreachable.clear()
    # it registers again under the same incarnation: the mark is cleared
    core.on_message(b"decode-0", hello("decode-0", "decode"), clock.advance(0.01))
    assert not core.table.workers["decode-0"].unreachable
    core.tick(clock.advance(0.09))
    work = [msg for peer, msg in box.take() if isinstance(msg, m.DecodeWork)]
    assert [(w.request_id, w.attempt) for w in work] == [(req.request_id, 1)]
    assert not req.done and req.attempt == 1
    moved = log.named("request_redispatched")
    assert moved and moved[0]["request_id"] == req.request_id and moved[0]["decode_worker"] == "decode-0"
    # the worker answers: the request is served
    core.on_message(b"decode-0", done("decode-0", work[0]), clock.advance(0.01))
    assert req.done and req.outcome == "ok"
    for _ in range(3):
        core.tick(clock.advance(0.1))
    assert core.counts["unsent_replaced"] == 1 and core.counts["orphaned"] == 0


def test_a_request_nobody_holds_is_placed_again_and_named() -> None:
    core, box, log = make_core("deflect-all", heartbeat_interval=0.1, liveness=10)
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0", "decode"), clock.now)
    req = core.submit([1, 2, 3], SAMPLING, clock.now)
    core.table.workers["decode-0"].holding.clear()  # lost track of it, by whatever bug
    box.take()
    core.tick(clock.advance(0.1))
    assert log.named("request_orphaned")[0]["request_id"] == req.request_id
    assert [msg.attempt for _, msg in box.take() if isinstance(msg, m.DecodeWork)] == [1]
    assert req.request_id in core.table.workers["decode-0"].holding and core.counts["orphaned"] == 1
    core.tick(clock.advance(1.1))  # the next audit, a liveness window later
    assert core.counts["orphaned"] == 1  # owned again: said once


def test_no_request_is_stranded_whatever_sends_fail() -> None:
    """Many requests; now and then a worker's connection drops for one send and the worker
    registers again (same incarnation) before or after the next tick: every request is served."""
    import random
    from collections import Counter

    rnd = random.Random(48)
    core, box, _ = make_core("deflect-all", heartbeat_interval=0.1, liveness=10, request_timeout=5.0)
    clock = Clock()
    ids = ["decode-0", "decode-1"]
    for w in ids:
        core.on_message(w.encode(), hello(w, "decode"), clock.now)
    reqs = []
    for step in range(300):
        now = clock.advance(0.01)
        flaky = rnd.choice(ids) if rnd.random() < 0.2 else None
        if flaky:
            box.unreachable = {flaky}
        if step < 200:
            reqs.append(core.submit([1, 2, 3], SAMPLING, now))
        box.unreachable = set()
        if flaky and rnd.random() < 0.7:
            core.on_message(flaky.encode(), hello(flaky, "decode"), now)  # back before the tick
        for peer, msg in box.take():  # the workers answer what reached them
            if isinstance(msg, m.DecodeWork):
                core.on_message(peer.encode(), done(peer, msg), now)
        if step % 10 == 0:
            for w in ids:
                if w not in core.table.workers:
                    core.on_message(w.encode(), hello(w, "decode"), now)
                else:
                    core.on_message(w.encode(), heartbeat(w, step), now)
            core.tick(now)
    assert Counter(r.outcome for r in reqs) == {"ok": len(reqs)}  # every one served
    assert not core.requests
    assert core.counts["unsent_replaced"] > 5  # the case above happened


async def test_the_router_gives_memory_back_when_it_falls_idle(monkeypatch: Any) -> None:
    """After load (requests in flight), the first idle telemetry round trims the heap once
    (common/memory.py; the RSS it gives back: docs/benchmarks/stranded.md)."""
    import asyncio

    from common import memory
    from services.router import service
    from tests.test_trust import make_router

    trims: list[int] = []
    monkeypatch.setattr(service.memory, "trim", lambda: trims.append(1) or True)
    r = make_router("deflect-all")
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), 0.0)
    loop = asyncio.create_task(r.telemetry_loop(every_s=0.01))
    try:
        req = r.submit([1, 2, 3], SAMPLING)
        await asyncio.sleep(0.1)
        assert not trims  # busy: nothing given back mid-load
        r.core.abort(req, 0.0)
        await asyncio.sleep(0.1)
        assert trims == [1]  # once, not every idle round
        # a steady load of short requests, none in flight when a round looks: not idle
        for _ in range(30):
            r.core.abort(r.submit([1, 2, 3], SAMPLING), 0.0)
            await asyncio.sleep(0.002)
        assert trims == [1]
        await asyncio.sleep(0.1)
        assert trims == [1, 1]  # the load stopped: given back once
    finally:
        loop.cancel()
        r.close()
    assert memory.trim() in (True, False) and memory.rss_bytes() > 0
