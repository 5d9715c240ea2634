"""Kairos's decode path searches workers in increasing lower bound and stops early (branch and
bound); the result must equal searching every worker in id order, as the rule is written. Also:
the handoff of a disaggregated decision is `least_loaded_decode`'s, and `alone` is the step_time sum."""

from __future__ import annotations

import random

import msgspec
import pytest

from common.engines.replay import alone, drain, extend, extend_end, shares
from common.perf_model import PerfModel, Profile, load_profile
from common.policy import (
    ClusterView,
    Decision,
    DecodeView,
    KairosConfig,
    NoWorkers,
    PrefillView,
    RequestSpec,
)
from common.policy.base import least_loaded_decode
from common.policy.kairos import Kairos
from common.policy.schedule import OK, bound_of, held_bound, search, surely_feasible

PROFILES = [load_profile(n) for n in ("a100-dsv2-lite", "a100-llama2-70b-tp4", "h100-llama2-70b-tp4")]


def id_order_best(k: Kairos, req: RequestSpec, view: ClusterView, now: float,
                  limit: float) -> tuple[str, tuple[int, ...], float] | None:
    """The decode path as written: every eligible worker in id order, each search cut at the best
    so far (strictly better replaces it: ties stay with the lowest id), no bound, no early stop."""
    cfg = k.cfg
    replay_p = cfg.predictor == "replay"
    tokens = req.prompt_tokens - (req.cached_tokens if cfg.prefix_aware else 0)
    per_worker = cfg.prefix_aware and bool(req.cached)
    best: tuple[str, tuple[int, ...], float] | None = None
    for d in sorted(view.decode, key=lambda x: x.worker_id):
        if d.deflections >= cfg.max_deflections or d.kv_free_tokens < req.prompt_tokens + req.max_tokens:
            continue
        m = k._model(d.model)
        slo = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else req.tbt_slo
        wait = d.busy_until - now if replay_p and d.busy_until > now else 0.0
        if replay_p and wait == 0.0 and (d.batch or d.deflections):
            wait = 0.5 * m.decode_time(d.batch, d.kv_tokens)
        cap = d.token_budget - d.batch
        ends = sorted((e - now - wait, c, x) for e, c, x in d.inflight) if replay_p and d.inflight else None
        if cfg.budget_fit and not ends:
            cap -= d.reserved_tokens
        cands = [c for c in sorted(cfg.candidates, reverse=True) if c <= cap]
        cut = (limit if best is None else min(limit, best[2])) - wait
        td = req.prompt_tokens - req.cached_on(d.worker_id) if per_worker else tokens
        st, sched, total = search(m, d, td, cfg.beta * slo, cands, cut, cfg.max_steps, replay_p,
                                   1 if wait > 0 else 0, ends, cap if cfg.budget_fit and ends else -1,
                                   req.prompt_tokens - td if per_worker else 0)
        if st == OK and (best is None or total + wait < best[2]):
            best = (d.worker_id, sched, total + wait)
    return best


def random_case(rng: random.Random) -> tuple[PerfModel, KairosConfig, RequestSpec, ClusterView, float]:
    prof = rng.choice(PROFILES)
    fast, slow = prof.model, prof.model.scaled(1.4)
    now = rng.uniform(0.0, 100.0)
    prefill = []
    for i in range(rng.randint(1, 4)):
        m = rng.choice([fast, fast, slow])
        backlog = tuple((rng.randint(1, 9000), 0) for _ in range(rng.choice([0, 0, 1, 4])))
        busy = now + rng.uniform(-0.1, 0.3)
        prefill.append(PrefillView(worker_id=f"prefill-{i}", queued_tokens=sum(p for p, _ in backlog),
                                   queued_requests=len(backlog), token_budget=prof.prefill_token_budget, model=m,
                                   backlog=backlog, busy_until=busy,
                                   drain=drain(m, prof.prefill_token_budget, 256, busy, backlog), max_batch=256))
    decode = []
    for i in range(rng.randint(1, 9)):
        batch = rng.choice([0, rng.randint(1, 40), rng.randint(40, 220)])
        defl = rng.choice([0, 0, 0, 1, 2])
        inflight = tuple((now + rng.uniform(-0.05, 2.0), rng.choice([0.0, 0.01]), rng.choice([128, 512]))
                         for _ in range(defl)) if rng.random() < 0.5 else ()
        decode.append(DecodeView(
            worker_id=f"decode-{i}", batch=batch, kv_tokens=rng.randint(0, 400_000),
            kv_free_tokens=rng.choice([1_000_000, 3000]), kv_capacity_tokens=1_000_000, resident_prefill_tokens=0,
            deflections=defl, strictest_tbt_slo=rng.choice([None, 0.05, 0.1, 0.2]) if batch or defl else None,
            token_budget=rng.choice([prof.decode_token_budget, 2304, 640]), model=rng.choice([fast, fast, slow]),
            reserved_step_s=rng.choice([0.0, 0.0, 0.01]), pending=rng.randint(0, 2),
            reserved_tokens=rng.choice([0, 0, 256]), busy_until=rng.choice([0.0, now + rng.uniform(-0.05, 0.1)]),
            inflight=inflight, step_s=rng.choice([0.0, 0.03])))
    rng.shuffle(decode)
    if rng.random() < 0.3:  # exact twins under other ids: ties, one id before and one after the original
        decode += [msgspec.structs.replace(decode[0], worker_id=decode[0].worker_id + "z"),
                   msgspec.structs.replace(decode[0], worker_id="decode-" + decode[0].worker_id[-1:] + "0")]
    cfg = rng.choice([KairosConfig(), KairosConfig(alpha=1.0), KairosConfig(max_deflections=1),
                      KairosConfig(candidates=(1024, 256), beta=1.0), KairosConfig(budget_fit=False),
                      KairosConfig(predictor="paper")])
    prompt = rng.choice([rng.randint(1, 9000), 2048, rng.randint(9000, 33000)])
    ids = [p.worker_id for p in prefill] + [d.worker_id for d in decode]
    held = tuple((w, rng.randint(0, 12_000)) for w in ids if rng.random() < 0.4) if rng.random() < 0.4 else ()
    req = RequestSpec(request_id="r", prompt_tokens=prompt, max_tokens=rng.randint(1, 400),
                      ttft_slo=rng.choice([0.05, 0.3, 1.0, 2.0, 30.0]), tbt_slo=rng.choice([0.05, 0.1]),
                      cached_tokens=rng.choice([0, 0, 500, prompt]),  # all cached: nothing to prefill
                      cached=held)  # per worker, as the router's prefix index knows it
    return prof.model, cfg, req, ClusterView(prefill=tuple(prefill), decode=tuple(decode)), now


@pytest.mark.parametrize("seed", range(4))
def test_bound_order_search_equals_the_id_order_search(seed: int) -> None:
    rng = random.Random(seed)
    deflected = 0
    for _ in range(400):
        model, cfg, req, view, now = random_case(rng)
        k = Kairos(cfg, default_model=model)
        try:
            d: Decision = k.decide(req, view, now)
        except NoWorkers:
            continue
        assert d.ttft_prefill_pred is not None
        limit = min(cfg.alpha * d.ttft_prefill_pred, req.ttft_slo)
        ref = id_order_best(Kairos(cfg, default_model=model), req, view, now, limit)
        if ref is None:
            assert d.route == "disagg"
            if cfg.predictor == "replay":  # the handoff
                assert d.decode_worker == least_loaded_decode(view, req).worker_id
        else:
            deflected += 1
            assert (d.route, d.decode_worker, d.chunk_schedule, d.ttft_decode_pred) == (
                "deflect", ref[0], ref[1], ref[2])
    assert deflected > 50  # the cases exercise the search, not only the disaggregated path


@pytest.mark.parametrize("seed", range(2))
def test_a_long_lived_policy_decides_as_a_fresh_one(seed: int) -> None:
    """Kairos keeps per-worker work between decisions (the replayed prefill queue, each decode
    view's request-independent terms), keyed by the view object: a policy that has seen other
    views under the same worker ids, and the same view before, decides as a fresh one does; so
    does one that prepared the view first (`Kairos.prepare`, as the router does when views
    change), also for another TBT SLO than the request's."""
    rng = random.Random(100 + seed)
    kept: dict[tuple[KairosConfig, int], Kairos] = {}
    for _ in range(300):
        model, cfg, req, view, now = random_case(rng)
        old = kept.setdefault((cfg, id(model)), Kairos(cfg, default_model=model))
        if rng.random() < 0.5:
            old.prepare(view, now, rng.choice([req.tbt_slo, 0.3]))
        try:
            want = Kairos(cfg, default_model=model).decide(req, view, now)
        except NoWorkers as e:
            with pytest.raises(type(e)):
                old.decide(req, view, now)
            continue
        assert old.decide(req, view, now) == want
        assert old.decide(req, view, now) == want  # the same view again


@pytest.mark.parametrize("prof", PROFILES, ids=lambda p: p.name)
def test_alone_is_the_sum_of_its_step_times(prof: Profile) -> None:
    """`alone` writes `step_time` out (the router runs it per request): bit for bit the same."""
    m = prof.model
    rng = random.Random(5)
    for _ in range(3000):
        budget, tokens = rng.choice([128, 512, 2048, 8192, rng.randint(1, 9000)]), rng.randint(0, 40_000)
        done = rng.choice([0, rng.randint(0, tokens)])
        t, at = 0.0, done
        while at < tokens:
            chi = min(budget, tokens - at)
            t += m.step_time(0, 0, ((chi, at),))
            at += chi
        assert alone(m, budget, tokens, done) == t


@pytest.mark.parametrize("prof", PROFILES, ids=lambda p: p.name)
def test_extend_is_the_replay_one_step_at_a_time(prof: Profile) -> None:
    """`extend` (and `extend_end`, which the decision uses) against the queue's steps timed one
    by one with `step_time`: the shared last step, then the prompt alone, bit for bit."""
    m = prof.model
    rng = random.Random(6)
    shared = 0
    for _ in range(3000):
        budget = rng.choice([512, 2048, 8192])
        backlog = tuple((rng.randint(1, 9000), 0) for _ in range(rng.randint(0, 5)))
        tail = drain(m, budget, rng.choice([0, 2, 256]), 10.0, backlog)
        tokens, join = rng.randint(1, 30_000), rng.uniform(9.0, tail.end + 1.0)
        max_batch = rng.choice([0, 2, 256])
        got = extend(m, budget, max_batch, tail, tokens, join)
        if shares(budget, max_batch, tail, join):
            shared += 1
            chi = min(budget - tail.used, tokens)
            t, done = tail.start + m.step_time(0, 0, (*tail.chunks, (chi, 0))), chi
            assert extend_end(m, budget, tail, tokens) == got.end
        else:
            t, done = max(tail.end, join), 0
        last: tuple[float, tuple[tuple[int, int], ...]] | None = None  # its last step alone
        while done < tokens:
            chi = min(budget, tokens - done)
            last = (t, ((chi, done),))
            t += m.step_time(0, 0, ((chi, done),))
            done += chi
        assert got.end == t
        if last is not None:
            assert (got.start, got.chunks, got.used) == (*last, last[1][0][0])
    assert shared > 300


@pytest.mark.parametrize("seed", range(2))
def test_what_prep_rules_out_has_no_schedule_and_surely_feasible_has_one(seed: int) -> None:
    """`_prep`'s `doom` (no schedule from that prompt size on) and `surely_feasible` (a schedule
    exists) let `decide` and its reason label skip searches; each must agree with `search`
    itself, whatever the step in flight, the deflections in flight and the cached prefix."""
    rng = random.Random(300 + seed)
    doomed = feasible = 0
    for _ in range(300):
        model, cfg, req, view, _ = random_case(rng)
        k = Kairos(cfg, default_model=model)
        exact = cfg.predictor == "replay"
        for d in view.decode:
            slo = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else req.tbt_slo
            prep = k._prep(d, slo)
            cands, doom = prep[7], prep[12]
            for td in {1, 64, 127, 128, 700, 2048, 5000, 20_000, int(min(doom, 1e6))}:
                lead = rng.choice([0, 1])
                ctx0 = rng.choice([0, 0, 3000])
                ends = sorted((rng.uniform(0.0, 1.0), c, x) for _, c, x in d.inflight) or None
                st, _, _ = search(prep[2], d, td, prep[3], cands, float("inf"), cfg.max_steps, exact, lead, ends,
                                   prep[6] if ends and cfg.budget_fit else -1, ctx0)
                if td >= doom:
                    doomed += 1
                    assert st != OK, (td, doom)
                if not ctx0 and not ends and surely_feasible(prep[2], d, td, prep[3], cands, cfg.max_steps, exact,
                                                              lead):
                    feasible += 1
                    assert st == OK, td
    assert doomed > 100 and feasible > 100  # both rules fire in these cases


@pytest.mark.parametrize("seed", range(2))
def test_the_lower_bound_with_deflections_in_flight_is_one(seed: int) -> None:
    """`bound_of` plus `held_bound` (the reserved cost of the deflections in flight over the steps that
    start before each ends) never exceeds the TTFT_D the search finds: branch and bound prunes
    on it."""
    rng = random.Random(500 + seed)
    checked = tight = 0
    for _ in range(400):
        model, cfg, req, view, now = random_case(rng)
        if cfg.predictor != "replay":
            continue
        k = Kairos(cfg, default_model=model)
        for d in view.decode:
            if not d.inflight:
                continue
            slo = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else req.tbt_slo
            prep = k._prep(d, slo)
            terms, cands, budget_s = prep[8], prep[7], prep[3]
            for td in (64, 500, 2048, 6000, 20_000):
                wait = rng.choice([0.0, 0.02])
                ends = sorted((e - now - wait, c, x) for e, c, x in d.inflight)
                st, _, total = search(prep[2], d, td, budget_s, cands, float("inf"), cfg.max_steps, True,
                                       1 if wait else 0, ends, prep[6] if cfg.budget_fit else -1)
                lb = bound_of(terms, td)
                if st != OK or lb <= 0.0:
                    continue
                held = held_bound(terms, td, d.inflight, now + wait, budget_s)
                checked += 1
                tight += held > 0.0
                assert lb + held <= total * (1 + 1e-9), (td, lb, held, total)
    assert checked > 100 and tight > 50


@pytest.mark.parametrize("n", [2, 8])
def test_a_policy_following_changing_views_decides_as_a_fresh_one(n: int) -> None:
    """Views that change a few workers at a time, as the router's do (`kairos bench-decision`'s
    `Cluster`: heartbeats, dispatches folded in, deflections in flight ending): the policy that
    followed them, preparing most of them first (`Kairos.prepare`), decides every request as a
    fresh policy does."""
    from bench.decision_cost import Cluster, make_view

    prof = PROFILES[1]
    rng = random.Random(n)
    lengths = [rng.choice([60, 300, 900, 2048, 3000, 6000]) for _ in range(64)]
    views = [make_view(rng, n, prof.model, prof.prefill_token_budget, prof.decode_token_budget,
                       prof.kv_capacity_tokens, lengths) for _ in range(8)]
    cluster = Cluster(views, prof.model, prof.prefill_token_budget, lengths)
    for cfg in (KairosConfig(), KairosConfig(predictor="paper", max_deflections=1)):
        kept = Kairos(cfg, default_model=prof.model)
        hb = random.Random(1)
        view = cluster.reset()
        for i in range(400):
            now = i * 0.01
            req = RequestSpec(request_id=str(i), prompt_tokens=lengths[i % len(lengths)], max_tokens=64,
                              ttft_slo=2.0, tbt_slo=0.1)
            if i % 3:
                kept.prepare(view, now, 0.1)
            d = kept.decide(req, view, now)
            assert d == Kairos(cfg, default_model=prof.model).decide(req, view, now), i
            view = cluster.after(hb, i, req, d, now)
