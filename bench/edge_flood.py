"""`python -m bench.edge_flood`: request latency with and without 5,000 silent and 500 slowloris
connections held open against the router (services/router/edge.py), in one run.

A 1 prefill + 1 decode cluster on the `fast` profile; 100 sequential small requests on one
keep-alive connection per pass; passes alternate: without the flood, with it, without, with, ...
Prints one JSON object: per pass kind the median of the passes' p50 and p99 (ms), and the ratio
flood/no flood. The absolute figures move with the machine's load; the ratio is the result.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kairos.up import Cluster, ClusterSpec

REQ = {"prompt": "hello", "max_tokens": 3}


def _pass(api: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=api, timeout=30) as client:
        for _ in range(n):
            t = time.perf_counter()
            r = client.post("/v1/completions", json=REQ)
            out.append(time.perf_counter() - t)
            if r.status_code != 200:
                raise SystemExit(f"request failed: {r.status_code} {r.text[:200]}")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.edge_flood", description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=5000, help="silent connections (default 5000)")
    ap.add_argument("--slowloris", type=int, default=500, help="connections trickling headers (default 500)")
    ap.add_argument("--requests", type=int, default=100, help="requests per pass (default 100)")
    ap.add_argument("--pairs", type=int, default=3, help="alternated pairs of passes (default 3)")
    a = ap.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp(prefix="kairos-edge-"))
    c = Cluster(ClusterSpec.ephemeral(log_dir=str(tmp), prefill=1, decode=1, profile="fast", monitor=False))
    c.start(timeout=60)
    passes: dict[str, list[list[float]]] = {"quiet": [], "flood": []}
    try:
        port = c.spec.http_port
        _pass(c.spec.api, 20)  # warm-up
        for _ in range(a.pairs):
            passes["quiet"].append(_pass(c.spec.api, a.requests))
            socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(a.idle)]
            for _ in range(a.slowloris):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kairos\r\n")
                socks.append(s)
            time.sleep(1.0)  # let the router accept them all: the flood held, not its arrival, is measured
            passes["flood"].append(_pass(c.spec.api, a.requests))
            for s in socks:
                s.close()
            time.sleep(1.0)
    finally:
        c.stop(15)

    def q(xs: list[float], f: float) -> float:
        return xs[min(len(xs) - 1, int(len(xs) * f))] * 1e3

    out: dict[str, object] = {"idle": a.idle, "slowloris": a.slowloris, "requests_per_pass": a.requests,
                              "pairs": a.pairs}
    for kind, ps in passes.items():
        out[f"{kind}_p50_ms"] = statistics.median(q(p, 0.5) for p in ps)
        out[f"{kind}_p99_ms"] = statistics.median(q(p, 0.99) for p in ps)
        out[f"{kind}_p50_ms_passes"] = [round(q(p, 0.5), 2) for p in ps]
    out["p50_ratio"] = out["flood_p50_ms"] / out["quiet_p50_ms"]  # type: ignore[operator]
    out["p99_ratio"] = out["flood_p99_ms"] / out["quiet_p99_ms"]  # type: ignore[operator]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
