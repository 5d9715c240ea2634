"""structlog, configured once per process: JSON lines when stdout is not a terminal.

Every line carries `service` and, for workers, `worker`; per-request lines carry `request_id`.
Event names are short snake_case facts; values are keys.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(service: str, *, level: str = "info", fmt: str = "auto", **context: Any) -> structlog.stdlib.BoundLogger:
    lvl = _LEVELS.get(level.lower(), logging.INFO)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
    # what libraries log through the standard library (uvicorn's traceback of a request that
    # failed, asyncio's "Task exception was never retrieved", pyzmq's warnings) comes out as the
    # same lines, with `service`, `level` and the traceback as `exception`; warnings and up only
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_logger_name,
                           structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(lvl, logging.WARNING))
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **context)
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log


def get() -> Any:
    return structlog.get_logger()


class Throttle:
    """At most one log line per `every_s` for each key (a peer, a kind of frame): `admit(key)`
    is None while the key is muted, else how many were held back since its last line. Bounded:
    past `max_keys` keys (a flood of forged identities) it forgets them all."""

    def __init__(self, every_s: float, max_keys: int = 4096) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def admit(self, key: Hashable) -> int | None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) > self.max_keys:
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)
