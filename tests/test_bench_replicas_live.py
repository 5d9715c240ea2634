"""bench/replicas_live.py's bookkeeping (the live runs themselves are a benchmark, not a test):
the alternated run order, the requests per replica read from the routers' logs, the pairs' ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replicas_live import main, order, per_replica, ratios


def test_runs_alternate_one_router_and_the_replicas_pair_by_pair() -> None:
    assert order(4, 3) == [(1, "a"), (4, "a"), (4, "b"), (1, "b"), (1, "c"), (4, "c")]


def test_requests_per_replica_and_flips_come_from_each_routers_log(tmp_path: Path) -> None:
    def log(name: str, *events: dict[str, str]) -> None:
        (tmp_path / f"{name}.log").write_text("".join(json.dumps(e) + "\n" for e in events) + "not json\n")

    done = {"event": "request_done", "outcome": "ok"}
    log("router", done, done, {"event": "request_done", "outcome": "error"}, {"event": "role_flip"})
    log("router-1", done)
    assert per_replica(tmp_path, ["router", "router-1", "router-2"]) == ([2, 1, 0], 1)  # router-2 wrote no log


def test_each_pair_compares_the_replicas_served_p95_with_one_routers() -> None:
    runs = [{"run": "a", "routers": 1, "served_p95": 1.0}, {"run": "a", "routers": 4, "served_p95": 1.25},
            {"run": "b", "routers": 4, "served_p95": 0.9}, {"run": "b", "routers": 1, "served_p95": 1.0},
            {"run": "c", "routers": 1, "served_p95": 1.0}]  # an unfinished pair: left out
    assert ratios(runs, 4) == [{"run": "a", "one": 1.0, "replicas": 1.25, "ratio": 1.25},
                               {"run": "b", "one": 1.0, "replicas": 0.9, "ratio": 0.9}]


def test_it_refuses_a_comparison_without_replicas(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--routers", "1"])


def test_a_router_setting_must_be_named_as_the_environment_names_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--router-env", "REPLICA_STAGGER_MS=10"])
