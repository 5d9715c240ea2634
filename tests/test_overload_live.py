"""Overload is refused at the door, on a live loopback cluster (router + simulated engines): about
5x capacity for a bounded time, every streamed request either served or refused at once with 429 +
Retry-After before any byte of a stream, none failing any other way, and the cluster serving
normally right after (bench/overload.py; its 60 s version: docs/benchmarks/overload.md).

The assertions do not depend on the machine's load: what a refusal looks like, that nothing fails
otherwise, and that a request after the burst is served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.overload import NO_CHUNK_ENV, offer, settle_then_probe, step_profile, summarize
from kairos.up import Cluster
from tests.conftest import start_cluster

STEP_S = 0.2   # every engine step: one prompt prefilled per step, so capacity is 5 requests/s
BUDGET = 64    # prompt tokens = the prefill token budget
LOAD = 5.0     # offered: 5x capacity
DURATION = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("overload")
    profile = step_profile(Path(tmp) / "steps.json", STEP_S, BUDGET)
    c = start_cluster(tmp, prefill=1, decode=1, profile=profile, policy="kairos", kv_transport="modeled",
                      router_env=NO_CHUNK_ENV | {"KAIROS_TTFT_SLO": "2"})
    yield c
    c.stop(15)


def test_five_times_capacity_is_served_or_refused_at_once_and_the_cluster_serves_right_after(cluster: Cluster) -> None:
    api = cluster.spec.api
    outcomes = asyncio.run(offer(api, rate=LOAD / STEP_S, duration=DURATION, budget=BUDGET, max_tokens=2,
                                 timeout_s=60.0))
    s = summarize(outcomes)
    assert s["failed"] == 0, s  # no request failed any other way (a stream error, a 503, a drop)
    assert s["served"] and s["refused"], s  # both happened: the cluster served what it could, refused the rest
    refused = [o for o in outcomes if o.kind == "refused"]
    # refused at once (not after a 30 s wait), each with its reason, before any byte of a stream
    assert all(o.status == 429 and o.stream_bytes == 0 and int(o.retry_after or 0) >= 1 for o in refused)
    assert {o.detail for o in refused} <= {"prefill_busy", "decode_busy", "kv_full"}, s
    assert max(o.answer_s for o in refused) < 10.0, s
    probe = asyncio.run(settle_then_probe(api, BUDGET, 2))
    assert probe.kind == "served", probe  # back to normal right after
    code, stats = cluster.get("/v1/kairos/stats")
    assert code == 200 and stats["in_flight"] == 0 and stats["kv_waiting"] == 0
    assert "kv_wait_timeouts" not in stats["counts"]
