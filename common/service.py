"""The service skeleton every process uses: uvloop, signals that only set a stop event, and a
fixed shutdown order (stop intake -> drain with timeout -> cancel -> close)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from common.errors import ConfigError


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM/SIGINT only set the service's stop event,
    and the service stops uvicorn itself after draining (uvicorn would otherwise close the HTTP
    side first and cut off streams)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            pass


def run(main: Callable[[], Awaitable[int | None]]) -> int:
    """Run `main` on uvloop (when installed); configuration errors exit 2 with one clear line."""
    try:
        import uvloop

        runner: Callable[..., int | None] = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        rc = runner(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)
