"""The replay TTFT predictor: exact against the simulator on noise-free queues, cheap by its
cache, safe on stale views; the decode path's schedules never exceed the token budget."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engines.batcher import Batcher, Seq
from common.engines.replay import alone, drain, extend, replay
from common.perf_model import load_profile
from common.policy import (
    ClusterView,
    Decision,
    DecodeView,
    KairosConfig,
    NoWorkers,
    Policy,
    PrefillView,
    RequestSpec,
    make_policy,
)
from common.policy.kairos import Kairos
from common.policy.predict import ReplayCache
from common.policy.schedule import largest_safe_schedule, search
from common.traces import TraceRequest
from sim.core import SimConfig, Simulation

PROF = load_profile("a100-dsv2-lite")
M = PROF.model


class Probe(Policy):
    """Routes like disagg-least-loaded and records Kairos's replay prediction for the chosen
    prefill worker (prefill end, no transfer), to compare with what the simulator then does."""

    name = "probe"

    def __init__(self) -> None:
        self.inner = make_policy("disagg-least-loaded")
        self.kairos = Kairos(KairosConfig())

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        d = self.inner.decide(req, view, now)
        p = next(x for x in view.prefill if x.worker_id == d.prefill_worker)
        tail = self.kairos._tail(p, p.model, now)
        t = self.kairos._replay_ttft(p, p.model, tail, req.prompt_tokens,
                                     alone(p.model, p.token_budget, req.prompt_tokens), now)
        return msgspec.structs.replace(d, ttft_prefill_pred=t)


def random_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(8.0)
        out.append(TraceRequest(t, rng.choice([rng.randint(1, 300), rng.randint(300, 7000)]), rng.randint(1, 20)))
    return out


@pytest.mark.parametrize(("seed", "heartbeat", "max_batch"),
                         [(0, 0.0, 256), (1, 0.0, 3), (2, 0.05, 256), (3, 0.2, 256), (4, 0.05, 2)])
def test_replay_is_exact_on_a_noise_free_queue(seed: int, heartbeat: float, max_batch: int) -> None:
    """For every request of a random burst, the predicted prefill end equals the simulated one
    once later arrivals are taken away (they may share its last step; no predictor sees them):
    with fresh views, and with stale heartbeats plus the ledger's dispatch times."""
    rng = random.Random(seed)
    trace = random_trace(rng, 40)
    prof = msgspec.structs.replace(PROF, max_batch=max_batch)
    for k in range(1, len(trace) + 1):
        res = Simulation(prof, Probe(), SimConfig(prefill=2, decode=1, heartbeat_interval=heartbeat)).run(trace[:k])
        r = res.records[-1]
        assert r.ttft_pred is not None and r.queue_s is not None and r.prefill_s is not None
        assert r.ttft_pred == pytest.approx(r.queue_s + r.prefill_s, rel=1e-9, abs=1e-12), f"request {k - 1}"


def test_replay_follows_the_batcher() -> None:
    """The replay's steps are the prefill Batcher's steps (the rule it mirrors), step by step."""
    rng = random.Random(9)
    for _ in range(200):
        budget, cap = rng.choice([512, 2048, 3000]), rng.choice([1, 2, 256])
        prompts = [rng.randint(1, 6000) for _ in range(rng.randint(1, 8))]
        b = Batcher(role="prefill", token_budget=budget, max_batch=cap, kv_capacity_tokens=10**9, default_chunk=budget)
        for i, p in enumerate(prompts):
            b.add(Seq(request_id=str(i), attempt=0, prompt_len=p, max_tokens=1))
        t = 0.0
        while (plan := b.plan()) is not None:
            t += M.step_time(plan.batch, plan.kv_tokens, plan.chunk_pairs())
            b.commit(plan)
        assert replay(M, budget, cap, 0.0, [(p, 0, -1.0) for p in prompts]).end == pytest.approx(t, rel=1e-12)


def test_cache_extends_by_the_ledger_and_replays_after_a_heartbeat() -> None:
    cache = ReplayCache()
    backlog = ((5000, 1000), (3000, 0))
    base = drain(M, 2048, 256, 1.0, backlog)
    a = cache.tail("p", M, 2048, 256, base, ())
    b = cache.tail("p", M, 2048, 256, base, ((700, 1.1),))
    full = replay(M, 2048, 256, 1.0, [(5000, 1000, -1.0), (3000, 0, -1.0), (700, 0, 1.1)])
    assert b.end == pytest.approx(full.end) and b.end > a.end and a is base
    assert extend(M, 2048, 256, a, 700, 1.1).end == pytest.approx(full.end)
    assert cache.tail("p", M, 2048, 256, base, ((700, 1.1),)) is b  # the same view: no work
    c = cache.tail("p", M, 2048, 256, base, ((700, 1.1), (50, 1.2)))  # one more: extended from b
    assert c.end == pytest.approx(replay(M, 2048, 256, 1.0, [*full_items(), (50, 0, 1.2)]).end)
    fresh = cache.tail("p", M, 2048, 256, drain(M, 2048, 256, 2.0, ((100, 0),)), ())  # a new heartbeat
    assert fresh.end == pytest.approx(2.0 + M.step_time(0, 0, [(100, 0)]))


def full_items() -> list[tuple[int, int, float]]:
    return [(5000, 1000, -1.0), (3000, 0, -1.0), (700, 0, 1.1)]


def pv(backlog: tuple[tuple[int, int], ...] | None, busy: float, ledger: tuple[tuple[int, float], ...] = (),
       queued: int = 0) -> PrefillView:
    return PrefillView(worker_id="prefill-0", queued_tokens=queued, queued_requests=len(backlog or ()) + len(ledger),
                       token_budget=2048, model=M, backlog=backlog, busy_until=busy, ledger=ledger, max_batch=256)


def dv(batch: int = 0, kv: int = 0, budget: int = 2304, reserved_tokens: int = 0, busy: float = 0.0,
       reserved: float = 0.0, defl: int = 0) -> DecodeView:
    return DecodeView(worker_id="decode-0", batch=batch, kv_tokens=kv, kv_free_tokens=10**7, kv_capacity_tokens=10**7,
                      resident_prefill_tokens=0, deflections=defl, strictest_tbt_slo=0.1 if batch else None,
                      token_budget=budget, model=M, reserved_step_s=reserved, reserved_tokens=reserved_tokens,
                      busy_until=busy)


def rq(tokens: int) -> RequestSpec:
    return RequestSpec(request_id="r", prompt_tokens=tokens, max_tokens=8, ttft_slo=2.0, tbt_slo=0.1)


def test_stale_views_stay_safe() -> None:
    """A stale view (its step in flight ended long ago) never predicts less than the prompt
    alone on the worker; an unreported backlog counts the queued tokens, not zero."""
    k = Kairos(KairosConfig(), default_model=M)
    own = alone(M, 2048, 3000)
    for busy, backlog in [(0.0, ()), (5.0, ((4000, 2048),)), (9.0, ((30_000, 0), (100, 0)))]:
        p = pv(backlog, busy)
        t = k._replay_ttft(p, M, k._tail(p, M, 10.0), 3000, own, 10.0)
        assert t >= own * (1 - 1e-12)
    blind = pv(None, 0.0, queued=40_000)
    seen = pv(((40_000, 0),), 10.0)
    assert k._replay_ttft(blind, M, k._tail(blind, M, 10.0), 3000, own, 10.0) == pytest.approx(
        k._replay_ttft(seen, M, k._tail(seen, M, 10.0), 3000, own, 10.0))
    # the decode path: a fresh busy_until adds its remainder, a stale one (the worker is busy at
    # an unknown phase) half a decode step; either way the step in flight first adds one token
    # to each decode's context
    view = ClusterView(prefill=(pv((), 0.0),), decode=(dv(batch=20, kv=40_000, busy=9.0),))
    later = ClusterView(prefill=(pv((), 0.0),), decode=(dv(batch=20, kv=40_000, busy=10.03),))
    a, b = k.decide(rq(900), view, 10.0), k.decide(rq(900), later, 10.0)
    assert a.route == b.route == "deflect" and a.chunk_schedule == b.chunk_schedule
    half = 0.5 * M.decode_time(20, 40_000)
    assert (a.ttft_decode_pred or 0.0) - half == pytest.approx((b.ttft_decode_pred or 0.0) - 0.03, rel=1e-12)
    idle = ClusterView(prefill=(pv((), 0.0),), decode=(dv(),))
    c = k.decide(rq(900), idle, 10.0)  # an idle worker: no wait
    assert c.ttft_decode_pred == pytest.approx(M.step_time(0, 0, [(900, 0)]))


def test_paper_predictor_is_selectable() -> None:
    busy = dv(batch=256, kv=900_000)
    view = ClusterView(prefill=(pv(((30_000, 0), (20_000, 0)), 0.0, queued=50_000),), decode=(busy,))
    paper = make_policy("kairos", kairos=KairosConfig(predictor="paper")).decide(rq(2000), view, 0.0)
    replayed = make_policy("kairos").decide(rq(2000), view, 0.0)
    assert paper.route == replayed.route == "disagg"
    eq1 = M.queue_wait(50_000, 2048) + M.prefill_exec(2000, 2048) + M.xfer_time(2000)
    assert paper.ttft_prefill_pred == pytest.approx(eq1)
    assert replayed.ttft_prefill_pred != pytest.approx(eq1)
    with pytest.raises(ValueError, match="predictor"):
        KairosConfig(predictor="oracle")  # type: ignore[arg-type]


@pytest.mark.parametrize("exact", [False, True])
def test_search_steps_equal_the_step_time(exact: bool) -> None:
    """The search writes PerfModel.step_time out for speed; this fails if the two drift apart
    (a new cost form must be written into `search` too)."""
    d = dv(batch=37, kv=90_000)
    st_, sched, total = search(M, d, 6000, 0.2, [2048, 1024, 512, 256], float("inf"), 4096, exact)
    assert st_ == 0
    want, done = 0.0, 0
    for i, chi in enumerate(sched):
        kv = d.kv_tokens + (d.batch * i if exact else done)
        want += M.step_time(d.batch, kv, [(chi, done)])
        done += chi
    assert total == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("exact", [False, True])
def test_search_runs_of_equal_chunks_equal_the_step_by_step_walk(exact: bool) -> None:
    """The search walks a run of equal chunks in closed form; on random states (long prompts,
    so runs are long) every step of its schedule fits the budget, the next larger candidate
    would not have (the greedy), and its TTFT_D is the sum of the steps' PerfModel.step_time."""
    rng = random.Random(7)
    cands = [2048, 1024, 512, 256, 128]
    for _ in range(300):
        d = dv(batch=rng.randint(0, 150), kv=rng.randint(0, 300_000))
        tokens, budget = rng.randint(1, 40_000), rng.uniform(0.05, 0.4)
        st_, sched, total = search(M, d, tokens, budget, cands, float("inf"), 4096, exact)
        if st_ != 0:
            continue
        want, done = 0.0, 0
        for i, chi in enumerate(sched):
            kv = d.kv_tokens + (d.batch * i if exact else done)
            t = M.step_time(d.batch, kv, [(chi, done)])
            assert t <= budget * (1 + 1e-9)
            bigger = [c for c in cands if c > chi and c <= tokens - done]
            if bigger:
                assert M.step_time(d.batch, kv, [(min(bigger), done)]) > budget * (1 - 1e-9)
            want += t
            done += chi
        assert done == tokens
        assert total == pytest.approx(want, rel=1e-9)


def test_deflected_prediction_is_exact_in_the_simulator() -> None:
    """With fresh views and no noise, TTFT_D is what the decode worker then takes: the wait for
    its step in flight, then the schedule's steps with the decodes' context growing."""
    trace = [TraceRequest(0.0, 800, 3000), TraceRequest(0.31, 600, 3000), TraceRequest(1.7, 5000, 4)]
    res = Simulation(PROF, make_policy("kairos"), SimConfig(prefill=0, decode=1, heartbeat_interval=0.0)).run(trace)
    for r in res.records:
        assert r.route == "deflect" and r.ttft is not None
        assert r.ttft_pred == pytest.approx(r.ttft, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(0, 400), reserved_tokens=st.integers(0, 2000), budget=st.integers(256, 4096),
       tokens=st.integers(1, 20_000), slo=st.sampled_from([0.05, 0.1, 0.3, 1.0]))
def test_schedule_fits_the_decode_token_budget(batch: int, reserved_tokens: int, budget: int, tokens: int,
                                               slo: float) -> None:
    d = dv(batch=batch, kv=batch * 1500, budget=budget, reserved_tokens=reserved_tokens)
    found = largest_safe_schedule(M, d, tokens, slo, (2048, 1024, 512, 256, 128), float("inf"), 4096, exact=True,
                                  fit=True)
    if found is not None:
        assert sum(found[0]) == tokens
        assert max(found[0]) + batch + reserved_tokens <= budget


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(64, 3000), decodes=st.integers(0, 60),
       schedules=st.lists(st.lists(st.integers(1, 2048), min_size=1, max_size=6), min_size=1, max_size=4))
def test_decode_batcher_never_exceeds_its_token_budget(budget: int, decodes: int, schedules: list[list[int]]) -> None:
    """Whatever schedules the router sent, a decode step holds at most `token_budget` tokens
    (decodes first), and every deflected prompt is still prefilled in full."""
    b = Batcher(role="decode", token_budget=budget, max_batch=10**6, kv_capacity_tokens=10**9, default_chunk=512)
    for i in range(decodes):
        b.add(Seq(request_id=f"d{i}", attempt=0, prompt_len=100, max_tokens=10**6, computed=100))
    for i, sched in enumerate(schedules):
        b.add(Seq(request_id=f"p{i}", attempt=0, prompt_len=sum(sched), max_tokens=10**6, schedule=deque(sched),
                  deflected=True))
    steps = 0
    while any(s.prefilling for s in b.running):
        plan = b.plan()
        assert plan is not None
        assert plan.num_tokens <= max(budget, len(plan.decodes))
        b.commit(plan)
        steps += 1
        assert steps <= sum(map(len, schedules)) * 2048  # progress every step (decodes < budget)


def test_kairos_cli_switches(tmp_path: Any) -> None:
    import json

    from sim.cli import main

    out = tmp_path / "r.json"
    assert main(["--trace", "synthetic", "--duration", "30", "--policy", "kairos", "--predictor", "paper",
                 "--no-budget-fit", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    knobs = res["config"]["settings"]["kairos"]["policy"]
    assert knobs["predictor"] == "paper" and knobs["budget_fit"] is False and knobs["max_deflections"] == 4
    assert set(res["policies"]["kairos"]["ttft_pred_mape_by_route"]) == {"disagg", "deflect"}



def test_router_view_carries_the_workers_drain_on_its_clock() -> None:
    """The live path: a prefill heartbeat's backlog and drain (seconds after the heartbeat)
    reach the policy on the router's clock, as the same objects until the next heartbeat (so the
    replay cache extends them by the ledger instead of starting over)."""
    from common import messages as wire
    from common.router_core.workers import LedgerEntry, WorkerTable

    table = WorkerTable(M)
    hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id="prefill-0", role="prefill", incarnation="i",
                       engine="sim", model="x", token_budget=2048, coeffs=M.to_coeffs())
    entry, _ = table.register(hello, b"id", 0.0)
    backlog = [(5000, 1000), (3000, 0)]
    t = drain(M, 2048, 256, 0.05, backlog)
    hb = wire.PrefillHeartbeat(worker_id="prefill-0", incarnation="i", seq=1, queued_tokens=7000, queued_requests=2,
                               token_budget=2048, backlog=backlog, busy_s=0.05, max_batch=256,
                               drain=wire.QueueDrain(start_s=t.start, chunks=list(t.chunks), used=t.used, end_s=t.end))
    hb = codec_roundtrip(hb)
    table.heartbeat(hb, 0.0)
    entry.next_dispatch(LedgerEntry("r1", 700, 0, deflect=False, at=entry.hb_at + 0.01))
    v1 = table.view(use_ledger=True).prefill[0]
    v2 = table.view(use_ledger=True).prefill[0]
    assert v1.drain is v2.drain and v1.backlog is v2.backlog and v1.backlog == tuple(backlog)
    assert v1.drain is not None and v1.drain.end == pytest.approx(entry.hb_at + t.end)
    assert v1.busy_until == pytest.approx(entry.hb_at + 0.05) and v1.ledger == ((700, entry.hb_at + 0.01),)
    k = Kairos(KairosConfig())
    now = entry.hb_at + 0.02
    want = replay(M, 2048, 256, entry.hb_at + 0.05,
                  [(5000, 1000, -1.0), (3000, 0, -1.0), (700, 0, entry.hb_at + 0.01), (900, 0, now)]).end - now
    got = k._replay_ttft(v1, M, k._tail(v1, M, now), 900, alone(M, 2048, 900), now)
    assert got == pytest.approx(want, rel=1e-9)


def codec_roundtrip(msg: Any) -> Any:
    from common import codec

    return codec.heartbeat_inbox.decode(codec.encode(msg))


def test_a_deflection_in_flight_counts_in_ttft_only_until_it_ends() -> None:
    """Its reserved step cost keeps every step of the schedule safe (the same schedule whenever
    it ends), but the predicted TTFT_D pays it only for the steps before its predicted end."""
    k = Kairos(KairosConfig(max_deflections=4), default_model=M)

    def view(end: float) -> ClusterView:
        d = msgspec.structs.replace(dv(batch=20, kv=40_000, reserved=0.02, defl=1), inflight=((end, 0.02, 0),))
        return ClusterView(prefill=(pv((), 0.0),), decode=(d,))

    long, short = k.decide(rq(6000), view(1e9), 0.0), k.decide(rq(6000), view(0.0), 0.0)
    assert long.route == short.route == "deflect" and long.chunk_schedule == short.chunk_schedule
    n = len(long.chunk_schedule)
    assert (long.ttft_decode_pred or 0.0) - (short.ttft_decode_pred or 0.0) == pytest.approx(0.02 * n, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(0, 300), budget=st.integers(256, 2304), tokens=st.integers(1, 12_000),
       inflight=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 1024)), max_size=4))
def test_schedule_leaves_the_live_deflections_their_tokens(batch: int, budget: int, tokens: int,
                                                           inflight: list[tuple[float, int]]) -> None:
    """With deflections in flight, every chunk fits the token budget beside the decodes and the
    largest chunks of the deflections predicted to be still running at its step."""
    d = msgspec.structs.replace(dv(batch=batch, kv=batch * 1000, budget=budget, defl=len(inflight)),
                                inflight=tuple((end, 0.0, k) for end, k in inflight))
    k = Kairos(KairosConfig(max_deflections=8), default_model=M)
    view = ClusterView(prefill=(), decode=(d,))
    req = RequestSpec(request_id="r", prompt_tokens=tokens, max_tokens=1, ttft_slo=1e9, tbt_slo=1.0)
    try:
        dec = k.decide(req, view, 0.0)
    except NoWorkers:
        return
    wait = 0.5 * M.decode_time(batch, batch * 1000) if batch or inflight else 0.0  # a busy worker, phase unknown
    t = 0.0  # from the schedule's start
    done = 0
    for i, chi in enumerate(dec.chunk_schedule):
        live = sum(k_ for end, k_ in inflight if end - wait > t)
        assert chi + batch + live <= budget
        t += M.step_time(batch, batch * 1000 + batch * (i + (1 if wait else 0)), [(chi, done)])
        done += chi


def test_share_expect_counts_what_later_requests_add_to_the_last_step() -> None:
    """After this policy sent a prefill worker tokens at some rate, a prompt whose last step
    starts later (and has spare budget) is predicted slower by what that rate adds to the step;
    switched off, or with nothing sent yet, the prediction is the bare replay."""
    busy = dv(batch=256, kv=3_000_000)  # no decode slack: every request goes to the prefill worker
    view = ClusterView(prefill=(pv(((6000, 0),), 0.0),), decode=(busy,))
    on, off = Kairos(KairosConfig(share_expect=True), default_model=M), Kairos(KairosConfig(), default_model=M)
    first = [k.decide(rq(3000), view, 0.0) for k in (on, off)]
    assert first[0].route == "disagg" and first[0].ttft_prefill_pred == first[1].ttft_prefill_pred
    for i in range(1, 20):  # 3000 tokens every 100 ms: 30k tokens/s at steady state
        a, b = on.decide(rq(3000), view, 0.1 * i), off.decide(rq(3000), view, 0.1 * i)
    assert (a.ttft_prefill_pred or 0.0) > (b.ttft_prefill_pred or 0.0)


def _greedy(model: Any, d: DecodeView, tokens: int, budget: float, cands: list[int], limit: float, exact: bool,
            lead: int, ends: list[tuple[float, float, int]], fit_tokens: int,
            ctx0: int) -> tuple[int, list[int], float]:
    """Algorithm 1 as printed, one step at a time, every candidate tried from the largest each
    step; the step cost is `search`'s (the module docstring's) so that float rounding agrees."""
    b = d.batch
    base0 = (model.a0 + model.a6 + (model.a1 + model.a3) * b + model.a5 * b * b + model.a2 * d.kv_tokens
             + d.reserved_step_s)
    a3 = model.a3 + 2.0 * model.a5 * b
    ka, g = (0.0, model.a2 * b) if exact else (model.a2, 0.0)
    base0 += ka * ctx0
    a3 += model.a4 * ctx0
    total, done, off, ei, sched = 0.0, 0, 0.0, 0, []
    cap = fit_tokens - sum(e[2] for e in ends) if fit_tokens >= 0 else 1 << 60
    while done < tokens:
        while ei < len(ends) and ends[ei][0] <= total:
            off, cap, ei = off + ends[ei][1], cap + ends[ei][2], ei + 1
        base = base0 + ka * done + g * (len(sched) + lead)
        for c in cands:
            chi = min(c, tokens - done)
            t = base + a3 * chi + model.a4 * chi * (done + chi * 0.5) + model.a5 * chi * chi
            if b - model.knee + chi > 0:
                t += model.a7 * (b - model.knee + chi)
            if chi <= cap and t <= budget:
                break
        else:
            return 1, [], 0.0
        sched.append(chi)
        total += t - off
        done += chi
        if total > limit:
            return 2, [], 0.0
    return 0, sched, total


@pytest.mark.parametrize("profile", ["a100-dsv2-lite", "a100-llama2-70b-tp4", "h100-llama2-70b-tp4", "kv-heavy"])
def test_search_equals_the_printed_greedy_with_deflections_in_flight(profile: str) -> None:
    """`search`'s shortcuts (it resumes from the last candidate that fit, tries the whole
    remainder once near the end, and walks runs of equal chunks in closed form, also between the
    ends of deflections in flight) give the printed greedy's schedule, status and TTFT_D, on
    random states: deflections in flight with their predicted ends, the token-budget fit, a
    cached prefix, a step in flight, finite and infinite limits. Past a finite limit it may give
    up as over the limit where the greedy would next find a step with no safe candidate."""
    if profile == "kv-heavy":  # KV reads dearer than prompt tokens: a remainder can cost more a step later
        model, kv_max = msgspec.structs.replace(M, a2=M.a3 * 1.5), 1000
    else:
        model, kv_max = load_profile(profile).model, 300_000
    rng = random.Random(11)
    cands = [2048, 1024, 512, 256, 128]
    seen = {0: 0, 1: 0, 2: 0}
    for _ in range(3000):
        ends = sorted((rng.uniform(-0.05, 1.5), rng.uniform(0.0, 0.02), rng.choice(cands))
                      for _ in range(rng.choice([0, 0, 1, 2, 4])))
        d = dv(batch=rng.randint(0, 150), kv=rng.randint(0, kv_max), reserved=sum(e[1] for e in ends))
        d = msgspec.structs.replace(d, model=model)
        tokens, budget = rng.randint(1, 20_000), rng.uniform(0.03, 0.5)
        exact, lead, ctx0 = rng.random() < 0.7, rng.randint(0, 1), rng.choice([0, 0, rng.randint(1, 8000)])
        fit_tokens = rng.choice([-1, rng.randint(128, 2304)])
        use = [c for c in cands if fit_tokens < 0 or c <= fit_tokens] or cands[-1:]
        limit = rng.choice([float("inf"), rng.uniform(0.05, 3.0)])
        got = search(model, d, tokens, budget, use, limit, 10**6, exact, lead, list(ends) or None, fit_tokens,
                      ctx0)
        want = _greedy(model, d, tokens, budget, use, limit, exact, lead, list(ends), fit_tokens, ctx0)
        free = _greedy(model, d, tokens, budget, use, float("inf"), exact, lead, list(ends), fit_tokens, ctx0)
        if got[0] == 0 or want[0] == 0:
            assert got[0] == want[0] == 0, (got, want)
            assert list(got[1]) == want[1]
            assert got[2] == pytest.approx(want[2], rel=1e-9)
        elif got[0] == 1:  # no schedule at all
            assert free[0] == 1, (got, free)
        else:  # over the limit (a lower bound may say so before a later step turns out infeasible)
            assert free[0] == 1 or free[2] > limit * (1 - 1e-9), (got, free, limit)
        seen[got[0]] += 1
    assert min(seen.values()) > 100, seen  # every outcome was exercised
