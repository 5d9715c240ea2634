"""The TBT delivery allowance (common/router_core/delivery.py): what the serving path adds to a
token's gap is taken off the TBT budget the decode guard plans to, at the router's decode room
and in the worker's chunk planning beside running decodes. The router core with explicit time
(tests/router_fakes.py); the measured part fed as the HTTP layer feeds it."""

from __future__ import annotations

import pytest

from common import messages as m
from common.engines.base import EngineRequest
from common.engines.batcher import Batcher, Seq
from common.engines.step_error import ChunkGuard, StepErrorEstimator
from common.errors import ConfigError
from common.router_core import delivery as dl
from common.router_core.delivery import DeliveryAllowance
from common.worker_core import DecodeCore, EngineInfo
from services.router.openai_serve import wrote
from tests.router_fakes import Clock, FakeOutbox, hello, make_core

H100 = "h100-llama2-70b-tp4"
SAMPLING = m.Sampling(max_tokens=64, ignore_eos=True)


def test_measured_part_is_a_high_quantile_of_the_extra_gap_once_enough_samples_are_in() -> None:
    d = DeliveryAllowance()
    assert d.plan_slo(0.1) == 0.1  # nothing measured, nothing configured: the SLO itself, to the bit
    for _ in range(dl.MIN_SAMPLES - 1):
        d.observe(0.010)
    assert d.measured_s == 0.0  # too few samples
    for i in range(2000):
        d.observe(0.002 if i % 10 else 0.010)  # 10 % of the tokens 10 ms late: the P99 is 10 ms
    assert 0.010 <= d.measured_s <= 0.010 + 1.01 * dl.BIN_S  # to the histogram's bin, rounded up
    assert d.plan_slo(0.1) == pytest.approx(0.1 - d.measured_s)
    for _ in range(dl.WINDOW + dl.RECOMPUTE_EVERY):
        d.observe(-0.005)  # writes sooner than the steps (batched tokens): count as 0, and the window moves on
    assert d.measured_s == 0.0 and d.plan_slo(0.1) == 0.1


def test_the_quantile_is_the_tail_a_long_stream_meets_not_the_p99() -> None:
    """The SLO is on a request's largest gap: a 200-token stream meets one of every 200 extras, so
    0.5 % of tokens 10 ms late would break most such streams if the budget left them out."""
    d = DeliveryAllowance()
    for i in range(4000):
        d.observe(0.010 if i % 200 == 0 else 0.002)
    assert d.measured_s >= 0.010
    assert d.plan_slo(0.1) <= 0.090


def test_configured_part_adds_to_the_measured_one_and_the_sum_is_capped() -> None:
    d = DeliveryAllowance(0.015)
    assert d.plan_slo(0.1) == pytest.approx(0.085) and d.total_s(0.1) == pytest.approx(0.015)
    for _ in range(dl.RECOMPUTE_EVERY * 2):
        d.observe(0.045)
    assert d.total_s(0.1) == pytest.approx(dl.CAP * 0.1) and d.capped(0.1)
    assert d.plan_slo(0.1) == pytest.approx(0.05)
    off = DeliveryAllowance(0.004, measured=False)
    for _ in range(dl.RECOMPUTE_EVERY * 2):
        off.observe(0.045)
    assert off.plan_slo(0.1) == pytest.approx(0.096)
    with pytest.raises(ConfigError, match="tbt_delivery_allowance_ms"):
        make_core("kairos", tbt_delivery_allowance_ms=-1.0)


def _two_requests(jitter_s: float) -> tuple[float, list[tuple[str, m.Msg]]]:
    """A 1P1D cluster on the H100 profile: request A on an empty decode worker, then a heartbeat
    saying the decode worker runs 150 requests (their strictest TBT budget: A's) with a decode
    step of ~90 ms, then request B. `jitter_s`: the extra gap the HTTP layer measured before A.
    Returns A's planned TBT budget and what B's dispatch sent."""
    core, box = make_core("kairos", profile=H100)
    model = core.profile.model
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0", "decode", kv_capacity_tokens=10**7), clock.now)
    core.on_message(b"prefill-0", hello("prefill-0", "prefill", kv_capacity_tokens=10**7), clock.now)
    box.take()
    for _ in range(1000):
        core.delivery.observe(jitter_s)
    core.submit(list(range(100)), SAMPLING, clock.now)
    work = [x for _, x in box.take() if isinstance(x, m.DecodeWork)]
    assert len(work) == 1
    # A's first token: its prompt is done, it decodes in the batch (no deflection left prefilling
    # there, so the decode room keeps no chunk step's room beside it)
    core.on_message(b"decode-0", m.TokenBatch(worker_id="decode-0", items=[
        m.TokenItem(work[0].request_id, work[0].attempt, [7], None)]), clock.advance(0.005))
    batch = 150
    kv = int((0.090 - model.decode_time(batch + 2, 0)) / model.a2)  # its decode step with B: ~90 ms
    core.on_message(b"decode-0", m.DecodeHeartbeat(
        worker_id="decode-0", incarnation="inc-decode-0", seq=1, batch=batch, kv_tokens=kv, kv_free_tokens=10**7,
        kv_capacity_tokens=10**7, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=work[0].tbt_slo,
        token_budget=2048, last_dispatch=1), clock.advance(0.01))
    box.take()
    core.submit(list(range(100)), SAMPLING, clock.advance(0.01))
    return work[0].tbt_slo, box.take()


def test_a_measured_10_ms_delivery_jitter_lowers_the_step_the_decode_guard_admits_to() -> None:
    """Without jitter the decode worker's ~90 ms step (with B) fits 0.95 x 100 ms and B is handed
    off to it; with 10 ms of measured jitter A was planned to 90 ms and the same step does not fit
    0.95 x 90 ms: B goes elsewhere (the prefill worker keeps and decodes it, planned to 90 ms too)."""
    slo, sent = _two_requests(0.0)
    assert slo == 0.1
    assert [(peer, type(x).__name__) for peer, x in sent] == [("decode-0", "DecodeWork"), ("prefill-0", "PrefillWork")]
    slo, sent = _two_requests(0.010)
    assert slo == pytest.approx(0.090, abs=1.01 * dl.BIN_S)
    assert [(peer, type(x).__name__) for peer, x in sent] == [("prefill-0", "PrefillWork")]
    kept = sent[0][1]
    assert isinstance(kept, m.PrefillWork) and kept.retain and kept.tbt_slo == slo


def test_the_worker_plans_its_chunks_beside_decodes_to_the_budget_its_work_carries() -> None:
    """The decode worker's chunk guard plans to the TBT SLO its work carries (DecodeWork.tbt_slo
    -> EngineRequest.tbt_slo -> the batcher's ChunkGuard): 10 ms of jitter, a smaller chunk."""
    core, _ = make_core("kairos", profile=H100)
    guard = ChunkGuard(core.profile.model, StepErrorEstimator())
    plain, _ = _two_requests(0.0)
    jittery, _ = _two_requests(0.010)
    full = guard.fit(64, 64 * 1000, [], 2048, 0, plain)
    cut = guard.fit(64, 64 * 1000, [], 2048, 0, jittery)
    assert 0 < cut < full < 2048


def test_the_http_layer_samples_each_write_gap_less_the_worker_s_step() -> None:
    """`wrote` (services/router/openai_serve.py): the gap between two writes of a stream's tokens
    less the step time the worker reported for the later ones (`TokenBatch.step_s`, kept by the
    core per request); an attempt's first token gives no sample."""
    core, box = make_core("deflect-all", outbox=FakeOutbox())
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0", "decode"), clock.now)
    box.take()
    req = core.submit([1, 2, 3], SAMPLING, clock.now)
    work = next(x for _, x in box.take() if isinstance(x, m.DecodeWork))
    d = DeliveryAllowance()

    def step(now: float, step_s: float) -> None:
        core.on_message(b"decode-0", m.TokenBatch(worker_id="decode-0", step_s=step_s,
                                                  items=[m.TokenItem(work.request_id, work.attempt, [7])]), now)

    step(clock.advance(0.5), 0.05)
    assert req.step_s < 0  # the first token: no gap of the worker's
    wrote(d, req, clock.now + 0.001)
    assert d.samples == 0
    for i in range(dl.RECOMPUTE_EVERY):
        step(clock.advance(0.05), 0.05)  # 50 ms steps, every other one written 12 ms later than the last
        wrote(d, req, clock.now + 0.001 + (0.012 if i % 2 == 0 else 0.0))
    assert d.samples == dl.RECOMPUTE_EVERY
    assert d.measured_s == pytest.approx(0.012, abs=1.01 * dl.BIN_S) and req.write_gap_max == pytest.approx(0.062)


def test_the_allowance_in_force_is_a_gauge_and_a_log_line_when_it_moves() -> None:
    from common import config
    from common.router_core.core import RouterCore

    class Log:
        def __init__(self) -> None:
            self.events: list[tuple[str, dict[str, object]]] = []

        def _log(self, event: str, **kw: object) -> None:
            self.events.append((event, kw))

        debug = info = warning = error = _log

        def named(self, event: str) -> list[dict[str, object]]:
            return [kw for e, kw in self.events if e == event]

    class Gauge:
        def __init__(self) -> None:
            self.values: list[float] = []

        def set_delivery_allowance(self, seconds: float) -> None:
            self.values.append(seconds)

        def __getattr__(self, name: str) -> object:
            return lambda *a, **k: None

    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "kairos", "profile": "fast",
                                                               "tbt_delivery_allowance_ms": 4.0})
    gauge, log = Gauge(), Log()
    core = RouterCore(cfg, FakeOutbox(), metrics=gauge, log=log)  # type: ignore[arg-type]
    core.telemetry(100.0)
    for _ in range(dl.RECOMPUTE_EVERY):
        core.delivery.observe(0.006)
    core.telemetry(101.0)  # moved, but within 10 s of the last line: the gauge only
    core.telemetry(111.0)
    assert gauge.values[0] == pytest.approx(0.004) and gauge.values[-1] == pytest.approx(0.010, abs=1.01 * dl.BIN_S)
    lines = log.named("delivery_allowance")
    assert [x["configured_ms"] for x in lines] == [4.0, 4.0] and lines[0]["plan_tbt_ms"] == 96.0
    assert lines[1]["measured_ms"] == pytest.approx(6.0, abs=0.3) and lines[1]["samples"] == dl.RECOMPUTE_EVERY
    assert core.stats()["delivery_allowance_ms"] == pytest.approx(10.0, abs=0.3)  # GET /v1/kairos/stats


def test_a_stall_of_the_router_s_loop_is_counted_but_does_not_shrink_the_budget() -> None:
    # a 10 s SIGSTOP under 50 streams: each stream's next write comes ~10 s after its last; kept in
    # the window those 50 samples put the P99 at the cap and the guard planned to half the SLO for a
    # minute (tests/chaos/test_stranded_live.py under a loaded CI host, 2026-12-07)
    d = DeliveryAllowance()
    for i in range(1000):
        d.observe(0.002 if i % 100 else 0.004)
    for _ in range(50):
        d.observe(10.0)
    for _ in range(dl.RECOMPUTE_EVERY):
        d.observe(0.002)
    assert d.stalls == 50 and d.samples == 1000 + dl.RECOMPUTE_EVERY
    assert 0.0 < d.measured_s <= 0.004 + dl.BIN_S and not d.capped(0.1)
    d.observe(dl.STALL_S - 0.001)  # just under a stall: a delivery cost, in the window
    assert d.stalls == 50 and d.samples == 1001 + dl.RECOMPUTE_EVERY


class _BatcherPorts:
    """A decode worker core's ports onto a real Batcher (the simulated engine's), as sim/state.py."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.batcher = Batcher(role="decode", token_budget=2048, max_batch=256, kv_capacity_tokens=10**7,
                               default_chunk=512)

    def send(self, msg: m.Msg) -> None:
        pass

    def start(self, req: EngineRequest) -> bool:
        self.batcher.add(Seq(request_id=req.request_id, attempt=req.attempt, prompt_len=len(req.prompt_token_ids),
                             max_tokens=req.sampling.max_tokens, tbt_slo=req.tbt_slo, computed=0))
        return True

    def abort(self, request_id: str) -> None:
        self.batcher.remove(request_id)

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        return self.batcher.lower_tbt_slo(request_id, tbt_slo)

    def beat_now(self, at_once: bool = False) -> None:
        pass

    def router_of(self, request_id: str) -> str:
        return self.router

    def release_kv(self, key: str) -> None:
        pass


def test_a_risen_allowance_reaches_the_requests_already_on_a_worker() -> None:
    """A request dispatched while the allowance was 0 is planned to the whole SLO. When the
    measured part rises to ~10 ms the router tells every worker once (PlanBudget, at its next
    telemetry tick), the worker plans that request to ~90 ms from then on (the batcher's
    strictest TBT SLO, which its heartbeats report and its chunk guard plans beside), and a
    request dispatched after carries ~90 ms and the allowance it was planned with."""
    core, box = make_core("deflect-all")
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0", "decode", plan_budget=True), clock.now)
    core.on_message(b"decode-1", hello("decode-1", "decode", plan_budget=True), clock.now)
    core.on_message(b"decode-2", hello("decode-2", "decode"), clock.now)  # from before PlanBudget: told nothing
    box.take()
    worker = DecodeCore("decode-0", "inc-decode-0", EngineInfo(engine="sim", token_budget=2048), ports :=
                        _BatcherPorts(core.incarnation), model="kairos-sim")
    core.submit(list(range(100)), SAMPLING, clock.now)
    sent = box.take()
    for _ in range(3):  # deflect-all spreads requests over the decode workers
        if any(peer == "decode-0" for peer, x in sent if isinstance(x, m.DecodeWork)):
            break
        core.submit(list(range(100)), SAMPLING, clock.now)
        sent = box.take()
    first = next(x for peer, x in sent if isinstance(x, m.DecodeWork) and peer == "decode-0")
    assert first.tbt_slo == 0.1 and first.allowance_s == 0.0
    worker.on_work(first, clock.now, ports.batcher.load(kv_capacity_tokens=10**7, inflight=None, busy_s=0.0), None)
    assert ports.batcher.strictest_tbt_slo() == 0.1
    core.telemetry(clock.advance(1.0))
    assert not [x for _, x in box.take() if isinstance(x, m.PlanBudget)]  # nothing moved: nothing told
    for _ in range(dl.RECOMPUTE_EVERY * 4):
        core.delivery.observe(0.010)
    core.telemetry(clock.advance(1.0))
    told = [(peer, x) for peer, x in box.take() if isinstance(x, m.PlanBudget)]
    assert sorted(peer for peer, _ in told) == ["decode-0", "decode-1"]
    news = told[0][1]
    assert news.allowance_s == pytest.approx(0.010, abs=1.01 * dl.BIN_S) and news.cap == dl.CAP
    assert worker.on_plan_budget(news) == 1
    assert ports.batcher.strictest_tbt_slo() == pytest.approx(0.1 - news.allowance_s)
    core.telemetry(clock.advance(1.0))
    assert not [x for _, x in box.take() if isinstance(x, m.PlanBudget)]  # told once per move
    core.submit(list(range(100)), SAMPLING, clock.now)
    later = next(x for _, x in box.take() if isinstance(x, m.DecodeWork))
    assert later.tbt_slo == pytest.approx(0.1 - news.allowance_s)
    assert later.allowance_s == pytest.approx(news.allowance_s)
    assert worker.tbt_budget(later) == pytest.approx(later.tbt_slo)
    # the allowance falls back: told, but the running request keeps its smaller budget
    core.delivery = DeliveryAllowance()
    core.telemetry(clock.advance(1.0))
    back = [x for _, x in box.take() if isinstance(x, m.PlanBudget)]
    assert len(back) == 2 and back[0].allowance_s == 0.0 and worker.on_plan_budget(back[0]) == 0
    assert ports.batcher.strictest_tbt_slo() == pytest.approx(0.1 - news.allowance_s)


def test_the_allowance_reaches_the_monitor_and_kairos_top() -> None:
    """RouterStats carries the allowance in force; the monitor keeps the largest among its routers
    and `kairos top` shows it on the router line."""
    import io

    from rich.console import Console

    from services.monitor import top
    from services.monitor.state import MonitorState

    core, box = make_core("kairos", tbt_delivery_allowance_ms=2.0)
    core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    for _ in range(dl.RECOMPUTE_EVERY):
        core.delivery.observe(0.0049)  # its bin: 4.75-5.0 ms, read as 5.0
    core.telemetry(2.0)
    stats = [x for x in box.published if isinstance(x, m.RouterStats)]
    assert stats[-1].delivery_allowance_ms == pytest.approx(7.0)
    st = MonitorState()
    for x in box.published:
        st.on_message(x, 10.0)  # type: ignore[arg-type]
    snap = st.snapshot(10.0)
    assert snap["router"]["delivery_allowance_ms"] == pytest.approx(7.0)
    out = Console(file=io.StringIO(), width=250)
    out.print(top.render(snap, "http://monitor"))
    assert "delivery allowance 7.0 ms" in out.file.getvalue()  # type: ignore[attr-defined]
