"""The measuring machinery of `kairos bench-router` (bench/router_throughput.py) and its peers
phase (bench/peers.py): load generator processes pinned to CPUs, one measured step at an offered
rate (the target process's CPU from its CPU-time clock, TTFT percentiles, errors), and the sustained step.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
from rich.console import Console

from bench.rawclient import Pool, Result, post
from kairos.loadgen import run_loop
from kairos.up import Cluster

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------- CPU accounting


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has run so far, all its threads (ended ones included), to the
    nanosecond: Linux's CPU-time clock of that process (what clock_getcpuclockid(3) returns for
    it). user + system from /proc/PID/stat count in clock ticks (10 ms), too coarse here: a bare
    app costs 0.2 s of CPU over a 4 s step, and its 1 s idle reading came out as 0 or 1 % of a
    core, which moved its cost per request by a quarter between runs. Elsewhere, the ticks."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except (OSError, AttributeError):
        return _cpu_ticks(pid)


def _cpu_ticks(pid: int) -> float:
    """user + system CPU seconds of a process so far (all its threads, ended ones included), in
    clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return float(sum(parts) - idle), float(sum(parts))


def parse_cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(part))
    return out


# ---------------------------------------------------------------------------------- client processes


@dataclass(frozen=True)
class Step:
    rate: float
    duration: float
    start_at: float          # time.time() at which every client starts sending
    max_tokens: int
    prompt_tokens: int
    tag: str = ""            # request ids are f"{tag}-{client}-{n}" when set (telemetry matching)


def _client_main(index: int, host: str, port: int, connections: int, cpus: list[int], seed: int,
                 conn: Connection, model: str = "") -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    run_loop(_client_loop(index, host, port, connections, seed, conn, model))


async def _client_loop(index: int, host: str, port: int, connections: int, seed: int, conn: Connection,
                       model: str = "") -> None:
    pool = Pool(host, port, connections)
    rng = random.Random(seed * 1000 + index)
    loop = asyncio.get_running_loop()
    try:
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg is None:
                return
            step: Step = msg
            conn.send(await _client_step(index, pool, rng, step, host, port, model))
    finally:
        pool.close()


async def _client_step(index: int, pool: Pool, rng: random.Random, step: Step, host: str, port: int,
                       model: str = "") -> dict[str, Any]:
    bodies = []
    for k in range(16):
        ids = [1000 + (k * 131 + j * 7 + index) % 1000 for j in range(step.prompt_tokens)]
        # a peer router takes text only (sglang-router refuses token ids): as many words as ids
        prompt: list[int] | str = " ".join(f"w{i}" for i in ids) if model else ids
        bodies.append(msgspec.json.encode({**({"model": model} if model else {}), "prompt": prompt,
                                           "max_tokens": step.max_tokens, "stream": True,
                                           "ignore_eos": True, "min_tokens": step.max_tokens}))
    results: list[Result] = []
    sent_at: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    waits0 = pool.waits
    cpu0 = time.process_time()

    last_done = 0.0

    async def one(raw: bytes, rid: str) -> None:
        nonlocal last_done
        results.append(await pool.request(raw, rid, timeout=30.0))
        last_done = time.perf_counter() - t0

    # wall clock to line the processes up, then the monotonic perf_counter for the schedule
    delay = step.start_at - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    t_next = 0.0
    n = 0
    lag_max = 0.0
    while t_next < step.duration:
        now = time.perf_counter() - t0
        if t_next > now:
            await asyncio.sleep(t_next - now)
            now = time.perf_counter() - t0
        lag_max = max(lag_max, now - t_next)
        rid = f"{step.tag}-{index}-{n}" if step.tag else ""
        raw = post(host, pool.port, "/v1/completions", bodies[n % len(bodies)], request_id=rid)
        sent_at.append(now)
        task = asyncio.create_task(one(raw, rid))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        t_next += rng.expovariate(step.rate)
    cpu_send = time.process_time() - cpu0
    if tasks:
        await asyncio.wait(set(tasks), timeout=35.0)
    return {"sent": n, "results": [(r.ttft, r.e2e, r.tokens, r.max_gap, r.error, r.route, r.request_id)
                                   for r in results],
            "pool_waits": pool.waits - waits0, "cpu_s": time.process_time() - cpu0, "cpu_send_s": cpu_send,
            "lag_max": lag_max, "span": last_done}


class Clients:
    """N load generator processes, each with its own event loop and connection pool."""

    def __init__(self, n: int, host: str, port: int, connections: int, cpus: Sequence[int], seed: int = 0,
                 model: str = "") -> None:
        """`model`: named in every body, whose prompt is then text (a peer router needs both); without
        it, prompts are token ids and the router's default model is used."""
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_main, args=(i, host, port, connections, list(cpus), seed, child, model),
                            daemon=True, name=f"bench-client-{i}")
            p.start()
            self.procs.append(p)
            self.conns.append(parent)

    def run(self, step: Step) -> list[dict[str, Any]]:
        per = Step(step.rate / len(self.conns), step.duration, step.start_at, step.max_tokens, step.prompt_tokens,
                   step.tag)
        for c in self.conns:
            c.send(per)
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()


# ---------------------------------------------------------------------------------- one measured step


def fmt(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


class Bench:
    def __init__(self, cluster: Cluster | None, clients: Clients, console: Console, *, pid: int = 0) -> None:
        """Measures the cluster's router, or with `pid` (and no cluster) that process instead."""
        self.cluster = cluster
        self.clients = clients
        self.console = console
        routers = cluster.spec.router_names if cluster is not None else ["router"]
        self.router_pids = [pid] if pid else [self._pid(n) for n in routers]  # every replica: their sum
        self.router_pid = self.router_pids[0]
        self.worker_pids = [s.proc.pid for n, s in cluster.services.items() if n not in routers and s.proc] \
            if cluster is not None else []
        self.idle_cpu = 0.0

    def measure_idle(self, seconds: float) -> float:
        """The router's CPU use with no requests (heartbeats, liveness and telemetry loops), in
        cores; subtracted from the per-request and per-token costs."""
        c0, t0 = self.router_cpu_s(), time.perf_counter()
        time.sleep(seconds)
        self.idle_cpu = (self.router_cpu_s() - c0) / (time.perf_counter() - t0)
        return self.idle_cpu

    def router_cpu_s(self) -> float:
        return sum(map(cpu_seconds, self.router_pids))

    def _pid(self, name: str) -> int:
        assert self.cluster is not None
        p = self.cluster.services[name].proc
        assert p is not None
        return p.pid

    def step(self, rate: float, duration: float, *, max_tokens: int, prompt_tokens: int, tag: str = "",
             during: Any = None) -> dict[str, Any]:
        start_at = time.time() + 0.3
        sampler: dict[str, Any] = {}

        def sample() -> dict[str, Any]:
            return {"router": self.router_cpu_s(), "workers": sum(map(cpu_seconds, self.worker_pids)),
                    "machine": machine_busy(), "t": time.perf_counter()}

        def start() -> None:  # counters when the clients start sending; then the profiler, if any
            time.sleep(max(0.0, start_at - time.time()))
            sampler["a"] = sample()
            if during is not None:
                during(duration)

        th = threading.Thread(target=start, daemon=True)
        th.start()
        outs = self.clients.run(Step(rate, duration, start_at, max_tokens, prompt_tokens, tag))
        th.join()
        # ... and when the last response is in: work done after the sending window (a backlog
        # draining) is part of what these requests cost
        b = sample()
        a = sampler["a"]
        if self.cluster is not None:
            self.cluster.check_alive()
        rows = [r for o in outs for r in o["results"]]
        sent = sum(o["sent"] for o in outs)
        ok = [r for r in rows if r[4] is None]
        errors = Counter(r[4] for r in rows if r[4] is not None)
        errors["not_finished"] = sent - len(rows)
        errors = +errors
        ttft = [r[0] for r in ok if r[0] is not None]
        e2e = [r[1] for r in ok if r[1] is not None]
        tokens = sum(r[2] for r in ok)
        wall = b["t"] - a["t"]
        router_cpu = b["router"] - a["router"]
        busy_cpu = max(0.0, router_cpu - self.idle_cpu * wall)  # what the requests cost
        (b0, t0), (b1, t1) = a["machine"], b["machine"]
        ncpu = os.cpu_count() or 1
        span = max(duration, max(o["span"] for o in outs))  # first send to last response
        return {
            "offered_rate": rate, "duration_s": duration, "span_s": span, "sent": sent, "completed": len(ok),
            "completed_rate": len(ok) / span, "errors": dict(errors),
            # the rate carried with each request's own lifetime taken off the span: a step that kept
            # up ends about one median lifetime after its sending window (2 s for 100 tokens at
            # 20 ms steps, where `completed_rate` over the span reads 30 % under the offered rate)
            "carried_rate": len(ok) / max(duration, span - (_pct(e2e, 50) or 0.0)),
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "ttft_max": max(ttft) if ttft else None,
            "max_gap_p99": _pct([r[3] for r in ok], 99),
            # the client's mean inter-token time per request, first token to last (joined events
            # count each token they hold), and its median and p99 over the requests
            "itl_p50": _pct(itl := [(r[1] - r[0]) / (max_tokens - 1) for r in ok
                                    if r[0] is not None and r[1] is not None and max_tokens > 1], 50),
            "itl_p99": _pct(itl, 99),
            # streams open at once while the step sends (Little's law: the rate it sent at times a
            # request's mean time open, send to last token)
            "open_streams": sum(e2e) / duration if e2e else None,
            "tokens": tokens, "tokens_per_s": tokens / span,
            "router_cpu": router_cpu / wall, "workers_cpu": (b["workers"] - a["workers"]) / wall,
            "clients_cpu": sum(o["cpu_s"] for o in outs) / wall,
            "machine_cpu": (b1 - b0) / max(t1 - t0, 1.0) * ncpu,
            "router_idle_cpu": self.idle_cpu,
            "router_us_per_request": 1e6 * busy_cpu / len(ok) if ok else None,
            "router_us_per_token": 1e6 * busy_cpu / tokens if tokens else None,
            # `tokens` counts SSE events with text, which is tokens only where every event holds one
            # (the reference app and a peer relaying it); Kairos's router puts every token ready
            # for a stream in one event, so per output token (each completed request streams
            # max_tokens: ignore_eos and min_tokens) is the figure that compares with a peer's
            "output_tokens": len(ok) * max_tokens,
            "router_us_per_output_token": 1e6 * busy_cpu / (len(ok) * max_tokens) if ok else None,
            "pool_waits": sum(o["pool_waits"] for o in outs), "send_lag_max": max(o["lag_max"] for o in outs),
            "_rows": rows,
        }


def sustained(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The highest step that kept up: its completion rate (`carried_rate`: over the time to its
    last response less a request's median lifetime) >= 97% of the rate it sent at (Poisson: the
    sent count varies around the offered rate), no
    errors, and TTFT p50 within 2x (+2 ms) of the lowest step's."""
    if not steps or steps[0]["ttft_p50"] is None:
        return None
    base = steps[0]["ttft_p50"]
    best = None
    for s in steps:
        if (s.get("carried_rate", s["completed_rate"]) >= 0.97 * s["sent"] / s["duration_s"] and not s["errors"]
                and s["ttft_p50"] is not None and s["ttft_p50"] <= 2 * base + 0.002):
            best = s
    return best



def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"not listening on port {port} after {timeout:g} s")


def request_steps(bench: Bench, console: Console, args: argparse.Namespace, rates: Sequence[float], label: str,
                   cpu_label: str, *, stop_past_saturation: bool) -> list[dict[str, Any]]:
    """One step of one-token requests per offered rate (the requests phase, and the reference app's
    rerun of it at the rates the router carried)."""
    steps = []
    for r in rates:
        s = bench.step(r, args.step, max_tokens=1, prompt_tokens=args.prompt_tokens)
        s.pop("_rows")
        steps.append(s)
        console.print(f"  {label} {r:,.0f}/s: done {s['completed_rate']:,.0f}/s, TTFT p50 "
                      f"{fmt(s['ttft_p50'], 1e3, 2)} ms, {cpu_label} {s['router_cpu']:.2f}")
        if stop_past_saturation and (s["completed_rate"] < 0.8 * r or (s["ttft_p50"] or 0.0) > 1.0):
            break  # far past saturation: stop before queues explode
    return steps


def token_steps(bench: Bench, console: Console, args: argparse.Namespace, rates: Sequence[float], label: str,
                cpu_label: str, *, stop_past_saturation: bool) -> list[dict[str, Any]]:
    """One step of requests of --stream-tokens tokens each per offered rate (the tokens phase)."""
    steps = []
    for r in rates:
        s = bench.step(r, args.step, max_tokens=args.stream_tokens, prompt_tokens=args.prompt_tokens)
        s.pop("_rows")
        steps.append(s)
        console.print(f"  {label} {r:,.0f} req/s: {s['tokens_per_s']:,.0f} tokens/s, TTFT p50 "
                      f"{fmt(s['ttft_p50'], 1e3, 2)} ms, {cpu_label} {s['router_cpu']:.2f}")
        if stop_past_saturation and (s["carried_rate"] < 0.8 * r or (s["ttft_p50"] or 0.0) > 1.0):
            break  # far past saturation
    return steps


def summarize_stacks(text: str, *, raw_path: str = "", top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares by function, from py-spy's collapsed ("raw") stacks."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return {"samples": total, "raw": raw_path,
            "self": [(f, n / total) for f, n in self_c.most_common(top)] if total else [],
            "inclusive": [(f, n / total) for f, n in incl.most_common(top)] if total else []}
