"""Restart the router (or every service, one at a time) under load and count what clients saw
(BENCHMARKS.md, "Router restart"; docs/benchmarks/restart.md, the rolling restart).

A local cluster (`kairos up`'s Cluster: router, P prefill and D decode workers, simulated engine)
takes an open-loop Poisson load of streamed completions; `--restart-at` seconds in, the router is
restarted as kairos up's supervisor does (SIGTERM: it stops intake and drains; then it is started
again, on the listening socket kairos up holds). With `--rolling`, every service is restarted
that way, one at a time: the router, each prefill worker, each decode worker, the monitor, each
after the previous one is back (the router answering, a worker registered again) and
`--gap` seconds. Each request is tried once (no client retries) and ends in one bucket:

    ok                    a full stream ([DONE], a finish_reason)
    refused               no connection (the router was down)
    503:<code>            answered 503 (shutting_down; unavailable: no worker could take it)
    <status>:<code>       any other HTTP error
    stream:<code>         an error event in an admitted stream
    dropped               the connection broke mid-response

"after accepting" counts the requests sent once the restarted router answered its first
connection: the figure the fix is about (none of them should be a 503 for want of workers).

    python -m bench.router_restart --rate 20 --duration 6 --restart-at 2 --out rr.json
    python -m bench.router_restart --rolling --rate 10 --duration 30 --out rolling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter

import httpx

from kairos.up import Cluster, ClusterSpec


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> str:
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    err = json.loads(raw)["error"]
                    code = "shutting_down" if "shutting down" in err["message"] else \
                        r.headers.get("x-kairos-error", err["code"])
                except (ValueError, KeyError, TypeError):
                    code = "?"
                return f"{r.status_code}:{code}"
            finish = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok" if finish else "stream:no_finish"
                ev = json.loads(line[6:])
                if "error" in ev:
                    return f"stream:{ev.get('kairos_error') or ev['error'].get('code')}"
                if ev["choices"] and ev["choices"][0].get("finish_reason"):
                    finish = ev["choices"][0]["finish_reason"]
            return "stream:ended_silently"
    except (httpx.ConnectError, httpx.ConnectTimeout):
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "dropped"
    except httpx.ReadTimeout:
        return "hung"


def rolling_order(cluster: Cluster) -> list[str]:
    """Every service of the cluster, in the order of a rolling restart: routers, prefill workers,
    decode workers, the monitor (what docs/deployment.md's rolling restart does)."""
    names = list(cluster.spec.router_names)
    names += [n for n in cluster.services if n.startswith("prefill-")]
    names += [n for n in cluster.services if n.startswith("decode-")]
    return names + [n for n in cluster.services if n == "monitor"]


async def restart_service(cluster: Cluster, name: str) -> dict[str, float]:
    """Restart one service as kairos up's supervisor does (SIGTERM, wait for its exit, start it
    again) and wait until it is back: a router answering /health, a worker registered again.
    Returns how long the stop and the way back took, seconds."""
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.stop_service, name, 40)  # SIGTERM: intake stops, what it holds drains
    stopped = time.monotonic()
    cluster.restart(name)
    if name in cluster.spec.router_names:
        async with httpx.AsyncClient(timeout=1.0) as c:
            while True:
                try:
                    await c.get(cluster.spec.api + "/health")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.01)
    elif name != "monitor":
        await asyncio.to_thread(cluster.wait_registered, {name}, 60.0)
    back = time.monotonic()
    print(f"{name}: stopped in {stopped - t0:.2f} s, back {back - stopped:.2f} s later", flush=True)
    return {"stop_s": round(stopped - t0, 3), "back_s": round(back - stopped, 3)}


async def load(cluster: Cluster, *, rate: float, duration: float, restart_at: float, seed: int,
               max_tokens: int, services: list[str] | None = None, gap: float = 1.0) -> dict[str, object]:
    """`services`: restart these one at a time from `restart_at` on, `gap` seconds apart (default:
    the router alone); the load goes on until `duration` and until the last one is back."""
    rng = random.Random(seed)
    url = cluster.spec.api + "/v1/completions"
    rows: list[tuple[float, asyncio.Task[str]]] = []
    took: dict[int, float] = {}  # row -> seconds from send to the end of its response

    async def timed(i: int, body: dict[str, object]) -> str:
        t = time.monotonic()
        try:
            return await one(client, url, body)
        finally:
            took[i] = time.monotonic() - t
    accepting_again: list[float] = []
    order = services if services is not None else ["router"]
    restarts: dict[str, dict[str, float]] = {}

    async def restart() -> None:
        await asyncio.sleep(restart_at)
        for i, name in enumerate(order):
            if i:
                await asyncio.sleep(gap)
            restarts[name] = await restart_service(cluster, name)
            if name in cluster.spec.router_names and cluster.spec.routers > 1:
                # replicas: the restarted one serves again (every worker back) before the next goes
                await asyncio.to_thread(cluster.wait_ready, 60.0)
            if name == "router" and not accepting_again:
                accepting_again.append(time.monotonic())

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=0)  # a new connection per request
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=2.0), limits=limits) as client:
        rt = asyncio.create_task(restart())
        start = time.monotonic()
        while time.monotonic() - start < duration or not rt.done():
            prompt = [1000 + rng.randrange(997) for _ in range(int(min(4000, max(16, rng.lognormvariate(6.0, 0.8)))))]
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            rows.append((time.monotonic(), asyncio.create_task(timed(len(rows), body))))
            await asyncio.sleep(rng.expovariate(rate))
        await rt
        await asyncio.wait([t for _, t in rows], timeout=90)
    at = accepting_again[0] if accepting_again else float("inf")
    outcomes: Counter[str] = Counter()
    after: Counter[str] = Counter()
    for sent, task in rows:
        res = task.result() if task.done() else "hung"
        outcomes[res] += 1
        if sent >= at:
            after[res] += 1
    times = sorted(took.values())
    return {"sent": len(rows), "outcomes": dict(outcomes), "after_accepting": dict(after), "restarts": restarts,
            "refused": outcomes["refused"], "failed": len(rows) - outcomes["ok"],
            "latency_s": {"p50": round(times[len(times) // 2], 3), "p99": round(times[int(len(times) * 0.99)], 3),
                          "max": round(times[-1], 3)} if times else {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of load")
    p.add_argument("--restart-at", type=float, default=2.0, help="seconds into the load")
    p.add_argument("--rolling", action="store_true",
                   help="restart every service one at a time (routers, prefill, decode workers, the monitor), "
                        "not only the router")
    p.add_argument("--gap", type=float, default=1.0, help="--rolling: seconds between one service back and the next "
                                                          "restart")
    p.add_argument("--monitor", action="store_true", help="start the monitor too (--rolling restarts it)")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas on the HTTP port (SO_REUSEPORT, as docker-compose.yml runs two); 1: the "
                        "one router on kairos up's handed-down socket")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--profile", default="a100-dsv2-lite")
    p.add_argument("--time-scale", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    spec = ClusterSpec.ephemeral(prefill=a.prefill, decode=a.decode, routers=a.routers, profile=a.profile,
                                 time_scale=a.time_scale,
                                 monitor=a.monitor, log_dir=tempfile.mkdtemp(prefix="router-restart-"))
    cluster = Cluster(spec)
    try:
        cluster.start(timeout=60)
        result = asyncio.run(load(cluster, rate=a.rate, duration=a.duration, restart_at=a.restart_at, seed=a.seed,
                                  max_tokens=a.max_tokens, services=rolling_order(cluster) if a.rolling else None,
                                  gap=a.gap))
    finally:
        cluster.stop(20)
    result.update(load_avg=os.getloadavg(), logs=spec.log_dir, args=vars(a))
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise SystemExit(main())
