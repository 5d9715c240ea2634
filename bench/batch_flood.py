"""`python -m bench.batch_flood`: one completion whose `prompt` is a list of 10,000 short prompts,
sent into a 100-stream load (issue 47): its status and how long it took, the other streams'
largest inter-token stall and TTFT while it was handled, against the same load before it, and
the router's RSS before, right after and 30 s after.

A local cluster (`kairos up`'s Cluster: router, P prefill and D decode simulated workers, the
`fast` profile, slowed down by `--time-scale` so that the load is streams, not a CPU flood)
serves `--streams` clients, each sending one streamed completion after another (`--max-tokens`
tokens each, a short prompt) from one asyncio loop over raw keep-alive connections
(bench/rawclient.py). After `--warmup` s the router's RSS is read, then the batched request is
sent (its prompts "prompt N: a short one", so every one is distinct text). The load runs on
until `--after` s past the batched request's answer, when the RSS is read again. Prints one
JSON object; a request counts as "during" the flood when it was streaming at any time between
the flood's sending and `--window` s after its answer. The clients' figures move with the
machine's load (a starved client reads several tokens at once); the router's own event-loop
lag over the same windows (its /metrics histogram) says whether the router stalled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.rawclient import Pool, post
from bench.steps import cpu_seconds
from kairos.up import Cluster, ClusterSpec


@dataclass(slots=True)
class Row:
    sent: float       # perf_counter when sent
    ended: float      # perf_counter when the response ended
    status: int
    ttft: float | None
    max_gap: float
    tokens: int
    error: str | None


async def loop_lag_buckets(api_port: int) -> dict[float, float]:
    """The router's event-loop lag histogram (common/loop_lag.py): cumulative count per bucket bound."""
    out: dict[float, float] = {}
    async with httpx.AsyncClient(timeout=30.0) as c:
        text = (await c.get(f"http://127.0.0.1:{api_port}/metrics")).text
    for line in text.splitlines():
        if line.startswith("kairos_event_loop_lag_seconds_bucket{") and 'service="router"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def worst_lag(a: dict[float, float], b: dict[float, float]) -> dict[str, Any]:
    """Between two readings: the samples taken, and the bucket the worst one fell in (its upper bound, ms)."""
    diff = {le: b.get(le, 0.0) - a.get(le, 0.0) for le in sorted(b)}
    total = diff.get(float("inf"), 0.0)
    worst = next((le for le, n in diff.items() if n >= total), float("inf")) if total else 0.0
    return {"samples": int(total), "worst_at_most_ms": None if worst == float("inf") else round(worst * 1e3, 1),
            "over_100ms": int(total - diff.get(0.1, 0.0)), "over_250ms": int(total - diff.get(0.25, 0.0))}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _stream_client(pool: Pool, raw: bytes, stop: asyncio.Event, rows: list[Row]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        r = await pool.request(raw, timeout=120.0)
        rows.append(Row(t, time.perf_counter(), r.status, r.ttft, r.max_gap, r.tokens, r.error))
        if r.error or r.status != 200:
            await asyncio.sleep(0.05)  # a refusal: do not spin


def summarize(rows: list[Row]) -> dict[str, Any]:
    ok = [r for r in rows if r.status == 200 and r.error is None]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    gaps = sorted(r.max_gap for r in ok)

    def q(xs: list[float], f: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(len(xs) * f))] * 1e3, 1) if xs else None

    return {"requests": len(rows), "ok": len(ok), "not_ok": len(rows) - len(ok),
            "max_gap_ms": q(gaps, 1.0), "max_gap_p99_ms": q(gaps, 0.99), "max_gap_p50_ms": q(gaps, 0.5),
            "ttft_p50_ms": q(ttfts, 0.5), "ttft_max_ms": q(ttfts, 1.0)}


async def run(api_port: int, router_pid: int, a: argparse.Namespace) -> dict[str, object]:
    stream_body = msgspec.json.encode({"prompt": "tell me a story", "max_tokens": a.max_tokens, "stream": True,
                                       "ignore_eos": True})
    raw = post("127.0.0.1", api_port, "/v1/completions", stream_body)
    pool = Pool("127.0.0.1", api_port, a.streams)
    flood_pool = Pool("127.0.0.1", api_port, 1)
    rows: list[Row] = []
    stop = asyncio.Event()
    clients = [asyncio.create_task(_stream_client(pool, raw, stop, rows)) for _ in range(a.streams)]
    try:
        await asyncio.sleep(a.warmup - a.window)
        lag0 = await loop_lag_buckets(api_port)
        await asyncio.sleep(a.window)
        lag1 = await loop_lag_buckets(api_port)
        rss_before = rss_mb(router_pid)
        prompts = [f"prompt {i}: a short one" for i in range(a.prompts)]
        body = msgspec.json.encode({"prompt": prompts, "max_tokens": 4})
        cpu0, t_flood = cpu_seconds(router_pid), time.perf_counter()
        got = await flood_pool.request(post("127.0.0.1", api_port, "/v1/completions", body), timeout=300.0)
        t_answer, cpu1 = time.perf_counter(), cpu_seconds(router_pid)
        rss_right_after = rss_mb(router_pid)
        await asyncio.sleep(a.window)
        lag2 = await loop_lag_buckets(api_port)
        await asyncio.sleep(max(0.0, a.after - a.window))
        rss_after = rss_mb(router_pid)
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
        pool.close()
        flood_pool.close()
    start = t_flood - a.warmup
    before = [r for r in rows if r.sent >= start + 1.0 and r.ended < t_flood]  # the first second warms up
    during = [r for r in rows if r.sent < t_answer + a.window and r.ended > t_flood]
    b, d = summarize(before), summarize(during)
    return {"batched_request": {"prompts": a.prompts, "body_bytes": len(body), "status": got.status,
                                "error": got.error, "answer_ms": round((t_answer - t_flood) * 1e3, 1),
                                # the router's CPU from its sending to its answer (with the load's, if any:
                                # run with --streams 0 for the request's own)
                                "router_cpu_ms": round((cpu1 - cpu0) * 1e3, 1)},
            "streams_before": b, "streams_during": d,
            # the router's own event-loop lag (sampled every 50 ms), `--window` s before the flood and
            # from its sending to `--window` s after its answer: a stall the router had, not the client
            "router_loop_lag_before": worst_lag(lag0, lag1), "router_loop_lag_during": worst_lag(lag1, lag2),
            # what the flood added to the worst stall any stream saw (the load's own gaps set the floor)
            "stall_added_ms": round((d["max_gap_ms"] or 0.0) - (b["max_gap_ms"] or 0.0), 1),
            "router_rss_mb": {"before": rss_before, "right_after": rss_right_after, f"after_{a.after:g}s": rss_after,
                              "after_over_before": round(rss_after / rss_before, 3) if rss_before else None}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_flood", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10_000, help="prompts in the batched request (default 10000)")
    ap.add_argument("--streams", type=int, default=100, help="concurrent streaming clients (default 100)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed completion (default 64)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=2.0, help="simulated engines' step time factor (default 2)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the batched request")
    ap.add_argument("--after", type=float, default=30.0, help="seconds of load after its answer, then RSS")
    ap.add_argument("--window", type=float, default=1.0, help="'during': until this long after its answer, s")
    a = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="kairos-batch-flood-")
    spec = ClusterSpec.ephemeral(prefill=a.prefill, decode=a.decode, profile="fast", monitor=False, log_dir=log_dir,
                                 time_scale=a.time_scale, log_level="warning")
    cluster = Cluster(spec)
    try:
        cluster.start(timeout=60)
        proc = cluster.services["router"].proc
        assert proc is not None
        result = asyncio.run(run(spec.http_port, proc.pid, a))
    finally:
        cluster.stop(20)
    result.update({"load_avg": os.getloadavg(), "logs": log_dir, "args": vars(a)})
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
