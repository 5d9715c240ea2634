"""A frozen router strands nothing (issue 48): a local cluster (`kairos up`'s Cluster, 1 prefill
+ 2 decode workers, simulated engine timed like a100-dsv2-lite) under streamed load while the
router is stopped (SIGSTOP) for 10 s, `freezes` times. Long enough for the workers' ZeroMQ
heartbeats to time out (3 s), so they reconnect under their ids while the router still holds
their old connections: the case where a send fails and the worker registers again before the
router's next liveness check. Every request must end, within its deadline, with its tokens or a
clear error; before the fix some waited without a token until the request deadline.

Each round sends `streams` streamed requests over 2 s and freezes the router 1 s in, so some are
mid-stream and the rest arrive during the freeze. The router's request deadline is set to
`deadline` s; a request still open past it, one ended by `deadline_exceeded`, or one that ends
without its tokens or an error fails the check. Also reports the router's RSS (VmRSS) before the
load, after it, and 10 s later.

    nice -n 10 .venv/bin/python -m tests.chaos.stranded --streams 200 --freezes 5   # docs/benchmarks/stranded.md
tests/chaos/test_stranded_live.py runs it with 50 streams and 2 freezes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kairos.up import Cluster, ClusterSpec
from tests.chaos.load import Tally, run_load

WORKERS = {"prefill-0", "decode-0", "decode-1"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run(log_dir: Path, *, streams: int, freezes: int, freeze_s: float, deadline: float,
              seed: int = 48, log_level: str = "info") -> dict[str, Any]:
    spec = ClusterSpec.ephemeral(log_dir=str(log_dir), prefill=1, decode=2, profile="a100-dsv2-lite",
                                 policy="kairos", monitor=False,
                                 router_env={"KAIROS_REQUEST_TIMEOUT": str(deadline)}, log_level=log_level)
    c = Cluster(spec)
    c.start(timeout=60)
    try:
        proc = c.services["router"].proc
        assert proc is not None
        pid = proc.pid
        rss0 = rss_mb(pid)
        rounds = []
        total = Tally()
        for i in range(freezes):
            tally = Tally()
            t0 = time.monotonic()
            load = asyncio.create_task(run_load(spec.api + "/v1/completions", rate=streams / 2.0, duration=6.0,
                                                count=streams, seed=seed + i, retry_for=freeze_s + 10,
                                                hang_after=deadline + 15, tally=tally))
            await asyncio.sleep(1.0)
            c.signal("router", signal.SIGSTOP)
            await asyncio.sleep(freeze_s)
            c.signal("router", signal.SIGCONT)
            await load
            elapsed = time.monotonic() - t0
            await asyncio.to_thread(c.wait_registered, WORKERS, 30.0)
            row = {"round": i + 1, "sent": tally.sent, "accepted": tally.accepted, "completed": tally.completed,
                   "failed": tally.failed, "lost": tally.lost, "hung": tally.hung, "retries": tally.retries,
                   "errors": dict(tally.errors), "seconds": round(elapsed, 1),
                   "ttft_max_s": round(max(tally.ttft, default=0.0), 2)}
            rounds.append(row)
            print(json.dumps(row), flush=True)
            for k in ("sent", "accepted", "completed", "failed", "lost", "hung", "retries"):
                setattr(total, k, getattr(total, k) + getattr(tally, k))
            total.errors.update(tally.errors)
        rss1 = rss_mb(pid)
        await asyncio.sleep(10)
        rss2 = rss_mb(pid)
        log = (log_dir / "router.log").read_text()
        events = Counter(json.loads(ln).get("event") for ln in log.splitlines() if ln.startswith("{"))
        return {"streams": streams, "freezes": freezes, "freeze_s": freeze_s, "deadline_s": deadline,
                "rounds": rounds,
                "total": {"sent": total.sent, "accepted": total.accepted, "completed": total.completed,
                          "failed": total.failed, "lost": total.lost, "hung": total.hung,
                          "errors": dict(total.errors)},
                "router_rss_mb": {"before": round(rss0, 1), "after": round(rss1, 1), "after_10s": round(rss2, 1)},
                "router_events": {k: events[k] for k in ("send_to_worker_failed", "request_redispatched",
                                                         "request_orphaned", "worker_lost", "router_stalled",
                                                         "dispatch_lost_in_transit", "request_failed")}}
    finally:
        c.stop(20)


def stranded(result: dict[str, Any]) -> list[str]:
    """What the check refuses: requests hung or lost, or ended only by their deadline."""
    t = result["total"]
    bad = []
    if t["hung"] or t["lost"]:
        bad.append(f"{t['hung']} hung, {t['lost']} lost: {t['errors']}")
    if t["errors"].get("deadline_exceeded"):
        bad.append(f"{t['errors']['deadline_exceeded']} ended only by their deadline (stranded)")
    if t["completed"] + t["failed"] + t["lost"] + t["hung"] != t["sent"]:
        bad.append(f"not every request accounted for: {t}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.stranded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=200, help="streamed requests per round (default 200)")
    p.add_argument("--freezes", type=int, default=5, help="rounds, one router freeze each (default 5)")
    p.add_argument("--freeze-s", type=float, default=10.0, help="how long the router is stopped (default 10)")
    p.add_argument("--deadline", type=float, default=60.0, help="the router's request_timeout, s (default 60)")
    p.add_argument("--log-level", default="info", help="every service's (debug: each request's way, to find one "
                                                      "that stranded; default info)")
    p.add_argument("--keep-logs", metavar="DIR", help="write the services' logs here (default: a temporary "
                                                      "directory, removed)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kairos-stranded-") as d:
        if a.keep_logs:
            Path(a.keep_logs).mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(Path(a.keep_logs or d), streams=a.streams, freezes=a.freezes, freeze_s=a.freeze_s,
                                 deadline=a.deadline, log_level=a.log_level))
    print(json.dumps(result, indent=2))
    bad = stranded(result)
    for b in bad:
        print("STRANDED:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
