"""bench/live_vs_sim.py's reading of a live run: the router's records on the largest gap (issue 44
compares every gap with the SLO), where the client's misses come from, and the live router's
settings for a time-scaled scenario."""

from __future__ import annotations

import pytest

from bench.live_vs_sim import delivery_view, gap_sources, router_view, scaled_env
from common import config
from sim.router import ROUTER_PERIODS


def _done(rid: str, p99: float, mx: float, ttft: float = 0.5) -> dict[str, object]:
    return {"event": "request_done", "request_id": rid, "outcome": "ok", "ttft_s": ttft, "tbt_p99_s": p99,
            "tbt_max_s": mx}


def test_router_view_counts_the_largest_gap() -> None:
    log = [_done("a", 0.05, 0.09), _done("b", 0.08, 0.15), _done("c", 0.09, 0.1), {"event": "role_flip"}]
    v = router_view(log, 2.0, 0.1)
    assert v["tbt_p99_slo_attainment"] == 1.0  # every P99 gap within 100 ms
    assert v["tbt_slo_attainment"] == pytest.approx(2 / 3)  # b's largest gap is not
    assert v["slo_attainment"] == pytest.approx(2 / 3)


def test_gap_sources_splits_client_misses_by_what_the_router_saw() -> None:
    log = [_done("a", 0.05, 0.09), _done("b", 0.08, 0.15), _done("c", 0.05, 0.08)]
    records = [{"request_id": "a", "error": None, "gaps": [0.05, 0.2]},   # router fine, client late
               {"request_id": "b", "error": None, "gaps": [0.05, 0.16]},  # the router saw it too
               {"request_id": "c", "error": None, "gaps": [0.05, 0.09]},  # no miss
               {"request_id": "d", "error": "incomplete", "gaps": [0.5]}]
    g = gap_sources(records, log, 0.1)
    assert (g["client_misses"], g["joined"], g["router_too"], g["client_only"]) == (2, 2, 1, 1)
    assert g["client_minus_router_max_gap_p90"] == pytest.approx(0.11)


def test_gap_sources_splits_client_only_misses_at_the_router_s_socket_write() -> None:
    """With the router's write gaps (`write_gap_max_s`): a miss the router's write already shows
    (router loop or write) against one that came after the write (network, client)."""
    log = [{**_done("a", 0.05, 0.09), "write_gap_max_s": 0.092},   # written on time: the client read late
           {**_done("b", 0.05, 0.09), "write_gap_max_s": 0.104}]   # the write itself late
    records = [{"request_id": "a", "error": None, "gaps": [0.05, 0.105]},
               {"request_id": "b", "error": None, "gaps": [0.05, 0.106]}]
    g = gap_sources(records, log, 0.1)
    assert (g["client_only"], g["with_write_gaps"], g["write_past_slo"]) == (2, 2, 1)
    assert g["client_minus_write_max_gap_p90"] == pytest.approx(0.013)
    assert g["write_minus_router_max_gap_p90"] == pytest.approx(0.014)


def test_delivery_view_reads_the_router_s_allowance_lines() -> None:
    log = [{"event": "delivery_allowance", "allowance_ms": 0.0, "configured_ms": 5.0, "measured_ms": 0.0},
           {"event": "delivery_allowance", "allowance_ms": 9.0, "configured_ms": 5.0, "measured_ms": 4.0,
            "samples": 4096, "plan_tbt_ms": 91.0},
           {"event": "delivery_allowance", "allowance_ms": 7.5, "configured_ms": 5.0, "measured_ms": 2.5,
            "samples": 4096, "plan_tbt_ms": 92.5}]
    v = delivery_view(log)
    assert (v["configured_ms"], v["measured_ms_max"], v["allowance_ms_max"]) == (5.0, 4.0, 9.0)
    assert v["last"]["plan_tbt_ms"] == 92.5 and delivery_view([]) == {}


@pytest.mark.parametrize("k", [1.0, 4.0])
def test_scaled_env_stretches_the_routers_scenario_settings(k: float) -> None:
    base, got = config.RouterConfig(), config.load(config.RouterConfig, env=scaled_env(k))
    for name in (*ROUTER_PERIODS, "ttft_slo", "tbt_slo", "heartbeat_interval", "kv_wait_timeout", "request_timeout"):
        assert getattr(got, name) == pytest.approx(k * getattr(base, name)), name
    assert got.liveness == base.liveness  # in heartbeats: the liveness window stretches with them
