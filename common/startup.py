"""Start-up failures in the logs' language: one event that says what to do, then a non-zero exit.

Every service's entry point runs inside `guard(service, main)`: a `ConfigError` (a bad setting,
a port in use, a missing model directory, an engine that is not installed) becomes ONE log line
(`event`, `level`, `service`, `timestamp` as structlog writes them, plus `error`, `fix` and the
error's own fields such as `key`, `expected`, `port`), and the process exits 2; any other
exception before or during the run becomes one `service_failed` line (its last frames in a
`traceback` field, so a bug report has them) and exit 1. JSON when stdout is not a terminal (the
service logs, like `log_format=auto`); on a terminal, two plain lines on stderr for the person
typing the command. Nothing here imports more than the standard library: a failure is written
before any heavy import has been paid for.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from common.errors import ConfigError

CONFIG_EXIT = 2   # the operator must change something
CRASH_EXIT = 1    # something else went wrong


def emit(service: str, event: str, message: str, fix: str, **fields: Any) -> None:
    """Write one start-up failure: a JSON line on stdout, or plain text on a terminal's stderr."""
    if sys.stdout.isatty():
        print(f"error: {message}\n  fix: {fix}", file=sys.stderr, flush=True)
        return
    line = {"event": event, "level": "error", "service": service, "error": message, "fix": fix,
            **{k: v for k, v in fields.items() if v is not None},
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z")}
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()


def report(service: str, e: ConfigError) -> None:
    emit(service, e.event, str(e), e.fix, **e.fields)


def guard(service: str, main: Callable[[], int]) -> int:
    """Run a service's `main` (flags, configuration, start and run): see the module docstring."""
    try:
        return main()
    except ConfigError as e:
        report(service, e)
        return CONFIG_EXIT
    except KeyboardInterrupt:
        return 130
    except SystemExit:  # argparse's --help, and what the service decided itself
        raise
    except Exception as e:  # one line, not a traceback spread over many
        frames = traceback.format_exception(e)
        emit(service, "service_failed", f"{type(e).__name__}: {e}"[:2000],
             "not a setting Kairos recognised: the traceback field says where it failed; report it with this "
             "line if the cause is not in your environment", traceback="".join(frames[-8:])[-4000:])
        return CRASH_EXIT
