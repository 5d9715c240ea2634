"""Headless Chromium driven over the DevTools protocol on a pipe: no driver, no download.

`Chromium` starts the system's Chromium (Debian: `apt-get install -y chromium`) with
`--remote-debugging-pipe`: protocol messages are JSON, NUL-terminated, written to the browser's
fd 3 and read from its fd 4. That is enough to open the dashboard, read its DOM as the page's
own script left it, and capture a screenshot. The browser test uses it, and so can an operator:

    python -m services.monitor.browser --url http://127.0.0.1:9100/ --out dashboard.png --wait 5

Every wait is bounded; `close()` (or leaving the `with` block) ends the browser's whole process
group.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--hide-scrollbars")


# Puts our pipe ends on fds 3 and 4, where Chromium expects them, then becomes Chromium. (A shell
# cannot: POSIX sh redirects only single-digit fds.) Both ends go above 9 first so that neither
# is overwritten when the other lands on 3 or 4.
_TRAMPOLINE = """
import fcntl, os, sys
r, w = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3])
os.dup2(r, 3)
os.dup2(w, 4)
for fd in {r, w, int(sys.argv[1]), int(sys.argv[2])} - {3, 4}:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, *, binary: str | None = None, width: int = 1400, height: int = 1000,
                 timeout: float = 20.0) -> None:
        exe = binary or find_chromium()
        if exe is None:
            raise BrowserError("no Chromium found: install it (Debian: apt-get install -y chromium)")
        self.timeout = timeout
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="kairos-chromium-")
        to_browser_r, self._w = os.pipe()
        self._r, from_browser_w = os.pipe()
        args = [exe, *FLAGS, f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
                "--remote-debugging-pipe", "about:blank"]
        cmd = [sys.executable, "-c", _TRAMPOLINE, str(to_browser_r), str(from_browser_w), *args]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            os.close(to_browser_r)
            os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    # ------------------------------------------------------------------ protocol
    def call(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True,
             timeout: float | None = None) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("Chromium did not answer in time")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium exited (code {self.proc.poll()})")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\0")
        out: dict[str, Any] = json.loads(line)
        return out

    # ------------------------------------------------------------------ what tests and tools need
    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise BrowserError(f"script error: {r['exceptionDetails'].get('text')}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            with contextlib.suppress(BrowserError):
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(0.2)
        raise BrowserError(f"timed out waiting for {expression!r} (last value {value!r})")

    def screenshot(self, path: str | Path, *, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            h = self.evaluate("document.documentElement.scrollHeight") or self.height
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": int(h), "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", params)["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrowserError, OSError):
                self.call("Browser.close", session=False, timeout=3.0)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # helpers (zygote, renderers) of our browser only
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.monitor.browser",
                                description="Screenshot the Kairos dashboard with headless Chromium.")
    p.add_argument("--url", default="http://127.0.0.1:9100/", help="the dashboard (default %(default)s)")
    p.add_argument("--out", default="dashboard.png", help="PNG to write (default %(default)s)")
    p.add_argument("--wait", type=float, default=5.0, help="seconds of live updates before the shot")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1000)
    a = p.parse_args(argv)
    try:
        with Chromium(width=a.width, height=a.height) as b:
            b.open(a.url)
            b.wait_for("Number(document.getElementById('updated')?.dataset.updates || 0) > 0")
            time.sleep(max(0.0, a.wait))
            b.screenshot(a.out)
    except BrowserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
