"""bench/check.py (`make bench-check`): the comparison with bench/baseline.json. The runs
themselves are CI's bench-check tier; here, what passes and what fails."""

import json
from pathlib import Path

from bench.check import BASELINE, compare

BASE = {"router_cost_ratio": 4.0, "decision_total_ratio": 10.0, "tolerance": 1.6}


def test_within_tolerance_passes() -> None:
    assert compare({"router_cost_ratio": 6.3, "decision_total_ratio": 15.9}, BASE) == []


def test_each_ratio_fails_on_its_own() -> None:
    bad = compare({"router_cost_ratio": 9.3, "decision_total_ratio": 10.0}, BASE)  # 3c42f7e's median
    assert len(bad) == 1 and bad[0].startswith("router_cost_ratio 9.30")
    bad = compare({"router_cost_ratio": 4.0, "decision_total_ratio": 16.5}, BASE)
    assert len(bad) == 1 and bad[0].startswith("decision_total_ratio")


def test_committed_baseline_is_complete() -> None:
    base = json.loads(Path(BASELINE).read_text())
    assert {"router_cost_ratio", "decision_total_ratio", "tolerance"} <= set(base)
    assert 1.0 < base["tolerance"] < 2.5  # wide enough for the machine's spread, narrow enough to catch 2x
