"""Kairos's late binding on a live loopback cluster (router + simulated engines): requests that
find the prefill queue deep and no decode worker able to take them in place wait at the router,
are dispatched as the prefill worker's heartbeats show its queue drop, and complete."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from common.perf_model import load_profile, save_profile
from kairos.up import Cluster
from tests.conftest import start_cluster

BUDGET = 64  # prefill token budget: one prompt of this size fills a step


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("late")
    fast = load_profile("fast")
    # 1 s a step, so the requests sent together find the first one's prefill still running (even on a loaded machine)
    prof = msgspec.structs.replace(fast, name="slow-steps", prefill_token_budget=BUDGET,
                                   model=msgspec.structs.replace(fast.model, a0=1.0))
    path = Path(tmp) / "slow-steps.json"
    save_profile(prof, path)
    # a 0.1 ms TBT SLO: no chunk schedule fits, so Kairos never deflects and every request needs
    # the prefill worker; late binding holds those that find a token budget already queued there
    c = start_cluster(tmp, prefill=1, decode=1, profile=str(path), policy="kairos", kv_transport="modeled",
                      router_env={"KAIROS_LATE_BINDING": "true", "KAIROS_TBT_SLO": "0.0001",
                                  "KAIROS_KV_WAIT_TIMEOUT": "30",
                                  # held, not refused: this is about holding (refusing: test_overload_live.py)
                                  "KAIROS_QUEUE_BUDGET": "-1"})
    yield c
    c.stop(15)


def test_held_requests_wait_at_the_router_then_complete(cluster: Cluster) -> None:
    api = cluster.spec.api

    def one(_: int) -> httpx.Response:
        return httpx.post(api + "/v1/completions", json={"prompt": [5] * BUDGET, "max_tokens": 2,
                                                          "ignore_eos": True}, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in answers)
    code, s = cluster.get("/v1/kairos/stats")
    assert code == 200
    assert s["counts"]["late_held"] >= 1  # some waited at the router instead of the prefill queue
    assert s["kv_waiting"] == 0 and s["held"] == 0  # and every one was dispatched
    assert s["routes"] == {"disagg": 4}
    assert s["counts"]["completed"] >= 4 and "kv_wait_timeouts" not in s["counts"]
