"""A decode worker killed, then the router frozen past the bus heartbeat timeout, under 30
streams: every stream's text is the simulated engine's own, none missing or repeated (before
TokenItem.pos and the worker's hold, every stream lost 7-80 tokens in about half of the runs and
still ended "length"). Real processes on loopback, about 20 s; more runs: `python -m
tests.chaos.transit --runs 6` (docs/benchmarks/transit.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.transit import run

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


async def test_no_token_is_lost_to_a_broken_bus_connection(tmp_path: Path) -> None:
    result = await run(tmp_path)
    print(result)
    assert result["bad"] == 0, result
    assert result["router_events"]["router_stalled"] >= 1  # the freeze did outlast the heartbeat timeout
