"""The simulated engine's steps last what the model says, under uvloop (the services' loop) too.

uvloop's timers and `loop.time()` are whole milliseconds (libuv's, cached per loop turn): a
sub-millisecond `asyncio.sleep` there returns at once (0.5 ms rounds to 0), so the `fast`
profile's 0.5 ms steps ran anywhere from microseconds to over a millisecond. Only lower bounds
are asserted here (a loaded machine makes sleeps longer, never shorter).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest

from common.engines.base import EngineRequest
from common.engines.sim import SimEngine
from common.messages import Sampling, TokenItem
from common.perf_model import load_profile
from common.precise_timer import PreciseTimer
from tests.sim_engine_run import run_to_end

uvloop = pytest.importorskip("uvloop")


def test_sleeps_last_at_least_their_time_under_uvloop() -> None:
    async def run() -> list[float]:
        t = PreciseTimer()
        assert t.precise or not sys.platform.startswith("linux")  # Linux: a timerfd (elsewhere asyncio.sleep)
        out = []
        try:
            for _ in range(40):
                s = time.monotonic()
                await t.sleep_until(s + 0.0003)
                out.append(time.monotonic() - s)
            s = time.monotonic()
            await t.sleep_until(s - 1.0)  # a passed deadline: at once
            out.append(-(time.monotonic() - s))
        finally:
            t.close()
        return out

    took = uvloop.run(run())
    assert min(took[:-1]) >= 0.0003
    assert -took[-1] < 0.05


def test_a_cancelled_sleep_does_not_wake_the_next_one_early() -> None:
    async def run() -> float:
        t = PreciseTimer()
        try:
            task = asyncio.ensure_future(t.sleep_until(time.monotonic() + 0.0002))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.002)  # the cancelled deadline passes
            s = time.monotonic()
            await t.sleep_until(s + 0.003)
            return time.monotonic() - s
        finally:
            t.close()

    assert uvloop.run(run()) >= 0.003


def test_the_simulated_engines_steps_take_their_modeled_time_under_uvloop() -> None:
    profile = load_profile("fast")

    async def run() -> tuple[SimEngine, list[float]]:
        e = SimEngine("decode", profile)
        done = asyncio.Event()
        ends: list[float] = []

        def on_tokens(items: list[TokenItem], step_s: float) -> None:
            ends.append(time.monotonic())
            if any(i.finish_reason for i in items):
                done.set()

        e.on_tokens = on_tokens
        task = asyncio.create_task(e.run())
        ends.append(time.monotonic())
        e.add(EngineRequest(request_id="r", attempt=0, prompt_token_ids=list(range(128)), mode="deflect",
                            sampling=Sampling(max_tokens=16, ignore_eos=True)))
        await asyncio.wait_for(done.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return e, ends

    e, ends = uvloop.run(run())
    steps = list(e.samples)
    assert len(steps) == 16 and len(ends) == 17
    modeled = [profile.model.step_time(s.batch, s.kv_tokens, s.chunks) for s in steps]
    # each step's tokens no sooner after the request came than the model of the steps so far says
    # (the engine keeps the modeled cadence: a late step is made up in the next one's sleep)
    since = [t - ends[0] for t in ends[1:]]
    due = [sum(modeled[: k + 1]) for k in range(len(modeled))]
    assert all(t >= 0.99 * d for t, d in zip(since, due, strict=True)), \
        [(round(t * 1e6), round(d * 1e6)) for t, d in zip(since, due, strict=True)]


def test_the_simulated_engine_sleeps_to_deadlines_a_modeled_step_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its steps' deadlines are at least the model's step times apart (exactly, unless a step
    started later than its deadline allows), on time.monotonic() (not uvloop's millisecond loop
    clock), and each is slept to with the precise timer."""
    profile = load_profile("fast")
    deadlines: list[float] = []
    sleep = PreciseTimer.sleep_until

    async def spy(self: PreciseTimer, deadline: float) -> None:
        deadlines.append(deadline)
        await sleep(self, deadline)

    monkeypatch.setattr(PreciseTimer, "sleep_until", spy)

    async def run() -> SimEngine:
        e = SimEngine("decode", profile)
        await run_to_end(e, EngineRequest(request_id="r", attempt=0, prompt_token_ids=list(range(128)),
                                          mode="deflect", sampling=Sampling(max_tokens=4, ignore_eos=True)))
        return e

    e = uvloop.run(run())
    modeled = [profile.model.step_time(s.batch, s.kv_tokens, s.chunks) for s in e.samples]
    assert len(deadlines) == len(modeled) == 4
    gaps = [b - a for a, b in itertools.pairwise(deadlines)]
    assert all(g >= m - 1e-9 for g, m in zip(gaps, modeled[1:], strict=True)), (gaps, modeled)
