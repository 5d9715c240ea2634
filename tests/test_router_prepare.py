"""The router has the policy prepare its views when they change (a dispatch, a heartbeat), once
the loop is free, so the next request's decision finds the view work done (`Kairos.prepare`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from common import messages as m
from common.policy import kairos, prepared
from services.router import service as router_service
from services.router.service import IDLE_READ_FLEET, Router, idle_gap
from tests.test_trust import SAMPLING, frame, hello, make_router


def count_preparations(monkeypatch: pytest.MonkeyPatch, builds: list[float], what: str = "decode") -> None:
    """Append to `builds` each time the policy prepares a new view: built afresh, or updated for
    the workers whose views changed (`ClusterPrep.update` on a different view)."""

    class Counting(prepared.ClusterPrep):
        def __init__(self, k: kairos.Kairos, view: kairos.ClusterView, slo: float, now: float,
                     incremental: bool = True) -> None:
            builds.append(len(view.decode) if what == "decode" else now)
            super().__init__(k, view, slo, now, incremental)

        def update(self, view: kairos.ClusterView, now: float) -> bool:
            if view.prefill is self.prefill and view.decode is self.decode:
                return True
            ok = super().update(view, now)
            if ok:
                builds.append(len(view.decode) if what == "decode" else now)
            return ok

    monkeypatch.setattr(kairos, "ClusterPrep", Counting)


@pytest.fixture
def router() -> Iterator[Router]:
    r = make_router(prepare_interval_ms=0)  # prepare as soon as the loop is free
    yield r
    r.close()


async def test_the_next_decision_finds_its_view_prepared(router: Router, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[float] = []
    count_preparations(monkeypatch, builds)
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"decode-1", hello("decode-1"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    router.submit([1, 2, 3] * 300, SAMPLING)  # decided, then its dispatch changes a view (the ledger)
    await asyncio.sleep(0)  # the loop is free: the router prepares the changed views
    n = len(builds)
    assert n >= 1
    cp = router.policy._cp  # type: ignore[attr-defined]
    view = router.table.view(use_ledger=router.cfg.ledger)
    assert all(a is b for a, b in zip(cp.decode, view.decode, strict=True)) and len(cp.decode) == 2
    router.submit([4, 5, 6] * 300, SAMPLING)
    assert len(builds) == n  # the decision used the prepared view as it was
    await asyncio.sleep(0)
    assert len(builds) == n + 1  # and its dispatch had the new one prepared, once


async def test_prepares_are_spaced_by_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's heartbeats each change a view; with `prepare_interval_ms` the router rebuilds at most
    once per interval, and the change that arrives inside it is still prepared once the interval ends."""
    r = make_router(prepare_interval_ms=40)
    try:
        builds: list[float] = []
        count_preparations(monkeypatch, builds, "now")
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        r.submit([1, 2, 3] * 300, SAMPLING)
        await asyncio.sleep(0)  # the first prepare runs as soon as the loop is free
        n = len(builds)
        assert n >= 1
        r.submit([4, 5, 6] * 300, SAMPLING)  # changes the view again, inside the interval
        await asyncio.sleep(0)
        assert len(builds) == n  # not yet: the interval has not passed
        for _ in range(100):
            if len(builds) > n:
                break
            await asyncio.sleep(0.005)
        assert len(builds) == n + 1  # prepared once, after the interval
        assert builds[-1] - builds[n - 1] >= 0.040 - 1e-3
    finally:
        r.close()


def _beat(worker_id: str, seq: int, batch: int) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=worker_id, incarnation="i1", seq=seq, batch=batch, kv_tokens=100 * batch,
                             kv_free_tokens=10**6 - 100 * batch, kv_capacity_tokens=10**6,
                             resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1, token_budget=2048)


@pytest.mark.parametrize("when_idle", [False, True])
async def test_an_idle_router_leaves_heartbeats_to_the_next_decision(monkeypatch: pytest.MonkeyPatch,
                                                                      when_idle: bool) -> None:
    """With no request in flight a fleet's heartbeats prepare nothing (issue 47: 256 workers' heartbeats
    at most 0.1 core); the next decision prepares each changed worker once, and decides on the latest
    heartbeats. `prepare_when_idle` brings back a preparation after each change."""
    r = make_router(prepare_interval_ms=0, prepare_when_idle=when_idle)
    try:
        builds: list[float] = []
        count_preparations(monkeypatch, builds, "now")
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"decode-1", hello("decode-1"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        for seq in range(1, 4):
            frame(r, b"decode-0", _beat("decode-0", seq, 30))
            frame(r, b"decode-1", _beat("decode-1", seq, 0))
            await asyncio.sleep(0)  # the loop is free after each heartbeat
        assert (len(builds) >= 3) if when_idle else (builds == [])
        n = len(builds)
        req = r.submit([1, 2, 3] * 300, SAMPLING)
        # lazily: the decision prepared the changed views itself, once; else they were ready
        assert len(builds) == n + (0 if when_idle else 1)
        assert req.decision is not None and req.decision.decode_worker == "decode-1"  # the idle one, as beaten
        cp = r.policy._cp  # type: ignore[attr-defined]
        assert [v.batch for v in cp.decode] == [30, 0]
        await asyncio.sleep(0)  # a request is in flight now: its dispatch's change is prepared at once
        assert len(builds) == n + (1 if when_idle else 2)
    finally:
        r.close()


async def test_a_request_at_an_idle_router_decides_on_the_heartbeats_not_yet_read() -> None:
    """While idle the work socket is read only every `idle_read_ms` (Inbox's idle gap): a request that
    arrives in a pause has the inbox catch up first, so its decision sees the heartbeats that came
    since the last read (here decode-1 became busy, so the request goes to decode-0)."""
    r = make_router(prepare_interval_ms=0)

    class PausedInbox:  # what Inbox.catch_up does for the router: the waiting frames are handled now
        caught_up = 0

        def catch_up(self) -> None:
            self.caught_up += 1
            frame(r, b"decode-0", _beat("decode-0", 2, 0))
            frame(r, b"decode-1", _beat("decode-1", 2, 60))

    try:
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"decode-1", hello("decode-1"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        frame(r, b"decode-0", _beat("decode-0", 1, 60))
        frame(r, b"decode-1", _beat("decode-1", 1, 0))
        inbox = PausedInbox()
        r._inbox = inbox  # type: ignore[assignment]
        req = r.submit([1, 2, 3] * 300, SAMPLING)
        assert inbox.caught_up == 1
        assert req.decision is not None and req.decision.decode_worker == "decode-0"
        r.submit([4, 5, 6] * 300, SAMPLING)
        assert inbox.caught_up == 1  # a request in flight: every message is read as it comes, nothing waits
    finally:
        r._inbox = None
        r.close()


def test_an_idle_routers_read_gap_grows_with_its_fleet() -> None:
    """`idle_read_ms` is the gap for a fleet of 256 workers (its heartbeats then batch); a small
    fleet's few heartbeats are read nearly as they come, so that a request arriving at an idle
    router does not read a backlog of them on its first token's path (issue 47)."""
    assert idle_gap(0.05, 300) == 0.05
    assert idle_gap(0.05, IDLE_READ_FLEET) == 0.05
    assert idle_gap(0.05, 6) == pytest.approx(0.05 * 6 / 256)
    assert idle_gap(0.05, 0) == 0.0


async def test_the_router_reads_its_socket_with_the_fleet_scaled_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's work loop gives its Inbox that gap: none while a request is in flight, the
    fleet-scaled one while idle, read afresh as workers join."""
    gaps: list[object] = []

    class Capture:
        def __init__(self, sock: object, on_frames: object, **kw: object) -> None:
            gaps.append(kw["idle_gap"])
            self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def close(self) -> None:
            pass

    monkeypatch.setattr(router_service, "Inbox", Capture)
    r = make_router(open_bus=True, idle_read_ms=50.0)
    try:
        loop = asyncio.create_task(r._work_loop())
        await asyncio.sleep(0)
        gap = gaps[0]
        assert callable(gap)
        assert gap() == 0.0  # no worker yet
        for i in range(6):
            frame(r, f"decode-{i}".encode(), hello(f"decode-{i}"))
        assert gap() == pytest.approx(0.05 * 6 / 256)
        r.requests["x"] = object()  # type: ignore[assignment]  # a request in flight: read as they come
        assert gap() == 0.0
        r.requests.clear()
        loop.cancel()
    finally:
        r.close()
