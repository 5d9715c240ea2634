"""Router replicas under `kairos up --routers 2` (a real process, 2P2D, A100 timing): Poisson 20
streamed requests/s for 6 s on the one shared HTTP port; 2 s in (once replica router-1 carries at
least 2 open responses, at most 2 s later) router-1 is killed with kill -9. Every request served
by the other replica completes with the full, correct stream; the only failures are dropped
connections of router-1's own clients; nothing hangs; the supervisor restarts router-1, every
worker registers with it again, it serves, and the surviving replica saw no worker leave or join.

About 40 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.chaos.load import Tally, run_load
from tests.chaos.supervised import WORKERS, Up

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("replicas"), time_scale=1.0, routers=2)
    try:
        u.wait_up()
        yield u
    finally:
        rc = u.stop()
    assert rc == 0, u.text()[-3000:]
    assert "stopped." in u.text()


def events(up: Up, service: str, event: str) -> list[dict[str, object]]:
    out = []
    for line in (up.log_dir / f"{service}.log").read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            out.append(json.loads(line))
    return out


def incarnations(up: Up, service: str) -> list[str]:
    return [str(e["incarnation"]) for e in events(up, service, "router_bus_bound")]


async def test_kill_one_replica_loses_only_its_streams(up: Up) -> None:
    survivor, victim = incarnations(up, "router")[-1], incarnations(up, "router-1")[-1]
    assert survivor != victim
    joined_before = len(events(up, "router", "worker_joined"))
    assert joined_before == len(WORKERS)
    tally = Tally()
    load = asyncio.create_task(run_load(up.api + "/v1/completions", rate=20.0, duration=18.0, seed=21,
                                        hang_after=60.0, count=120, tally=tally))
    await asyncio.sleep(2.0)
    deadline = time.monotonic() + 2.0
    while tally.open_by_router[victim] < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    carried = tally.open_by_router[victim]
    pid = up.pids("router-1")[-1]
    os.kill(pid, signal.SIGKILL)
    await load
    print(f"\nkill router-1 with {carried} open: {tally.row('')}  {tally.worst()}  by router: {tally.by_router}")

    assert tally.sent == 120
    assert tally.hung == 0 and tally.lost == 0, tally.errors
    # the surviving replica lost nothing
    assert set(tally.by_router[survivor]) == {"completed"}, tally.by_router
    # the only failures are dropped connections: router-1's open streams, or a request that had
    # just reached it (no header yet)
    dropped = sum(n for k, n in tally.errors.items() if k.startswith("connection_dropped"))
    assert tally.failed == dropped, tally.errors
    assert set(tally.by_router.get(victim, {})) <= {"completed", "connection_dropped"}, tally.by_router
    assert set(tally.by_router.get("", {})) <= {"connection_dropped"}, tally.by_router
    assert tally.completed == tally.sent - dropped
    assert tally.by_router.get(victim, {}).get("connection_dropped", 0) <= carried + 2
    assert tally.by_router[survivor]["completed"] >= 30  # it took on the load after the kill (83 of 120 in one run)

    # the supervisor restarted router-1 (a new process, a new incarnation) and every worker registered with it
    await asyncio.to_thread(up.wait_for, "router-1 restarted", lambda: up.pids("router-1")[-1] != pid, 30)
    exits = [e for e in up.lines() if e.get("event") == "service_exited" and e.get("service") == "router-1"]
    assert exits and exits[-1]["exit"] == "killed by SIGKILL"
    await asyncio.to_thread(up.wait_for, "router-1 bound again", lambda: len(incarnations(up, "router-1")) == 2, 30)
    reborn = incarnations(up, "router-1")[-1]
    await asyncio.to_thread(up.wait_for, "every worker registered with the new router-1",
                            lambda: len(events(up, "router-1", "worker_joined")) >= 2 * len(WORKERS), 30)
    # it serves: new connections reach both replicas again (bounded tries, the kernel picks)
    seen: set[str] = set()
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(60):
            r = await client.post(up.api + "/v1/completions", json={"prompt": "after", "max_tokens": 4},
                                  headers={"connection": "close"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            seen.add(r.headers["x-kairos-router"])
            if seen == {survivor, reborn}:
                break
    assert seen == {survivor, reborn}
    # the survivor was not disturbed: no worker left, was lost, or joined it again
    assert len(events(up, "router", "worker_joined")) == joined_before
    for ev in ("worker_lost", "worker_departed", "worker_restarted"):
        assert not events(up, "router", ev), ev
    assert set(WORKERS) <= up.registered()
