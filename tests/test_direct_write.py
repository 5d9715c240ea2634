"""services/router/edge.py's DirectWrite on a real uvicorn server (the router's edge protocol, in
this test's event loop, on loopback): chunks written straight to the socket between ASGI sends
reach the client in order, framed as uvicorn frames its own, the response ends normally and the
keep-alive connection serves the next request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import uvicorn

from common.ports import free_ports
from services.router.edge import DIRECT, EdgeLimits, edge_protocol

seen: list[tuple[bool, bool]] = []  # per request: (a DirectWrite in the scope, ready() once started)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    direct = scope.get("extensions", {}).get(DIRECT)
    assert direct is None or not direct.ready()  # nothing started yet
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"one,", "more_body": True})
    ready = direct is not None and direct.ready()
    seen.append((direct is not None, ready))
    if ready:
        direct.write(b"two,")
        direct.write(b"three,")
    else:
        await send({"type": "http.response.body", "body": b"two,three,", "more_body": True})
    await send({"type": "http.response.body", "body": b"four", "more_body": False})
    assert direct is None or not direct.open()  # over: nothing more may be written


async def test_direct_chunks_reach_the_client_in_order_and_the_connection_serves_on() -> None:
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", access_log=False,
                                           log_level="warning", http=edge_protocol(EdgeLimits())))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        seen.clear()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(2):  # the second on the same keep-alive connection
                r = await client.get("/")
                assert r.status_code == 200 and r.text == "one,two,three,four"
                assert r.headers["transfer-encoding"] == "chunked"
        assert seen == [(True, True), (True, True)]
        # on the wire: each direct chunk framed as uvicorn frames the ones sent the ASGI way
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.0\r\nhost: x\r\n\r\n")
        raw = await reader.read()
        writer.close()
        assert raw.endswith(b"\r\n\r\n4\r\none,\r\n4\r\ntwo,\r\n6\r\nthree,\r\n4\r\nfour\r\n0\r\n\r\n"), raw
        assert seen[-1] == (True, True)
    finally:
        server.should_exit = True
        await task


class _Socket:
    """A DirectWrite that takes everything, its bodies into the same list as the ASGI sends'."""

    def __init__(self, out: list[bytes]) -> None:
        self.out = out
        self.written = 0

    def ready(self) -> bool:
        return True

    def open(self) -> bool:
        return True

    def write(self, body: bytes) -> None:
        self.written += 1
        self.out.append(body)

    lost: Any = None

    def on_lost(self, fn: Any) -> None:
        self.lost = fn


async def _serve(r: Any, sock: _Socket, receive: Any, send: Any) -> asyncio.Task[None]:
    """The router's HTTP app serving one POST /v1/completions with `sock` as the connection's
    DirectWrite, run until the router holds the request."""
    from services.router import http

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "client": ("10.0.0.7", 1),
             "extensions": {DIRECT: sock}}
    task = asyncio.create_task(http.App(r)(scope, receive, send))
    for _ in range(100):
        await asyncio.sleep(0)
        if r.requests:
            break
    return task


async def test_the_http_layer_hands_a_plain_stream_the_connections_direct_write() -> None:
    """services/router/http.py passes the scope's DirectWrite to the stream: the middle chunks of
    a plain streamed completion go that way, in order with what goes through `send`."""
    from common import codec, config
    from common import messages as m
    from services.router.service import Router
    from tests.router_fakes import FakeOutbox, hello

    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "deflect-all", "profile": "fast",
                                                              "liveness": 10_000})
    r = Router(cfg, outbox=FakeOutbox())
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    out: list[bytes] = []
    sock = _Socket(out)
    body = b'{"prompt": [5, 6, 7], "max_tokens": 3, "stream": true}'
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            out.append(msg["body"])

    task = await _serve(r, sock, receive, send)
    (req,) = r.requests.values()
    for k, fin in enumerate([None, None, "length"]):
        r._on_work_frames([b"decode-0", codec.encode(m.TokenBatch(worker_id="decode-0", items=[
            m.TokenItem(request_id=req.request_id, attempt=req.attempt, token_ids=[100 + k], finish_reason=fin)]))])
        for _ in range(5):
            await asyncio.sleep(0)
    await asyncio.wait_for(task, 5)
    # the first two tokens' chunks went the direct way; the last token, which arrives with the
    # end, goes with it through `send`, one chunk, as vLLM's server and the queued path write it
    assert sock.written == 2
    events = [e for e in b"".join(out).split(b"\n\n") if e]
    chunks = [json.loads(e[6:])["choices"][0] for e in events if e.startswith(b"data: {")]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [
        (" " + r.tokenizer.token_text(100), None), (" " + r.tokenizer.token_text(101), None),
        (" " + r.tokenizer.token_text(102), "length")]
    assert events[-1] == b"data: [DONE]" and out[-1].startswith(b"data: {")  # the last chunk with the end: one body


async def test_a_client_that_goes_mid_stream_is_aborted_by_its_connection_without_a_watcher_task() -> None:
    """On the router's edge the HTTP layer hands the connection a function for its
    `connection_lost` (DirectWrite.on_lost) instead of a task per request awaiting `receive()`:
    `receive` is read for the body only, and when the connection is lost mid-stream the request
    is aborted (its worker told) and the handler ends."""
    from common import config
    from common import messages as m
    from services.router.service import Router
    from tests.router_fakes import FakeOutbox, hello

    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "deflect-all", "profile": "fast",
                                                              "liveness": 10_000})
    outbox = FakeOutbox()
    r = Router(cfg, outbox=outbox)
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    sock = _Socket([])
    body = b'{"prompt": [5, 6, 7], "max_tokens": 3, "stream": true}'
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if reads == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # uvicorn's: until the client goes
        raise AssertionError

    async def send(msg: dict[str, Any]) -> None:
        pass

    task = await _serve(r, sock, receive, send)
    for _ in range(10):
        await asyncio.sleep(0)
    (req,) = r.requests.values()
    assert reads == 1 and callable(sock.lost)  # the body only: no task awaits the disconnect
    sock.lost()  # the connection's connection_lost
    await asyncio.wait_for(task, 5)
    assert not r.requests and req.done
    assert any(isinstance(msg, m.Cancel) and msg.request_id == req.request_id for _, msg in outbox.sent)
    assert sock.lost is None  # the handler took its function back on the way out


lost_calls: list[str] = []


async def _lost_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    direct = scope["extensions"][DIRECT]
    path = scope["path"]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    direct.on_lost(lambda: lost_calls.append(path))
    if path == "/short":  # over before the client goes: the function is not called
        await send({"type": "http.response.body", "body": b"done", "more_body": False})
        direct.on_lost(None)
        return
    await send({"type": "http.response.body", "body": b"wait,", "more_body": True})
    for _ in range(500):  # until the client goes (a lost connection calls the function)
        if lost_calls:
            break
        await asyncio.sleep(0.01)
    direct.on_lost(lambda: lost_calls.append("late"))  # registered after it went: called at once


async def test_the_edge_calls_on_lost_when_the_client_goes_before_the_response_is_over() -> None:
    lost_calls.clear()
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(_lost_app, host="127.0.0.1", port=port, lifespan="off", access_log=False,
                                           log_level="warning", http=edge_protocol(EdgeLimits())))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"0\r\n\r\n")).endswith(b"done\r\n0\r\n\r\n")
        writer.write(b"GET /long HTTP/1.1\r\nhost: x\r\n\r\n")  # the same connection: the next request
        await reader.readuntil(b"wait,\r\n")
        writer.close()
        for _ in range(500):
            if len(lost_calls) == 2:
                break
            await asyncio.sleep(0.01)
        assert lost_calls == ["/long", "late"]
    finally:
        server.should_exit = True
        await task
