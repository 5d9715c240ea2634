"""Two router replicas on one HTTP port (`Cluster` with routers=2, what `kairos up --routers 2`
runs) on an authenticated bus (CURVE): both routers take the same worker keys, every worker
registers with both, both serve on the shared port, and a request that goes through prefill
worker and decode worker (the KV hand-off crosses the router) completes on either. The monitor
reads both replicas' telemetry and sums their counts."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kairos.up import Cluster
from tests.conftest import start_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys = tmp_path_factory.mktemp("keys") / "curve"
    rc = subprocess.run([sys.executable, "-m", "kairos.cli", "keys", str(keys)], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    c = start_cluster(tmp_path_factory.mktemp("replicas"), prefill=1, decode=1, profile="fast",
                      policy="disagg-least-loaded", kv_transport="modeled", routers=2, curve_keys_dir=str(keys),
                      monitor=True)
    yield c
    c.stop(15)


def test_both_replicas_serve_on_one_port_with_every_worker(cluster: Cluster) -> None:
    assert cluster.spec.routers == 2 and set(cluster.spec.router_names) <= set(cluster.services)
    seen: dict[str, int] = {}
    with httpx.Client(timeout=30) as client:
        for i in range(80):  # new connections: the kernel picks the replica (bounded tries)
            r = client.post(cluster.spec.api + "/v1/completions", headers={"connection": "close"},
                            json={"prompt": "hello " * (20 + i), "max_tokens": 5})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            assert r.headers["x-kairos-route"] == "disagg"  # prefill worker -> KV -> decode worker
            seen[r.headers["x-kairos-router"]] = seen.get(r.headers["x-kairos-router"], 0) + 1
            if len(seen) == 2 and min(seen.values()) >= 3:
                break
    assert len(seen) == 2 and min(seen.values()) >= 3, seen
    for name in cluster.spec.router_names:
        log = Path(cluster.services[name].log_path or "").read_text()
        assert log.count('"worker_joined"') == 2, name  # prefill-0 and decode-0, with the shared worker key


def test_the_monitor_reads_every_replica(cluster: Cluster) -> None:
    """After the requests above (both replicas served some), the monitor shows both replicas and
    their accepted requests summed; its telemetry subscription is CURVE-authenticated too."""
    url = f"http://127.0.0.1:{cluster.spec.monitor_port}/api/state"
    deadline = time.monotonic() + 30  # RouterStats come once a second from each router
    state: dict[str, object] = {}
    while time.monotonic() < deadline:
        state = httpx.get(url, timeout=5).json()
        r = state.get("router")
        # each router's RouterStats come once a second: wait until both carry all the requests above
        if isinstance(r, dict) and len(r.get("replicas", [])) == 2 \
                and all(x["accepted"] > 0 for x in r["replicas"]) and r["accepted"] >= 6:
            break
        time.sleep(0.5)
    r = state["router"]
    assert isinstance(r, dict) and len(r["replicas"]) == 2, state
    assert all(x["accepted"] > 0 and x["age_s"] < 5 for x in r["replicas"]), r
    assert r["accepted"] == sum(x["accepted"] for x in r["replicas"]) >= 6
