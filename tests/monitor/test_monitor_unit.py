"""The monitor without sockets: telemetry in, metrics text, state snapshot and HTTP routes out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client import REGISTRY
from rich.console import Console

from common import codec
from common import messages as m
from common.config import MonitorConfig
from common.sockets import TELEMETRY_TOPIC
from services.monitor import top
from services.monitor.service import Monitor
from services.monitor.state import percentile
from services.router import metrics as router_metrics
from tests.monitor.conftest import parse_metrics, value

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class RecordV2(m.RequestRecord, frozen=True, kw_only=True):  # type: ignore[misc]
    """A RequestRecord with the fields proposed in docs/observability.md (what the monitor reads
    once the router sends them)."""

    tbt_gaps_s: tuple[float, ...] = ()
    kv_bytes: int = 0
    kv_transfer_s: float | None = None
    kv_error: str = ""
    prefill_queue_s: float | None = None
    prefill_s: float | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None


def seen(worker_id: str, role: m.Role, **state: float) -> m.WorkerSeen:
    return m.WorkerSeen(worker_id=worker_id, role=role, incarnation="inc-" + worker_id, engine="sim",
                        state=state, at=T0)


def decision(rid: str, route: m.Route, reason: str, *, us: float = 50.0) -> m.DecisionRecord:
    return m.DecisionRecord(request_id=rid, policy="kairos", route=route,
                            prefill_worker="prefill-0" if route == "disagg" else None, decode_worker="decode-0",
                            reason=reason, prompt_tokens=2000, ttft_prefill_pred=0.25,
                            ttft_decode_pred=0.125 if route == "deflect" else None,
                            chunk_schedule=(1024, 976) if route == "deflect" else (), decision_us=us, at=T0)


def record(rid: str, route: m.Route | None, *, ttft: float | None, pred: float | None, outcome: str = "ok",
           kv_fallback: bool = False, cls: type[m.RequestRecord] = m.RequestRecord, **kw: Any) -> m.RequestRecord:
    return cls(request_id=rid, route=route, reason="x", prefill_worker=None, decode_worker="decode-0",
               prompt_tokens=2000, output_tokens=16, ttft_s=ttft, ttft_pred_s=pred, tbt_p50_s=0.015,
               tbt_p99_s=0.05, tbt_max_s=0.06, e2e_s=0.75, outcome=outcome, kv_fallback=kv_fallback, at=T0, **kw)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def mon(clock: Clock) -> Monitor:
    mon = Monitor(MonitorConfig(), clock=clock)
    for msg in (
        seen("prefill-0", "prefill", queued_tokens=4096, queued_requests=2, step_ms_p50=120.0),
        seen("decode-0", "decode", batch=7, kv_tokens=1000, kv_used=0.25, deflections=1, step_ms_p50=15.0,
             step_ms_max=40.0, tbt_slack_ms=12.0, waiting_kv=3),
        seen("decode-1", "decode", batch=0, kv_tokens=0, kv_used=0.0, deflections=0, step_ms_p50=0.0,
             step_ms_max=0.0, tbt_slack_ms=-1.0),
        m.RouterStats(at=T0, in_flight=5, accepted=10, completed=4, failed=1, rejected=2),
        decision("a", "deflect", "decode_faster", us=40.0),
        decision("b", "deflect", "within_alpha", us=60.0),
        decision("c", "disagg", "deflection_in_flight", us=2000.0),
        record("a", "deflect", ttft=0.125, pred=0.25),               # predicted 0.125 s too slow
        record("c", "disagg", ttft=0.5, pred=0.25, kv_fallback=True),  # 0.25 s faster than reality
        record("b", "deflect", ttft=None, pred=None, outcome="worker_lost_midstream"),
    ):
        mon.on_message(msg)
    return mon


def test_decisions_requests_and_latency_histograms(mon: Monitor) -> None:
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_routing_decisions_total", route="deflect", reason="decode_faster") == 1
    assert value(s, "kairos_routing_decisions_total", route="deflect", reason="within_alpha") == 1
    assert value(s, "kairos_routing_decisions_total", route="disagg", reason="deflection_in_flight") == 1
    assert value(s, "kairos_routing_decision_seconds_count") == 3
    assert value(s, "kairos_routing_decision_seconds_bucket", le="0.0001") == 2  # 40 and 60 µs; not 2 ms
    assert value(s, "kairos_requests_total", route="deflect", outcome="ok") == 1
    assert value(s, "kairos_requests_total", route="deflect", outcome="worker_lost_midstream") == 1
    assert value(s, "kairos_requests_total", route="disagg", outcome="ok") == 1
    assert value(s, "kairos_time_to_first_token_seconds_count", route="deflect") == 1
    assert value(s, "kairos_time_to_first_token_seconds_sum", route="disagg") == 0.5
    assert value(s, "kairos_time_to_first_token_seconds_bucket", route="disagg", le="0.25") == 0
    assert value(s, "kairos_time_to_first_token_seconds_bucket", route="disagg", le="0.5") == 1
    assert value(s, "kairos_e2e_request_latency_seconds_count", route="deflect") == 1  # failed ones excluded
    assert value(s, "kairos_request_tbt_p99_seconds_count", route="deflect") == 2
    # no gaps in today's record: one sample per request (its median gap)
    assert value(s, "kairos_inter_token_latency_seconds_count", route="deflect") == 2
    # predicted - actual: +0.125 (deflect), -0.25 (disagg): negative buckets hold the latter
    assert value(s, "kairos_ttft_prediction_error_seconds_bucket", route="disagg", le="-0.25") == 1
    assert value(s, "kairos_ttft_prediction_error_seconds_bucket", route="disagg", le="-0.5") == 0
    assert value(s, "kairos_ttft_prediction_error_seconds_bucket", route="deflect", le="0.0") == 0
    assert value(s, "kairos_ttft_prediction_error_seconds_bucket", route="deflect", le="0.25") == 1
    assert value(s, "kairos_kv_fallbacks_total", route="disagg") == 1
    assert value(s, "kairos_kv_transfer_failures_total", reason="unknown") == 1
    assert value(s, "kairos_prompt_tokens_total", route="deflect") == 4000
    assert value(s, "kairos_generation_tokens_total", route="disagg") == 16


def test_worker_gauges_router_stats_and_live_workers(mon: Monitor) -> None:
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_workers", role="prefill") == 1
    assert value(s, "kairos_workers", role="decode") == 2
    assert value(s, "kairos_worker_prefill_queue_tokens", worker="prefill-0", role="prefill") == 4096
    assert value(s, "kairos_worker_prefill_queue_requests", worker="prefill-0", role="prefill") == 2
    assert value(s, "kairos_worker_decode_batch", worker="decode-0", role="decode") == 7
    assert value(s, "kairos_worker_kv_cache_usage_perc", worker="decode-0", role="decode") == 0.25
    assert value(s, "kairos_worker_kv_cache_tokens", worker="decode-0", role="decode") == 1000
    assert value(s, "kairos_worker_deflections_in_flight", worker="decode-0", role="decode") == 1
    assert value(s, "kairos_worker_tbt_slack_seconds", worker="decode-0", role="decode") == pytest.approx(0.012)
    assert value(s, "kairos_worker_tbt_slack_seconds", worker="decode-1", role="decode") is None  # unknown: absent
    assert value(s, "kairos_worker_step_seconds", worker="decode-0", role="decode", stat="max") == 0.04
    assert value(s, "kairos_worker_step_seconds", worker="prefill-0", role="prefill", stat="p50") == 0.12
    assert value(s, "kairos_worker_state", worker="decode-0", role="decode", key="waiting_kv") == 3  # unnamed key
    assert value(s, "kairos_worker_info", worker="decode-0", role="decode", engine="sim",
                 incarnation="inc-decode-0") == 1
    assert value(s, "kairos_requests_in_flight") == 5
    assert value(s, "kairos_router_reported_requests_total", state="rejected") == 2
    assert value(s, "kairos_telemetry_messages_total", type="DecisionRecord") == 3


def test_lost_and_silent_workers_leave_no_series(mon: Monitor, clock: Clock) -> None:
    mon.on_message(m.WorkerLost(worker_id="decode-0", role="decode", reason="heartbeat timeout", at=T0))
    text = mon.metrics.render().decode()
    assert 'worker="decode-0"' not in text
    assert 'worker="decode-1"' in text
    s = parse_metrics(text)
    assert value(s, "kairos_workers", role="decode") == 1
    assert mon.snapshot()["lost"][0]["worker_id"] == "decode-0"
    # the router stops reporting everyone (it died): after the expiry, nobody is left
    clock.now += 5
    mon.on_message(seen("decode-1", "decode", batch=1))
    clock.now += 7
    text = mon.metrics.render().decode()
    assert 'worker="prefill-0"' not in text and 'worker="decode-1"' in text
    clock.now += 4
    assert 'worker="' not in mon.metrics.render().decode()


def test_proposed_record_fields_feed_their_metrics(clock: Clock) -> None:
    mon = Monitor(MonitorConfig(), clock=clock)
    mon.on_message(record("g", "deflect", ttft=0.1, pred=0.1, cls=RecordV2, tbt_gaps_s=(0.01, 0.02, 0.2),
                          ttft_slo_s=2.0, tbt_slo_s=0.1))                      # TTFT met, TBT p99 0.05 met
    mon.on_message(record("h", "disagg", ttft=3.0, pred=0.5, cls=RecordV2, kv_bytes=1 << 20, kv_transfer_s=0.02,
                          prefill_queue_s=0.5, prefill_s=0.25, kv_error="kv_timeout: no notification in 10 s",
                          kv_fallback=True,
                          ttft_slo_s=2.0, tbt_slo_s=0.1))                      # TTFT missed
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_inter_token_latency_seconds_count", route="deflect") == 3
    assert value(s, "kairos_inter_token_latency_seconds_bucket", route="deflect", le="0.01") == 1
    assert value(s, "kairos_kv_transfer_bytes_total") == 1 << 20
    assert value(s, "kairos_kv_transfer_seconds_count") == 1
    assert value(s, "kairos_kv_transfer_failures_total", reason="kv_timeout") == 1
    assert value(s, "kairos_request_queue_time_seconds_sum", route="disagg") == 0.5
    assert value(s, "kairos_request_prefill_time_seconds_sum", route="disagg") == 0.25
    assert value(s, "kairos_slo_judged_requests_total", route="disagg") == 1
    assert value(s, "kairos_slo_attained_requests_total", route="deflect", slo="both") == 1
    assert value(s, "kairos_slo_attained_requests_total", route="disagg", slo="tbt") == 1
    assert value(s, "kairos_slo_attained_requests_total", route="disagg", slo="ttft") is None
    w = mon.snapshot()["window"]
    assert w["tbt_p99"] == 0.2 and w["slo_attainment"] == 0.5


def test_frames_sequence_gaps_and_bad_payloads(clock: Clock) -> None:
    mon = Monitor(MonitorConfig(), clock=clock)
    payload = codec.encode(m.RouterStats(at=T0, in_flight=0, accepted=0, completed=0, failed=0, rejected=0))
    mon.on_frames([TELEMETRY_TOPIC, codec.pack_seq(1), payload])
    mon.on_frames([TELEMETRY_TOPIC, codec.pack_seq(5), payload])       # 2, 3, 4 dropped on the way
    mon.on_frames([TELEMETRY_TOPIC, codec.pack_seq(6), b"\xc1garbage"])
    mon.on_frames([TELEMETRY_TOPIC, payload])
    mon.on_frames([TELEMETRY_TOPIC, codec.pack_seq(1), payload])       # router restarted: not a gap
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_telemetry_missed_total") == 3
    assert value(s, "kairos_telemetry_bad_frames_total") == 2
    assert value(s, "kairos_telemetry_messages_total", type="RouterStats") == 3


def test_replicated_routers_are_numbered_apart_summed_and_shown_each(clock: Clock) -> None:
    """Two router replicas: each numbers its own telemetry (no false gaps when their frames
    interleave), their counts are summed, a silent one is named, and one gone for good is dropped."""
    mon = Monitor(MonitorConfig(telemetry="127.0.0.1:5557,127.0.0.1:5560"), clock=clock)

    def stats(in_flight: int, accepted: int) -> bytes:
        return codec.encode(m.RouterStats(at=clock.now, in_flight=in_flight, accepted=accepted, completed=0,
                                          failed=1, rejected=0))

    a, b = TELEMETRY_TOPIC + b"host:5557", TELEMETRY_TOPIC + b"host:5560"
    for seq in range(1, 4):  # interleaved: 1, 1, 2, 2, 3, 3
        mon.on_frames([a, codec.pack_seq(seq), stats(3, 10)])
        mon.on_frames([b, codec.pack_seq(seq), stats(4, 20)])
    mon.on_frames([b, codec.pack_seq(6), stats(4, 20)])  # 4 and 5 of b lost
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_telemetry_missed_total") == 2
    assert value(s, "kairos_requests_in_flight") == 7
    assert value(s, "kairos_router_reported_requests_total", state="accepted") == 30
    r = mon.snapshot()["router"]
    assert (r["accepted"], r["failed"]) == (30, 2)
    assert [x["name"] for x in r["replicas"]] == ["host:5557", "host:5560"]
    console = Console(width=200, record=True)
    console.print(top.render(mon.snapshot(), "http://m"))
    assert "2 routers ok · 7 in flight · 30 accepted" in console.export_text()
    clock.now += 20  # replica a is killed; b keeps reporting
    mon.on_frames([b, codec.pack_seq(7), stats(2, 25)])
    snap = mon.snapshot()
    assert snap["router"]["in_flight"] == 2  # a's last in-flight count is stale: not summed
    assert snap["router"]["accepted"] == 35   # its counts stay until it is forgotten
    console = Console(width=200, record=True)
    console.print(top.render(snap, "http://m"))
    assert "1 of 2 routers silent (host:5557)" in console.export_text()
    clock.now += 400
    mon.on_frames([b, codec.pack_seq(8), stats(0, 25)])
    assert [x["name"] for x in mon.snapshot()["router"]["replicas"]] == ["host:5560"]


def test_a_router_back_under_another_name_replaces_the_silent_one(clock: Clock) -> None:
    """A recreated router container has a new host name: with one router configured, its stats
    replace the old name's at once (no "1 of 2 routers silent" for a router that no longer
    exists); with two, only the stalest name goes."""
    def stats(accepted: int) -> bytes:
        return codec.encode(m.RouterStats(at=clock.now, in_flight=0, accepted=accepted, completed=0, failed=0,
                                          rejected=0))

    one = Monitor(MonitorConfig(), clock=clock)
    one.on_frames([TELEMETRY_TOPIC + b"old:5557", codec.pack_seq(1), stats(10)])
    clock.now += 3
    one.on_frames([TELEMETRY_TOPIC + b"new:5557", codec.pack_seq(1), stats(2)])
    r = one.snapshot()["router"]
    assert [x["name"] for x in r["replicas"]] == ["new:5557"] and r["accepted"] == 2
    two = Monitor(MonitorConfig(telemetry="a:5557,b:5557"), clock=clock)
    for name in (b"a1:5557", b"b:5557"):
        two.on_frames([TELEMETRY_TOPIC + name, codec.pack_seq(1), stats(1)])
    clock.now += 3
    two.on_frames([TELEMETRY_TOPIC + b"b:5557", codec.pack_seq(2), stats(1)])
    two.on_frames([TELEMETRY_TOPIC + b"a2:5557", codec.pack_seq(1), stats(1)])  # a recreated
    assert [x["name"] for x in two.snapshot()["router"]["replicas"]] == ["a2:5557", "b:5557"]


def test_telemetry_endpoints_are_checked() -> None:
    from common.errors import ConfigError
    from common.sockets import telemetry_endpoints

    assert telemetry_endpoints(MonitorConfig(router_host="10.0.0.5", telemetry_port=6000)) == [("10.0.0.5", 6000, "")]
    assert telemetry_endpoints(MonitorConfig(telemetry="a:1, b:2")) == [("a", 1, ""), ("b", 2, "")]
    assert telemetry_endpoints(MonitorConfig(telemetry="a:1:router-a,b:2")) == [("a", 1, "router-a"), ("b", 2, "")]
    with pytest.raises(ConfigError, match="not host:port"):
        telemetry_endpoints(MonitorConfig(telemetry="a:1,b"))


def test_snapshot_window_series_and_recent_decisions(mon: Monitor, clock: Clock) -> None:
    clock.now += 2
    snap = mon.snapshot()
    msgspec.json.encode(snap)  # JSON-ready
    w = snap["window"]
    assert w["decisions"] == 3 and w["deflect_ratio"] == pytest.approx(2 / 3)
    assert w["completed"] == 3 and w["errors"] == 1 and w["kv_fallbacks"] == 1
    assert w["ttft_by_route"]["disagg"]["p50"] == 0.5
    assert w["ttft_pred_bias"] == pytest.approx((0.125 - 0.25) / 2)
    assert len(snap["series"]) == 60 and snap["series"][-1]["deflect_ratio"] == pytest.approx(2 / 3)
    assert [r["request_id"] for r in snap["recent"]] == ["c", "b", "a"]
    assert snap["recent"][0]["ttft_s"] == 0.5 and snap["recent"][1]["outcome"] == "worker_lost_midstream"
    assert [w["worker_id"] for w in snap["workers"]] == ["prefill-0", "decode-0", "decode-1"]
    assert snap["live_workers"] == {"prefill": 1, "decode": 2}
    assert snap["router"]["in_flight"] == 5 and snap["policy"] == "kairos"
    assert snap["totals"]["decisions"]["disagg/deflection_in_flight"] == 1
    # a minute later the window is empty again
    clock.now += 70
    mon.on_message(seen("decode-0", "decode", batch=0))
    w = mon.snapshot()["window"]
    assert w["decisions"] == 0 and w["deflect_ratio"] is None and w["ttft_p50"] is None


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0


async def test_http_routes(mon: Monitor) -> None:
    transport = httpx.ASGITransport(app=mon.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as c:
        r = await c.get("/")
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert "/static/dashboard.js" in r.text and "://" not in r.text  # nothing from elsewhere
        for name in ("dashboard.js", "dashboard.css"):
            r = await c.get("/static/" + name)
            assert r.status_code == 200 and "https://" not in r.text
        r = await c.get("/metrics")
        assert r.status_code == 200 and "kairos_routing_decisions_total" in r.text
        r = await c.get("/api/state")
        assert r.status_code == 200 and r.json()["live_workers"]["decode"] == 2
        assert (await c.get("/health")).json()["status"] == "ok"
        assert (await c.get("/static/../service.py")).status_code == 404
        assert (await c.get("/nope")).status_code == 404
        assert (await c.post("/metrics")).status_code == 405


async def test_http_api_key_guards_the_data_routes() -> None:
    guarded = Monitor(MonitorConfig(api_key="s3cret"))
    transport = httpx.ASGITransport(app=guarded.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as c:
        for path in ("/metrics", "/api/state"):
            assert (await c.get(path)).status_code == 401
            assert (await c.get(path, headers={"authorization": "Bearer wrong"})).status_code == 401
            assert (await c.get(path, headers={"authorization": "Bearer s3cret"})).status_code == 200
            assert (await c.get(path + "?key=s3cret")).status_code == 200
        assert (await c.get("/events")).status_code == 401
        assert (await c.get("/health")).status_code == 200  # probes need no key
        assert (await c.get("/")).status_code == 200          # the page holds no data; it passes ?key= on


async def test_event_stream_pushes_snapshots_and_ends_on_stop(mon: Monitor) -> None:
    async def ticks() -> None:
        for _ in range(3):
            await asyncio.sleep(0.05)
            mon.feed.publish(msgspec.json.encode(mon.snapshot()))
        mon.stop.set()
        mon.feed.publish(mon.feed.data)

    transport = httpx.ASGITransport(app=mon.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as c:
        task = asyncio.create_task(ticks())
        r = await asyncio.wait_for(c.get("/events"), 10)
        await task
    assert r.headers["content-type"] == "text/event-stream"
    events = [e for e in r.text.split("\n\n") if e.startswith("event: state")]
    assert len(events) >= 3
    assert msgspec.json.decode(events[-1].split("data: ", 1)[1])["live_workers"]["decode"] == 2
    assert mon.app.streams == 0


def test_top_renders_a_snapshot(mon: Monitor) -> None:
    console = Console(record=True, width=180)
    console.print(top.render(mon.snapshot(), "http://monitor"))
    out = console.export_text()
    for text in ("decode-0", "prefill-0", "deflection_in_flight", "router ok", "67%", "worker_lost_midstream",
                 "SLO attained"):
        assert text in out


def test_top_once_fails_cleanly_without_a_monitor(capsys: pytest.CaptureFixture[str]) -> None:
    assert top.main(["--once", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_router_metrics_module() -> None:
    def get(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (get("kairos_router_decisions_total", route="deflect", reason="decode_faster"),
              get("kairos_router_inter_token_latency_seconds_count", route="deflect"),
              get("kairos_router_requests_total", route="none", outcome="unavailable"))
    router_metrics.observe_decision(decision("r1", "deflect", "decode_faster"))
    router_metrics.observe_request(record("r1", "deflect", ttft=0.1, pred=0.1), gaps=[0.01, 0.02])
    router_metrics.observe_request(record("r2", None, ttft=None, pred=None, outcome="unavailable"))
    router_metrics.set_in_flight(3)
    router_metrics.set_workers(prefill=2, decode=1)
    router_metrics.observe_rejected("overloaded")
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=100, nbytes=4096, transfer_s=0.02)
    kv_before = get("kairos_router_kv_transfer_bytes_total")
    router_metrics.observe_prefill_done(m.PrefillDone(request_id="r1", attempt=0, worker_id="prefill-0", kv=kv,
                                                      queue_s=0.1, prefill_s=0.2))
    assert get("kairos_router_kv_transfer_bytes_total") == kv_before + 4096
    assert get("kairos_router_request_prefill_time_seconds_count") >= 1
    assert router_metrics.kv_reason("kv_timeout: no notification in 10 s") == "kv_timeout"
    assert router_metrics.kv_reason("") == "unknown"
    assert get("kairos_router_decisions_total", route="deflect", reason="decode_faster") == before[0] + 1
    assert get("kairos_router_inter_token_latency_seconds_count", route="deflect") == before[1] + 2
    assert get("kairos_router_requests_total", route="none", outcome="unavailable") == before[2] + 1
    assert get("kairos_router_requests_in_flight") == 3
    assert get("kairos_router_workers", role="decode") == 1
    assert get("kairos_router_rejected_requests_total", reason="overloaded") >= 1


def top_text(snapshot: dict[str, Any]) -> str:
    console = Console(record=True, width=180)
    console.print(top.render(snapshot, "http://monitor"))
    return console.export_text()


def test_a_loss_two_routers_report_is_listed_once(mon: Monitor, clock: Clock) -> None:
    lost = m.WorkerLost(worker_id="decode-1", role="decode", reason="heartbeat timeout", at=T0)
    mon.on_message(lost, "router-a:5557")
    clock.now += 0.3
    mon.on_message(lost, "router-b:5557")  # the other replica saw the same loss
    assert [x["worker_id"] for x in mon.snapshot()["lost"]] == ["decode-1"]
    clock.now += 60  # lost again, later: a second loss
    mon.on_message(lost, "router-a:5557")
    assert [x["worker_id"] for x in mon.snapshot()["lost"]] == ["decode-1", "decode-1"]


def test_a_drained_worker_left_it_was_not_lost(mon: Monitor) -> None:
    mon.on_message(m.WorkerLost(worker_id="decode-1", role="decode", reason="departed", at=T0))
    out = top_text(mon.snapshot())
    assert "left 0 s ago (drained)" in out and "lost 0 s ago: departed" not in out
    js = (Path(top.__file__).parent / "static" / "dashboard.js").read_text()
    assert 'l.reason === "departed"' in js and "(drained)" in js


def test_a_silent_router_does_not_mean_no_workers(mon: Monitor, clock: Clock) -> None:
    """The router froze (no telemetry): the monitor forgets its workers after the expiry, and
    the table must not say that none were ever reported."""
    clock.now += 30
    s = mon.snapshot()
    assert not s["workers"] and s["router"]["age_s"] > 5
    out = top_text(s)
    assert "no report from the router for 30 s" in out and "no workers reported yet" not in out
    assert "no report from the router" in (Path(top.__file__).parent / "static" / "dashboard.js").read_text()


def test_top_finds_a_cluster_on_other_ports_and_says_to_use_url(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "monitor.log").write_text(
        '{"event": "monitor_started", "dashboard": "http://0.0.0.0:9"}\n{"event": "other"}\n')
    assert top.discover(str(tmp_path)) == "http://127.0.0.1:9"
    assert top.discover(str(tmp_path / "none")) is None
    assert top.main(["--once", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "http://127.0.0.1:9/api/state" in err  # the discovered address was tried
    assert "--url" in err and "--url" in top.unreachable_hint(top.DEFAULT_URL, given=False)


def test_role_flips_are_rows_in_top_and_the_snapshot_and_counted(mon: Monitor, clock: Clock) -> None:
    flip = m.RoleFlip(worker_id="prefill-1", frm="prefill", to="decode", reason="decode_short", phase="started",
                      evidence={"decode_step_of_slo": 0.93}, at=T0)
    mon.on_message(flip)
    console = Console(width=200, record=True)
    console.print(top.render(mon.snapshot(), "http://m"))
    assert "role flip prefill → decode (decode_short): draining since 0 s ago" in console.export_text()
    clock.now += 4
    mon.on_message(msgspec.structs.replace(flip, phase="done", took_s=3.5))
    flips = mon.snapshot()["flips"]
    assert [(f["worker_id"], f["phase"], f["took_s"]) for f in flips] == [("prefill-1", "done", 3.5)]
    assert flips[0]["evidence"] == {"decode_step_of_slo": 0.93}
    console = Console(width=200, record=True)
    console.print(top.render(mon.snapshot(), "http://m"))
    assert "role flip prefill → decode (decode_short): done 0 s ago, took 4 s" in console.export_text()
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_role_flips_total", from_role="prefill", to_role="decode", reason="decode_short",
                 phase="done") == 1
