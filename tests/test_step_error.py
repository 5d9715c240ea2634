"""common/engines/step_error.py: injected model error, the worker's error estimator, and chunk
planning under a measured error distribution (the closed-loop TBT protection)."""

import math
import random
from collections import deque

import pytest

from common.engines.batcher import Batcher, Seq
from common.engines.step_error import ChunkGuard, StepError, StepErrorEstimator
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


def test_estimator_trusts_the_model_until_it_has_seen_enough() -> None:
    est = StepErrorEstimator(min_samples=32)
    for _ in range(31):
        est.observe(0.05, 0.08)
    assert est.margin() == 1.0 and est.bias() == 1.0
    est.observe(0.05, 0.08)
    assert est.margin() == pytest.approx(1.6) and est.bias() == pytest.approx(1.6)


def test_estimator_margin_is_the_measured_quantile() -> None:
    rng = random.Random(3)
    src = StepError(noise=0.1).source(0, rng)
    est = StepErrorEstimator(target=0.01, window=4096)
    for _ in range(4096):
        est.observe(0.05, 0.05 * src.factor(0.0))
    # a mean-1 lognormal with sigma 0.1: its 99th percentile is exp(-0.005 + 2.326 * 0.1) = 1.256
    assert est.margin() == pytest.approx(math.exp(-0.005 + 2.326 * 0.1), rel=0.04)
    assert est.bias() == pytest.approx(math.exp(-0.005), rel=0.02)


def test_a_slower_engine_is_measured_as_bias_and_margin() -> None:
    est = StepErrorEstimator()
    src = StepError(scale=1.15).source(0, random.Random(0))
    for _ in range(100):
        est.observe(0.04, 0.04 * src.factor(0.0))
    assert est.bias() == pytest.approx(1.15) and est.margin() == pytest.approx(1.15)


def test_an_overrun_raises_the_margin_at_once_until_a_step_comes_back() -> None:
    est = StepErrorEstimator(min_samples=8)
    for _ in range(300):  # enough that one slow step is not the window's 99th percentile itself
        est.observe(0.05, 0.05)
    assert est.margin() == 1.0
    est.observe(0.05, 0.1)  # a step twice as slow as predicted
    assert est.margin() == pytest.approx(2.0)
    assert est.overruns == 1
    est.observe(0.05, 0.05)  # back within the quantile: the window's margin again
    assert est.margin() == 1.0


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
