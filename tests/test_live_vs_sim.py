"""bench/live_vs_sim.py's reading of a live run: the router's records on the largest gap (issue 44
compares every gap with the SLO), where the client's misses come from, and the live router's
settings for a time-scaled scenario."""

from __future__ import annotations

import pytest

from bench.live_vs_sim import gap_sources, router_view, scaled_env
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


@pytest.mark.parametrize("k", [1.0, 4.0])
def test_scaled_env_stretches_the_routers_scenario_settings(k: float) -> None:
    base, got = config.RouterConfig(), config.load(config.RouterConfig, env=scaled_env(k))
    for name in (*ROUTER_PERIODS, "ttft_slo", "tbt_slo", "heartbeat_interval", "kv_wait_timeout", "request_timeout"):
        assert getattr(got, name) == pytest.approx(k * getattr(base, name)), name
    assert got.liveness == base.liveness  # in heartbeats: the liveness window stretches with them
