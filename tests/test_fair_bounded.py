"""`python -m sim.fair_bounded`: each baseline tuned on the tune slice (its split first) and judged
on the report slice, Kairos as shipped beside it, rows written as they finish."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.traces import synthetic
from sim import fair_bounded
from sim.core import SimConfig
from sim.tune import SPLIT
from sim.workloads import PHASES


def test_bounded_tunes_the_split_on_the_tune_slice_and_reports_on_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rate, arrival, cv, lengths = PHASES["output"]
    slices = {10: synthetic(rate=rate, duration=20, arrival=arrival, cv=cv, seed=3, **lengths),  # type: ignore[arg-type]
              11: synthetic(rate=rate, duration=20, arrival=arrival, cv=cv, seed=4, **lengths)}  # type: ignore[arg-type]
    asked: list[Any] = []

    def load(w: Any, which: Any, scale: float) -> list[Any]:
        asked.append((w.name, which, scale))
        return slices[which]

    monkeypatch.setattr(fair_bounded, "load", load)
    monkeypatch.setattr(fair_bounded, "BOUNDED", {"disagg-least-loaded": {SPLIT: (1, 2, 3)}})
    monkeypatch.setattr(fair_bounded, "BASELINES", ("disagg-least-loaded",))
    # a 45 ms TBT SLO: 20 s of the output-heavy phase is decode-bound at 2P2D, not at 1P3D
    monkeypatch.setattr(fair_bounded, "SimConfig", lambda **kw: SimConfig(**{**kw, "tbt_slo": 0.045}))
    out = tmp_path / "rows.json"
    assert fair_bounded.main(["--workload", "shift", "--policy", "disagg-least-loaded", "--no-kairos",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert asked == [("shift", 10, 1.0), ("shift", 11, 1.0)]  # the tune slice and the report slice, at x1
    (row,) = res["rows"]
    assert (row["workload"], row["policy"], row["condition"], row["tuned"]) == ("shift", "disagg-least-loaded",
                                                                                 "exact", True)
    assert row["cluster"] == "1P3D" and row["evaluated"] == 3
    assert row["report"]["requests"] == len(slices[11]) and row["tune"]["requests"] == len(slices[10])
    assert res["passes"] == 1 and res["stress"] == [1.0] and "wall_s" in res


def test_edges_steps_one_value_past_the_reduced_grid_never_past_the_full_one() -> None:
    """--edges: a tuned value that is the smallest (largest) tried gets the full grid's next one
    down (up); a value inside what was tried, an "off" value or the full grid's end get none."""
    tried = {512, 768, 1024}
    assert fair_bounded.beyond("chunked-prefill", "decode_token_budget", 512, tried) == [256]
    assert fair_bounded.beyond("chunked-prefill", "decode_token_budget", 768, tried) == []
    assert fair_bounded.beyond("chunked-prefill", "decode_token_budget", 1024, tried) == [2048]
    assert fair_bounded.beyond("disagg-least-loaded", "prefill_token_budget", 16384, {2048, 8192, 16384}) == []
    assert fair_bounded.beyond("conditional-disagg", "prefill_busy_threshold", 2.0, {2.0, 1000.0}) == [1.0, 4.0]
    assert fair_bounded.beyond("conditional-disagg", "prefill_busy_threshold", 1000.0, {2.0, 1000.0}) == []
    assert fair_bounded.beyond("conditional-disagg", "eff_isl_threshold", 0, {0, 2048}) == []
    # a profile's default off the full grid (the A100's decode budget 320, chunk 192): the nearest beyond it
    assert fair_bounded.beyond("chunked-prefill", "decode_token_budget", 320, {320, 512, 1024}) == [256]
    assert fair_bounded.beyond("chunked-prefill", "decode_chunk", 192, {192, 256, 1024}) == [128]
    assert fair_bounded.beyond("chunked-prefill", "decode_token_budget", 768, {512, 768, 1024}) == []


def test_rate_and_profile_reach_both_slices_kairos_and_the_edges_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--profile and --rate (the A100's regime, x0.35): both slices and Kairos's run load at that
    scale on that profile, the file records both, and --edges takes them from its RESULT (a
    --rate or --profile that differs from RESULT's is refused)."""
    rate, arrival, cv, lengths = PHASES["output"]
    trace = synthetic(rate=rate, duration=10, arrival=arrival, cv=cv, seed=3, **lengths)  # type: ignore[arg-type]
    asked: list[Any] = []

    def load(w: Any, which: Any, scale: float) -> list[Any]:
        asked.append((which, scale))
        return trace

    monkeypatch.setattr(fair_bounded, "load", load)
    monkeypatch.setattr("sim.fair_eval.load", load)
    monkeypatch.setattr(fair_bounded, "BOUNDED",
                        {"disagg-least-loaded": {SPLIT: (2,), "prefill_token_budget": (2048,)}})
    monkeypatch.setattr(fair_bounded, "BASELINES", ("disagg-least-loaded",))
    out, edges = tmp_path / "rows.json", tmp_path / "edges.json"
    assert fair_bounded.main(["--workload", "shift", "--profile", "a100-llama2-70b-tp4", "--rate", "0.35",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert asked == [(10, 0.35), (11, 0.35), (11, 0.35)]  # tune slice, report slice, Kairos's report run
    assert res["profile"] == "a100-llama2-70b-tp4" and res["rate_scale"] == 0.35
    assert [r["policy"] for r in res["rows"]] == ["disagg-least-loaded", "kairos"]
    asked.clear()
    assert fair_bounded.main(["--edges", str(out), "--out", str(edges)]) == 0
    assert asked and all(scale == 0.35 for _, scale in asked)
    e = json.loads(edges.read_text())
    assert e["profile"] == "a100-llama2-70b-tp4" and e["rate_scale"] == 0.35 and len(e["rows"]) == 1
    assert fair_bounded.main(["--edges", str(out), "--rate", "1", "--out", str(edges)]) == 2
    assert fair_bounded.main(["--edges", str(out), "--profile", "h100-llama2-70b-tp4", "--out", str(edges)]) == 2
    assert "differs" in capsys.readouterr().err
    assert fair_bounded.main(["--workload", "shift", "--rate", "0", "--out", str(out)]) == 2
