"""The service skeleton every process uses: uvloop, signals that only set a stop event, and a
fixed shutdown order (stop intake -> drain with timeout -> cancel -> close)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from common.errors import ConfigError


def settle_heap() -> int:
    """Once a service is up: collect, then move every object alive (modules, configuration, the
    tokenizer, the app) to the permanent generation, so the cyclic collector's full passes scan only
    what the service made since. Measured on the live router at 300 req/s (docs/benchmarks/
    router-throughput.md, 2026-12-07): each full pass over the start-up heap held the loop 17-28 ms,
    two in 25 s. Returns how many objects were frozen. Objects are still freed by their reference
    counts; only cycles among start-up objects are no longer collected, and start-up makes none
    that later become garbage."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM/SIGINT only set the service's stop event,
    and the service stops uvicorn itself after draining (uvicorn would otherwise close the HTTP
    side first and cut off streams)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen_socket(host: str, port: int, *, reuse_port: bool, backlog: int = 2048) -> socket.socket:
    """A service's HTTP listening socket, bound here rather than by uvicorn, so that a port in use is a
    ConfigError written as `http_failed_to_start` (uvicorn would exit the process first)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if reuse_port:
            why = (f"cannot bind the HTTP port {host}:{port} with SO_REUSEPORT ({e}); a process without "
                   "SO_REUSEPORT holds it")
        else:
            why = f"cannot bind the HTTP port {host}:{port} ({e.strerror or e})"
        raise ConfigError(why, event="http_failed_to_start", host=host, port=port,
                          fix=f"stop what holds port {port} (`ss -ltnp 'sport = :{port}'` names it) or pick another "
                              "with --http-port / KAIROS_HTTP_PORT") from e
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            pass


def run(main: Callable[[], Awaitable[int | None]]) -> int:
    """Run `main` on uvloop (when installed). A ConfigError goes up to the entry point's
    `common.startup.guard`, which writes it as one log line and exits 2."""
    try:
        import uvloop

        runner: Callable[..., int | None] = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        rc = runner(main())
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)
