"""The monitor's HTTP side, a plain ASGI app served by uvicorn in the monitor process.

Routes (GET only):
    /             the dashboard (static/index.html; its script and style from /static/)
    /static/NAME  the dashboard's files, loaded into memory at start (nothing from the internet)
    /metrics      Prometheus text format (the monitor's own registry)
    /api/state    the cluster picture as JSON (see MonitorState.snapshot)
    /events       server-sent events: `event: state` with the same JSON, about once a second
    /health       200 {"status": "ok", ...}: the process is up (the router may still be silent)

With an API key (MonitorConfig.api_key, the router's key), /metrics, /api/state and /events need
`Authorization: Bearer <key>` or `?key=<key>` (a browser's EventSource cannot send headers: open
the dashboard as /?key=<key> and it passes the key on); /health, / and /static/ stay open (no
data). Keys are compared in constant time.

/events is bounded: at most `max_streams` clients at once (503 beyond), and every stream ends
when the client goes away or the monitor stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_json = msgspec.json.Encoder()
JSON = b"application/json"
CONTENT_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
                 ".css": b"text/css; charset=utf-8", ".svg": b"image/svg+xml", ".png": b"image/png",
                 ".ico": b"image/x-icon"}


def load_static() -> dict[str, tuple[bytes, bytes]]:
    """The files of services/monitor/static/: name -> (content type, bytes)."""
    out: dict[str, tuple[bytes, bytes]] = {}
    root = resources.files("services.monitor") / "static"
    for entry in root.iterdir():
        name = entry.name
        suffix = name[name.rfind("."):] if "." in name else ""
        if entry.is_file() and suffix in CONTENT_TYPES:
            out[name] = (CONTENT_TYPES[suffix], entry.read_bytes())
    return out


class Feed:
    """The latest snapshot, and a wake-up for every stream each time a new one is published."""

    def __init__(self) -> None:
        self.data = b"{}"
        self._event = asyncio.Event()

    def publish(self, data: bytes) -> None:
        self.data = data
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def next(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


class App:
    def __init__(self, *, snapshot: Callable[[], dict[str, Any]], metrics: Callable[[], bytes],
                 health: Callable[[], dict[str, Any]], feed: Feed, stop: asyncio.Event,
                 max_streams: int = 32, api_key: str = "") -> None:
        self.snapshot = snapshot
        self.metrics = metrics
        self.health = health
        self.feed = feed
        self.stop = stop
        self.max_streams = max_streams
        self.streams = 0
        self.static = load_static()
        self._key = api_key.encode()

    def _authorised(self, scope: Scope) -> bool:
        if not self._key:
            return True
        for k, v in scope["headers"]:
            if k == b"authorization" and hmac.compare_digest(v, b"Bearer " + self._key):
                return True
        given = parse_qs(scope.get("query_string", b"").decode(errors="replace")).get("key", [""])[0]
        return hmac.compare_digest(given.encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method not in ("GET", "HEAD"):
            await self._reply(send, 405, JSON, _json.encode({"error": f"{path} takes GET"}))
            return
        if path == "/":
            path = "/static/index.html"
        if path in ("/metrics", "/api/state", "/events") and not self._authorised(scope):
            await self._reply(send, 401, JSON, _json.encode(
                {"error": "missing or wrong API key: send 'Authorization: Bearer <key>' (or ?key=<key>)"}))
            return
        if path == "/metrics":
            await self._reply(send, 200, CONTENT_TYPE_LATEST.encode(), self.metrics())
        elif path == "/api/state":
            await self._reply(send, 200, JSON, _json.encode(self.snapshot()))
        elif path == "/health":
            await self._reply(send, 200, JSON, _json.encode(self.health()))
        elif path == "/events":
            await self._events(receive, send)
        elif path.startswith("/static/") and path[len("/static/"):] in self.static:
            ctype, body = self.static[path[len("/static/"):]]
            await self._reply(send, 200, ctype, body, cache=b"no-cache")
        else:
            await self._reply(send, 404, JSON, _json.encode({"error": f"no route {path}"}))

    @staticmethod
    async def _reply(send: Send, status: int, ctype: bytes, body: bytes, *, cache: bytes = b"no-store") -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"cache-control", cache)]})
        await send({"type": "http.response.body", "body": body})

    async def _events(self, receive: Receive, send: Send) -> None:
        if self.streams >= self.max_streams:
            await self._reply(send, 503, JSON, _json.encode({"error": f"{self.streams} event streams open"}))
            return
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        self.streams += 1
        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                    (b"x-accel-buffering", b"no")]})
            await send({"type": "http.response.body", "body": b"retry: 2000\n\n" + self._event(self.feed.data),
                        "more_body": True})
            while not gone.is_set() and not self.stop.is_set():
                await self.feed.next(timeout=2.0)
                if gone.is_set() or self.stop.is_set():
                    break
                await send({"type": "http.response.body", "body": self._event(self.feed.data), "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.streams -= 1
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    @staticmethod
    def _event(data: bytes) -> bytes:
        return b"event: state\ndata: " + data + b"\n\n"
