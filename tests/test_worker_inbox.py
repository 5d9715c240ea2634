"""A worker reads its router's messages from the socket's reader callback (an `Inbox`), and
every send of its own goes through that Inbox while it reads: a send on a ZeroMQ socket may
consume the read edge of its file descriptor, and only the Inbox knows to read again after it
(issue 47: no Future and no loop turn per message on the first token's path).

A real decode worker (sim engine, in this process) against a fake router (a ROUTER socket bound by
the test), synchronised on messages and on the worker's state, no timing assumptions.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from common import messages as m
from common.sockets import Inbox
from tests.test_replica_links import Fake, work
from tests.test_transit_hold import _until, welcome, worker_of


async def test_a_worker_reads_through_an_inbox_and_sends_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work sent while the worker heartbeats every few ms (each beat a send on the socket) is all
    read and served; the worker's bus has an Inbox while it runs and none after."""
    ctx = zmq.asyncio.Context()
    a = Fake(ctx, "A")
    w = worker_of(a, monkeypatch, hold=True, drain_timeout=1.0)
    task = asyncio.create_task(w.run())
    bus = None
    try:
        await welcome(a, heartbeat_interval_s=0.002)
        bus = w.links[0].bus
        assert bus is not None and isinstance(bus.inbox, Inbox)
        sends: list[int] = []
        real = bus.inbox.send

        def counting(frames: list[bytes]) -> bool:
            sends.append(1)
            return real(frames)

        monkeypatch.setattr(bus.inbox, "send", counting)
        ids = [f"r{i}" for i in range(30)]
        for n, rid in enumerate(ids, start=1):
            await a.send(work(rid, dispatch=n, max_tokens=2))
            await asyncio.sleep(0.001)
        await a.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == ids[-1] and i.finish_reason
                                                                    for i in x.items), timeout=10.0)
        done = {i.request_id for x in a.got if isinstance(x, m.TokenBatch) for i in x.items if i.finish_reason}
        assert done == set(ids)
        assert sends  # its heartbeats and tokens went through the Inbox
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 20)
        a.close()
        ctx.term()
    assert bus is not None and bus.inbox is None


async def test_a_role_change_from_the_inbox_says_bye_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """SetRole is handled in the reader callback: the worker tells its router it is going (no
    wait on the socket there) and its service stops for the new role."""
    ctx = zmq.asyncio.Context()
    a = Fake(ctx, "A")
    w = worker_of(a, monkeypatch, hold=True, drain_timeout=1.0)
    task = asyncio.create_task(w.run())
    try:
        await welcome(a)
        await a.send(m.SetRole(role="prefill", reason="test"))
        await _until(lambda: w.stop.is_set())
        assert w.next_role == "prefill"
        await a.until(lambda x: isinstance(x, m.Goodbye) and x.reason == "role_change", timeout=5.0)
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 20)
        for link in w.links:  # kept for the next role's service, which this test does not start
            if link.bus is not None:
                link.bus.close()
        await w.engine.close()
        a.close()
        ctx.term()
