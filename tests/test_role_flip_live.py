"""The role planner on a live loopback cluster (router, monitor-less, 2 prefill + 1 decode worker
on the simulated engine, separate processes): while requests stream, the planner finds the decode
pool short and moves a prefill worker to the decode role; the worker drains, its engine switches
in place (same process) and it registers as a decode worker; every request completes.

Not timing-sensitive: the planner's step threshold is set far below any batch's share of the TBT
SLO's room (planner_step_hi 1e-9), so once a batch of more than one sequence has been decoded the
decode pool is short on every sample, whatever the machine's load; the prefill pool
is idle enough to spare one worker, and planner_min_prefill keeps the last one. The test sends
requests until the flip is done (bounded), then a few more, and checks all of them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kairos.up import Cluster
from tests.conftest import start_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("flip")
    c = start_cluster(tmp, prefill=2, decode=1, profile="fast", policy="disagg-least-loaded", kv_transport="modeled",
                      router_env={"KAIROS_PLANNER": "true", "KAIROS_PLANNER_INTERVAL_S": "0.25",
                                  "KAIROS_PLANNER_WINDOW_S": "1", "KAIROS_PLANNER_MIN_DWELL_S": "0",
                                  "KAIROS_PLANNER_MIN_GAP_S": "0", "KAIROS_PLANNER_STEP_HI": "1e-9",
                                  "KAIROS_PLANNER_STEP_LO": "1e-10"})
    yield c
    c.stop(15)


def test_a_prefill_worker_becomes_a_decode_worker_under_load_and_no_request_is_lost(cluster: Cluster) -> None:
    api = cluster.spec.api

    def one(i: int) -> httpx.Response:
        return httpx.post(api + "/v1/completions", json={"prompt": [5 + i % 7] * 32, "max_tokens": 40,
                                                          "ignore_eos": True}, timeout=60)

    answers: list[httpx.Response] = []
    roles: dict[str, str] = {}
    deadline = time.monotonic() + 90
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            answers += list(pool.map(one, range(len(answers), len(answers) + 8)))
            _, s = cluster.get("/v1/kairos/stats")
            roles = {w: v["role"] for w, v in s["workers"].items()}
            if s["planner"]["flips"] and s["planner"]["pending"] is None and len(roles) == 3:
                break
        answers += list(pool.map(one, range(len(answers), len(answers) + 8)))  # after the flip
    assert sorted(roles.values()) == ["decode", "decode", "prefill"], roles
    assert s["planner"]["flips"] == {"decode_short": 1}  # planner_min_prefill keeps the last prefill worker
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in answers)
    moved = next(w for w, role in roles.items() if w.startswith("prefill") and role == "decode")
    _, s = cluster.get("/v1/kairos/stats")
    assert s["counts"]["completed"] >= len(answers) and not s["counts"].get("failed")
    # the flip's lines: the router's decision with its reason, the worker's drain and switch, in place
    router_log = [json.loads(x) for x in Path(cluster.spec.log_dir, "router.log").read_text().splitlines() if x]
    flip = [x for x in router_log if x.get("event") == "role_flip"]
    assert len(flip) == 1 and flip[0]["worker"] == moved and flip[0]["reason"] == "decode_short"
    assert flip[0]["from_role"] == "prefill" and flip[0]["to"] == "decode" and "decode_step_of_slo" in flip[0]
    assert any(x.get("event") == "role_flip_done" and x.get("worker") == moved for x in router_log)
    worker_log = [json.loads(x) for x in Path(cluster.spec.log_dir, f"{moved}.log").read_text().splitlines() if x]
    events = [x.get("event") for x in worker_log]
    assert events.count("worker_starting") == 1  # the process was not restarted: its service changed role
    assert events.index("role_change_started") < events.index("role_changed") < events.index("role_started")
    gauge = f'kairos_router_worker_role{{role="decode",worker="{moved}"}} 1.0'
    until = time.monotonic() + 10  # (the gauge is set on the router's telemetry tick: wait for the next one)
    while gauge not in (metrics := httpx.get(api + "/metrics", timeout=10).text) and time.monotonic() < until:
        time.sleep(0.2)
    assert 'kairos_router_role_flips_total{from_role="prefill",reason="decode_short",to_role="decode"} 1.0' in metrics
    assert gauge in metrics
