"""Decode-side admission of deflections (common/policy/admission.py): the check itself, the
decode worker that applies it to its live state, the router that takes the disaggregated path
when a deflection is rejected, and the simulator's routers (round-robin, own ledgers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec
import pytest

from common import messages as m
from common.perf_model import PerfModel, load_profile, save_profile
from common.policy import ClusterView, DecodeView, Hold, KairosConfig, PrefillView, RequestSpec, make_policy
from common.policy.admission import REJECTED_REASON, Accepted, accepted_entry, check_deflection, decide_without
from common.policy.schedule import reserved_step_cost
from common.router_core.workers import LedgerEntry
from common.traces import TraceRequest
from kairos.up import Cluster
from services.decode_worker.service import DecodeWorker
from services.router import metrics
from services.router.service import Router
from sim.core import SimConfig, simulate
from sim.stats import summarize
from tests.conftest import start_cluster
from tests.test_poison import FakeRouter, _start
from tests.test_trust import frame, hello, make_router, sent

FAST = load_profile("fast").model  # step = 0.5 ms + 0.2 us per token of the step
SAMPLING = m.Sampling(max_tokens=4, ignore_eos=True)


# ------------------------------------------------------------------ the check


def test_a_schedule_that_fits_an_idle_worker_is_admitted() -> None:
    sched = (1000, 1000, 1000)
    alone = FAST.step_time(0, 0, [(1000, 0)])  # 0.7 ms
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=alone, tbt_slo=0.1,
                            accepted=()) == ""
    why = check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=alone * 0.99, tbt_slo=0.1,
                           accepted=())
    assert why.startswith("step 1 of 3 (1000 tokens) would take 0.7 ms > 0.7 ms budget")


def test_the_deflections_already_accepted_take_their_reserved_step_cost() -> None:
    sched = (1000, 1000)
    first = accepted_entry(FAST, sched, 0.00085, token_budget=8192)
    assert first.reserved_s == pytest.approx(reserved_step_cost(FAST, sched, 8192)) == pytest.approx(0.0002)
    # alone it fits (0.7 ms <= 0.85 ms); beside the first (0.7 + 0.2 ms) it does not
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=0.00085, tbt_slo=0.1,
                            accepted=()) == ""
    why = check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=0.00085, tbt_slo=0.1,
                           accepted=[first])
    assert "0.9 ms > 0.8 ms budget beside 0 decodes and 1 deflections in flight" in why
    # a generous budget of its own does not lift the budget the first was planned under
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=1.0, tbt_slo=0.1,
                            accepted=[first]) != ""
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=sched, budget_s=1.0, tbt_slo=0.1,
                            accepted=[Accepted(reserved_s=0.0002, budget_s=0.0)]) == ""


def test_decodes_and_their_growing_context_count() -> None:
    model = msgspec.structs.replace(FAST, a2=1e-6)  # 1 us per KV token read
    sched = (100, 100, 100)
    steps = [model.step_time(10, 5000 + 10 * i, [(100, 100 * i)]) for i in range(3)]
    assert steps[0] < steps[1] < steps[2]
    ok = check_deflection(model, batch=10, kv_tokens=5000, schedule=sched, budget_s=steps[2], tbt_slo=0.1,
                          accepted=())
    assert ok == ""
    why = check_deflection(model, batch=10, kv_tokens=5000, schedule=sched, budget_s=steps[2] * 0.999, tbt_slo=0.1,
                           accepted=())
    assert why.startswith("step 3 of 3") and "beside 10 decodes" in why


def test_a_stricter_resident_slo_scales_the_budget() -> None:
    alone = FAST.step_time(0, 0, [(1000, 0)])
    # planned at beta = 0.9 of a 100 ms SLO; a resident holds 50 ms: the budget is 0.9 x 50 ms
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=(1000,), budget_s=alone * 2, tbt_slo=0.1,
                            accepted=(), strictest_tbt_slo=0.05) == ""
    assert check_deflection(FAST, batch=0, kv_tokens=0, schedule=(1000,), budget_s=alone * 2, tbt_slo=0.1,
                            accepted=(), strictest_tbt_slo=0.04) != ""


def test_no_budget_or_no_schedule_is_admitted_unchecked() -> None:
    busy: list[Accepted] = [Accepted(reserved_s=10.0, budget_s=0.001)]
    assert check_deflection(FAST, batch=99, kv_tokens=10**6, schedule=(4096,), budget_s=0.0, tbt_slo=0.1,
                            accepted=busy) == ""
    assert check_deflection(FAST, batch=99, kv_tokens=10**6, schedule=(), budget_s=0.001, tbt_slo=0.1,
                            accepted=busy) == ""


def _views(model: PerfModel) -> ClusterView:
    d = [DecodeView(worker_id=f"decode-{i}", batch=0, kv_tokens=0, kv_free_tokens=10**6, kv_capacity_tokens=10**6,
                    resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None, token_budget=2048, model=model)
         for i in range(2)]
    p = [PrefillView(worker_id=f"prefill-{i}", queued_tokens=1000 * i, queued_requests=i, token_budget=2048,
                     model=model, backlog=((1000, 0),) * i) for i in range(2)]
    return ClusterView(prefill=tuple(p), decode=tuple(d))


@pytest.mark.parametrize("policy", ["kairos", "deflect-all", "conditional-disagg"])
def test_the_fallback_is_disaggregated_on_the_least_loaded_workers(policy: str) -> None:
    model = load_profile("a100-dsv2-lite").model
    view = _views(model)
    req = RequestSpec(request_id="r", prompt_tokens=500, max_tokens=10, ttft_slo=2.0, tbt_slo=0.1)
    pol = make_policy(policy, default_model=model)
    assert pol.decide(req, view, 0.0).route == "deflect"  # what the workers would have rejected
    d = decide_without(pol, req, view, 0.0)
    assert (d.route, d.prefill_worker, d.decode_worker, d.reason) == ("disagg", "prefill-0", "decode-0",
                                                                      REJECTED_REASON)
    assert d.ttft_decode_pred is None and d.step_budget_s == 0.0


def test_the_fallback_deflects_to_a_worker_that_did_not_reject() -> None:
    model = load_profile("a100-dsv2-lite").model
    view = _views(model)
    req = RequestSpec(request_id="r", prompt_tokens=500, max_tokens=10, ttft_slo=2.0, tbt_slo=0.1)
    pol = make_policy("kairos", default_model=model)
    assert pol.decide(req, view, 0.0).decode_worker == "decode-0"
    d = decide_without(pol, req, view, 0.0, frozenset({"decode-0"}))
    assert (d.route, d.decode_worker) == ("deflect", "decode-1") and d.step_budget_s > 0
    d = decide_without(pol, req, view, 0.0, frozenset({"decode-0", "decode-1"}))
    assert (d.route, d.reason) == ("disagg", REJECTED_REASON)
    # deflect-all deflects to the open worker; with every one closed it gets least-loaded disagg
    d = decide_without(make_policy("deflect-all"), req, view, 0.0, frozenset({"decode-0"}))
    assert (d.route, d.decode_worker) == ("deflect", "decode-1")
    d = decide_without(make_policy("deflect-all"), req, view, 0.0, frozenset({"decode-0", "decode-1"}))
    assert (d.route, d.prefill_worker, d.decode_worker) == ("disagg", "prefill-0", "decode-0")


def test_a_rejected_deflection_that_late_binding_holds_waits_instead_of_joining_a_deep_prefill_queue() -> None:
    # issue 44 (branch gap44): deflections the decode workers' admission turned away at the change
    # from an output-heavy phase to a prompt-heavy one were sent to the one prefill worker
    # whatever its queue (up to 200k tokens: 20 s), late themselves and every prompt behind them.
    # Decided again, Kairos holds such a request (the queue is deep, no other decode worker can
    # prefill it in place): it waits at the router like any held request, and the same for no
    # decode room (NoDecodeRoom): the least-loaded fallback is only for a policy that cannot decide
    model = load_profile("a100-dsv2-lite").model
    view = _views(model)
    deep = msgspec.structs.replace(view.prefill[0], queued_tokens=40 * 2048, backlog=((40 * 2048, 0),))
    view = ClusterView(prefill=(deep, msgspec.structs.replace(deep, worker_id="prefill-1")), decode=view.decode)
    req = RequestSpec(request_id="r", prompt_tokens=500, max_tokens=10, ttft_slo=2.0, tbt_slo=0.1)
    pol = make_policy("kairos", kairos=KairosConfig(late_binding=True), default_model=model)
    assert pol.decide(req, view, 0.0).route == "deflect"
    with pytest.raises(Hold):
        decide_without(pol, req, view, 0.0, frozenset({"decode-0", "decode-1"}))
    with pytest.raises(Hold):
        decide_without(pol, req, view, 0.0)
    # without late binding the same request is committed to the prefill path, as before
    d = decide_without(make_policy("kairos", default_model=model), req, view, 0.0)
    assert (d.route, d.reason) == ("disagg", REJECTED_REASON)


def test_kairos_plans_under_beta_times_the_strictest_slo() -> None:
    model = load_profile("a100-dsv2-lite").model
    view = _views(model)
    req = RequestSpec(request_id="r", prompt_tokens=500, max_tokens=10, ttft_slo=2.0, tbt_slo=0.1)
    d = make_policy("kairos", default_model=model).decide(req, view, 0.0)
    assert d.route == "deflect" and d.step_budget_s == pytest.approx(0.9 * 0.1)


# ------------------------------------------------------------------ the decode worker


@pytest.fixture
async def decode(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[DecodeWorker, FakeRouter]]:
    async for x in _start("decode", monkeypatch):
        yield x


def deflection(rid: str, budget: float, schedule: tuple[int, ...] = (1000, 1000), dispatch: int = 1) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect",
                        prompt_token_ids=[1] * sum(schedule), sampling=SAMPLING, tbt_slo=0.1, deadline_s=30.0,
                        chunk_schedule=schedule, step_budget_s=budget)


async def test_decode_worker_rejects_a_deflection_that_does_not_fit_beside_the_accepted_one(
        decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    await asyncio.wait_for(w.answered.wait(), 10)  # welcomed: it knows the router's incarnation
    # back to back, no engine step between them: the first is accepted and still prefilling
    w.on_message(deflection("first", 0.00085))
    w.on_message(deflection("second", 0.00085, dispatch=2))
    assert set(w.accepted) == {"first"}
    hb = w.heartbeat()
    assert hb.held == [m.HeldDeflection(router="fake", reserved_s=pytest.approx(0.0002),  # type: ignore[arg-type]
                                        largest_chunk=1000)]
    f = await router.until(lambda x: isinstance(x, m.RequestFailed))
    assert isinstance(f, m.RequestFailed)
    assert (f.request_id, f.code, f.retryable) == ("second", REJECTED_REASON, True)
    assert "beside 0 decodes and 1 deflections in flight" in f.reason
    assert w.counters["deflect_rejected"] == 1 and "second" not in w.active
    # the first runs to its end, and once its prefill is over the same deflection fits again
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(
        it.request_id == "first" and it.finish_reason == "length" for it in x.items))
    assert w.accepted == {} and w.heartbeat().held == []
    w.on_message(deflection("third", 0.00085, dispatch=3))
    assert set(w.accepted) == {"third"}
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(
        it.request_id == "third" and it.finish_reason == "length" for it in x.items))


async def test_decode_worker_admission_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    async for w, router in _start("decode", monkeypatch, deflect_admission=False):
        w.on_message(deflection("first", 0.00085))
        w.on_message(deflection("second", 0.00085, dispatch=2))
        assert {"first", "second"} <= set(w.active) and w.counters["deflect_rejected"] == 0
        done: set[str] = set()
        while done != {"first", "second"}:
            b = await router.until(lambda x: isinstance(x, m.TokenBatch))
            assert isinstance(b, m.TokenBatch)
            done |= {it.request_id for it in b.items if it.finish_reason == "length"}


async def test_a_cancelled_deflection_frees_its_reservation(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    w.on_message(deflection("first", 0.00085, schedule=(1000,) * 50))
    assert set(w.accepted) == {"first"}
    await router.send(m.Cancel(request_id="first", attempt=0, reason="client_disconnected"))
    await router.send(deflection("second", 0.00085, dispatch=2))
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(
        it.request_id == "second" and it.finish_reason == "length" for it in x.items))
    assert "first" not in w.accepted and w.counters["deflect_rejected"] == 0


# ------------------------------------------------------------------ the router


@pytest.fixture
def captured() -> Iterator[tuple[Router, list[tuple[str, m.Msg]]]]:
    router = make_router()
    yield router, sent(router)
    router.close()


def _rejected() -> float:
    return metrics.DEFLECT_REJECTED._value.get()  # type: ignore[no-any-return]


async def test_router_sends_a_rejected_deflection_down_the_disaggregated_path(
        captured: tuple[Router, list[tuple[str, m.Msg]]]) -> None:
    router, sent = captured
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    sent.clear()  # the Welcomes
    req = router.submit([1] * 300, SAMPLING)
    (peer, work), = sent
    assert peer == "decode-0" and isinstance(work, m.DecodeWork) and work.mode == "deflect"
    assert work.step_budget_s == pytest.approx(router.cfg.beta * req.tbt_slo)
    sent.clear()
    before = _rejected()
    frame(router, b"decode-0", m.RequestFailed(request_id=req.request_id, attempt=0, worker_id="decode-0",
                                               reason="step 1 of 1 would take 1 ms > 0.5 ms budget",
                                               code=REJECTED_REASON))
    kinds = sorted((peer, type(msg).__name__, getattr(msg, "mode", "")) for peer, msg in sent)
    assert kinds == [("decode-0", "DecodeWork", "handoff"), ("prefill-0", "PrefillWork", "")]
    assert req.decision is not None and req.decision.reason == REJECTED_REASON
    assert (req.prefill_worker, req.attempt, req.done) == ("prefill-0", 0, False)
    assert router.counts["deflect_rejected"] == 1 and _rejected() == before + 1
    assert router.counts["redispatched"] == 0
    assert "decode-0" in router.table.workers and req.request_id not in router.table.workers["decode-0"].deflecting
    # the disaggregated path completes as usual
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=300)
    frame(router, b"prefill-0", m.PrefillDone(request_id=req.request_id, attempt=0, worker_id="prefill-0", kv=kv,
                                              queue_s=0, prefill_s=0))
    frame(router, b"decode-0", m.TokenBatch(worker_id="decode-0", items=[m.TokenItem(req.request_id, 0, [5, 6],
                                                                                      "length")]))
    assert req.done and req.outcome == "ok"
    assert req.record(0.0).reason == REJECTED_REASON


async def test_router_tries_another_decode_worker_before_the_disaggregated_path(
        captured: tuple[Router, list[tuple[str, m.Msg]]]) -> None:
    router, sent = captured
    for wid in ("decode-0", "decode-1"):
        frame(router, wid.encode(), hello(wid))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    sent.clear()
    req = router.submit([1] * 300, SAMPLING)
    first = req.decode_worker
    other = "decode-1" if first == "decode-0" else "decode-0"
    for wid in (first, other):
        assert req.decode_worker == wid and req.decision is not None and req.decision.route == "deflect"
        sent.clear()
        frame(router, wid.encode(), m.RequestFailed(request_id=req.request_id, attempt=0, worker_id=wid,
                                                    reason="no room", code=REJECTED_REASON))
    assert req.decision.route == "disagg" and req.prefill_worker == "prefill-0"
    assert sorted(type(msg).__name__ for _, msg in sent) == ["DecodeWork", "PrefillWork"]
    assert router.counts["deflect_rejected"] == 2 and req.rejected_by == {"decode-0", "decode-1"}


def test_router_view_adds_the_deflections_other_routers_sent() -> None:
    router = make_router()
    try:
        frame(router, b"decode-0", hello("decode-0"))
        e = router.table.workers["decode-0"]
        held = [m.HeldDeflection(router="other-router", reserved_s=0.003, largest_chunk=512),
                m.HeldDeflection(router=router.incarnation, reserved_s=0.005, largest_chunk=256)]
        router.table.heartbeat(m.DecodeHeartbeat(
            worker_id="decode-0", incarnation="i1", seq=1, batch=0, kv_tokens=0, kv_free_tokens=10**6,
            kv_capacity_tokens=10**6, resident_prefill_tokens=0, deflections=2, strictest_tbt_slo=0.1,
            token_budget=2048, held=held), time.monotonic())
        e.add_deflection("mine", 0.005, 256, 0.0)  # this router's own record of the second one
        (d,) = router.table.view(use_ledger=True).decode
        assert d.deflections == 2 and d.reserved_step_s == pytest.approx(0.008) and d.reserved_tokens == 768
        (d,) = router.table.view(use_ledger=False).decode  # the paper's view: heartbeats only
        assert d.deflections == 2 and d.reserved_step_s == 0.0
    finally:
        router.close()


async def test_router_without_a_prefill_worker_deflects_again_unchecked(
        captured: tuple[Router, list[tuple[str, m.Msg]]]) -> None:
    router, sent = captured
    frame(router, b"decode-0", hello("decode-0"))
    sent.clear()
    req = router.submit([1] * 300, SAMPLING)
    assert isinstance(sent[0][1], m.DecodeWork) and sent[0][1].step_budget_s > 0
    sent.clear()
    frame(router, b"decode-0", m.RequestFailed(request_id=req.request_id, attempt=0, worker_id="decode-0",
                                               reason="no room", code=REJECTED_REASON))
    (_, again), = sent
    assert isinstance(again, m.DecodeWork) and again.mode == "deflect" and again.step_budget_s == 0.0
    assert not req.done


# ------------------------------------------------------------------ the simulator's routers


def _burst(n: int = 40) -> list[TraceRequest]:
    """Short prompts arriving faster than heartbeats: the routers keep deflecting."""
    return [TraceRequest(0.01 * i, 3000 + 100 * (i % 7), 40) for i in range(n)]


def _sim(routers: int, admission: bool, **kw: object) -> tuple[dict[str, object], dict[str, object]]:
    prof = load_profile("a100-dsv2-lite")
    res = simulate(_burst(), prof, make_policy("kairos", default_model=prof.model),
                   SimConfig(routers=routers, admission=admission, **kw))  # type: ignore[arg-type]
    return summarize(res.records, ttft_slo=2.0, tbt_slo=0.1), res.stats


def test_sim_routers_that_see_only_their_own_deflections_stack_them_and_break_the_tbt_slo() -> None:
    """Without admission and without the worker's chunk guard (closed_loop), stacked deflections
    break gaps; the guard, which cuts each step's chunks to the strictest TBT SLO beside the
    batch, already keeps part of them (admission, below, keeps all)."""
    one, _ = _sim(1, admission=False, held_list=False, closed_loop=False)
    four, _ = _sim(4, admission=False, held_list=False, closed_loop=False)
    assert one["tbt_slo_attainment"] == 1.0
    assert four["tbt_slo_attainment"] < 0.9  # type: ignore[operator]
    assert four["deflection_rate"] > one["deflection_rate"]  # type: ignore[operator]
    guarded, _ = _sim(4, admission=False, held_list=False)
    assert guarded["tbt_slo_attainment"] > four["tbt_slo_attainment"]  # type: ignore[operator]


def test_sim_admission_keeps_the_tbt_slo_with_several_routers() -> None:
    four, stats = _sim(4, admission=True, held_list=False)
    assert four["tbt_slo_attainment"] == 1.0
    assert stats["admission_rejected"] > 0 and stats["routers"] == 4  # type: ignore[operator]
    reasons = four["reasons"]
    assert isinstance(reasons, dict) and REJECTED_REASON in reasons


def test_sim_heartbeats_listing_held_deflections_keep_the_routers_apart() -> None:
    """Routers that see the others' deflections (decode heartbeats list them, at once on a
    change) no longer stack them: the TBT SLO holds without admission, and with it few are
    rejected."""
    listed, _ = _sim(4, admission=False, held_list=True)
    assert listed["tbt_slo_attainment"] == 1.0
    _, blind = _sim(4, admission=True, held_list=False)
    both, stats = _sim(4, admission=True, held_list=True)
    assert both["tbt_slo_attainment"] == 1.0
    assert stats["admission_rejected"] < blind["admission_rejected"]  # type: ignore[operator]


def test_sim_heartbeats_at_dispatch_make_replicas_one_router() -> None:
    """Live workers heartbeat when work reaches them (2 ms later, the default) or at once (0):
    routers that see every dispatch that soon decide as one router does; with periodic
    heartbeats only (-1) they do not."""
    for beat in (0.0, 0.002):
        one, _ = _sim(1, admission=True, prompt_beat=beat)
        four, _ = _sim(4, admission=True, prompt_beat=beat)
        assert four["ttft_p95"] == pytest.approx(one["ttft_p95"], rel=0.02)  # type: ignore[arg-type]
        assert four["tbt_slo_attainment"] == one["tbt_slo_attainment"] == 1.0
    one, _ = _sim(1, admission=True, prompt_beat=-1)
    four, _ = _sim(4, admission=True, prompt_beat=-1)
    assert four["ttft_p95"] != pytest.approx(one["ttft_p95"], rel=0.02)  # type: ignore[arg-type]


def test_sim_one_router_with_admission_is_the_router_without() -> None:
    on, s_on = _sim(1, admission=True)
    off, _ = _sim(1, admission=False)
    assert s_on["admission_rejected"] == 0
    assert on["ttft_p95"] == off["ttft_p95"] and on["tbt_slo_attainment"] == off["tbt_slo_attainment"]


def test_sim_config_needs_a_router() -> None:
    with pytest.raises(ValueError, match="at least one router"):
        SimConfig(routers=0)


# ------------------------------------------------------------------ a live cluster


@pytest.fixture(scope="module")
def blind_router_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """1P1D with steps slow enough (40 ms + 0.2 ms per token) for deflections to overlap, a 1 s
    TBT SLO, and a router whose ledger is off: it does not reserve its own deflections in flight,
    as a replica does not see another's, so it stacks them and the decode worker must say no."""
    tmp = tmp_path_factory.mktemp("admission")
    base = load_profile("fast")
    prof = msgspec.structs.replace(base, name="slow-steps",
                                   model=msgspec.structs.replace(base.model, a0=0.04, a3=2e-4))
    path = tmp / "slow-steps.json"
    save_profile(prof, path)
    c = start_cluster(tmp, prefill=1, decode=1, profile=str(path), policy="kairos", kv_transport="modeled",
                      router_env={"KAIROS_LEDGER": "false", "KAIROS_TBT_SLO": "1.0", "KAIROS_TTFT_SLO": "10"})
    yield c
    c.stop(15)


async def test_live_decode_worker_rejects_stacked_deflections_and_every_request_completes(
        blind_router_cluster: Cluster) -> None:
    api = blind_router_cluster.spec.api
    body = {"prompt": [5] * 3000, "max_tokens": 3, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        rs = await asyncio.gather(*[client.post(api + "/v1/completions", json=body) for _ in range(6)])
    assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in rs)
    code, s = blind_router_cluster.get("/v1/kairos/stats")
    assert code == 200
    counts = s["counts"]
    assert counts.get("deflect_rejected", 0) >= 1, counts
    assert counts.get("redispatched", 0) == 0 and counts["completed"] >= 6


def test_router_keeps_a_workers_view_until_it_changes() -> None:
    """The policy keeps per-view work by identity: an unchanged worker keeps its view object
    between decisions, and every change to what a view is built from gives a new one."""
    router = make_router()
    try:
        frame(router, b"decode-0", hello("decode-0"))
        e = router.table.workers["decode-0"]

        def view() -> object:
            (d,) = router.table.view(use_ledger=True).decode
            return d

        def beat(seq: int, batch: int) -> None:
            router.table.heartbeat(m.DecodeHeartbeat(
                worker_id="decode-0", incarnation="i1", seq=seq, batch=batch, kv_tokens=0, kv_free_tokens=10**6,
                kv_capacity_tokens=10**6, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1,
                token_budget=2048, last_dispatch=seq - 1), time.monotonic())

        beat(1, 3)
        v = view()
        assert view() is v
        changes = [lambda: beat(2, 4),  # a heartbeat
                   lambda: e.next_dispatch(LedgerEntry("r1", 100, 200, deflect=False)),  # the ledger
                   lambda: beat(3, 4),  # acknowledges r1
                   lambda: e.add_deflection("r2", 0.01, 256, 1.0),
                   lambda: e.end_deflection("r2")]
        for change in changes:
            change()
            w = view()
            assert w is not v and view() is w
            v = w
        assert view().batch == 4 and view().pending == 0 and view().deflections == 0
    finally:
        router.close()
