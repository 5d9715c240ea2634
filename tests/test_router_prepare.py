"""The router has the policy prepare its views when they change (a dispatch, a heartbeat), once
the loop is free, so the next request's decision finds the view work done (`Kairos.prepare`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from common.policy import kairos, prepared
from services.router.service import Router
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
