"""The HTTP server's own CPU per request: uvicorn (httptools, uvloop: what the router runs) against
granian, each serving the same bare ASGI app (bench/reference_app.py, one SSE token per request),
and against the same answer from httptools' parser on a plain asyncio Protocol, no ASGI cycle
(bench/raw_http_app.py: the floor of an HTTP path of the router's own in Python).

    python -m bench.http_stack                       # 300 req/s for 4 s, 3 alternated rounds
    python -m bench.http_stack --rate 300 --seconds 4 --rounds 3 --granian /opt/granian/bin/granian

Each server runs pinned to CPU 0 (one worker process, granian with one runtime thread, single-threaded
runtime, HTTP/1, uvloop), this process drives it from CPU 1 with an open-loop Poisson load
(bench/rawclient.py, 64 keep-alive connections, streamed completions of one token), and the
server's CPU (its process and its children, from /proc, less its idle use measured just before)
is divided by the requests it answered. Rounds alternate the servers. /proc counts CPU in clock
ticks (10 ms): at 300 req/s for 4 s that is about 8 us per request of resolution.

granian is not a dependency of Kairos: install it anywhere (`python -m venv /opt/granian &&
/opt/granian/bin/pip install granian`) and give --granian, or put it on PATH; without it only
uvicorn and the raw protocol are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.rawclient import Pool, post
from bench.steps import cpu_seconds, wait_port

ROOT = Path(__file__).resolve().parent.parent


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and its children (`bench.steps.cpu_seconds` each)."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total = 0.0
    for p in [pid, *(int(k) for k in kids)]:
        try:
            total += cpu_seconds(p)
        except OSError:
            continue  # a child that ended between pgrep and here
    return total


def server(kind: str, port: int, granian: str) -> subprocess.Popen[bytes]:
    if kind == "raw":
        cmd = [sys.executable, "-m", "bench.raw_http_app", "--port", str(port)]
    elif kind == "uvicorn":
        cmd = [sys.executable, "-c", "import uvicorn, bench.reference_app as r; r.set_model('reference'); "
               f"uvicorn.run(r.app, host='127.0.0.1', port={port}, lifespan='off', access_log=False, "
               "log_level='warning', http='httptools', loop='uvloop')"]
    else:
        cmd = [granian, "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--runtime-threads", "1", "--runtime-mode", "st", "--http", "1", "--loop", "uvloop", "--no-ws",
               "--log-level", "warning", "bench.reference_app:app"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["taskset", "-c", "0", *cmd], env=env, cwd=ROOT)


async def drive(port: int, rate: float, seconds: float) -> tuple[int, int, float | None]:
    """(sent, answered, TTFT p50) of a Poisson load at `rate` for `seconds`."""
    body = json.dumps({"model": "reference", "prompt": "hello " * 16, "max_tokens": 1, "stream": True}).encode()
    pool = Pool("127.0.0.1", port, 64)
    raw = post("127.0.0.1", port, "/v1/completions", body)
    rnd = random.Random(1)
    tasks = []
    t0 = t = time.perf_counter()
    while t - t0 < seconds:
        t += rnd.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        tasks.append(asyncio.create_task(pool.request(raw)))
    res = await asyncio.gather(*tasks)
    pool.close()
    ok = [r for r in res if r.status == 200 and not r.error]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    return len(tasks), len(ok), ttft[len(ttft) // 2] if ttft else None


async def run(a: argparse.Namespace) -> dict[str, list[float]]:
    from common.ports import free_port

    kinds = ["uvicorn", "raw"] + (["granian"] if a.granian else [])
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for rnd in range(a.rounds):
        for kind in kinds:
            port = free_port()
            proc = server(kind, port, a.granian)
            try:
                wait_port(port, proc, timeout=10.0)  # nothing else runs on this loop yet
                await drive(port, 50, 1.0)  # warm-up
                await asyncio.sleep(0.5)
                c0, w0 = tree_cpu(proc.pid), time.perf_counter()
                await asyncio.sleep(2.0)
                idle = (tree_cpu(proc.pid) - c0) / (time.perf_counter() - w0)
                c0, w0 = tree_cpu(proc.pid), time.perf_counter()
                sent, ok, ttft = await drive(port, a.rate, a.seconds)
                cpu = tree_cpu(proc.pid) - c0 - idle * (time.perf_counter() - w0)
            finally:
                proc.terminate()
                proc.wait()
            us = cpu / max(1, ok) * 1e6
            out[kind].append(us)
            print(f"round {rnd + 1} {kind}: {ok} of {sent} answered, {us:.0f} us of CPU per request, TTFT p50 "
                  f"{ttft * 1e3 if ttft is not None else float('nan'):.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=300.0, help="requests/s (default 300)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of load per server per round (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    p.add_argument("--granian", default=shutil.which("granian") or "",
                   help="the granian command (default: on PATH; none: uvicorn only)")
    a = p.parse_args(argv)
    if not a.granian:
        print("bench.http_stack: granian not found (give --granian or put it on PATH); measuring uvicorn and the raw "
              "protocol only")
    os.sched_setaffinity(0, {1} if (os.cpu_count() or 1) > 1 else {0})
    out = asyncio.run(run(a))
    for kind, xs in out.items():
        print(f"{kind}: median {statistics.median(xs):.0f} us of CPU per request (runs "
              f"{', '.join(f'{x:.0f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
