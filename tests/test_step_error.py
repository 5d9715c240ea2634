"""common/engines/step_error.py: injected model error, the worker's error estimator, and chunk
planning under a measured error distribution (the closed-loop TBT protection)."""

import math
import random
from collections import deque

import pytest

from common.engines.batcher import Batcher, Seq
from common.engines.step_error import (
    DECODE_TARGET,
    TAIL_SAMPLES,
    TARGET,
    WINDOW,
    ChunkGuard,
    StepError,
    StepErrorEstimator,
    stricter_margin,
)
from common.perf_model import load_profile

PROFILE = load_profile("h100-llama2-70b-tp4")
MODEL = PROFILE.model
SLO = 0.1
BATCH, KV = 48, 48 * 1500


def largest_chunk(limit: float, context: int = 0) -> int:
    """The largest chunk whose step, beside BATCH decodes, the model predicts within `limit`."""
    lo, hi = 1, 16384
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if MODEL.step_time(BATCH, KV, [(mid, context)]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_estimator_plans_with_the_worst_step_seen_until_it_has_enough_for_a_quantile() -> None:
    """Before `min_samples` steps: the margin is the largest ratio seen (at least 1; 1 before any
    step), and the bias the router scales by stays 1. A cold worker on a slow engine does not plan
    its first chunks with the model alone."""
    est = StepErrorEstimator(min_samples=32)
    assert est.margin() == 1.0
    for r in (1.2, 1.6, 1.4):
        est.observe(0.05, 0.05 * r)
    assert est.margin() == pytest.approx(1.6) and est.bias() == 1.0
    for _ in range(29):
        est.observe(0.05, 0.08)
    assert est.bias() == pytest.approx(1.6) and est.margin() > 1.6  # now a quantile of the spread seen
    fast = StepErrorEstimator(min_samples=32)
    fast.observe(0.05, 0.04)
    assert fast.margin() == 1.0  # faster than the model: no margin below 1


def test_estimator_margin_is_the_measured_quantile() -> None:
    rng = random.Random(3)
    src = StepError(noise=0.1).source(0, rng)
    est = StepErrorEstimator(target=0.01, window=4096)
    for _ in range(4096):
        est.observe(0.05, 0.05 * src.factor(0.0))
    # a mean-1 lognormal with sigma 0.1: its 99th percentile is exp(-0.005 + 2.326 * 0.1) = 1.256
    assert est.margin() == pytest.approx(math.exp(-0.005 + 2.326 * 0.1), rel=0.04)
    assert est.bias() == pytest.approx(math.exp(-0.005), rel=0.02)


def test_a_target_smaller_than_the_window_shows_uses_a_fitted_lognormal() -> None:
    """1 %/30 per step (a request meets about 30 steps beside chunks): the window of 512 ratios
    holds too few beyond that quantile, so the margin is a lognormal's fitted to the window."""
    target = 0.01 / 30
    src = StepError(noise=0.1).source(0, random.Random(5))
    est = StepErrorEstimator(target=target)
    for _ in range(2000):
        est.observe(0.05, 0.05 * src.factor(0.0))
    z = 3.40  # the standard normal's 1 - 1/3000 quantile
    assert est.margin() == pytest.approx(math.exp(-0.005 + z * 0.1), rel=0.03)
    exact = StepErrorEstimator(target=target)
    slow = StepErrorEstimator(target=target)
    for _ in range(600):
        exact.observe(0.05, 0.05)
        slow.observe(0.05, 0.05 * 1.15)
    assert exact.margin() == 1.0  # an exact model: no margin, whatever the target
    assert slow.margin() == pytest.approx(1.15)  # a uniform bias: the bias itself


def test_the_decode_room_margin_is_the_same_lognormal_read_at_the_decode_target() -> None:
    """`stricter_margin`: a worker's margin at TARGET, extrapolated to DECODE_TARGET, is what
    the estimator itself reads at DECODE_TARGET from the same steps (both a fitted lognormal's
    quantile, relative to the median); no spread stays no margin."""
    src = StepError(noise=0.1).source(0, random.Random(11))
    at, strict = StepErrorEstimator(target=TARGET), StepErrorEstimator(target=DECODE_TARGET)
    for _ in range(3000):
        f = src.factor(0.0)
        at.observe(0.05, 0.05 * f)
        strict.observe(0.05, 0.05 * f)
    got = stricter_margin(at.margin() / at.bias())
    assert got == pytest.approx(strict.margin() / strict.bias(), rel=0.01)
    assert got > at.margin() / at.bias() * 1.05  # stricter by more than noise: about 1.50 against 1.40
    assert stricter_margin(1.0) == 1.0 and stricter_margin(0.97) == 0.97
    assert stricter_margin(1.3, TARGET, TARGET) == 1.3


def test_a_smaller_overrun_target_makes_overruns_rarer() -> None:
    error = StepError(noise=0.1)
    per_step = overrun_share(ChunkGuard(MODEL, StepErrorEstimator(target=0.01), None), error, steps=20_000)
    per_request = overrun_share(ChunkGuard(MODEL, StepErrorEstimator(target=0.01 / 30), None), error, steps=20_000)
    assert per_request < per_step / 4, (per_request, per_step)


def test_a_slower_engine_is_measured_as_bias_and_margin() -> None:
    est = StepErrorEstimator()
    src = StepError(scale=1.15).source(0, random.Random(0))
    for _ in range(100):
        est.observe(0.04, 0.04 * src.factor(0.0))
    assert est.bias() == pytest.approx(1.15) and est.margin() == pytest.approx(1.15)


@pytest.mark.parametrize("target", [0.01, TARGET])
def test_an_overrun_raises_the_margin_at_once_until_a_step_comes_back(target: float) -> None:
    est = StepErrorEstimator(target=target, min_samples=8)
    for _ in range(300):  # enough that one slow step is not the window's 99th percentile itself
        est.observe(0.05, 0.05)
    assert est.margin() == 1.0
    est.observe(0.05, 0.1)  # a step twice as slow as predicted
    assert est.margin() == pytest.approx(2.0)
    assert est.overruns == 1
    est.observe(0.05, 0.05)  # back within the quantile: the window's margin again
    if target * WINDOW >= TAIL_SAMPLES:
        assert est.margin() == 1.0  # read off the window: the one slow step is beyond the quantile
    else:  # the lognormal fitted to the window remembers the slow step while the window holds it
        assert 1.0 < est.margin() < 1.3


def test_injected_error_kinds() -> None:
    assert StepError().exact and not StepError(scale=1.1).exact
    fleet = StepError(speeds=(0.85, 1.15))
    assert [fleet.speed(i) for i in range(4)] == [0.85, 1.15, 0.85, 1.15]
    slow = StepError(slow_every_s=10.0, slow_for_s=5.0, slow_factor=2.0).source(0, random.Random(1))
    factors = [slow.factor(t * 0.1) for t in range(100_000)]
    share = sum(f == 2.0 for f in factors) / len(factors)
    assert 0.2 < share < 0.45  # slow a third of the time on average (5 s of every 15 s)
    strag = StepError(straggler_p=0.05, straggler_factor=3.0).source(0, random.Random(2))
    share = sum(strag.factor(0.0) == 3.0 for _ in range(20_000)) / 20_000
    assert 0.04 < share < 0.06
    with pytest.raises(ValueError):
        StepError(scale=0.0)


def overrun_share(guard: ChunkGuard | None, error: StepError, steps: int = 3000, learn: bool = True) -> float:
    """Steps that carry a router-planned chunk (packed to the SLO by the model, as a router
    planning with beta = 1 would) beside BATCH decodes, executed with `error`: the share whose
    gap exceeds the SLO."""
    rng = random.Random(11)
    src = error.source(0, rng)
    planned = largest_chunk(SLO)
    over = 0
    for i in range(steps):
        chi = planned if guard is None else guard.fit(BATCH, KV, [], planned, 0, SLO)
        pred = MODEL.step_time(BATCH, KV, [(chi, 0)])
        took = pred * src.factor(i * 0.1)
        if guard is not None and learn:
            guard.estimator.observe(pred, took)
        over += took > SLO
    return over / steps


@pytest.mark.parametrize("error", [StepError(noise=0.1), StepError(scale=1.15),
                                   StepError(noise=0.05, speeds=(1.1,), straggler_p=0.005)])
def test_chunks_planned_from_the_measured_error_keep_gaps_within_the_slo(error: StepError) -> None:
    guarded = overrun_share(ChunkGuard(MODEL, StepErrorEstimator(target=0.01)), error)
    unguarded = overrun_share(None, error)
    frozen = overrun_share(ChunkGuard(MODEL, StepErrorEstimator(target=0.01)), error, learn=False)
    # the target is 1 %: the first min_samples steps are planned with margin 1, and the window's
    # quantile is an estimate, so allow 2.5 %
    assert guarded <= 0.025, guarded
    # without the margin (the model trusted, or the measured error dropped) gaps break far more often
    assert unguarded > 0.2 and frozen > 0.2, (unguarded, frozen)


def test_the_guard_costs_nothing_with_an_exact_model() -> None:
    guard = ChunkGuard(MODEL, StepErrorEstimator())
    assert overrun_share(guard, StepError()) == 0.0
    assert guard.cuts == 0  # a chunk the model says fits is never cut when the model is right


def test_the_batcher_cuts_a_scheduled_chunk_and_carries_the_rest() -> None:
    est = StepErrorEstimator(min_samples=1)
    est.observe(1.0, 1.3)  # this worker runs 30 % slow
    guard = ChunkGuard(MODEL, est)
    b = Batcher(role="decode", token_budget=8192, max_batch=256, kv_capacity_tokens=10_000_000, default_chunk=512,
                prefix_cache=None, guard=guard)
    for i in range(BATCH):
        b.add(Seq(request_id=f"d{i}", attempt=0, prompt_len=1500, max_tokens=1000, computed=1500, tbt_slo=SLO))
    planned = largest_chunk(SLO)
    b.add(Seq(request_id="x", attempt=0, prompt_len=3 * planned, max_tokens=4, tbt_slo=SLO,
              schedule=deque([planned, planned, planned]), deflected=True))
    plan = b.plan()
    assert plan is not None and len(plan.chunks) == 1
    chi = plan.chunks[0][1]
    assert chi == largest_chunk(SLO / 1.3, 0) < planned
    assert MODEL.step_time(plan.batch, plan.kv_tokens, plan.chunk_pairs()) * 1.3 <= SLO
    b.commit(plan)
    seq = b.get("x")
    assert seq is not None and seq.computed == chi and seq.schedule is not None
    assert seq.schedule[0] == planned - chi  # the cut-off part runs next step


def test_a_scheduled_chunk_that_not_one_token_of_fits_beside_the_decodes_waits_a_step() -> None:
    """A step with a chunk costs the model's fixed `a6` (17 ms on the H100 profile) more than a
    decode-only one, so beside a decode batch within a6 of the guard's limit no chunk fits. The
    decode worker's batcher then ran the deflection one token a step anyway, each step ~17 ms
    over the limit (`shift-code`, 10 % noise, x1.25: steps predicted at 82 ms against a 67 ms
    limit, five of them past 100 ms, 119 requests missed TBT; branch noise44c). Now the chunk
    waits, the decodes step alone, and it runs once the batch leaves it room."""
    est = StepErrorEstimator(min_samples=1)
    est.observe(1.0, 1.3)
    guard = ChunkGuard(MODEL, est)
    limit = SLO / guard.margin()
    n = next(n for n in range(1, 400) if MODEL.step_time(n, n * 1000, []) > limit - MODEL.a6 / 2)
    assert MODEL.step_time(n, n * 1000, []) <= limit < MODEL.step_time(n, n * 1000, [(1, 0)])  # the premise
    b = Batcher(role="decode", token_budget=8192, max_batch=512, kv_capacity_tokens=10_000_000, default_chunk=512,
                prefix_cache=None, guard=guard)
    for i in range(n):
        b.add(Seq(request_id=f"d{i}", attempt=0, prompt_len=1000, max_tokens=1000, computed=1000, tbt_slo=SLO))
    b.add(Seq(request_id="x", attempt=0, prompt_len=512, max_tokens=4, tbt_slo=SLO, schedule=deque([256, 256]),
              deflected=True))
    plan = b.plan()
    assert plan is not None and plan.batch == n and plan.chunks == []  # the decodes step alone
    assert MODEL.step_time(plan.batch, plan.kv_tokens, plan.chunk_pairs()) <= limit
    b.commit(plan)
    seq = b.get("x")
    assert seq is not None and seq.computed == 0 and list(seq.schedule or ()) == [256, 256]  # nothing lost
    for i in range(n // 2):  # half the decodes finish: now a chunk fits
        b.remove(f"d{i}")
    plan = b.plan()
    assert plan is not None and len(plan.chunks) == 1 and plan.chunks[0][1] >= 1
    assert MODEL.step_time(plan.batch, plan.kv_tokens, plan.chunk_pairs()) <= limit


# ------------------------------------------------------------------ the router's bias correction


def test_bias_factor_deadband_rounding_and_limits() -> None:
    from common.engines.step_error import bias_factor
    assert bias_factor(1.0) == bias_factor(1.019) == bias_factor(0.981) == 1.0  # an exact model stays exact
    assert bias_factor(1.153) == 1.15 and bias_factor(0.874) == 0.87
    assert bias_factor(5.0) == 2.0 and bias_factor(0.1) == 0.5 and bias_factor(math.nan) == 1.0


def _hello(role: str, wid: str):  # type: ignore[no-untyped-def]
    from common import messages as wire
    return wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id=wid, role=role, incarnation="i", engine="sim",
                      model="x", token_budget=2048, coeffs=MODEL.to_coeffs())


@pytest.mark.parametrize("correct", [True, False])
def test_the_router_predicts_each_worker_with_its_measured_bias(correct: bool) -> None:
    from common import messages as wire
    from common.router_core.workers import WorkerTable

    table = WorkerTable(MODEL, bias_correction=correct)
    table.register(_hello("prefill", "prefill-0"), b"p", 0.0)
    table.register(_hello("decode", "decode-0"), b"d", 0.0)

    def beat(seq: int, bias: float) -> None:
        table.heartbeat(wire.PrefillHeartbeat(worker_id="prefill-0", incarnation="i", seq=seq, queued_tokens=4096,
                                              queued_requests=1, token_budget=2048, step_bias=bias,
                                              drain=wire.QueueDrain(start_s=0.1, chunks=[(2048, 2048)], used=2048,
                                                                    end_s=0.3)), float(seq))
        table.heartbeat(wire.DecodeHeartbeat(worker_id="decode-0", incarnation="i", seq=seq, batch=8, kv_tokens=8000,
                                             kv_free_tokens=10**6, kv_capacity_tokens=10**6,
                                             resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=SLO,
                                             token_budget=2048, step_margin=1.3, step_bias=bias), float(seq))

    beat(1, 1.2)
    view = table.view(use_ledger=True)
    p, d = view.prefill[0], view.decode[0]
    f = 1.2 if correct else 1.0
    assert p.model.a0 == pytest.approx(MODEL.a0 * f) and d.model.a3 == pytest.approx(MODEL.a3 * f)
    assert d.step_margin == pytest.approx(1.3 / f)  # what is left of the margin beside the bias
    entry = table.workers["prefill-0"]
    assert p.drain is not None and p.drain.end - entry.hb_at == pytest.approx(0.3 * f)
    model = p.model
    beat(2, 1.201)  # the same bias: the same model object (the policy caches replays by identity)
    assert table.view(use_ledger=True).prefill[0].model is model
    beat(3, 1.0)
    assert table.view(use_ledger=True).decode[0].model.a0 == pytest.approx(MODEL.a0)


def _sim(correct: bool, scale: float):  # type: ignore[no-untyped-def]
    from common.traces import LENGTHS, synthetic
    from sim.core import SimConfig, simulate
    from sim.knobs import Setup, build, shipped
    from sim.stats import summarize
    trace = synthetic(rate=3.0, duration=120, arrival="onoff", cv=2.2, seed=3, **LENGTHS["code"])  # type: ignore[arg-type]
    policy, prof = build("kairos", shipped("kairos", Setup()), PROFILE)
    cfg = SimConfig(step_scale=scale, bias_correction=correct)
    res = simulate(trace, prof, policy, cfg)
    return summarize(res.records, ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo)


def test_bias_correction_makes_a_slow_engines_ttft_predictable_and_changes_nothing_when_exact() -> None:
    on, off = _sim(True, 1.15), _sim(False, 1.15)
    assert on["ttft_pred_mape"] < 0.8 * off["ttft_pred_mape"], (on["ttft_pred_mape"], off["ttft_pred_mape"])
    exact_on, exact_off = _sim(True, 1.0), _sim(False, 1.0)
    for k in ("slo_attainment", "ttft_p95", "tbt_slo_attainment", "deflection_rate", "ttft_pred_mape"):
        assert exact_on[k] == exact_off[k], k


def test_the_decode_worker_admits_against_the_model_the_router_planned_with() -> None:
    """The router plans a fast worker's chunks with its model x 0.85; the worker's admission
    check must use the same, or it refuses every chunk the router sized to its real speed."""
    from common import config
    from common import messages as wire
    from common.engines.sim import SimEngine
    from services.decode_worker.service import DecodeWorker

    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_transport": "modeled"})
    worker = DecodeWorker(cfg, SimEngine("decode", PROFILE))
    # an idle worker: the largest chunk whose step fits the budget if steps take 0.85 x the model's time
    chunk = max(c for c in range(64, 16384, 16) if MODEL.step_time(0, 0, [(c, 0)]) * 0.85 <= SLO * 0.9)
    assert MODEL.step_time(0, 0, [(chunk, 0)]) > SLO * 0.9

    def work(bias: float) -> wire.DecodeWork:
        return wire.DecodeWork(request_id="r", attempt=0, dispatch=1, mode="deflect", prompt_token_ids=[1] * chunk,
                               sampling=wire.Sampling(max_tokens=4), tbt_slo=SLO, deadline_s=10.0,
                               chunk_schedule=(chunk,), step_budget_s=SLO * 0.9, model_bias=bias)

    load, model = worker.engine.load(), worker.step_model()
    assert worker.core.check(work(0.85), load, model) == ""
    assert "budget" in worker.core.check(work(1.0), load, model)  # the unscaled model: too big


def test_the_overrun_target_reaches_live_workers_from_kairos_up() -> None:
    """`kairos up --overrun-target P` -> KAIROS_OVERRUN_TARGET on every worker -> its engine's estimator."""
    import argparse

    from common import config
    from common.engines import make_engine
    from common.errors import ConfigError
    from kairos.up import error_env
    from sim.knobs import add_error_flags, error_settings

    p = argparse.ArgumentParser()
    add_error_flags(p)
    _, worker_env = error_env(error_settings(p.parse_args(["--overrun-target", "0.0005"])))
    assert worker_env["KAIROS_OVERRUN_TARGET"] == "0.0005"
    cfg = config.load(config.WorkerConfig, env=worker_env, overrides={"engine": "sim", "profile": "fast"})
    engine = make_engine(cfg, "decode")
    assert engine.estimator.target == 0.0005  # type: ignore[attr-defined]
    with pytest.raises(ConfigError):
        make_engine(config.load(config.WorkerConfig, env={"KAIROS_OVERRUN_TARGET": "0.7"},
                                overrides={"engine": "sim", "profile": "fast"}), "decode")


def test_every_default_overrun_target_is_the_one_constant() -> None:
    """The shipped per-step target (step_error.TARGET) is the default everywhere it can be set: a
    worker's settings, `kairos sim/tune/up`'s flag, the simulator's config, both engines, and what
    `kairos up` hands its workers when no flag is given."""
    import argparse
    import ast
    from pathlib import Path

    from common import config
    from common.engines import make_engine
    from kairos.up import error_env
    from sim.knobs import add_error_flags, error_settings
    from sim.state import SimConfig

    vllm_engine_file = Path(config.__file__).parent / "engines" / "vllm.py"
    assert TARGET < 0.01  # per step, for a per-request SLO (docs/cost-model.md)
    assert config.WorkerConfig().overrun_target == TARGET
    assert SimConfig().overrun_target == TARGET
    p = argparse.ArgumentParser()
    add_error_flags(p)
    args = p.parse_args([])
    assert args.overrun_target == TARGET
    _, worker_env = error_env(error_settings(args))
    assert float(worker_env["KAIROS_OVERRUN_TARGET"]) == TARGET
    engine = make_engine(config.load(config.WorkerConfig, env={}, overrides={"engine": "sim", "profile": "fast"}),
                         "decode")
    assert engine.estimator.target == TARGET  # type: ignore[attr-defined]
    # the vLLM engine (not importable without vLLM): its constructor's default is the constant by name
    tree = ast.parse(Path(vllm_engine_file).read_text())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "VllmEngine"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    names = [a.arg for a in init.args.kwonlyargs]
    default = init.args.kw_defaults[names.index("overrun_target")]
    assert isinstance(default, ast.Name) and default.id == "TARGET"


def test_a_nan_or_infinite_step_time_is_ignored() -> None:
    """A broken timing (NaN, inf) must neither enter the window nor unsort it."""
    est = StepErrorEstimator(window=8, min_samples=2)
    for v in (1.0, 2.0, math.nan, 3.0, math.inf, *([1.5] * 20)):
        est.observe(1.0, v)
    assert est.steps == 23 and list(est.ratios) == [1.5] * 8
    assert est.margin() == pytest.approx(1.5) and est.bias() == pytest.approx(1.5)


def test_the_guard_also_cuts_a_planned_prefill_whose_schedule_ran_out_but_not_an_unplanned_one() -> None:
    """A router-planned prefill whose schedule ran out before its prompt did (the worker's prefix
    cache held less of it than the router's index said) goes on at the default chunk, still cut
    to the measured margin; a prefill sent without a schedule (a baseline's) is not cut."""
    est = StepErrorEstimator(min_samples=1)
    est.observe(1.0, 1.3)
    default = largest_chunk(SLO)  # fits by the model alone, not with the 1.3 x margin

    def first_chunk(schedule: deque[int] | None) -> int:
        b = Batcher(role="decode", token_budget=8192, max_batch=256, kv_capacity_tokens=10_000_000,
                    default_chunk=default, prefix_cache=None, guard=ChunkGuard(MODEL, est))
        for i in range(BATCH):
            b.add(Seq(request_id=f"d{i}", attempt=0, prompt_len=1500, max_tokens=1000, computed=1500, tbt_slo=SLO))
        b.add(Seq(request_id="x", attempt=0, prompt_len=4 * default, max_tokens=4, tbt_slo=SLO,
                  schedule=schedule, deflected=True))
        plan = b.plan()
        assert plan is not None and len(plan.chunks) == 1
        return plan.chunks[0][1]

    assert first_chunk(deque()) == largest_chunk(SLO / 1.3, 0) < default  # planned, ran out: cut
    assert first_chunk(None) == default  # never planned: the engine's default, as the baselines run


def test_a_step_beside_a_chunk_is_held_to_the_decode_steps_overrun_chance() -> None:
    """Issue 44: a step carrying an in-place chunk holds every running decode, as a decode-only
    step does, and one overrun breaks all of their TBT at once (one step 1.48 x its prediction
    beside 59 decodes was 2 % of a run's requests). So the chunk guard plans it with the measured
    margin made stricter for DECODE_TARGET (relative to the bias), and the router plans a
    deflection's chunks to the same (`step_budget`); an exact model and a uniform bias change nothing."""
    from common.policy.kairos import step_budget

    src = StepError(noise=0.1).source(0, random.Random(11))
    est = StepErrorEstimator()
    for _ in range(3000):
        est.observe(0.05, 0.05 * src.factor(0.0))
    guard = ChunkGuard(MODEL, est)
    assert guard.margin() == pytest.approx(est.bias() * stricter_margin(est.margin() / est.bias()))
    assert guard.margin() > est.margin() * 1.04  # about 1.50 against 1.40 at 10 % noise
    planned = largest_chunk(SLO / est.margin())  # what fitted the per-request TARGET alone
    chi = guard.fit(BATCH, KV, [], planned, 0, SLO)
    assert chi < planned
    assert MODEL.step_time(BATCH, KV, [(chi, 0)]) <= SLO / guard.margin() < MODEL.step_time(BATCH, KV, [(chi + 1, 0)])
    assert not guard.fits(BATCH, KV, [], planned, 0, SLO)
    assert step_budget(0.9, 1.4, SLO) == pytest.approx(SLO / stricter_margin(1.4))
    assert step_budget(0.9, 1.0, SLO) == pytest.approx(0.9 * SLO)  # exact: beta x the SLO, as before
    exact, slow = StepErrorEstimator(), StepErrorEstimator()
    for _ in range(600):
        exact.observe(0.05, 0.05)
        slow.observe(0.05, 0.05 * 1.15)
    assert ChunkGuard(MODEL, exact).margin() == 1.0
    assert ChunkGuard(MODEL, slow).margin() == pytest.approx(1.15)  # a bias is not a spread


def test_a_uniformly_slow_decode_worker_gets_the_decode_room_of_a_model_that_knows_its_speed() -> None:
    """Issue 44 (slow44): an engine 15 % slower than its profile, no noise. Its bias reaches the
    router once: the model is scaled by it and the margin left beside it is 1, so the decode
    room is that of a profile that models the slow engine exactly, and the decode-only step it
    allows runs the guard's decode_beta x the SLO, no less (counted twice, it would run 0.95 x SLO
    / 1.15 and a decode worker would hold 19 % fewer sequences than it can)."""
    import msgspec

    from common import messages as wire
    from common.policy.kairos import _room
    from common.router_core.workers import WorkerTable

    est = StepErrorEstimator()
    src = StepError(scale=1.15).source(0, random.Random(0))
    for _ in range(100):
        pred = MODEL.decode_time(100, 80_000)
        est.observe(pred, pred * src.factor(0.0))
    table = WorkerTable(MODEL)
    table.register(_hello("decode", "decode-0"), b"d", 0.0)
    table.heartbeat(wire.DecodeHeartbeat(worker_id="decode-0", incarnation="i", seq=1, batch=100, kv_tokens=80_000,
                                         kv_free_tokens=10**6, kv_capacity_tokens=10**6, resident_prefill_tokens=0,
                                         deflections=0, strictest_tbt_slo=SLO, token_budget=2048,
                                         step_margin=est.margin(), step_bias=est.bias()), 1.0)
    d = table.view(use_ledger=True).decode[0]
    exact = msgspec.structs.replace(d, model=MODEL.scaled(1.15), step_margin=1.0)
    room = _room(d.model, d, SLO, 0.95)
    assert room > 0 and room == pytest.approx(_room(exact.model, exact, SLO, 0.95))
    # the step with the new request at that context, as the slow engine runs it: 0.95 x the SLO
    assert MODEL.decode_time(101, 80_000 + int(room)) * 1.15 == pytest.approx(0.95 * SLO, rel=1e-3)
