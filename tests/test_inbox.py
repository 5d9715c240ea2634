"""common.sockets.Inbox: the router's work socket read from the event loop, in batches while idle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq
import zmq.asyncio

from common.sockets import Inbox


async def _until(cond: object, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.001)
    return True


@asynccontextmanager
async def _pair(name: str) -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """A ROUTER bound on inproc://NAME and a DEALER peer `w1` connected to it; closed after."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"inproc://{name}")
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"w1")
    peer.connect(f"inproc://{name}")
    try:
        yield router, peer
    finally:
        peer.close(0)
        router.close(0)
        ctx.term()


async def test_reads_every_message_and_spaces_reads_only_while_asked() -> None:
    """Multipart messages arrive whole; with an idle gap the socket is not read again before the gap
    (heartbeats pile up and are read in one batch), a send ends the pause at once, and with no gap
    every message is read as it comes."""
    async with _pair("inbox-test") as (router, peer):
        got: list[list[bytes]] = []
        gap = [3600.0]  # an hour: nothing but a send can end the pause within this test
        inbox = Inbox(router, got.append, idle_gap=lambda: gap[0])
        try:
            await peer.send_multipart([b"a", b"1"])
            assert await _until(lambda: got == [[b"w1", b"a", b"1"]])  # the first read is never held
            for i in range(5):
                await peer.send(str(i).encode())
            await asyncio.sleep(0.05)
            assert len(got) == 1  # paused: the gap has not passed
            assert inbox.send([b"w1", b"ping"])  # a send (a dispatch, whose reply matters) reads now
            assert await _until(lambda: len(got) == 6)
            assert [f[1] for f in got[1:]] == [b"0", b"1", b"2", b"3", b"4"]
            assert inbox.messages == 6 and inbox.wakeups < 6  # the five were read in one batch
            assert await peer.recv() == b"ping"
            gap[0] = 0.0  # busy: no gap
            for i in range(3):
                await peer.send(b"x%d" % i)
                assert await _until(lambda n=i: len(got) == 7 + n)
        finally:
            inbox.close()


async def test_catch_up_reads_what_waits_during_a_pause_at_once() -> None:
    """A request arriving at an idle router: `catch_up` folds in every message that came during the
    pause before it returns (its decision sees the fleet as it is), and does nothing when not paused."""
    async with _pair("inbox-catch-up") as (router, peer):
        got: list[list[bytes]] = []
        inbox = Inbox(router, got.append, idle_gap=lambda: 3600.0)
        try:
            inbox.catch_up()  # not paused: nothing to do
            await peer.send(b"first")
            assert await _until(lambda: len(got) == 1)
            for i in range(4):
                await peer.send(b"hb%d" % i)
            await asyncio.sleep(0.05)
            assert len(got) == 1  # paused for the gap
            inbox.catch_up()
            assert [f[1] for f in got] == [b"first", b"hb0", b"hb1", b"hb2", b"hb3"]  # read before it returned
            inbox.catch_up()  # nothing more waits: harmless
            assert len(got) == 5
        finally:
            inbox.close()


async def test_catch_up_reads_past_one_batch() -> None:
    """More waiting than one read takes (`batch`): `catch_up` goes on reading until none is left."""
    async with _pair("inbox-catch-up-batches") as (router, peer):
        got: list[list[bytes]] = []
        inbox = Inbox(router, got.append, batch=2, idle_gap=lambda: 3600.0)
        try:
            await peer.send(b"first")
            assert await _until(lambda: len(got) == 1)
            for i in range(7):
                await peer.send(b"hb%d" % i)
            await asyncio.sleep(0.05)
            assert len(got) == 1
            inbox.catch_up()
            assert [f[1] for f in got[1:]] == [b"hb%d" % i for i in range(7)]  # four reads of two, at once
        finally:
            inbox.close()


async def test_read_queued_reads_what_waits_at_once_when_busy_too() -> None:
    """A router replica deciding a request (or taking its turn) while its loop is busy: what already
    waits on the socket (another replica's dispatch, in a worker's heartbeat) is read before the
    decision, not when the reader callback's turn comes; `catch_up` does that only while paused."""
    async with _pair("inbox-read-queued") as (router, peer):
        got: list[list[bytes]] = []
        inbox = Inbox(router, got.append)  # busy: no idle gap, never paused
        sync_peer: zmq.Socket[bytes] = zmq.Socket.shadow(peer.underlying)
        try:
            sync_peer.send(b"hello")
            assert await _until(lambda: len(got) == 1)
            sync_peer.send(b"hb1")  # queued: the loop has not run since (no await)
            sync_peer.send(b"hb2")
            inbox.catch_up()  # not paused: nothing
            assert len(got) == 1
            inbox.read_queued()
            assert [f[1] for f in got] == [b"hello", b"hb1", b"hb2"]
            inbox.read_queued()  # nothing waits: nothing happens
            assert len(got) == 3
        finally:
            inbox.close()


async def test_drained_at_moves_only_when_a_read_finds_the_socket_empty() -> None:
    """`drained_at` (the router judges a heartbeat's age by it: Membership.sent_after) is the last
    read that found nothing more: a backlog read in batches keeps it where the backlog began, so a
    message read from it is known to be at most that old, never younger than it is."""
    async with _pair("inbox-drained") as (router, peer):
        seen: list[float] = []
        inbox: Inbox | None = None

        def on_frames(frames: list[bytes]) -> None:
            assert inbox is not None
            seen.append(inbox.drained_at)

        inbox = Inbox(router, on_frames, batch=2)
        sync_peer: zmq.Socket[bytes] = zmq.Socket.shadow(peer.underlying)
        try:
            sync_peer.send(b"first")
            assert await _until(lambda: len(seen) == 1)
            drained = inbox.drained_at
            assert drained >= seen[0]  # read empty after it
            for i in range(6):  # three batches of two, read on three loop passes
                sync_peer.send(b"m%d" % i)
            assert await _until(lambda: len(seen) == 7)
            assert seen[1:] == [drained] * 6  # each read from the backlog, none at a drained socket
            assert inbox.drained_at > drained  # and the last read found it empty
        finally:
            inbox.close()
