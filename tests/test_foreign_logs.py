"""What libraries log through the standard library leaves a service as the same JSON lines as its
own: uvicorn's traceback of a request that failed with HTTP 500 was a raw multi-line traceback in
router.log, which no JSON log reader counted (found 2026-12-07: a resumed request's echo+logprobs
failed with 500 and router.log had no `"level": "error"` line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import logging
from common import logging as clog
clog.configure("router", level="info", fmt="json")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("uvicorn.error").error("Exception in ASGI application", exc_info=True)
logging.getLogger("some.library").info("chatter below warning")
logging.getLogger("asyncio").warning("Task exception was never retrieved")
"""


def test_a_library_traceback_is_one_json_error_line_of_the_service() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    lines = [json.loads(ln) for ln in out.splitlines()]  # every line is JSON
    assert [(d["logger"], d["level"]) for d in lines] == [("uvicorn.error", "error"), ("asyncio", "warning")]
    err = lines[0]
    assert err["service"] == "router" and err["event"] == "Exception in ASGI application"
    assert "ZeroDivisionError" in err["exception"] and "timestamp" in err
