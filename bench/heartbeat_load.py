"""`python -m bench.heartbeat_load`: the router's CPU with a large fleet heartbeating and no requests.

Starts one router (no workers of its own), then registers N prefill + N decode fake workers on
its bus from this process (real DEALER connections, real Hello and heartbeat messages, with
varying load so every heartbeat changes the worker's view; prefill heartbeats carry the queue's
backlog and the worker's replay of it, as real ones do), each heartbeating every 100 ms,
staggered evenly. Measures the router process's CPU (all threads, from its CPU-time clock)
over a window, and prints one JSON object: cores used, heartbeats per second, and CPU per
heartbeat. With `--env K=V` (repeatable) the router gets extra settings, so two variants can be
run alternately in one invocation with `--compare K=V`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from bench.steps import cpu_seconds, summarize_stacks, wait_port
from common import codec
from common import messages as m
from common.perf_model import load_profile
from common.ports import free_ports


def parse_workers(text: str) -> tuple[int, int]:
    """'128' (as many of each) or '128+64' (prefill + decode)."""
    p, _, d = text.partition("+")
    n_p, n_d = int(p), int(d or p)
    if n_p < 0 or n_d < 0 or n_p + n_d == 0:
        raise ValueError(f"--workers: expected N or P+D, got {text!r}")
    return n_p, n_d


def run(n: int, seconds: float, env_extra: dict[str, str], interval: float = 0.1, *, decode: int | None = None,
        cpus: str = "", profile: Path | None = None) -> dict[str, Any]:
    """`n` prefill and `decode` (default `n`) decode workers heartbeating every `interval` s; the
    router pinned to `cpus` (a taskset list) when given. `profile`: a folder where `py-spy record
    --gil` samples the router over the window (its raw stacks; the result gets the top functions)."""
    n_d = n if decode is None else decode
    http, work, hb, tel = free_ports(4)
    env = {**os.environ, "KAIROS_HTTP_PORT": str(http), "KAIROS_WORK_PORT": str(work),
           "KAIROS_HEARTBEAT_PORT": str(hb), "KAIROS_TELEMETRY_PORT": str(tel), "KAIROS_LOG_LEVEL": "warning",
           "KAIROS_LIVENESS": "50", **env_extra}
    log = Path(tempfile.mkdtemp(prefix="kairos-hb-")) / "router.log"
    with open(log, "w") as out:
        pin = ["taskset", "-c", cpus] if cpus else []
        router = subprocess.Popen([*pin, sys.executable, "-m", "kairos.cli", "router"], env=env, stdout=out,
                                  stderr=out)
    ctx = zmq.Context()
    socks: list[tuple[zmq.Socket[bytes], str, str]] = []
    spy: subprocess.Popen[bytes] | None = None
    try:
        wait_port(http, router, 120.0)  # imported and serving: its start-up is not in the window
        rng = random.Random(0)
        coeffs = load_profile("h100-llama2-70b-tp4").model.to_coeffs()  # sent as real workers send it: every beat
        for i in range(n + n_d):
            role: m.Role = "prefill" if i < n else "decode"
            wid = f"{role}-{i if i < n else i - n}"
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, wid.encode())
            s.connect(f"tcp://127.0.0.1:{work}")
            inc = f"{i:012x}"
            s.send(codec.encode(m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=wid, role=role, incarnation=inc,
                                        engine="sim", model="kairos-sim", token_budget=8192,
                                        kv_capacity_tokens=0 if role == "prefill" else 10**6,
                                        kv_transport="nixl", coeffs=coeffs)))
            socks.append((s, wid, inc))
        wait_registered(http, n + n_d)
        seq = 0
        sent = 0
        t_start = time.monotonic()
        c0 = w0 = None
        m0 = 0.0
        slot = interval / len(socks)
        nxt = time.monotonic()
        while True:
            seq += 1
            for s, wid, inc in socks:
                q = rng.randint(0, 20000)
                if wid.startswith("prefill"):
                    # as a real prefill worker reports its queue: the backlog and its own replay of it
                    # (so the router extends that replay instead of replaying the queue itself)
                    backlog = [(1000, 0)] * (q // 1000) + ([(q % 1000, 0)] if q % 1000 else [])
                    first = min(q, 8192)
                    drain = m.QueueDrain(start_s=0.0, chunks=[(first, 0)] if q else [], used=first,
                                         end_s=0.05 * q / 8192) if q else None
                    msg: m.Msg = m.PrefillHeartbeat(worker_id=wid, incarnation=inc, seq=seq, queued_tokens=q,
                                                    queued_requests=len(backlog), token_budget=8192,
                                                    backlog=backlog, drain=drain, coeffs=coeffs)
                else:
                    msg = m.DecodeHeartbeat(worker_id=wid, incarnation=inc, seq=seq, batch=q // 500, kv_tokens=q * 10,
                                            kv_free_tokens=10**6 - q * 10, kv_capacity_tokens=10**6,
                                            resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1,
                                            token_budget=8192, coeffs=coeffs)
                try:
                    s.send(codec.encode(msg), zmq.NOBLOCK)
                    sent += c0 is not None
                except zmq.Again:
                    pass
                nxt += slot
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            now = time.monotonic()
            if c0 is None and now - t_start > 2.0:  # warmed up: start the window
                c0, w0, m0 = cpu_seconds(router.pid), now, main_thread_cpu(router.pid)
                if profile is not None:
                    spy = start_py_spy(router.pid, seconds, profile)
            elif c0 is not None and w0 is not None and now - w0 >= seconds:
                used = cpu_seconds(router.pid) - c0
                main_used = main_thread_cpu(router.pid) - m0
                res: dict[str, Any] = {
                    "workers": n + n_d, "prefill": n, "decode": n_d, "interval_s": interval,
                    "window_s": round(now - w0, 2), "router_cores": round(used / (now - w0), 4),
                    "heartbeats_per_s": round(sent / (now - w0), 1),
                    "router_us_per_heartbeat": round(used / max(sent, 1) * 1e6, 1),
                    # the event loop's thread (Python); the rest is ZeroMQ's I/O thread, mostly the kernel
                    "main_thread_cores": round(main_used / (now - w0), 4)}
                if spy is not None and profile is not None:
                    res["profile"] = end_py_spy(spy, profile)
                    spy = None
                return res
    finally:
        if spy is not None:
            spy.kill()
            spy.wait()
        for s, _, _ in socks:
            s.close(0)
        ctx.term()
        router.terminate()
        router.wait(20)


def wait_registered(http_port: int, workers: int, timeout: float = 60.0) -> None:
    """Until the router lists `workers` workers (their Hellos handled; a loaded machine takes seconds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = httpx.get(f"http://127.0.0.1:{http_port}/v1/kairos/stats", timeout=10.0).json()
            if len(got.get("workers", {})) >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the router did not list {workers} workers within {timeout:g} s")


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread alone (Linux's schedstat, in ns); NaN elsewhere."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


def start_py_spy(pid: int, seconds: float, out_dir: Path) -> subprocess.Popen[bytes]:
    """`py-spy record --gil` of `pid` for `seconds`, raw stacks into `out_dir`/router-pyspy.txt."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise SystemExit("--profile: py-spy is not installed (it is in this project's dev extra: "
                         "pip install -e '.[dev]')")
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", "500", "--format", "raw", "--gil", "--nonblocking",
                             "--output", str(out_dir / "router-pyspy.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_py_spy(spy: subprocess.Popen[bytes], out_dir: Path) -> dict[str, Any]:
    spy.wait(60)
    raw = out_dir / "router-pyspy.txt"
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed ({spy.returncode})"}
    return summarize_stacks(raw.read_text(), raw_path=str(raw), top=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.heartbeat_load", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="128", help="N (N prefill and N decode workers) or P+D (default 128)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    ap.add_argument("--env", action="append", default=[], help="K=V for the router (A)")
    ap.add_argument("--compare", action="append", default=[], help="K=V for the router (B): A and B alternate")
    ap.add_argument("--pairs", type=int, default=1, help="A/B pairs (with --compare)")
    ap.add_argument("--profile", type=Path, help="a folder: also sample the router with py-spy --gil over each "
                    "window (A's runs; B's with --compare: subfolders A0, B0, ...)")
    a = ap.parse_args(argv)
    n_p, n_d = parse_workers(a.workers)
    env_a = dict(kv.split("=", 1) for kv in a.env)
    out: dict[str, object] = {"A": {"env": env_a, "runs": []}}
    if a.compare:
        out["B"] = {"env": {**env_a, **dict(kv.split("=", 1) for kv in a.compare)}, "runs": []}
    for i in range(a.pairs if a.compare else 1):
        for k in out:
            prof = a.profile / f"{k}{i}" if a.profile else None
            out[k]["runs"].append(run(n_p, a.seconds, out[k]["env"], decode=n_d, profile=prof))  # type: ignore[index]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
