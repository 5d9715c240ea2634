"""Shared fixtures: real local clusters of processes on free loopback ports."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kairos.up import Cluster, ClusterSpec


def start_cluster(tmp: Path, **kw: object) -> Cluster:
    kw.setdefault("monitor", False)
    # the role planner is on by default; a test's cluster keeps the split it asked for (a flip
    # mid-test would move what it checks) unless the test sets KAIROS_PLANNER itself
    env = dict(kw.get("router_env") or {})  # type: ignore[call-overload]
    env.setdefault("KAIROS_PLANNER", "false")
    kw["router_env"] = env
    spec = ClusterSpec.ephemeral(log_dir=str(tmp), **kw)
    c = Cluster(spec)
    c.start(timeout=60)  # a failed start stops what it started
    return c


@pytest.fixture(scope="module")
def fast_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """1 prefill + 1 decode worker on the near-zero `fast` profile; policy from the module's POLICY."""
    policy = getattr(request.module, "POLICY", "kairos")
    c = start_cluster(tmp_path_factory.mktemp("cluster"), prefill=1, decode=1, profile="fast", policy=policy)
    yield c
    c.stop(15)


@pytest.fixture(autouse=True)
def _heap_unfrozen() -> Iterator[None]:
    """A router or worker started in this process freezes the heap (common/service.py `settle_heap`),
    the test session's too: thaw it after each test, so later tests' garbage is collected as before."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
