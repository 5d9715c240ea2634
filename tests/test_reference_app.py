"""bench/reference_app.py, the floor `kairos bench-router` measures the router against: it must
answer the load generator's requests as the router does (an SSE stream it counts token by token)."""

from __future__ import annotations

from typing import Any

from bench.reference_app import app
from kairos.loadgen import SSEParser, classify


async def _call(method: str, path: str, body: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    return sent


async def test_streams_max_tokens_events_then_done() -> None:
    sent = await _call("POST", "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 3, "stream": true}')
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream") in sent[0]["headers"]
    parser = SSEParser()
    events = [classify(d) for m in sent[1:] for d in parser.feed(m["body"])]
    assert [e.token for e in events] == [True, True, True, False]
    assert events[2].finish_reason == "length" and events[3].done
    assert sent[-1]["more_body"] is False


async def test_anything_else_is_404_or_400() -> None:
    assert (await _call("GET", "/v1/models", b""))[0]["status"] == 404
    assert (await _call("POST", "/v1/completions", b"not json at all"))[0]["status"] == 400


async def test_the_raw_protocol_gives_the_same_stream_and_keeps_the_connection() -> None:
    """bench/raw_http_app.py (bench.http_stack's floor without uvicorn's cycle) answers byte for byte
    what a client reads from the reference app: the same events, on one keep-alive connection."""
    import asyncio

    from bench.raw_http_app import RawHttp

    server = await asyncio.get_running_loop().create_server(RawHttp, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"prompt": [1, 2], "max_tokens": 3, "stream": true}'
    try:
        for expect in (200, 404, 400):
            path, data = {200: (b"/v1/completions", body), 404: (b"/nope", b""),
                          400: (b"/v1/completions", b"not json")}[expect]
            writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (path, len(data), data))
            status = await reader.readline()
            assert int(status.split()[1]) == expect
            headers = {}
            while (line := await reader.readline()) != b"\r\n":
                k, v = line.decode().split(":", 1)
                headers[k.lower()] = v.strip()
            if expect != 200:
                assert headers["content-length"] == "0"
                continue
            assert headers["content-type"] == "text/event-stream" and headers["transfer-encoding"] == "chunked"
            payload = b""
            while (size := int(await reader.readline(), 16)) > 0:
                payload += await reader.readexactly(size)
                await reader.readexactly(2)
            await reader.readexactly(2)
            events = [classify(d) for d in SSEParser().feed(payload)]
            assert [e.token for e in events] == [True, True, True, False]
            assert events[2].finish_reason == "length" and events[3].done
    finally:
        writer.close()
        server.close()
