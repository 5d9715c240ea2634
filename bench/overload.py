"""Overload at the door: offer a local cluster several times its capacity and count what clients saw
(docs/benchmarks/overload.md; the short version is tests/test_overload_live.py).

The cluster (`kairos up`'s Cluster: router, P prefill and D decode workers, simulated engine) runs a
profile with a known capacity: every engine step takes `--step-s` seconds, and each prompt is one
prefill token budget (`--budget` tokens), so each prefill worker prefills one prompt per step; the
TBT SLO is one no chunk fits in, so every request takes the prefill path (decode workers never
prefill in place). With the decode guard on (`--decode-guard on`, as shipped) no decode step fits
that SLO either, so each decode worker decodes one request at a time: the decode pool is short
(a decode-pool overload, `decode_busy`), capacity min(P / step_s, D / (max_tokens x step_s)); with
it off, the prefill pool is short (`prefill_busy`), capacity P / step_s. Open-loop streamed
completions arrive at `--load` x that rate (evenly spaced) for `--duration` seconds, each tried
once, with distinct prompts (no prefix-cache hits), and each ends in one bucket:

    served     200, a full stream ([DONE], a finish_reason); its TTFT (request sent -> first token)
    refused    429 with a Retry-After and an x-kairos-error, before any byte of a stream (at once, or
               after waiting at the router until its budget ran out: `refused_after_wait`)
    failed     anything else: another status, a 429 without Retry-After, an error event inside a
               stream, a dropped or hung connection

After the burst the cluster must serve again: once nothing is in flight, one request is sent alone.
Then `--batches` batched requests of `max_batch` prompts each are sent one after another (each is
admitted sub-request by sub-request until the cluster is predicted full, then refused whole). The
router's RSS is read before the burst, after it and after the batches.

    python -m bench.overload --prefill 2 --decode 2 --step-s 1.0 --load 5 --duration 60 --out o.json
    python -m bench.overload --decode-guard off ...   # the prefill-pool overload
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import msgspec

from common.perf_model import load_profile, save_profile
from kairos.up import Cluster, ClusterSpec

NO_CHUNK_FITS = "0.0001"  # TBT SLO, seconds: no chunk schedule fits, so every request takes the prefill path
# With the decode guard on, as shipped (KAIROS_DECODE_ROOM true, decode_beta 0.95): under that SLO no
# decode step fits either, so each decode worker takes one request at a time (the first on an idle worker
# has no residents' SLO to keep) and the decode pool is what is short: a decode-pool overload (`decode_busy`)
GUARD_ENV = {"KAIROS_TBT_SLO": NO_CHUNK_FITS}
# ... and with the guard off, the prefill pool is what is short: a prefill-pool overload (`prefill_busy`)
NO_CHUNK_ENV = GUARD_ENV | {"KAIROS_DECODE_ROOM": "false"}


def capacity_rps(prefill: int, decode: int, step_s: float, max_tokens: int, guard: bool) -> float:
    """Requests per second the cluster serves: each prefill worker prefills one prompt a step; with
    the decode guard on, each decode worker also decodes one request at a time, max_tokens steps."""
    cap = prefill / step_s
    return min(cap, decode / (max(1, max_tokens) * step_s)) if guard else cap


WAITED_S = 0.5  # a refusal answered later than this came after a wait at the router, not at the door


@dataclass
class Outcome:
    kind: str                  # served, refused or failed
    status: int = 0
    detail: str = ""           # failed: what happened; refused: x-kairos-error
    sent_at: float = 0.0       # seconds since the load began
    answer_s: float = 0.0      # request sent -> status line
    ttft_s: float | None = None
    retry_after: str | None = None
    stream_bytes: int = 0      # body bytes of a refused answer that were stream events (must be 0)


def step_profile(path: Path, step_s: float, budget: int) -> str:
    """The `fast` profile with every step `step_s` seconds and a prefill budget of `budget` tokens."""
    fast = load_profile("fast")
    prof = msgspec.structs.replace(fast, name=f"steps-{step_s:g}s", prefill_token_budget=budget,
                                   model=msgspec.structs.replace(fast.model, a0=step_s, a3=0.0))
    save_profile(prof, path)
    return str(path)


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object], t0: float) -> Outcome:
    sent = time.monotonic()
    out = Outcome(kind="failed", sent_at=sent - t0)
    try:
        async with client.stream("POST", url, json=body) as r:
            out.status, out.answer_s = r.status_code, time.monotonic() - sent
            if r.status_code != 200:
                raw = await r.aread()
                out.stream_bytes = raw.count(b"data:")
                out.retry_after = r.headers.get("retry-after")
                out.detail = r.headers.get("x-kairos-error", "?")
                ok = (r.status_code == 429 and out.retry_after is not None and out.retry_after.isdigit()
                      and int(out.retry_after) >= 1 and not out.stream_bytes)
                out.kind = "refused" if ok else "failed"
                return out
            finish = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.kind, out.detail = ("served", "") if finish else ("failed", "stream:no_finish")
                    return out
                ev = json.loads(line[6:])
                if "error" in ev:
                    out.detail = f"stream:{ev.get('kairos_error') or ev['error'].get('code')}"
                    return out
                ch = ev["choices"][0] if ev.get("choices") else None
                if ch is not None and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - sent
                if ch and ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            out.detail = "stream:ended_silently"
    except (httpx.ConnectError, httpx.ConnectTimeout):
        out.detail = "connection_refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        out.detail = "dropped"
    except httpx.ReadTimeout:
        out.detail = "hung"
    return out


async def offer(api: str, *, rate: float, duration: float, budget: int, max_tokens: int, seed: int = 1,
                timeout_s: float = 120.0) -> list[Outcome]:
    """Open-loop streamed completions at `rate` per second for `duration` seconds; every outcome."""
    rng = random.Random(seed)
    url = api + "/v1/completions"
    tasks: list[asyncio.Task[Outcome]] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits) as client:
        t0 = time.monotonic()
        n = int(rate * duration)
        for i in range(n):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            prompt = [10 + rng.randrange(900) for _ in range(budget)]  # distinct: no prefix-cache hits
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            tasks.append(asyncio.create_task(one(client, url, body, t0)))
        await asyncio.wait(tasks, timeout=timeout_s + 10)
    return [t.result() if t.done() else Outcome(kind="failed", detail="hung") for t in tasks]


async def settle_then_probe(api: str, budget: int, max_tokens: int, timeout_s: float = 60.0) -> Outcome:
    """Wait until nothing is in flight at the router, then send one request alone."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            s = (await c.get(api + "/v1/kairos/stats")).json()
            if s["in_flight"] == 0:
                break
            await asyncio.sleep(0.2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0)) as client:
        body = {"prompt": [7] * budget, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        return await one(client, api + "/v1/completions", body, time.monotonic())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def batches(api: str, n: int, size: int, budget: int) -> dict[str, int]:
    """`n` batched completions of `size` prompts each, one after another: their statuses."""
    got: Counter[str] = Counter()
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as c:
        for _ in range(n):
            prompts = [[10 + rng.randrange(900) for _ in range(budget)] for _ in range(size)]
            r = await c.post(api + "/v1/completions", json={"prompt": prompts, "max_tokens": 1})
            got[f"{r.status_code}:{r.headers.get('x-kairos-error', '')}"] += 1
    return dict(got)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def summarize(outcomes: list[Outcome], budget_s: float | None = None) -> dict[str, object]:
    """The counts and times of `outcomes`; with `budget_s`, how many were served past it (TTFT as the
    client measures it: the router's own adds the HTTP path's milliseconds)."""
    kinds = Counter(o.kind for o in outcomes)
    served = [o.ttft_s for o in outcomes if o.kind == "served" and o.ttft_s is not None]
    over = {} if budget_s is None else {"served_over_budget": sum(t > budget_s for t in served)}
    refused = [o for o in outcomes if o.kind == "refused"]
    return {
        "sent": len(outcomes), "served": kinds["served"], "refused": kinds["refused"], "failed": kinds["failed"],
        **over,
        "failed_how": dict(Counter(o.detail or str(o.status) for o in outcomes if o.kind == "failed")),
        "refused_codes": dict(Counter(o.detail for o in refused)),
        # refused after waiting at the router (its wait let in, its budget ran out before it was placed)
        "refused_after_wait": sum(o.answer_s > WAITED_S for o in refused),
        "retry_after_s": dict(sorted(Counter(int(o.retry_after or 0) for o in refused).items())),
        "refused_answer_s": {"p50": pct([o.answer_s for o in refused], 0.5),
                             "p99": pct([o.answer_s for o in refused], 0.99),
                             "max": round(max((o.answer_s for o in refused), default=0.0), 3)},
        "served_ttft_s": {"p50": pct(served, 0.5), "p90": pct(served, 0.9), "p99": pct(served, 0.99),
                          "max": round(max(served, default=0.0), 3),
                          "mean": round(statistics.fmean(served), 3) if served else None},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--step-s", type=float, default=1.0, help="every engine step, seconds")
    p.add_argument("--budget", type=int, default=256, help="prefill token budget = prompt tokens")
    p.add_argument("--load", type=float, default=5.0, help="offered load, times the cluster's capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ttft-slo", type=float, default=5.0, help="the router's TTFT SLO, seconds")
    p.add_argument("--queue-budget", type=float, default=0.0, help="the router's queue_budget (0: the TTFT SLO)")
    p.add_argument("--decode-guard", choices=("on", "off"), default="on",
                   help="the router's decode guard (KAIROS_DECODE_ROOM; on as shipped): on, the decode pool is "
                        "what is short; off, the prefill pool")
    p.add_argument("--log-requests", action="store_true",
                   help="the router logs request_done per request (with request_waiting's predicted_ttft_s: "
                        "how each admitted wait was predicted and how it went)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batches", type=int, default=10, help="batched requests of max_batch prompts after the burst")
    p.add_argument("--out", help="write the result as JSON here (and every outcome beside it, .rows.json)")
    a = p.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="overload-")
    profile = step_profile(Path(log_dir) / "steps.json", a.step_s, a.budget)
    guard = a.decode_guard == "on"
    capacity = capacity_rps(a.prefill, a.decode, a.step_s, a.max_tokens, guard)
    spec = ClusterSpec.ephemeral(prefill=a.prefill, decode=a.decode, profile=profile, kv_transport="modeled",
                                 monitor=False, log_dir=log_dir, policy="kairos",
                                 router_env=(GUARD_ENV if guard else NO_CHUNK_ENV)
                                 | {"KAIROS_TTFT_SLO": str(a.ttft_slo), "KAIROS_QUEUE_BUDGET": str(a.queue_budget),
                                    "KAIROS_LOG_REQUESTS": str(a.log_requests).lower()})
    cluster = Cluster(spec)
    try:
        cluster.start(timeout=60)
        proc = cluster.services["router"].proc
        assert proc is not None
        rss = {"before": rss_mb(proc.pid)}
        t0 = time.monotonic()
        outcomes = asyncio.run(offer(spec.api, rate=capacity * a.load, duration=a.duration, budget=a.budget,
                                     max_tokens=a.max_tokens, seed=a.seed))
        burst_s = time.monotonic() - t0
        probe = asyncio.run(settle_then_probe(spec.api, a.budget, a.max_tokens))
        rss["after_burst"] = rss_mb(proc.pid)
        batched = asyncio.run(batches(spec.api, a.batches, 256, a.budget))
        asyncio.run(settle_then_probe(spec.api, a.budget, a.max_tokens))
        rss["after_batches"] = rss_mb(proc.pid)
        stats = httpx.get(spec.api + "/v1/kairos/stats", timeout=10).json()
    finally:
        cluster.stop(20)
    budget_s = a.queue_budget if a.queue_budget > 0 else a.ttft_slo
    result: dict[str, object] = {"capacity_rps": capacity, "offered_rps": capacity * a.load,
                                 "burst_s": round(burst_s, 1), **summarize(outcomes, budget_s), "after": asdict(probe),
                                 "router_counts": stats["counts"], "batches": batched, "router_rss_mb": rss,
                                 "load_avg": os.getloadavg(), "logs": log_dir, "args": vars(a)}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
        Path(a.out).with_suffix(".rows.json").write_text(json.dumps([asdict(o) for o in outcomes]))
    return 0 if result["failed"] == 0 and probe.kind == "served" else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise SystemExit(main())
