"""The reference app's answer without uvicorn's cycle: httptools' parser on an asyncio Protocol.

    python -m bench.raw_http_app --port 8100

`bench.http_stack` measures it beside uvicorn to price issue 47's first architectural option: an
HTTP path of the router's own that skips uvicorn's per-request ASGI cycle (scope dict, receive
and send coroutines, a task per request) but stays in Python. It does the reference app's work
(bench/reference_app.py): parse the request, decode the JSON body's `max_tokens` with msgspec,
answer POST /v1/completions with a chunked SSE stream of `max_tokens` one-token events and
`[DONE]`, keep the connection alive. It is a measuring stick only: no pipelining beyond what the
parser hands back in order, no timeouts, no flow control, no 100-continue; a router built this
way would need all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httptools
import msgspec

from bench.reference_app import _DONE, _LAST, _TOKEN, _decode

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n\r\n")
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"
_END = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_TOKEN_CHUNK = _chunk(_TOKEN)
_LAST_CHUNK = _chunk(_LAST + _DONE) + _END


class RawHttp(asyncio.Protocol):
    """One connection: httptools calls back into this object as it parses."""

    __slots__ = ("body", "method", "parser", "transport", "url")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.method = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_BAD)
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        t = self.transport
        assert t is not None
        if self.parser.get_method() != b"POST" or self.url != b"/v1/completions":
            t.write(_NOT_FOUND)
            return
        try:
            n = max(1, _decode(b"".join(self.body)).max_tokens)
        except msgspec.DecodeError:
            t.write(_BAD)
            return
        t.write(b"".join([_HEAD, _TOKEN_CHUNK * (n - 1), _LAST_CHUNK]))
        if not self.parser.should_keep_alive():
            t.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(RawHttp, host, port, backlog=2048)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.raw_http_app", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    import uvloop

    uvloop.run(serve(a.host, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
