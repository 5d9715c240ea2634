"""services/router/edge.py's timeouts on one timer per connection: a keep-alive connection's
requests re-arm it without making or cancelling a timer each (they cost about 5 µs a request
when they did), and the header and body timeouts still fire when due. A real uvicorn in this
test's event loop, on loopback, with timeouts of a fraction of a second."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn

from common.ports import free_ports
from services.router.edge import EdgeLimits, edge_protocol, unread_bytes

_TIMERS = {"_header_timeout", "_body_timeout", "_due_check"}  # the edge's own callbacks (not uvicorn's)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve(limits: EdgeLimits, keep_alive_s: float = 5.0) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, lifespan="off", access_log=False,
                                           log_level="warning", http=edge_protocol(limits),  # type: ignore[arg-type]
                                           timeout_keep_alive=keep_alive_s))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


async def test_a_keep_alive_connections_requests_do_not_make_a_timer_each(monkeypatch: Any) -> None:
    loop = asyncio.get_running_loop()
    made: list[str] = []
    for name in ("call_at", "call_later"):
        real = getattr(loop, name)

        def counted(when: float, cb: Any, *args: Any, _real: Any = real, **kw: Any) -> Any:
            if getattr(cb, "__name__", "") in _TIMERS:
                made.append(cb.__name__)
            return _real(when, cb, *args, **kw)

        monkeypatch.setattr(loop, name, counted)
    server, task, port = await _serve(EdgeLimits(header_timeout_s=30.0, body_timeout_s=60.0))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(20):
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
        writer.close()
        await writer.wait_closed()
        assert len(made) <= 1, made  # the connection's first arming only (it was 2 per request)
    finally:
        server.should_exit = True
        await task


async def test_the_header_and_body_timeouts_still_fire() -> None:
    server, task, port = await _serve(EdgeLimits(header_timeout_s=0.3, body_timeout_s=0.3))
    try:
        # never a byte: closed
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(silent_r.read(), 5) == b""
        # served once, then silent on the same connection: the next request's headers are timed too
        served_r, served_w = await asyncio.open_connection("127.0.0.1", port)
        served_w.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        assert (await asyncio.wait_for(served_r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(served_r.read(), 5) == b""
        # a body that stops half way: 408, then closed
        stalled_r, stalled_w = await asyncio.open_connection("127.0.0.1", port)
        stalled_w.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
        reply = await asyncio.wait_for(stalled_r.read(), 5)
        assert reply.startswith(b"HTTP/1.1 408") and b"x-kairos-error: body_timeout" in reply
        for wr in (silent_w, served_w, stalled_w):
            wr.close()
            await wr.wait_closed()
    finally:
        server.should_exit = True
        await task


_REQ = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"


async def test_a_timeout_that_finds_the_next_request_unread_does_not_close_its_connection() -> None:
    """The client's next request on a kept-alive connection reached the socket in time, but the
    router's loop was not running (frozen, starved) and, as uvloop does after a freeze, ran the
    due timeouts before it read the socket: uvicorn's keep-alive and the edge's header timeout
    closed the connection with the request unread, a reset the client sees for a request sent in
    good time (tests.chaos.stranded: 5-6 of 1,000; every one of five tries live, keep-alive
    connections across a freeze). Here the timeouts are called while the request is unread, as
    such a loop turn would: the connection stays and the request is served; once it is idle with
    nothing unread, the timeouts close it as before."""
    server, task, port = await _serve(EdgeLimits(header_timeout_s=30.0, body_timeout_s=30.0), keep_alive_s=30.0)
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_REQ)
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.05)
        (proto,) = server.server_state.connections
        writer.write(_REQ)  # written to the socket at once (no await: the server has not read it)
        time.sleep(0.05)  # the loop blocked (frozen): the bytes wait in the kernel, unread
        p: Any = proto
        assert unread_bytes(p.transport) == len(_REQ)
        p.timeout_keep_alive_handler()  # due now, as the loop turn after a freeze would run it
        p._due = loop.time()  # the header timeout due now too
        p._due_check()
        assert not p.transport.is_closing()
        reply = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        await asyncio.sleep(0.05)
        assert unread_bytes(p.transport) == 0
        p.timeout_keep_alive_handler()  # idle, nothing unread, on time: closed
        assert p.transport.is_closing()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()
    finally:
        server.should_exit = True
        await task
