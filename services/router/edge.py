"""The router's HTTP edge: connection limits and timeouts that uvicorn does not have.

uvicorn's own limits protect the wrong thing for a public front door. Its `limit_concurrency`
counts idle connections, so a few thousand sockets that never send a byte make every new
request (and `/ready`) get a 503; its keep-alive timeout starts only after a response and is
reset by every byte, so a connection that never sends a request, or sends its headers one byte
every few seconds (slowloris), is held forever. `edge_protocol` returns uvicorn's httptools
protocol with these instead:

- header timeout: a connection must finish a request's headers within `header_timeout_s` of
  opening (or of its previous response), however it trickles them; else it is closed;
- body timeout: a request's body must arrive within `body_timeout_s` of its headers; else the
  client gets a 408 (OpenAI error shape) and the connection is closed;
- a timeout (these, and uvicorn's keep-alive) that fires late or finds the client's bytes unread
  looks again a second later, once (`STALL_S`): after a stall the loop runs due timers before it
  reads, and closing would reset a connection whose request came in time;
- connection limit: past `max_connections`, a new connection closes the connection that has
  been idle longest (no request in progress: never one being served); only when every
  connection is busy is the new one refused (503, `connection: close`);
- per-client limit: past `max_per_client` connections from one address, that address's oldest
  idle connection is closed, or, when all of them are busy, the new one is refused (429).

Closed connections are counted in `kairos_router_http_connections_closed{reason}`; nothing a
client sends is logged above debug.

Each request's ASGI scope also carries `extensions[DIRECT]`, a `DirectWrite`: a streamed
response's body chunks written to the socket at once, without the ASGI `send` coroutine (the
router's plain SSE streams write each token chunk from the bus reader this way: no task switch
per chunk). It writes only what `send` would write, and refuses (`ready()` False) whenever `send`
would have to wait or do more: the response not started or over, not chunked, the client gone,
or the socket's buffer full (then `send` waits for it to drain). Its `on_lost` names a function
the connection calls when the client goes before the response is over, from the protocol's own
`connection_lost`: what a task awaiting `receive()` for `http.disconnect` would learn, without a
task per request.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.router.errors import error_json

log = structlog.get_logger()

CLOSED = Counter("kairos_router_http_connections_closed", "HTTP connections the router closed or refused at its "
                 "edge: header_timeout, body_timeout, idle_evicted (the connection limit neared), "
                 "client_evicted (its address at its limit), refused_full, refused_client.", ["reason"])


# A connection's timeout (uvicorn's keep-alive, the edge's header timeout) may fire while the
# client's next request already waits unread in the socket: a loop turn runs its due timers
# before it reads, and after the router's loop did not run for a while (a freeze, CPU starvation,
# a burst's parsing) the client had sent it in good time. Closing then resets a connection that
# carries a request: the client reads an error for a request it sent before any timeout (5-6 of
# 1,000 requests in tests.chaos.stranded's five 10 s freezes, and every keep-alive connection
# used during a freeze longer than uvicorn's 5 s keep-alive). So a timeout that finds bytes unread
# on the socket, or fires more than STALL_S late, is checked again STALL_GRACE_S later instead,
# once per timeout (a client trickling its headers gains one grace, not a way round the timeout).
STALL_S = 0.5
STALL_GRACE_S = 1.0


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for the connection that the loop has not read yet (0 if unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except (OSError, ValueError):
        return 0
    return int(buf[0])


DIRECT = "kairos.direct_write"  # the scope extension holding a request's DirectWrite
_CYCLE = ("response_started", "response_complete", "chunked_encoding", "disconnected", "flow", "transport")


class DirectWrite:
    """One request's response body chunks straight to its connection (see the module's docstring)."""

    __slots__ = ("_cycle", "lost")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle  # uvicorn's RequestResponseCycle of this request
        self.lost: Callable[[], None] | None = None  # `on_lost`'s function, until the response is over

    def on_lost(self, fn: Callable[[], None] | None) -> None:
        """Call `fn` (once, on the event loop, from the connection's `connection_lost`) when the
        client goes before this response is over; at once if it has gone already. None: no more."""
        self.lost = fn
        if fn is not None and self._cycle.disconnected:
            self.lost = None
            fn()

    def _connection_lost(self) -> None:
        fn, self.lost = self.lost, None
        if fn is not None and self._cycle.disconnected:  # (uvicorn: lost before the response was complete)
            try:
                fn()
            except Exception:  # the connection's teardown goes on whatever the callback does
                log.exception("disconnect_callback_failed")

    def ready(self) -> bool:
        """A chunk may be written now, with the bytes and in the order `send` would write it."""
        c = self._cycle
        return (c.response_started and not c.response_complete and c.chunked_encoding is True
                and not c.disconnected and not c.flow.write_paused and not c.transport.is_closing())

    def open(self) -> bool:
        """The response can still take a chunk (started, not over, the client there); `send`
        would wait for the socket's buffer to drain first, this does not."""
        c = self._cycle
        return (c.response_started and not c.response_complete and c.chunked_encoding is True
                and not c.disconnected and not c.transport.is_closing())

    def write(self, body: bytes) -> None:
        """One body chunk (more to come), as uvicorn frames it; only after `ready()` or `open()`."""
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 8192
    max_per_client: int = 4096


@dataclass(slots=True)
class _Edge:
    """What the connections of one server share."""
    limits: EdgeLimits
    idle: dict[Any, None] = field(default_factory=dict)  # idle connections, longest idle first
    by_client: dict[str, dict[Any, None]] = field(default_factory=dict)  # every connection, per address


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = error_json(status, message)
    head = {503: "Service Unavailable", 429: "Too Many Requests", 408: "Request Timeout"}[status]
    return (f"HTTP/1.1 {status} {head}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-kairos-error: {reason}\r\nconnection: close\r\n\r\n").encode() + body


def edge_protocol(limits: EdgeLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol class with `limits` (pass it as uvicorn.Config's `http`)."""
    edge = _Edge(limits)

    class EdgeProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None  # the connection's one timer (`_arm`)
        _due = 0.0  # loop time at which the armed check is due
        _fire: Callable[[], None] | None = None  # the check armed (None: none)
        _serving = False  # from a request's complete headers to its complete response
        _host = ""
        _registered = False  # counted in the edge's tables (not a refused connection)
        _direct: DirectWrite | None = None  # the DirectWrite of the request being served
        _graced = False  # the armed check was put off once already (STALL_S)
        _ka_graced = False  # ... uvicorn's keep-alive timeout, since the last response

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            lim = edge.limits
            self._host = self.client[0] if self.client else ""
            if len(self.connections) > lim.max_connections and not self._evict(edge.idle, "idle_evicted"):
                self._refuse(503, "refused_full", "the router is at its connection limit and every connection is "
                             "busy: retry shortly")
                return
            mine = edge.by_client.setdefault(self._host, {})
            if len(mine) >= lim.max_per_client and not self._evict(
                    (c for c in mine if c in edge.idle), "client_evicted"):
                self._refuse(429, "refused_client", f"too many connections from {self._host} "
                             f"({lim.max_per_client}, every one busy): reuse connections or retry shortly")
                return
            mine[self] = None
            self._registered = True
            self._idle()

        @staticmethod
        def _evict(candidates: Any, reason: str) -> bool:
            for victim in candidates:
                victim._close(reason)
                return True
            return False

        def _refuse(self, status: int, reason: str, message: str) -> None:
            CLOSED.labels(reason).inc()
            log.debug("http_connection_refused", reason=reason, client=self._host)
            self.transport.write(_refusal(status, reason, message))
            self.transport.close()

        def _close(self, reason: str) -> None:
            CLOSED.labels(reason).inc()
            log.debug("http_connection_closed", reason=reason, client=self._host)
            self._forget()
            if not self.transport.is_closing():
                self.transport.close()

        def _forget(self) -> None:
            self._fire = None
            if self._timer is not None:  # closing: nothing may keep the connection alive
                self._timer.cancel()
                self._timer = None
            if not self._registered:
                return
            self._registered = False
            edge.idle.pop(self, None)
            mine = edge.by_client.get(self._host)
            if mine is not None:
                mine.pop(self, None)
                if not mine:
                    del edge.by_client[self._host]

        def _arm(self, delay: float | None, fire: Callable[[], None] | None = None) -> None:
            """Call `fire` `delay` seconds from now, instead of what was armed (None: nothing).
            One timer per connection, moved only when the new check is due before it fires: a
            request re-arms three times (its body, its end, the next request's headers), which
            cost a timer made and one cancelled each; now the timer fires once per timeout
            period at most and `_due_check` sets it again for what is due then."""
            if delay is None or fire is None:
                self._fire = None
                return
            self._graced = False
            due = self.loop.time() + delay
            self._due, self._fire = due, fire
            timer = self._timer
            if timer is not None:
                if timer.when() <= due:
                    return
                timer.cancel()
            self._timer = self.loop.call_at(due, self._due_check)

        def _due_check(self) -> None:
            self._timer = None
            fire = self._fire
            if fire is None:
                return
            now = self.loop.time()
            # re-armed since for later (by more than a timer's rounding: uvloop's clock is whole
            # milliseconds, and a check fired a hair early must not spin)
            if self._due - now > 0.005:
                self._timer = self.loop.call_at(self._due, self._due_check)
                return
            if not self._graced and self._read_first(self._due):
                self._graced = True  # the client's bytes may be waiting: read them first (STALL_S)
                self._due = now + STALL_GRACE_S
                self._timer = self.loop.call_at(self._due, self._due_check)
                return
            self._fire = None
            fire()

        def _read_first(self, due: float) -> bool:
            """A timeout due at `due` fires now: put it off (`STALL_S`) if it fired late or the
            client's bytes wait unread."""
            return self.loop.time() - due > STALL_S or unread_bytes(self.transport) > 0

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn's keep-alive timeout (closes a connection idle since its last response), but
            not on a late timer: see `STALL_S`."""
            task = self.timeout_keep_alive_task
            if task is not None and not self._ka_graced and self._read_first(task.when()):
                self._ka_graced = True
                self.timeout_keep_alive_task = self.loop.call_later(STALL_GRACE_S, self.timeout_keep_alive_handler)
                return
            super().timeout_keep_alive_handler()

        def _idle(self) -> None:
            """No request in progress: idle (longest-idle order), and the next request's headers timed."""
            self._serving = False
            edge.idle.pop(self, None)
            edge.idle[self] = None
            self._arm(edge.limits.header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            if not self._serving:
                self._close("header_timeout")

        def _body_timeout(self) -> None:
            cycle = self.cycle
            if cycle is None or not cycle.more_body or cycle.response_started:
                return
            if not self.transport.is_closing():
                self.transport.write(_refusal(408, "body_timeout", f"the request body did not arrive within "
                                              f"{edge.limits.body_timeout_s:g} s of its headers"))
            self._close("body_timeout")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            edge.idle.pop(self, None)  # a request is coming: no longer a candidate for eviction

        def on_headers_complete(self) -> None:
            self._serving = True
            self._arm(edge.limits.body_timeout_s, self._body_timeout)
            super().on_headers_complete()
            cycle = self.cycle
            # this request's cycle (not an upgrade's), of a uvicorn whose cycle has what DirectWrite reads
            if cycle is not None and cycle.scope is self.scope and all(hasattr(cycle, a) for a in _CYCLE):
                ext: dict[str, Any] = self.scope.setdefault("extensions", {})
                ext[DIRECT] = self._direct = DirectWrite(cycle)

        def on_message_complete(self) -> None:
            self._arm(None)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._ka_graced = False  # (uvicorn arms its keep-alive timeout anew)
            super().on_response_complete()
            cycle = self.cycle
            if self._registered and not self.transport.is_closing() and (cycle is None or cycle.response_complete):
                self._idle()

        def connection_lost(self, exc: Exception | None) -> None:
            self._forget()
            super().connection_lost(exc)
            direct, self._direct = self._direct, None
            if direct is not None:
                direct._connection_lost()

    return EdgeProtocol
