"""The must-show scenarios of a supervised cluster: a real `kairos up` process, 2P2D, Poisson
streamed load, one worker killed (kill -9, no manual restart) or frozen (SIGSTOP for a while)
a little after the load starts. Used by tests/chaos/test_supervised.py; run alone it prints the
figures for BENCHMARKS.md:

    nice -n -5 .venv/bin/python -m tests.chaos.supervised --runs 3

Service pids come from `kairos up`'s own JSON log lines (`service_started`), as an operator's
log shipper would see them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common.ports import LOWEST, ephemeral_low
from tests.chaos.load import Tally, run_load

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def free_port_run(n: int) -> int:
    """The first of n consecutive free loopback ports (the bus takes three in a row)."""
    rng = random.Random()
    low = ephemeral_low()  # below the kernel's ephemeral range (common/ports.py says why)
    top = low - n if low > LOWEST + 1000 else 60000
    for _ in range(200):
        base = rng.randrange(LOWEST, top)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


class Up:
    """`kairos up` as a child process, its JSON lines read from a file."""

    def __init__(self, log_dir: Path, *, time_scale: float = 1.0, extra: tuple[str, ...] = (),
                 routers: int = 1, planner: str = "off") -> None:
        # the role planner off by default, as the other test clusters (tests/conftest.py): these
        # scenarios check that a killed or frozen worker's streams survive and that the worker is
        # given work again, and a flip mid-scenario moves what they check (with the planner on, a
        # prefill worker flipped to decode took the restarted decode-0's share in one CI run)
        self.log_dir = log_dir
        extra = ("--planner", planner, *extra)
        self.port, bus, mon = free_port_run(1), free_port_run(3 * routers), free_port_run(1)
        if routers > 1:
            extra = ("--routers", str(routers), *extra)
        self.api = f"http://127.0.0.1:{self.port}"
        self.out = log_dir / "up.out"
        cmd = [sys.executable, "-m", "kairos.cli", "up", "--prefill", "2", "--decode", "2", "--port", str(self.port),
               "--bus-port", str(bus), "--monitor-port", str(mon), "--time-scale", str(time_scale),
               "--log-dir", str(log_dir), "--log-format", "json", *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def pids(self, name: str) -> list[int]:
        """Every pid the service has had, oldest first."""
        return [e["pid"] for e in self.lines() if e.get("event") == "service_started" and e.get("service") == name]

    def wait_for(self, what: str, cond: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kairos up exited ({self.proc.returncode}) waiting for {what}:\n"
                                   f"{self.text()[-3000:]}")
            if cond():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{what} not within {timeout:.0f}s; kairos up said:\n{self.text()[-3000:]}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.api + path, timeout=2) as r:
            return json.loads(r.read())

    def registered(self) -> set[str]:
        with contextlib.suppress(OSError, ValueError):
            return {w for w, i in self.get("/v1/kairos/stats")["workers"].items() if not i.get("draining")}
        return set()

    def wait_up(self, timeout: float = 90) -> None:
        self.wait_for("Kairos is up", lambda: "Kairos is up." in self.text(), timeout)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


async def fault(up: Up, kind: str, name: str, *, freeze_s: float) -> int:
    """Do the fault; return the pid it hit."""
    pid = up.pids(name)[-1]
    if kind == "none":  # the baseline: the same load, no fault
        return pid
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(freeze_s)
        finally:
            os.kill(pid, signal.SIGCONT)
    return pid


async def scenario(up: Up, kind: str, name: str, *, rate: float = 20.0, duration: float = 6.0, at: float = 2.0,
                   freeze_s: float = 3.0, seed: int = 1) -> tuple[Tally, dict[str, Any]]:
    """Load for `duration` s, the fault `at` s in; then wait until the cluster is whole again."""
    before = dict(up.get("/v1/kairos/stats")["counts"])
    tally = Tally()
    load = asyncio.create_task(run_load(up.api + "/v1/completions", rate=rate, duration=3 * duration, seed=seed,
                                        hang_after=60.0, count=round(rate * duration), tally=tally))
    await asyncio.sleep(at)
    if name.startswith("decode") and kind != "none":
        # hit a decode worker while it streams (what the scenario is about): wait for two of its
        # streams up to the end of the load's arrivals (on a loaded CI machine 2 s were not always
        # enough: the requests it held were still being prefilled, and the freeze found it idle)
        deadline = time.monotonic() + max(2.0, duration - at)
        while tally.streaming[name] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tally.streaming_at_fault = tally.streaming[name]
    pid = await fault(up, kind, name, freeze_s=freeze_s)
    await load
    if kind == "kill":  # the supervisor restarts it under the same id, with a new pid
        await asyncio.to_thread(up.wait_for, f"{name} restarted", lambda: up.pids(name)[-1] != pid, 30)
    await asyncio.to_thread(up.wait_for, "every worker registered", lambda: set(WORKERS) <= up.registered(), 30)
    after = up.get("/v1/kairos/stats")["counts"]
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    return tally, delta


SCENARIOS = [("kill", "decode-0"), ("kill", "prefill-0"), ("freeze", "decode-1"), ("freeze", "prefill-1")]


async def _main(a: argparse.Namespace) -> int:
    for run in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="kairos-supervised-") as tmp:
            d = Path(a.keep_logs) / f"run{run + 1}" if a.keep_logs else Path(tmp)
            d.mkdir(parents=True, exist_ok=True)
            up = Up(d, time_scale=a.time_scale)
            try:
                up.wait_up()
                for i, (kind, name) in enumerate(a.scenario or SCENARIOS):
                    tally, delta = await scenario(up, kind, name, rate=a.rate, duration=a.duration,
                                                  seed=1000 * run + i)
                    print(f"run {run + 1}  {kind:<6} {name:<10} {tally.row('')}  {tally.worst()}  router: {delta}",
                          flush=True)
            finally:
                up.stop()
    print(f"load average: {os.getloadavg()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--scenario", action="append", type=lambda v: tuple(v.split(":", 1)), metavar="KIND:SERVICE",
                   help="kill, freeze or none (no fault, the baseline), e.g. kill:decode-0; repeatable "
                        "(default: kill and freeze of a decode and a prefill worker)")
    p.add_argument("--keep-logs", default="", metavar="DIR", help="keep each run's service logs in DIR/runN")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim step times x this (default 1: A100 timing)")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
