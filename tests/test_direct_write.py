"""services/router/edge.py's DirectWrite on a real uvicorn server (the router's edge protocol, in
this test's event loop, on loopback): chunks written straight to the socket between ASGI sends
reach the client in order, framed as uvicorn frames its own, the response ends normally and the
keep-alive connection serves the next request."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import uvicorn

from kairos.up import free_ports
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
