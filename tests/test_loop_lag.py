"""The event loop's lag as a metric (common/loop_lag.py; issue 47, item 7): measured as expected
against actual wake-up, on the Prometheus registry, in the router's RouterStats and the workers'
heartbeats, on the monitor's /metrics, dashboard state and `kairos top`."""

from __future__ import annotations

import asyncio
import io
import time

from prometheus_client import REGISTRY, generate_latest
from rich.console import Console

from common import codec, config
from common import messages as m
from common.engines.sim import SimEngine
from common.loop_lag import LoopLag
from common.perf_model import load_profile
from services.decode_worker.service import DecodeWorker
from services.monitor import top
from services.monitor.metrics import _StateCollector
from services.monitor.state import MonitorState
from tests.router_fakes import hello, make_core


def lag_count(service: str) -> float:
    return REGISTRY.get_sample_value("kairos_event_loop_lag_seconds_count", {"service": service}) or 0.0


async def test_fake_clock_lag_is_actual_minus_expected_wake_up() -> None:
    now = [100.0]
    late = [0.0, 0.0, 0.3, 0.0]  # the third wake-up comes 0.3 s late (the loop was blocked)

    async def sleep(s: float) -> None:
        now[0] += s + late.pop(0)
        if not late:
            raise asyncio.CancelledError

    lag = LoopLag("test-fake", interval=0.05, clock=lambda: now[0], sleep=sleep)
    before = lag_count("test-fake")
    try:
        await lag.run()
    except asyncio.CancelledError:
        pass
    assert lag_count("test-fake") == before + 3
    assert abs(lag.take_max() - 0.3) < 1e-9
    assert lag.take_max() == 0.0  # taken: starts over


async def test_a_blocked_loop_moves_the_metric() -> None:
    lag = LoopLag("test-real", interval=0.01)
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        lag.take_max()
        time.sleep(0.25)  # hold the loop, as a long callback would
        await asyncio.sleep(0.05)  # the sampler wakes (late) and records it
        assert lag.take_max() >= 0.2  # at least the block less the sampling interval, whatever the load
        assert lag_count("test-real") >= 2
        assert b'kairos_event_loop_lag_seconds_bucket{le="0.25",service="test-real"}' in generate_latest(REGISTRY)
    finally:
        task.cancel()


def test_router_stats_and_worker_states_carry_the_lag_to_the_monitor_and_top() -> None:
    core, box = make_core()
    core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    hb = m.DecodeHeartbeat(worker_id="decode-0", incarnation="inc-decode-0", seq=1, batch=0, kv_tokens=0,
                           kv_free_tokens=100_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                           deflections=0, strictest_tbt_slo=None, token_budget=2048, loop_lag_ms=42.0)
    core.on_message(b"decode-0", hb, 1.1)
    core.telemetry(2.0, loop_lag_ms=150.0)
    stats = [x for x in box.published if isinstance(x, m.RouterStats)]
    seen = [x for x in box.published if isinstance(x, m.WorkerSeen)]
    assert stats[-1].loop_lag_ms == 150.0 and seen[-1].state["loop_lag_ms"] == 42.0
    st = MonitorState()
    for x in box.published:
        st.on_message(x, 10.0)  # type: ignore[arg-type]
    snap = st.snapshot(10.0)
    assert snap["router"]["loop_lag_ms"] == 150.0 and snap["router"]["replicas"][0]["loop_lag_ms"] == 150.0
    samples = {(f.name, s.labels.get("worker")): s.value for f in _StateCollector(st, lambda: 10.0).collect()
               for s in f.samples}
    assert samples[("kairos_router_event_loop_lag_seconds", None)] == 0.15
    assert samples[("kairos_worker_event_loop_lag_seconds", "decode-0")] == 0.042
    out = Console(file=io.StringIO(), width=250)
    out.print(top.render(snap, "http://monitor"))
    text = out.file.getvalue()  # type: ignore[attr-defined]
    assert "loop lag 150 ms" in text


async def test_a_workers_heartbeat_carries_its_worst_lag_since_the_last_one() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_transport": "modeled", "heartbeat_interval": 0.01})
    w = DecodeWorker(cfg, SimEngine("decode", load_profile("fast")))
    beats: list[m.DecodeHeartbeat] = []

    class Bus:
        async def beat(self, payload: bytes) -> None:
            hb = codec.router_inbox.decode(payload)
            assert isinstance(hb, m.DecodeHeartbeat)
            beats.append(hb)
            w.left = len(beats) >= 2  # two beats, then the loop returns

    w.bus = Bus()  # type: ignore[assignment]
    w.loop_lag.observe(0.2)
    await asyncio.wait_for(w.heartbeat_loop(), 5)
    assert beats[0].loop_lag_ms == 200.0
    assert beats[1].loop_lag_ms == 0.0  # taken by the first beat


def test_router_stats_keep_each_workers_largest_step_margin() -> None:
    """`kairos demo` explains a live deflection gap with the margins the workers planned with during
    the run: a burst's margin is gone from the last heartbeat by the end, so the stats keep the largest."""
    core, _ = make_core()
    core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    for seq, margin in enumerate((1.0, 1.3, 1.02), start=1):
        core.on_message(b"decode-0", m.DecodeHeartbeat(
            worker_id="decode-0", incarnation="inc-decode-0", seq=seq, batch=0, kv_tokens=0, kv_free_tokens=100_000,
            kv_capacity_tokens=100_000, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
            token_budget=2048, step_margin=margin), 1.0 + seq)
    w = core.stats()["workers"]["decode-0"]
    assert w["step_margin"] == 1.02 and w["step_margin_max"] == 1.3
