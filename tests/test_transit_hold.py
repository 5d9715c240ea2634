"""A worker whose connection to its router breaks keeps what it sends until the router welcomes
it again, then sends it in order: no token is lost to the broken connection, or to a new one
the router does not hear yet (common/router_link.py, RouterLink.hold).

A real decode worker (sim engine, in this process) and a fake router (a ROUTER socket bound by
the test). The break: the fake router's socket is closed; the "restart": a new one on the same
port. Synchronised on messages and on the worker's own state, no timing assumptions.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from common import config
from common import messages as m
from common import worker as worker_mod
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from services.decode_worker.service import DecodeWorker
from tests.test_replica_links import Fake, work


async def _until(cond: object, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def worker_of(router: Fake, monkeypatch: pytest.MonkeyPatch, *, hold: bool, drain_timeout: float) -> DecodeWorker:
    """A decode worker (sim engine, steps of tens of ms) of the fake `router`; `hold` False: as
    before RouterLink.hold, nothing kept across a break and nothing sent again."""
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "router_host": "127.0.0.1", "work_port": router.work_port, "heartbeat_port": router.hb_port,
        "kv_transport": "modeled", "worker_id": "decode-r", "refit_interval": 0, "drain_timeout": drain_timeout})
    w = DecodeWorker(cfg, SimEngine("decode", load_profile("fast"), time_scale=20.0))
    if not hold:
        link = type(w.links[0])
        monkeypatch.setattr(link, "holding_out", property(lambda self: False))
        monkeypatch.setattr(link, "on_break", lambda self: None)
    return w


async def welcome(router: Fake, heartbeat_interval_s: float = 0.1) -> None:
    """The worker's first Hello to the fake `router`, answered."""
    await router.until(lambda x: isinstance(x, m.Hello))
    await router.send(m.Welcome(router_incarnation=router.name, heartbeat_interval_s=heartbeat_interval_s))


async def start_long(router: Fake) -> None:
    """Welcome the worker and give it "long" (400 tokens, seconds of steps; dispatch 1); returns
    once its first tokens reached the router."""
    await welcome(router)
    await router.send(work("long", dispatch=1, max_tokens=400))
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == "long" for i in x.items))


def positions(got: list[m.Msg], rid: str) -> list[int]:
    return [i.pos + k for x in got if isinstance(x, m.TokenBatch) for i in x.items if i.request_id == rid
            for k in range(len(i.token_ids))]


@pytest.mark.parametrize("hold", [True, False])
async def test_what_a_worker_sent_around_a_break_reaches_the_router_after_it(
        monkeypatch: pytest.MonkeyPatch, hold: bool) -> None:
    ctx = zmq.asyncio.Context()
    a = Fake(ctx, "A")
    w = worker_of(a, monkeypatch, hold=hold, drain_timeout=1.0)
    link = w.links[0]
    task = asyncio.create_task(w.run())
    b: Fake | None = None
    try:
        await start_long(a)
        before = positions(a.got, "long")
        await a.send(work("short", dispatch=2, max_tokens=4))
        await asyncio.sleep(0.3)          # token batches wait unread in the router's queue ...
        a.close()                         # ... and are lost with it (a router frozen past the heartbeat timeout)
        await _until(lambda: not link.connected)
        await asyncio.sleep(0.5)          # the worker goes on producing tokens; "short" ends meanwhile
        b = Fake(ctx, "B", like=a)        # a router again, on the same port
        h = await b.until(lambda x: isinstance(x, m.Hello))
        assert isinstance(h, m.Hello)
        await b.send(m.Welcome(router_incarnation="A", heartbeat_interval_s=0.1))
        await b.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == "long" and i.finish_reason
                                                                     for i in x.items), timeout=30.0)
        after = positions(b.got, "long")
        got = sorted(set(before) | set(after))
        if hold:
            assert got == list(range(400))                      # nothing lost; repeats are the router's to drop
            assert after == sorted(after)                       # in order
            assert positions(b.got, "short") == [0, 1, 2, 3]    # its whole output, the end included
            assert "short" in h.held                            # its end was still to come: not resumed
        else:
            assert got != list(range(400))                      # a hole: what the test is about
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 10)
        a.close()
        if b is not None:
            b.close()
        ctx.term()
