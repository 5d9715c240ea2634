"""A live role flip keeps the worker's running decodes (issue 44 item 3, as the simulator does):
the worker shell (common/worker.py) passes `keep` to its core, its engine's step loop runs on
through the switch (`Engine.between_steps`, `switch_role(keep=...)`), the new role's core adopts
the kept requests and says Hello under the same incarnation naming them, and their tokens go on
from the same worker, token for token: nothing is handed back, re-dispatched or lost.

A real worker (the simulated engine, in this process) against a fake router socket, synchronised
on messages; the engine's steps are 5 ms (time_scale 10), so each stream lasts about 2 s and is
still running when the SetRole comes.
"""

from __future__ import annotations

from typing import Any

import pytest

from common import messages as m
from common.engines.sim import SimEngine, synthetic_token, token_key
from common.perf_model import load_profile
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker
from services.roles import RoleSwitching
from tests.test_replica_links import Fake
from tests.test_role_planner_live import _stop, _worker, finished

TOKENS = 400


async def _started(role: m.Role, monkeypatch: pytest.MonkeyPatch) -> tuple[RoleSwitching, Fake, Any, Any]:
    return await _worker(SimEngine(role, load_profile("fast"), time_scale=10.0), monkeypatch)


def tokens_of(got: list[m.Msg], rid: str) -> list[int]:
    return [t for x in got if isinstance(x, m.TokenBatch) for it in x.items if it.request_id == rid
            for t in it.token_ids]


def expected(rid: str) -> list[int]:
    return [synthetic_token(token_key(rid, None), pos) for pos in range(TOKENS)]


async def _flip_keeps(proc: RoleSwitching, fake: Fake, to: m.Role, rid: str) -> m.Hello:
    """SetRole to `to` while `rid` streams; the flip keeps it: returns the Hello under the new role."""
    first = proc.worker
    await fake.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == rid for i in x.items))
    await fake.send(m.SetRole(role=to, reason="test", router_incarnation="A"))
    bye = await fake.until(lambda x: isinstance(x, m.Goodbye))
    assert isinstance(bye, m.Goodbye) and bye.reason == "role_change"
    switch = await fake.until(lambda x: isinstance(x, m.Goodbye))
    # not "drained": the worker stays registered, draining, until its Hello under the new role
    assert isinstance(switch, m.Goodbye) and switch.reason == "role_switch"
    again = await fake.until(lambda x: isinstance(x, m.Hello))
    assert isinstance(again, m.Hello)
    # the same worker and incarnation in its other role (router core `role_changed`), still decoding it
    assert (again.role, again.worker_id, again.incarnation) == (to, "decode-r", bye.incarnation)
    assert rid in again.held
    # the same engine and the same step loop, never stopped: it switched between two steps
    assert proc.worker is not first and proc.worker.engine is first.engine and first.engine.role == to
    assert proc.worker.engine_task is first.engine_task and not first.engine_task.done()
    await fake.send(m.Welcome(router_incarnation="A", heartbeat_interval_s=0.05))
    return again


def _check_stream(fake: Fake, rid: str, hello: m.Hello) -> None:
    """Every token of `rid` came from this worker, in order, once: none lost, none repeated."""
    assert tokens_of(fake.got, rid) == expected(rid)
    # some of them after the Hello under the new role: the new role's core streamed them
    after = fake.got[fake.got.index(hello):]
    assert tokens_of(after, rid)
    assert not [x for x in fake.got if isinstance(x, m.RequestFailed) and x.request_id == rid]
    assert sum(1 for x in fake.got if isinstance(x, m.TokenBatch)
               for it in x.items if it.request_id == rid and it.finish_reason) == 1
    assert all(x.worker_id == "decode-r" for x in fake.got if isinstance(x, m.TokenBatch))


async def test_a_decode_worker_flipped_to_prefill_keeps_streaming_its_decodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proc, fake, task, ctx = await _started("decode", monkeypatch)
    try:
        await fake.send(m.DecodeWork(request_id="running", attempt=0, dispatch=1, mode="deflect",
                                     prompt_token_ids=[1, 2, 3], deadline_s=30.0, tbt_slo=0.1,
                                     sampling=m.Sampling(max_tokens=TOKENS, ignore_eos=True)))
        hello = await _flip_keeps(proc, fake, "prefill", "running")
        assert isinstance(proc.worker, PrefillWorker) and "running" in proc.worker.core.decoding
        # the new role works meanwhile: a prompt to prefill is prefilled and handed off
        await fake.send(m.PrefillWork(request_id="p", attempt=0, dispatch=1, prompt_token_ids=[1] * 64,
                                      sampling=m.Sampling(max_tokens=4), decode_worker="decode-x", deadline_s=30.0))
        await fake.until(finished("running"))
        _check_stream(fake, "running", hello)
        if not [x for x in fake.got if isinstance(x, m.PrefillDone) and x.request_id == "p"]:
            await fake.until(lambda x: isinstance(x, m.PrefillDone | m.RequestFailed) and x.request_id == "p")
        assert [x.request_id for x in fake.got if isinstance(x, m.PrefillDone)] == ["p"]
        assert not proc.worker.core.decoding and not proc.worker.core.work  # its ledger ended with the stream
    finally:
        await _stop(proc, fake, task, ctx)


async def test_a_prefill_worker_flipped_to_decode_keeps_streaming_the_requests_it_decodes_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proc, fake, task, ctx = await _started("prefill", monkeypatch)
    try:
        await fake.send(m.PrefillWork(request_id="mine", attempt=0, dispatch=1, prompt_token_ids=[1] * 64,
                                      sampling=m.Sampling(max_tokens=TOKENS, ignore_eos=True),
                                      decode_worker="decode-r", deadline_s=30.0, retain=True, tbt_slo=0.1))
        hello = await _flip_keeps(proc, fake, "decode", "mine")
        assert isinstance(proc.worker, DecodeWorker) and "mine" in proc.worker.core.active
        await fake.until(finished("mine"))
        _check_stream(fake, "mine", hello)
        assert not proc.worker.core.active
        assert not [x for x in fake.got if isinstance(x, m.PrefillDone)]  # its KV never moved
    finally:
        await _stop(proc, fake, task, ctx)
