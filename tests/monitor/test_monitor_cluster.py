"""The monitor in a real local cluster: load down both routes, then /metrics, /api/state, kairos top."""

from __future__ import annotations

import httpx
import pytest

from kairos.up import Cluster
from services.monitor import top
from tests.monitor.conftest import (
    monitor_url,
    parse_metrics,
    send_burst,
    value,
    wait_until,
    with_name,
)

pytestmark = pytest.mark.timeout(180)


def metrics(c: Cluster) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(monitor_url(c) + "/metrics", timeout=5.0)
    r.raise_for_status()
    return parse_metrics(r.text)


def test_metrics_under_a_mixed_load(monitored_cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    c = monitored_cluster
    routes = send_burst(c.spec.api, n_long=8, n_short=6) + send_burst(c.spec.api, n_long=4, n_short=4)
    assert set(routes) == {"deflect", "disagg"}, routes

    def all_counted() -> bool:
        return sum(with_name(metrics(c), "kairos_requests_total").values()) >= len(routes)
    wait_until(all_counted, 15, "the monitor to count every request")
    s = metrics(c)

    decisions = with_name(s, "kairos_routing_decisions_total")
    by_route: dict[str, float] = {}
    for labels, n in decisions.items():
        by_route[dict(labels)["route"]] = by_route.get(dict(labels)["route"], 0) + n
        assert dict(labels)["reason"]
    assert by_route.get("deflect", 0) > 0 and by_route.get("disagg", 0) > 0, decisions
    # one decision per dispatch: a deflection a decode worker's admission refused (more likely with
    # late binding, which releases held requests together) or a re-dispatch is decided again
    counts = httpx.get(c.spec.api + "/v1/kairos/stats", timeout=5.0).json()["counts"]
    again = counts.get("deflect_rejected", 0) + counts.get("redispatched", 0)
    assert len(routes) <= sum(by_route.values()) <= len(routes) + again, (by_route, counts)
    for route in ("deflect", "disagg"):
        assert (value(s, "kairos_time_to_first_token_seconds_count", route=route) or 0) > 0
        assert (value(s, "kairos_e2e_request_latency_seconds_count", route=route) or 0) > 0
        assert (value(s, "kairos_ttft_prediction_error_seconds_count", route=route) or 0) > 0
        assert (value(s, "kairos_requests_total", route=route, outcome="ok") or 0) > 0
    assert (value(s, "kairos_routing_decision_seconds_count") or 0) == sum(by_route.values())
    assert value(s, "kairos_workers", role="prefill") == 2 and value(s, "kairos_workers", role="decode") == 2
    for w in ("decode-0", "decode-1"):
        assert value(s, "kairos_worker_decode_batch", worker=w, role="decode") is not None
        assert value(s, "kairos_worker_kv_cache_usage_perc", worker=w, role="decode") is not None
        assert value(s, "kairos_worker_deflections_in_flight", worker=w, role="decode") is not None
        assert (value(s, "kairos_worker_step_seconds", worker=w, role="decode", stat="p50") or 0) > 0
    for w in ("prefill-0", "prefill-1"):
        assert value(s, "kairos_worker_prefill_queue_tokens", worker=w, role="prefill") is not None
    assert value(s, "kairos_telemetry_bad_frames_total") == 0

    state = httpx.get(monitor_url(c) + "/api/state", timeout=5.0).json()
    assert state["policy"] == "kairos" and state["router"] is not None
    assert state["window"]["completed"] >= len(routes)
    assert 0 < state["window"]["deflect_ratio"] < 1
    assert {r["route"] for r in state["recent"]} == {"deflect", "disagg"}
    assert all(r["outcome"] == "ok" for r in state["recent"])

    assert top.main(["--once", "--url", monitor_url(c)]) == 0
    out = capsys.readouterr().out
    assert "decode-1" in out and "prefill-0" in out and "deflect" in out


def test_a_lost_worker_leaves_metrics(monitored_cluster: Cluster) -> None:
    c = monitored_cluster
    assert 'worker="decode-1"' in httpx.get(monitor_url(c) + "/metrics", timeout=5.0).text
    c.stop_service("decode-1", timeout=20)

    def gone() -> bool:
        text = httpx.get(monitor_url(c) + "/metrics", timeout=5.0).text
        return 'worker="decode-1"' not in text
    wait_until(gone, 20, "decode-1's series to disappear")
    s = metrics(c)
    assert value(s, "kairos_workers", role="decode") == 1
    lost = httpx.get(monitor_url(c) + "/api/state", timeout=5.0).json()["lost"]
    assert [w["worker_id"] for w in lost] == ["decode-1"]
