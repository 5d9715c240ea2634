"""The live predictor's error books (common/prediction_error.py) with a fake clock, and where
they show: engine load -> heartbeat -> router telemetry -> monitor metrics and `kairos top`."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from common import messages as m
from common.config import MonitorConfig
from common.engines.base import EngineLoad, EngineRequest
from common.engines.sim import SimEngine
from common.messages import Sampling
from common.perf_model import load_profile
from common.prediction_error import ErrorWindow, relative_error
from common.worker_core import DecodeCore, EngineInfo, PrefillCore
from services.monitor import top
from services.monitor.service import Monitor
from tests.monitor.conftest import parse_metrics, value
from tests.sim_engine_run import run_to_end
from tests.test_worker_core import Ports

T0 = 1_800_000_000.0


def test_relative_errors_median_p90_bias_and_window() -> None:
    w = ErrorWindow(window_s=10.0)
    assert w.summary(0.0) is None
    # predicted against measured: 10 % fast, 10 % slow, 20 % slow, exact, 50 % fast
    for i, (pred, meas) in enumerate(((1.1, 1.0), (0.9, 1.0), (0.8, 1.0), (2.0, 2.0), (0.15, 0.1))):
        w.observe(pred, meas, float(i))
    s = w.summary(4.0)
    assert s is not None and s["n"] == 5
    assert s["median"] == pytest.approx(0.1) and s["p90"] == pytest.approx(0.5)
    assert s["bias"] == pytest.approx(0.0)  # signed: -0.2, -0.1, 0, +0.1, +0.5
    # nothing measured, or nonsense, counts for nothing
    assert w.observe(1.0, 0.0, 4.0) is None and w.observe(float("nan"), 1.0, 4.0) is None
    assert w.total == 5 and relative_error(1.0, -1.0) is None
    # 12.5 s on, the first three (at 0, 1, 2) are out of the 10 s window
    s = w.summary(12.5)
    assert s is not None and s["n"] == 2 and s["median"] == pytest.approx(0.5)
    assert w.summary(100.0) is None and w.total == 5
    # a summary asked twice with nothing new is the same one; a new error changes it
    w.observe(1.0, 1.25, 100.0)
    assert w.summary(100.0) == w.summary(100.0) and w.summary(100.0)["median"] == pytest.approx(0.2)  # type: ignore[index]


def test_maxlen_bounds_the_window() -> None:
    w = ErrorWindow(window_s=1e9, maxlen=3)
    for i in range(10):
        w.observe(1.0 + i, 1.0, float(i))
    assert w.errors(10.0) == [7.0, 8.0, 9.0] and w.total == 10
    with pytest.raises(ValueError):
        ErrorWindow(window_s=0)


def test_the_summary_kept_sorted_is_the_windows_own() -> None:
    """Kept sorted as errors come, leave by age and fall off maxlen: the same quantiles as
    sorting the window each time (ties, negative and positive errors)."""
    import random

    rng = random.Random(7)
    w = ErrorWindow(window_s=5.0, maxlen=50)
    now = 0.0
    for i in range(2000):
        now += rng.choice((0.001, 0.01, 0.1, 1.0))
        w.observe(1.0, rng.choice((0.5, 1.0, 2.0, rng.uniform(0.2, 3.0))), now)
        if i % 7 == 0:
            errs = w.errors(now)
            s = w.summary(now)
            assert s is not None and s["n"] == len(errs) <= 50
            absolute, signed = sorted(abs(e) for e in errs), sorted(errs)
            assert (s["median"], s["p90"], s["bias"]) == (absolute[int(0.5 * len(errs))],
                                                         absolute[min(len(errs) - 1, int(0.9 * len(errs)))],
                                                         signed[int(0.5 * len(errs))])
    assert w.summary(now + 10.0) is None and w.errors(now + 10.0) == []


def test_heartbeats_carry_the_engines_step_error() -> None:
    w = ErrorWindow()
    for meas in (1.0, 1.1, 1.2, 1.3):
        w.observe(1.0, meas, 0.0)
    load = w.fill(EngineLoad(batch=1), 0.0)
    assert load.step_err_p50 == pytest.approx(round(0.2 / 1.2, 4))
    info = EngineInfo(engine="fake", token_budget=2048, kv_capacity_tokens=10_000, max_batch=64)
    hb = DecodeCore("decode-0", "inc", info, Ports(), model="m").heartbeat(load)  # type: ignore[arg-type]
    assert (hb.step_err_p50, hb.step_err_p90) == (load.step_err_p50, load.step_err_p90)
    phb = PrefillCore("prefill-0", "inc", info, Ports(), model="m").heartbeat(load, None)  # type: ignore[arg-type]
    assert phb.step_err_p90 == load.step_err_p90
    assert DecodeCore("d", "i", info, Ports(), model="m").heartbeat(EngineLoad()).step_err_p50 is None  # type: ignore[arg-type]


def test_the_simulated_engine_books_every_step() -> None:
    async def run() -> SimEngine:
        e = SimEngine("decode", load_profile("a100-dsv2-lite"), time_scale=0.01)
        await run_to_end(e, EngineRequest(request_id="r", attempt=0, prompt_token_ids=list(range(300)),
                                          mode="deflect", sampling=Sampling(max_tokens=8, ignore_eos=True)))
        return e

    e = asyncio.run(run())
    assert e.step_errors.total == e.batcher.steps >= 8
    assert e.load().step_err_p50 is not None


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _record(rid: str, ttft: float, pred: float) -> m.RequestRecord:
    return m.RequestRecord(request_id=rid, route="deflect", reason="x", prefill_worker=None, decode_worker="decode-0",
                           prompt_tokens=100, output_tokens=4, ttft_s=ttft, ttft_pred_s=pred, tbt_p50_s=None,
                           tbt_p99_s=None, tbt_max_s=None, e2e_s=1.0, outcome="ok", at=T0)


def test_monitor_metrics_snapshot_and_top_show_the_errors() -> None:
    clock = Clock()
    mon = Monitor(MonitorConfig(), clock=clock)
    mon.on_message(m.WorkerSeen(worker_id="decode-0", role="decode", incarnation="i", engine="vllm", at=T0,
                                state={"batch": 2.0, "step_err_p50": 0.07, "step_err_p90": 0.19}))
    for i, (ttft, pred) in enumerate(((1.0, 1.04), (1.0, 0.9), (0.5, 0.5), (2.0, 3.0))):
        mon.on_message(_record(f"r{i}", ttft, pred))
    s = parse_metrics(mon.metrics.render().decode())
    assert value(s, "kairos_ttft_prediction_relative_error_count", route="deflect") == 4
    assert value(s, "kairos_ttft_prediction_relative_error_bucket", route="deflect", le="0.05") == 2
    assert value(s, "kairos_ttft_prediction_relative_error_bucket", route="deflect", le="0.1") == 3
    assert value(s, "kairos_worker_step_prediction_error_p50", worker="decode-0", role="decode") == 0.07
    clock.now += 1
    snap = mon.snapshot()
    err = snap["window"]["ttft_pred_err"]
    assert err["n"] == 4 and err["median"] == pytest.approx(0.1) and err["p90"] == pytest.approx(0.5)
    console = Console(record=True, width=220)
    console.print(top.render(snap, "http://monitor"))
    text = console.export_text()
    assert "error p50/p90 10% / 50% (n=4)" in text and "7% / 19%" in text
    clock.now += 120  # out of the window
    assert mon.snapshot()["window"]["ttft_pred_err"] is None


def test_a_workers_own_metrics_show_its_step_error() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from common.worker_metrics import EngineMetrics

    em = EngineMetrics("m")
    reg = CollectorRegistry()
    reg.register(em)
    info = EngineInfo(engine="fake", token_budget=2048, kv_capacity_tokens=10_000, max_batch=64)
    core = DecodeCore("decode-0", "inc", info, Ports(), model="m")  # type: ignore[arg-type]
    em.hb = core.heartbeat(EngineLoad(step_err_p50=0.04, step_err_p90=0.12))
    s = parse_metrics(generate_latest(reg).decode())
    assert value(s, "kairos_engine_step_prediction_error", model_name="m", worker="decode-0", role="decode",
                 stat="p90") == 0.12
    em.hb = core.heartbeat(EngineLoad())
    assert "kairos_engine_step_prediction_error{" not in generate_latest(reg).decode()


def test_the_router_passes_the_workers_step_error_to_the_monitor() -> None:
    from services.monitor.state import MonitorState
    from tests.router_fakes import hello, make_core

    core, box = make_core()
    core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    hb = m.DecodeHeartbeat(worker_id="decode-0", incarnation="inc-decode-0", seq=1, batch=0, kv_tokens=0,
                           kv_free_tokens=100_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                           deflections=0, strictest_tbt_slo=None, token_budget=2048, step_err_p50=0.06,
                           step_err_p90=0.2)
    core.on_message(b"decode-0", hb, 1.1)
    core.telemetry(2.0)
    seen = [x for x in box.published if isinstance(x, m.WorkerSeen)]
    assert seen[-1].state["step_err_p50"] == 0.06 and seen[-1].state["step_err_p90"] == 0.2
    st = MonitorState()
    for x in box.published:
        st.on_message(x, 10.0)  # type: ignore[arg-type]
    assert st.snapshot(10.0)["workers"][0]["state"]["step_err_p90"] == 0.2
