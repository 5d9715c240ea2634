"""A vLLM worker with no stored profile measures one, stores it by its keys, reports it, and the
router predicts that worker with it; then every step's prediction is compared with the step.

Runs on the session's engines (tests/vllm/conftest.py): the prefill engine measures (the short
sweep, a prefill engine serving the sweep's in-place requests), the decode engine (same keys)
loads what it stored. Both are put back as they were (no profile) at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.config import WorkerConfig
from common.perf_model import PerfModel, load_profile
from common.router_core.workers import WorkerTable
from tests.vllm.helpers import PD, VLLM_MISSING, request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(600),  # the session engines' start alone may take up to 400 s on 2 busy cores
]


async def test_a_worker_without_a_profile_measures_one_and_the_router_uses_it(pd: PD, tmp_path: Path) -> None:
    from common.engines import measured
    from services.decode_worker.service import DecodeWorker

    p, d = pd.prefill, pd.decode
    assert p.profile is None and d.profile is None  # the session engines run on no profile
    store = tmp_path / "profiles"
    cb = (d.on_tokens, d.on_kv_fallback, d.on_failed)
    try:
        t0 = time.monotonic()
        await p._own_profile(store)  # the prefill engine: nothing stored, so it measures
        took = time.monotonic() - t0
        assert p.profile_measured, "no stored profile: the engine must measure one"
        keys = p.profile_keys
        assert keys["dtype"] == "float32" and keys["tensor_parallel_size"] == "1"
        assert keys["pipeline_parallel_size"] == "1" and keys["quantization"] == "none"
        assert keys["device"].startswith("cpu:") and keys["model"].startswith(Path(p.model_dir).name + "@")
        path = measured.stored_path(store, keys)
        stored = load_profile(str(path))
        assert stored.keys == keys and stored.model == p.profile.model  # stored beside its keys
        assert stored.fit_mape["all"] < 0.5, stored.fit_mape  # loose: a fit, not noise
        assert {"decode_only", "prefill_only", "mixed"} <= set(stored.fit_mape)
        assert took < 120, took

        t0 = time.monotonic()
        await d._own_profile(store)  # same model, device, parallelism, dtype: loads, does not measure
        assert not d.profile_measured and d.profile_keys == keys
        assert d.profile.model == stored.model and time.monotonic() - t0 < 5

        # the worker reports it (Hello and heartbeats carry its coefficients) and the router uses it
        worker = DecodeWorker(WorkerConfig(engine="vllm", model=p.model_dir), d)
        d.on_tokens, d.on_kv_fallback, d.on_failed = cb  # the worker took the engine's callbacks: the tests' again
        hello = worker.core.hello(coeffs=worker.coeffs())
        assert hello.coeffs == stored.model.to_coeffs()
        assert worker.heartbeat().coeffs == stored.model.to_coeffs()
        table = WorkerTable(load_profile("h100-llama2-70b-tp4").model)
        entry, _ = table.register(hello, b"decode-0", 0.0)
        assert entry.model == PerfModel.from_coeffs(stored.model.to_coeffs())
        assert entry.model != table.default_model

        # live accuracy: from now on every step of the decode engine is predicted by that model
        base = d.step_errors.total
        steps = d.steps
        bg = [request(f"acc-bg{i}", [(11 * i + j) % 900 + 3 for j in range(64)], 24) for i in range(4)]
        for r in bg:
            d.add(r)
        await pd.out.wait("acc-bg0")
        await pd.run_decode(request("acc-defl", [(5 * j) % 900 + 3 for j in range(192)], 4, schedule=(64, 64, 64)))
        for r in bg:
            await pd.out.wait(r.request_id)
        observed = d.step_errors.total - base
        assert observed >= 20 and observed == d.steps - steps  # every step, once
        load = d.load()
        assert load.step_err_p50 is not None and load.step_err_p90 is not None
        assert 0 <= load.step_err_p50 <= load.step_err_p90
        assert worker.heartbeat().step_err_p50 == load.step_err_p50
    finally:
        d.on_tokens, d.on_kv_fallback, d.on_failed = cb
        for e in (p, d):
            e.profile, e._predict = None, None
            await e.reset_prefix_cache()  # the sweep's prompts: not the next tests' cache hits


async def test_vllm_turns_async_scheduling_off_on_cpu(tiny_model: Path) -> None:
    """What keeping async scheduling off costs on the vLLM CPU tier: nothing, vLLM's CPU platform
    turns it off itself whatever is asked (docs/results.md). Should a vLLM release run it on CPU,
    this fails and the cost must be measured."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg = AsyncEngineArgs(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=2048,
                              kv_cache_memory_bytes=64 << 20, async_scheduling=True).create_engine_config()
    assert cfg.scheduler_config.async_scheduling is False
