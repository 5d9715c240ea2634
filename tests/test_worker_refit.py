"""Online refits: a worker whose engine measures its steps reports the refitted model.

The engine (the sim engine, declared able to refit) returns a scripted sequence of fits; each call records what the
heartbeat carried at that moment, which is the outcome of the previous fit (the refit loop
handles a result before it asks for the next one). So every fit's effect is checked, not only
the final state.
"""

from __future__ import annotations

import asyncio

from common import config
from common import messages as m
from common.engines.sim import SimEngine
from common.perf_model import PerfModel, load_profile
from services.decode_worker.service import DecodeWorker

BAD = (PerfModel(a0=0.5, a3=1e-3), 0.9)       # error 90%: over refit_max_mape (25%)
GOOD = (PerfModel(a0=0.02, a3=2e-5), 0.05)
BETTER = (PerfModel(a0=0.03, a3=3e-5), 0.10)


class RefittingSim(SimEngine):
    can_refit = True  # refit() is scripted per test


async def heartbeats_after_each(fits: list[tuple[PerfModel, float]]) -> tuple[m.Coeffs | None, list[m.Coeffs | None]]:
    """Run the refit loop over `fits`; the heartbeat's coeffs before any fit and after each one."""
    cfg = config.load(config.WorkerConfig, env={}, overrides={"refit_interval": 0.001, "kv_transport": "modeled"})
    engine = RefittingSim("decode", load_profile("fast"))
    w = DecodeWorker(cfg, engine)
    seen: list[m.Coeffs | None] = []
    done = asyncio.Event()
    queue = list(fits)

    def refit() -> tuple[PerfModel, float] | None:
        seen.append(w.heartbeat().coeffs)  # the state the previous fit left
        if not queue:
            done.set()
            return None
        return queue.pop(0)

    engine.refit = refit  # type: ignore[method-assign]
    before = w.heartbeat().coeffs
    task = asyncio.create_task(w.refit_loop())
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        task.cancel()
    return before, seen[1:len(fits) + 1]


def coeffs_of(fit: tuple[PerfModel, float]) -> m.Coeffs:
    return fit[0].to_coeffs()


async def test_a_bad_refit_is_not_used_and_a_good_one_reaches_the_heartbeat() -> None:
    engine_coeffs = SimEngine("decode", load_profile("fast")).coeffs()
    before, after = await heartbeats_after_each([BAD, GOOD])
    assert before == engine_coeffs
    assert after[0] == engine_coeffs            # the bad fit changed nothing
    assert after[1] == coeffs_of(GOOD)          # the good one is what the router now sees


async def test_an_engine_that_cannot_refit_gets_norefit_loop() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={"refit_interval": 0.001, "kv_transport": "modeled"})
    engine = SimEngine("decode", load_profile("fast"))
    calls: list[int] = []

    def refit() -> None:
        calls.append(1)

    engine.refit = refit  # type: ignore[method-assign]
    w = DecodeWorker(cfg, engine)
    await asyncio.wait_for(w.refit_loop(), 1)  # returns at once
    assert calls == []


async def test_a_bad_refit_does_not_replace_a_good_one() -> None:
    before, after = await heartbeats_after_each([GOOD, BAD, BETTER])
    assert after[0] == coeffs_of(GOOD)
    assert after[1] == coeffs_of(GOOD)          # still the good one, not the bad one
    assert after[2] == coeffs_of(BETTER)        # a later good fit replaces it
    assert before != coeffs_of(GOOD)
