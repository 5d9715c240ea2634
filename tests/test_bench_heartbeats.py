"""`kairos bench-router --phases heartbeats`: a router alone with fake workers heartbeating over real
bus connections (loopback); it must report the heartbeats it sent and the router's CPU for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.heartbeat_load import parse_workers
from bench.router_throughput import main


def test_parse_workers() -> None:
    assert parse_workers("128") == (128, 128)
    assert parse_workers("8+2") == (8, 2)
    with pytest.raises(ValueError):
        parse_workers("0+0")


def test_heartbeats_phase_alone(tmp_path: Path) -> None:
    out = tmp_path / "hb.json"
    assert main(["--phases", "heartbeats", "--workers", "3+2", "--heartbeat-interval", "0.05", "--step", "1",
                 "--router-cpus", "", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["heartbeats"]
    assert (got["prefill"], got["decode"], got["workers"]) == (3, 2, 5)
    # 5 workers every 50 ms: at most 100 a second (less what a descheduled sender did not send: how
    # much depends on the machine's load, so no lower bound but "some")
    assert 0 < got["heartbeats_per_s"] <= 110
    assert got["router_cores"] > 0 and got["router_us_per_heartbeat"] > 0
    # the figures agree with each other: CPU per heartbeat = cores / heartbeats a second (rounding)
    assert got["router_us_per_heartbeat"] == pytest.approx(got["router_cores"] / got["heartbeats_per_s"] * 1e6,
                                                           rel=0.05)


def test_unknown_phase_is_refused() -> None:
    assert main(["--phases", "heartbeat"]) == 2
