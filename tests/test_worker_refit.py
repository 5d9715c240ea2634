"""Online refits: a worker whose engine measures its steps reports the refitted model."""

from __future__ import annotations

import asyncio

from common import config
from common.engines.sim import SimEngine
from common.perf_model import PerfModel, load_profile
from services.decode_worker.service import DecodeWorker


async def test_good_refit_reaches_the_heartbeat_and_a_bad_one_does_not() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={"refit_interval": 0.01, "kv_transport": "modeled"})
    engine = SimEngine("decode", load_profile("fast"))
    fits = [(PerfModel(a0=0.5, a3=1e-3), 0.9), (PerfModel(a0=0.02, a3=2e-5), 0.05)]  # bad first, then good
    engine.refit = lambda: fits.pop(0) if fits else None  # type: ignore[attr-defined]
    w = DecodeWorker(cfg, engine)
    assert w.heartbeat().coeffs == engine.coeffs()
    task = asyncio.create_task(w._refit_loop())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not fits:
            break
    await asyncio.sleep(0.03)
    task.cancel()
    hb = w.heartbeat()
    assert hb.coeffs is not None and hb.coeffs.a0 == 0.02 and hb.coeffs.a3 == 2e-5
