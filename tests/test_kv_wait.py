"""Overload on a live cluster, as engines behave: a request that finds no decode worker with KV
room waits at the router and completes once room frees; one that can never fit (more KV than a
decode worker has at all, as advertised at registration) gets a clear 400 at once, not a wait."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from common.perf_model import load_profile, save_profile
from kairos.up import Cluster
from tests.conftest import start_cluster

CAPACITY = 300  # KV tokens per decode worker: one 100 + 100 request fits, two do not


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("kvwait")
    prof = msgspec.structs.replace(load_profile("fast"), name="small-kv", kv_capacity_tokens=CAPACITY,
                                   model=msgspec.structs.replace(load_profile("fast").model, a0=0.004))
    path = Path(tmp) / "small-kv.json"
    save_profile(prof, path)
    c = start_cluster(tmp, prefill=0, decode=1, profile=str(path), policy="chunked-prefill", kv_transport="modeled",
                      # no admission budget: the wait itself is what is tested, whatever this machine's
                      # load makes of the predicted wait (tests/test_shed.py tests the budget)
                      router_env={"KAIROS_KV_WAIT_TIMEOUT": "2", "KAIROS_QUEUE_BUDGET": "-1"})
    yield c
    c.stop(15)


def body(prompt: int, out: int, stream: bool = False) -> dict[str, object]:
    return {"prompt": [5] * prompt, "max_tokens": out, "stream": stream, "ignore_eos": True}


def stats(c: Cluster) -> dict[str, object]:
    code, s = c.get("/v1/kairos/stats")
    assert code == 200
    return s


def test_a_request_without_kv_room_waits_then_completes(cluster: Cluster) -> None:
    api = cluster.spec.api
    with httpx.Client(timeout=30) as client, client.stream("POST", api + "/v1/completions",
                                                           json=body(100, 100, stream=True)) as first:
        lines = first.iter_lines()
        assert first.status_code == 200
        next(line for line in lines if line.startswith("data: {"))  # the first holds its KV now
        # the second finds no room: it waits at the router (no 503) and is served when the first ends
        second = client.post(api + "/v1/completions", json=body(100, 100))
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["completion_tokens"] == 100
    s = stats(cluster)
    assert s["counts"]["kv_waited"] == 1 and s["kv_waiting"] == 0  # type: ignore[index]


def test_a_request_that_can_never_fit_gets_a_clear_400_at_once(cluster: Cluster) -> None:
    r = httpx.post(cluster.spec.api + "/v1/completions", json=body(200, 200), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and r.headers["x-kairos-error"] == "context_length_exceeded"
    assert err["param"] == "max_tokens"
    assert "400 tokens of KV" in err["message"] and str(CAPACITY) in err["message"]
    assert "retry-after" not in r.headers
    assert "kv_wait_timeouts" not in json.dumps(stats(cluster)["counts"])  # it never waited
    # and the cluster still serves
    assert httpx.post(cluster.spec.api + "/v1/completions", json=body(10, 5), timeout=30).status_code == 200
