"""Prefix caching end to end on a loopback cluster of the simulated engine: the decode workers
report what their prefix caches hold, the router's index learns it, and a conversation's second
turn is deflected to the decode worker that holds its first, priced (and prefilled) as its suffix."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kairos.up import Cluster
from tests.conftest import start_cluster

BLOCK = 16  # the sim engine's default prefix block


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("prefix"), prefill=1, decode=2, profile="a100-dsv2-lite",
                      policy="kairos", router_env={"KAIROS_MAX_DEFLECTIONS": "1"})
    yield c
    c.stop(15)


def complete(c: Cluster, prompt: list[int], max_tokens: int = 8) -> tuple[httpx.Headers, list[int]]:
    r = httpx.post(c.spec.api + "/v1/completions", timeout=60,
                   json={"model": "kairos-sim", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.headers, r.json()["choices"][0].get("token_ids") or []


def stats(c: Cluster) -> dict:  # type: ignore[type-arg]
    r = httpx.get(c.spec.api + "/v1/kairos/stats", timeout=10)
    return r.json()  # type: ignore[no-any-return]


def test_second_turns_go_where_their_first_turns_are_cached(cluster: Cluster) -> None:
    a1 = [5 + i % 400 for i in range(1500)]
    b1 = [7 + (3 * i) % 400 for i in range(1500)]
    # both first turns at once: one deflection per decode worker at a time, so the second takes the other
    with ThreadPoolExecutor(2) as pool:
        (ha1, _), (hb1, _) = pool.map(lambda p: complete(cluster, p), [a1, b1])
    assert ha1["x-kairos-route"] == hb1["x-kairos-route"] == "deflect"
    wa, wb = ha1["x-kairos-decode-worker"], hb1["x-kairos-decode-worker"]
    assert wa != wb, "the two first turns should have taken different decode workers"
    assert int(ha1["x-kairos-cached-tokens"]) == int(hb1["x-kairos-cached-tokens"]) == 0
    for first, worker in ((a1, wa), (b1, wb)):
        second = first + [11, 12, 13, 14, 15, 16, 17, 18] + [20 + i for i in range(100)]
        h, _ = complete(cluster, second)
        assert h["x-kairos-route"] == "deflect"
        assert h["x-kairos-decode-worker"] == worker  # where the conversation's KV is
        assert int(h["x-kairos-cached-tokens"]) == len(first) // BLOCK * BLOCK
    s = stats(cluster)["prefix"]
    assert s["enabled"] and s["hits"] >= 2 and s["blocks"] > 0
    assert set(s["workers"]) >= {wa, wb}  # both decode workers reported their caches (heartbeat summaries)
