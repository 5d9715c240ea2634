"""The router core's CPU per heartbeat while requests wait (held by late binding), with the
heartbeat retry gap (`heartbeat_retry_ms`) on or off, in process: a Kairos core with 1 prefill and
8 decode workers, 100 prompts of 6,000 tokens submitted behind a deep prefill queue, then 1,600
decode heartbeats SPACING seconds apart (0.0004: the rate of a 256-worker fleet's heartbeats; 0.01:
a small fleet's). The shell's timer (the `retry_later` hook) is played by the loop below.

    python -m bench.held_retry GAP_MS SPACING_S     # e.g. 10 0.0004, then 0 0.0004
"""

from __future__ import annotations

import argparse
import sys
import time

from common import config
from common import messages as m
from common.router_core.core import RouterCore
from common.router_core.ports import Hooks

NOW = 1000.0


class _Outbox:
    """Sends and publishes go nowhere (the core's `Outbox` port)."""

    def send(self, identity: bytes, msg: m.Msg) -> bool:
        return True

    def publish(self, msg: m.Msg) -> None:
        pass


def _hello(worker_id: str, role: m.Role) -> m.Hello:
    return m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=worker_id, role=role, incarnation=f"inc-{worker_id}",
                   engine="sim", model="kairos-sim", token_budget=2048, kv_capacity_tokens=100_000, max_batch=64)


def _dhb(w: str, seq: int) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=w, incarnation=f"inc-{w}", seq=seq, batch=150, kv_tokens=50_000,
                             kv_free_tokens=50_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                             deflections=0, strictest_tbt_slo=0.1, token_budget=2048)


def _phb(seq: int) -> m.PrefillHeartbeat:
    return m.PrefillHeartbeat(worker_id="prefill-0", incarnation="inc-prefill-0", seq=seq, queued_tokens=400_000,
                              queued_requests=60, token_budget=8192)


def run(gap_ms: float, spacing: float) -> tuple[float, int]:
    """(CPU µs per heartbeat, requests still waiting at the end)."""
    cfg = config.load(config.RouterConfig, env={},
                      overrides={"policy": "kairos", "profile": "fast", "heartbeat_retry_ms": gap_ms})
    due: list[float] = []
    now = NOW
    r = RouterCore(cfg, _Outbox(), hooks=Hooks(retry_later=lambda d: due.append(now + d)))
    ws = [f"decode-{i}" for i in range(8)]
    for wid, role in [("prefill-0", "prefill"), *[(w, "decode") for w in ws]]:
        r.on_message(wid.encode(), _hello(wid, role), now)  # type: ignore[arg-type]
    r.on_message(b"prefill-0", _phb(1), now)
    for w in ws:
        r.on_message(w.encode(), _dhb(w, 1), now)
    for i in range(100):
        r.submit(list(range(i, i + 6000)), m.Sampling(max_tokens=64), now)
    n = 0
    t0 = time.process_time()
    for k in range(2, 202):
        for w in ws:
            now += spacing
            if due and now >= min(due):  # the shell's timer: the folded heartbeats' retry
                due.clear()
                r.retry_now(now, turn=True)
            r.on_message(w.encode(), _dhb(w, k), now)
            n += 1
    return (time.process_time() - t0) * 1e6 / n, len(r.waiting.queue)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.held_retry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gap_ms", type=float, help="heartbeat_retry_ms (0: every heartbeat retries the wait queue)")
    p.add_argument("spacing_s", type=float, help="seconds between two heartbeats (0.0004: a 256-worker fleet)")
    a = p.parse_args(argv)
    gap_ms, spacing = a.gap_ms, a.spacing_s
    us, waiting = run(gap_ms, spacing)
    print(f"heartbeat_retry_ms {gap_ms:g}, heartbeats {spacing * 1e3:.1f} ms apart: {us:.0f} µs of CPU per "
          f"heartbeat, {waiting} requests waiting at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
