"""Kairos's prepared view (`ClusterPrep`) is brought up to date one changed worker at a time; it
must equal, entry for entry and in the same order, a build from scratch of the same view, and
the decisions taken on it must equal a fresh policy's."""

from __future__ import annotations

import random

import msgspec
import pytest

from common.policy import ClusterView, DecodeView, NoWorkers, PrefillView
from common.policy.kairos import Kairos
from common.policy.prepared import ClusterPrep
from tests.test_decision_order import random_case


def _ids(xs: list) -> list[int]:  # type: ignore[type-arg]
    return [id(x[0]) for x in xs]


def same(a: ClusterPrep, b: ClusterPrep) -> None:
    assert [(e[0], e[1], id(e[2]), id(e[3])) for e in a.pre] == [(e[0], e[1], id(e[2]), id(e[3])) for e in b.pre]
    assert _ids(a.ll) == _ids(b.ll)
    assert _ids(a.dec) == _ids(b.dec)
    assert _ids(a.alive) == _ids(b.alive)
    assert _ids(a.live) == _ids(b.live)
    assert (a.defl_full, a.monotone, a.slo) == (b.defl_full, b.monotone, b.slo)


def changed(rng: random.Random, view: ClusterView, donor: ClusterView, now: float) -> ClusterView:
    """`view` with a few workers' views replaced (same ids, same places): by another case's view of
    the same role, or by their own with a new load; the rest keep their very objects."""
    pre, dec = list(view.prefill), list(view.decode)
    for _ in range(rng.randint(1, 3)):
        if pre and rng.random() < 0.4:
            i = rng.randrange(len(pre))
            src: PrefillView = rng.choice(donor.prefill)
            busy = now + rng.uniform(-0.1, 0.3)
            pre[i] = msgspec.structs.replace(src, worker_id=pre[i].worker_id, busy_until=busy,
                                             drain=src.drain if rng.random() < 0.5 else None)
        elif dec:
            i = rng.randrange(len(dec))
            d: DecodeView = rng.choice(donor.decode) if rng.random() < 0.5 else dec[i]
            dec[i] = msgspec.structs.replace(d, worker_id=dec[i].worker_id, batch=rng.randint(0, 200),
                                             deflections=rng.choice([0, 0, 1, 4]),
                                             kv_tokens=rng.randint(0, 400_000))
    return ClusterView(prefill=tuple(pre), decode=tuple(dec))


@pytest.mark.parametrize("seed", range(6))
def test_updated_one_worker_at_a_time_equals_built_afresh(seed: int) -> None:
    rng = random.Random(seed)
    updated = 0
    for _ in range(60):
        model, cfg, req, view, now = random_case(rng)
        k = Kairos(cfg, default_model=model)
        k.incremental_min = 0  # these fleets are small: update them in place all the same
        cp = k._cluster(view, req.tbt_slo, now)
        for _ in range(8):
            _, _, _, donor, _ = random_case(rng)
            now += rng.uniform(0.0, 0.05)
            view = changed(rng, view, donor, now)
            got = k._cluster(view, req.tbt_slo, now)
            updated += got is cp  # the same object: updated in place, not rebuilt
            cp = got
            same(got, ClusterPrep(k, view, req.tbt_slo, now))
            try:
                d = k.decide(req, view, now)
            except NoWorkers:
                continue
            # the same decision as a policy that never saw the earlier views
            assert d == Kairos(cfg, default_model=model).decide(req, view, now)
    assert updated > 300  # the incremental path is what ran


def test_membership_change_builds_afresh() -> None:
    rng = random.Random(7)
    model, cfg, req, view, now = random_case(rng)
    k = Kairos(cfg, default_model=model)
    k.incremental_min = 0
    cp = k._cluster(view, req.tbt_slo, now)
    fewer = ClusterView(prefill=view.prefill, decode=view.decode[1:])
    assert cp.update(fewer, now) is False
    moved = ClusterView(prefill=view.prefill, decode=(view.decode[-1], *view.decode[:-1]))
    assert len(view.decode) == 1 or cp.update(moved, now) is False
    got = k._cluster(fewer, req.tbt_slo, now)
    assert got is not cp
    same(got, ClusterPrep(k, fewer, req.tbt_slo, now))


def test_small_fleets_are_rebuilt_the_same() -> None:
    """Below `incremental_min` a changed view is built afresh (the lean build): the same lists."""
    rng = random.Random(11)
    for _ in range(200):
        model, cfg, req, view, now = random_case(rng)
        k = Kairos(cfg, default_model=model)
        lean = k._cluster(view, req.tbt_slo, now)
        assert lean.update(ClusterView(prefill=tuple(view.prefill), decode=tuple(view.decode)), now)
        same(lean, ClusterPrep(k, view, req.tbt_slo, now, incremental=True))
        _, _, _, donor, _ = random_case(rng)
        other = changed(rng, view, donor, now)
        assert lean.update(other, now) is False
