"""Decode-side admission on the vLLM engine: the decode worker checks each deflection against
vLLM's live state (EngineLoad: decodes, their KV, the strictest SLO) and its own record of the
deflections it accepted, with the step-time model the worker reports (its profile)."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from common import config
from common import messages as m
from common import worker as worker_mod
from common.perf_model import load_profile
from common.policy.admission import REJECTED_REASON
from common.policy.schedule import reserved_step_cost
from common.ports import free_port
from services.decode_worker.service import DecodeWorker
from tests.test_poison import FakeRouter
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
    pytest.mark.asyncio(loop_scope="session"),
]

PROFILE = load_profile("cpu-tiny-llama")
TOKEN_BUDGET = 256
SCHEDULE = (64, 64)
PROMPT = [5 + (i % 50) for i in range(sum(SCHEDULE))]


@pytest_asyncio.fixture(loop_scope="session")
async def decode(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> AsyncIterator[tuple[DecodeWorker, FakeRouter]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import common.engines.vllm as vllm_engine
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "work_port": port, "heartbeat_port": free_port(), "kv_transport": "modeled", "worker_id": "decode-v",
        "engine": "vllm", "refit_interval": 0, "drain_timeout": 1.0})
    engine = vllm_engine.VllmEngine("decode", model=str(tiny_model), max_model_len=2048, kv_cache_mib=32,
                                    token_budget=TOKEN_BUDGET, max_batch=16, kv_timeout=20.0,
                                    side_channel_port=free_port(), cache_root=str(tmp_path), profile=PROFILE)
    w = DecodeWorker(cfg, engine)
    task = asyncio.create_task(w.run())
    router = FakeRouter(sock, b"decode-v")
    try:
        h = await router.until(lambda x: isinstance(x, m.Hello), timeout=300)
        assert isinstance(h, m.Hello) and h.coeffs == PROFILE.model.to_coeffs()
        await router.send(m.Welcome(router_incarnation="fake", heartbeat_interval_s=0.1))
        await asyncio.wait_for(w.answered.wait(), 30)
        yield w, router
    finally:
        w.stop.set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await asyncio.wait_for(task, 60)
        sock.close(0)
        ctx.term()


def deflection(rid: str, budget: float, dispatch: int) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect", prompt_token_ids=PROMPT,
                        sampling=m.Sampling(max_tokens=4, ignore_eos=True), tbt_slo=1.0, deadline_s=60.0,
                        chunk_schedule=SCHEDULE, step_budget_s=budget)


async def finished(router: FakeRouter, rid: str) -> None:
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(
        it.request_id == rid and it.finish_reason == "length" for it in x.items), timeout=120)


async def test_vllm_decode_worker_admits_what_fits_and_rejects_what_does_not(
        decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    model = PROFILE.model
    alone = max(model.step_time(0, 0, [(chi, done)]) for chi, done in ((64, 0), (64, 64)))
    reserved = reserved_step_cost(model, SCHEDULE, TOKEN_BUDGET)
    budget = alone + 0.5 * reserved  # one fits alone, a second does not beside the first

    w.on_message(deflection("first", budget, 1))
    w.on_message(deflection("second", budget, 2))  # back to back: the first is still prefilling
    assert set(w.accepted) == {"first"}
    f = await router.until(lambda x: isinstance(x, m.RequestFailed), timeout=30)
    assert isinstance(f, m.RequestFailed) and (f.request_id, f.code) == ("second", REJECTED_REASON)
    assert "1 deflections in flight" in f.reason
    await finished(router, "first")
    assert w.accepted == {}

    w.on_message(deflection("tight", alone * 0.5, 3))  # does not fit even alone
    f = await router.until(lambda x: isinstance(x, m.RequestFailed), timeout=30)
    assert isinstance(f, m.RequestFailed) and f.request_id == "tight" and f.reason.startswith("step 1 of 2")

    w.on_message(deflection("roomy", 10.0, 4))
    await finished(router, "roomy")
    assert w.counters["deflect_rejected"] == 2
