"""The router's memory after a spike (issue 48): RSS (VmRSS) of a local cluster's router before a
burst, at its peak, and 5 s after it has fallen idle. The burst: `streams` streamed requests with
long prompts (`prompt` tokens) sent at once to a 1 prefill + 2 decode cluster (simulated engine,
`fast` profile). Run before and after a change to compare (docs/benchmarks/stranded.md):

    nice -n 10 .venv/bin/python -m tests.chaos.memory_spike --streams 400 --prompt 6000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

from kairos.up import Cluster, ClusterSpec
from tests.chaos.stranded import rss_mb


async def burst(url: str, streams: int, prompt: int) -> dict[str, object]:
    """Each stream's outcome: its status, or `200 error` when an error event came in a 200 stream
    (a failure the status alone hides), or the client's exception; and the slowest first byte and
    end of the 200 streams, seconds from the burst's start."""
    outcome: dict[str, int] = {}
    first: list[float] = []
    ends: list[float] = []
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=16)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as client:

        async def one(i: int) -> None:
            body = {"prompt": [1000 + (i + k) % 997 for k in range(prompt)], "max_tokens": 16, "stream": True,
                    "ignore_eos": True}
            try:
                async with client.stream("POST", url, json=body) as r:
                    key = str(r.status_code)
                    got = False
                    async for line in r.aiter_lines():
                        if not got and line.startswith("data:"):
                            got = True
                            if r.status_code == 200:
                                first.append(loop.time() - t0)
                        if r.status_code == 200 and line.startswith("data:") and '"error"' in line:
                            key = "200 error"
                    if key == "200":
                        ends.append(loop.time() - t0)
            except httpx.HTTPError as e:
                key = type(e).__name__
            outcome[key] = outcome.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(streams)))
    return {**outcome, "first_byte_max_s": round(max(first, default=0.0), 2),
            "end_max_s": round(max(ends, default=0.0), 2)}


async def run(log_dir: Path, streams: int, prompt: int, rounds: int) -> dict[str, object]:
    spec = ClusterSpec.ephemeral(log_dir=str(log_dir), prefill=1, decode=2, profile="fast", policy="kairos",
                                 monitor=False, router_env={"KAIROS_MAX_IN_FLIGHT": str(streams * 2)})
    c = Cluster(spec)
    c.start(timeout=60)
    try:
        proc = c.services["router"].proc
        assert proc is not None
        before = rss_mb(proc.pid)
        peaks, afters, outcomes = [], [], []
        for _ in range(rounds):
            task = asyncio.create_task(burst(spec.api + "/v1/completions", streams, prompt))
            peak = 0.0
            while not task.done():
                peak = max(peak, rss_mb(proc.pid))
                await asyncio.sleep(0.1)
            outcomes.append(task.result())
            await asyncio.sleep(5.0)
            peaks.append(round(peak, 1))
            afters.append(round(rss_mb(proc.pid), 1))
        return {"streams": streams, "prompt_tokens": prompt, "rss_mb_before": round(before, 1),
                "rss_mb_peak": peaks, "rss_mb_idle_5s_after": afters, "outcomes": outcomes}
    finally:
        c.stop(20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.memory_spike", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--prompt", type=int, default=6000, help="prompt tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kairos-memory-") as d:
        print(json.dumps(asyncio.run(run(Path(d), a.streams, a.prompt, a.rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
