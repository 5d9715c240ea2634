"""sim/regress.py, the refactoring check of the simulator: its digest is stable across runs of the
same code and changes when any request's record or the simulation's stats change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import pytest

from common.traces import synthetic
from sim import regress
from sim.regress import Case, digest, first_difference, run_case

TINY = Case("tiny", "a tiny bursty run", lambda: synthetic(rate=2.0, duration=20.0, arrival="onoff", cv=2.2, seed=3),
            sim={"step_noise": 0.1})


def test_digest_is_stable_and_sees_a_changed_record() -> None:
    a, b = run_case(TINY), run_case(TINY)
    assert a.result.records and a.digest == b.digest
    recs = list(a.result.records)
    served = next(i for i, r in enumerate(recs) if r.ttft is not None)
    r = recs[served]
    recs[served] = dataclasses.replace(r, ttft=r.ttft + 1e-12)  # type: ignore[operator]
    assert digest(recs, a.result.stats) != a.digest
    recs[served] = dataclasses.replace(r, tbt_gaps=[*r.tbt_gaps, 0.01])
    assert digest(recs, a.result.stats) != a.digest
    assert digest(a.result.records, {**a.result.stats, "steps": a.result.stats["steps"] + 1}) != a.digest
    assert digest(a.result.records, {**a.result.stats, "wall_s": 1e9, "decision_us_p50": 1.0}) == a.digest
    old = regress.entry(TINY, a)
    new = regress.entry(TINY, dataclasses.replace(a, result=msgspec.structs.replace(a.result, records=recs)))
    assert f"#{served}" in first_difference(old, new)


def test_check_fails_on_a_difference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(regress, "CASES", (TINY,))
    out = tmp_path / "d.json"
    assert regress.main(["--out", str(out)]) == 0
    assert regress.main(["--check", str(out)]) == 0
    data = json.loads(out.read_text())
    data["runs"]["tiny"]["digest"] = "0" * 64
    data["runs"]["tiny"]["record_hashes"][1] = "x"
    out.write_text(json.dumps(data))
    capsys.readouterr()
    assert regress.main(["--check", str(out)]) == 1
    text = capsys.readouterr().out
    assert "DIFFERENT" in text and "first differing request: #1" in text
