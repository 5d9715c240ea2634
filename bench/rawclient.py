"""A lean streaming HTTP/1.1 client for measuring the router itself (`kairos bench-router`).

`kairos bench` uses httpx, which costs the client a millisecond or so of CPU per streamed
request: fine for trace replays at tens of requests/s, but at thousands per second the client
would be what is measured. This one is an asyncio Protocol per keep-alive connection: one write
per request, the response parsed in `data_received` (status line, headers, chunked framing, SSE
events), token arrival times taken there with time.perf_counter, and one future per request.
It speaks only what the benchmark needs: POST with a body, responses with chunked transfer
encoding or a Content-Length, keep-alive. One process runs one event loop; `kairos
bench-router` starts several processes to get more client CPU.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

from kairos.loadgen import SSEParser, classify


@dataclass(slots=True)
class Result:
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    max_gap: float = 0.0
    status: int = 0
    route: str = ""
    error: str | None = None
    request_id: str = ""


@dataclass(slots=True)
class _Pending:
    result: Result
    sent: float
    done: asyncio.Future[Result]
    last: float = 0.0
    finished: bool = False
    sse: SSEParser = field(default_factory=SSEParser)


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection; one request at a time (HTTP/1.1 without pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._p: _Pending | None = None
        self._headers_done = False
        self._chunked = False
        self._remaining = 0        # bytes left of a Content-Length body
        self._body = bytearray()   # a non-streamed body (errors)
        self._keep_alive = True

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._p is not None and not self._p.done.done():
            self._p.result.error = "connection_lost"
            self._p.done.set_result(self._p.result)
        self._p = None

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        p = self._p
        if p is None:
            return
        self._buf += data
        if not self._headers_done and not self._parse_headers(p):
            return
        if self._chunked:
            self._parse_chunks(p, now)
        else:
            take = min(self._remaining, len(self._buf))
            self._body += self._buf[:take]
            del self._buf[:take]
            self._remaining -= take
            if self._remaining == 0:
                self._finish(p, now)

    # -- requests -------------------------------------------------------------------------------
    def request(self, raw: bytes, request_id: str = "") -> asyncio.Future[Result]:
        assert self.transport is not None and self._p is None
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._p = _Pending(Result(request_id=request_id), time.perf_counter(), fut)
        self._headers_done = self._chunked = False
        self._remaining = 0
        self._body.clear()
        self._buf.clear()
        self.transport.write(raw)
        return fut

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- parsing --------------------------------------------------------------------------------
    def _parse_headers(self, p: _Pending) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[:end + 4]
        try:
            p.result.status = int(head[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            p.result.error = "bad_status_line"
            self._abort(p)
            return False
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif name == b"content-length":
                length = int(value)
            elif name == b"x-kairos-route":
                p.result.route = value.decode()
            elif name == b"connection" and value.lower() == b"close":
                self._keep_alive = False
        self._remaining = length
        self._headers_done = True
        return True

    def _parse_chunks(self, p: _Pending, now: float) -> None:
        buf = self._buf
        while self._p is p:
            nl = buf.find(b"\r\n")
            if nl < 0:
                return
            try:
                size = int(bytes(buf[:nl]).split(b";")[0], 16)
            except ValueError:
                p.result.error = "bad_chunk"
                self._abort(p)
                return
            if size == 0:
                if len(buf) < nl + 4:
                    return  # wait for the final CRLF
                del buf[:nl + 4]
                self._finish(p, now)
                return
            if len(buf) < nl + 2 + size + 2:
                return  # the whole chunk is not here yet
            chunk = bytes(buf[nl + 2:nl + 2 + size])
            del buf[:nl + 2 + size + 2]
            self._on_chunk(p, chunk, now)

    def _on_chunk(self, p: _Pending, chunk: bytes, now: float) -> None:
        r = p.result
        if r.status != 200:
            self._body += chunk
            return
        for data in p.sse.feed(chunk):
            ev = classify(data)
            if ev.error is not None:
                r.error = f"stream_error:{ev.error_code}"
            elif ev.token:
                if r.ttft is None:
                    r.ttft = now - p.sent
                else:
                    r.max_gap = max(r.max_gap, now - p.last)
                p.last = now
                r.tokens += 1
            if ev.finish_reason is not None or ev.done:
                p.finished = True

    def _finish(self, p: _Pending, now: float) -> None:
        r = p.result
        r.e2e = now - p.sent
        if r.status != 200:
            r.error = r.error or f"http_{r.status}"
        elif not p.finished and r.error is None:
            r.error = "incomplete"
        self._p = None
        if not self._keep_alive:
            self.close()
        if not p.done.done():
            p.done.set_result(r)

    def _abort(self, p: _Pending) -> None:
        self._p = None
        self.close()
        if not p.done.done():
            p.done.set_result(p.result)


def post(host: str, port: int, path: str, body: bytes, *, request_id: str = "") -> bytes:
    """The raw bytes of one POST request with a JSON body."""
    head = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n" + (f"x-request-id: {request_id}\r\n" if request_id else "")
            + "\r\n")
    return head.encode() + body


class Pool:
    """Up to `size` keep-alive connections; a request waits for a free one (counted)."""

    def __init__(self, host: str, port: int, size: int) -> None:
        self.host, self.port, self.size = host, port, size
        self._idle: list[StreamConnection] = []
        self._open = 0
        self._free = asyncio.Condition()
        self.waits = 0

    async def _get(self) -> StreamConnection:
        while True:
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    return c
                self._open -= 1
            if self._open < self.size:
                self._open += 1
                try:
                    _, proto = await asyncio.get_running_loop().create_connection(StreamConnection, self.host,
                                                                                  self.port)
                except BaseException:
                    self._open -= 1
                    raise
                return proto
            self.waits += 1
            async with self._free:
                await self._free.wait()

    async def _put(self, c: StreamConnection) -> None:
        if c.closed:
            self._open -= 1
        else:
            self._idle.append(c)
        async with self._free:
            self._free.notify()

    async def request(self, raw: bytes, request_id: str = "", timeout: float = 60.0) -> Result:
        c = await self._get()
        try:
            return await asyncio.wait_for(c.request(raw, request_id), timeout)
        except TimeoutError:
            c.close()
            return Result(error="timeout", request_id=request_id)
        finally:
            await self._put(c)

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
