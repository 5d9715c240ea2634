"""A prefill worker that still holds a stale attempt's hand-off when a new attempt of the same
request arrives (the router re-dispatched or migrated it back here): each hand-off waits for its
own attempt's KV target. (Both used to wake on the new target; the stale one pushed into the new
one's blocks and the new one never reported, so the request hung.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from common import config
from common import messages as m
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from services.prefill_worker import service as prefill_service
from services.prefill_worker.service import PrefillWorker


class FakeTx:
    def __init__(self) -> None:
        self.pushes: list[tuple[str, list[int]]] = []

    def add_peer(self, info: Any) -> None:
        pass

    async def push_pattern(self, peer: str, key: str, block_ids: list[int], **kw: Any) -> Any:
        self.pushes.append((key, block_ids))
        return SimpleNamespace(nbytes=len(block_ids))


def work(attempt: int) -> m.PrefillWork:
    return m.PrefillWork(request_id="r", attempt=attempt, dispatch=attempt, prompt_token_ids=[1] * 40,
                         sampling=m.Sampling(max_tokens=1), decode_worker="decode-1", deadline_s=30)


async def test_a_stale_hand_off_does_not_take_the_new_attempts_kv_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_service, "layout_from_info", lambda info, block_tokens: SimpleNamespace(
        bytes_per_token=16))
    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_timeout": 30.0})
    w = PrefillWorker(cfg, SimEngine("prefill", load_profile("fast")))
    sent: list[m.Msg] = []
    w.send = sent.append  # type: ignore[method-assign]
    tx = FakeTx()
    w.tx = tx  # type: ignore[assignment]
    old, new = work(1), work(3)
    w.work["r"] = old
    stale = asyncio.create_task(w.push_nixl(old))
    await asyncio.sleep(0)
    w.work["r"] = new  # attempt 3 replaced attempt 1 (as a PrefillWork of attempt 3 does)
    fresh = asyncio.create_task(w.push_nixl(new))
    await asyncio.sleep(0)
    assert [x.attempt for x in sent if isinstance(x, m.KvWant)] == [1, 3]
    agent = m.KvAgentInfo(agent_name="decode-1", metadata=b"", block_bytes=16 * 16, num_blocks=64)
    w.on_message(m.KvTarget(request_id="r", attempt=3, decode_worker="decode-1", agent_name="decode-1",
                                  block_ids=[7, 8, 9], kv_agent=agent))
    assert await asyncio.wait_for(fresh, 5) == (3, "")
    assert tx.pushes == [("r:3", [7, 8, 9])]  # only the new attempt wrote, into its own blocks
    await asyncio.sleep(0.01)
    assert not stale.done()                   # the stale one still waits for its own target (or its timeout)
    stale.cancel()
    # a target for an attempt this worker no longer holds is ignored
    w.on_message(m.KvTarget(request_id="r", attempt=1, decode_worker="decode-1", block_ids=[1]))
    assert ("r", 1) not in w.targets
