"""The event loop's lag: how late a service's asyncio loop wakes a task that asked to wake at a
given time (issue 47, item 7). A loop blocked by a long callback (a huge request parsed in one go,
a slow decode of a frame, a GC pause) delays every stream and heartbeat it serves; this makes that
visible as a number instead of a `router_stalled` guess.

A small task sleeps `interval` seconds at a time and records, on each wake, actual minus expected
wake-up time. Each sample goes to the Prometheus histogram `kairos_event_loop_lag_seconds`
(label `service`: router, prefill, decode) on the default registry (the router's /metrics, a
worker's metrics port), and the worst lag since the last `take_max` to the one reader that reports
it: the router's RouterStats (once a second), a worker's heartbeats (which carry it to the router,
the monitor's dashboard and `kairos top`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Histogram

LAG = Histogram("kairos_event_loop_lag_seconds", "How late the service's event loop woke a task that asked to "
                "wake at a given time (sampled every 50 ms).", ["service"],
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))

INTERVAL_S = 0.05


class LoopLag:
    """Samples one event loop's lag. `clock` and `sleep` are the test's to replace."""

    def __init__(self, service: str, *, interval: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        self.interval = interval
        self.clock, self.sleep = clock, sleep
        self.last_s = 0.0  # the latest sample
        self.max_s = 0.0   # the worst since the last take_max
        self._hist = LAG.labels(service)

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.last_s = lag_s
        if lag_s > self.max_s:
            self.max_s = lag_s
        self._hist.observe(lag_s)

    def take_max(self) -> float:
        """The worst lag since the previous call, in seconds (then starts over)."""
        worst, self.max_s = self.max_s, 0.0
        return worst

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            expected = self.clock() + self.interval
            await self.sleep(self.interval)
            self.observe(self.clock() - expected)
