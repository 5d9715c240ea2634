"""structlog, configured once per process: JSON lines when stdout is not a terminal.

Every line carries `service` and, for workers, `worker`; per-request lines carry `request_id`.
Event names are short snake_case facts; values are keys.
"""

from __future__ import annotations

import logging
import sys
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
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **context)
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log


def get() -> Any:
    return structlog.get_logger()
