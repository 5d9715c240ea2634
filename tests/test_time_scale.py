"""`kairos sim --time-scale K` is the same scenario K times slower (issue 44's live-vs-simulated
check runs the live cluster slowed so that two cores keep up, and the simulator must run the same
scenario): every time of the run K times longer, every attainment the same, the role planner's
flip at K times the time. Fails when a wall-clock setting of the scenario is left unscaled (the
router's planner periods, the heartbeat, the KV transfer, the SLOs, the arrivals)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.perf_model import load_profile
from common.sessions import write_jsonl
from sim.cli import main
from sim.workloads import WORKLOADS, load


def _run(trace: Path, out: Path, k: float) -> dict[str, Any]:
    # the workers' 2 ms state beat is a real delay live and stays 2 ms under --time-scale; scaled here by
    # hand, so that nothing of the scenario is left unscaled and the two runs must agree exactly
    main(["--trace", str(trace), "--start", "170", "--duration", "60", "--rate-scale", "0.75", "--policy", "kairos",
          "--planner", "on", "--time-scale", str(k), "--prompt-beat", str(0.002 * k), "--quiet", "--out", str(out)])
    return dict(json.loads(out.read_text())["policies"]["kairos"])


def test_time_scaled_sim_is_the_same_scenario(tmp_path: Path) -> None:
    w = WORKLOADS["shift-code"]
    trace = tmp_path / "trace.jsonl"
    write_jsonl(load(w, w.report, 1.0), trace)
    one, three = _run(trace, tmp_path / "k1.json", 1.0), _run(trace, tmp_path / "k3.json", 3.0)
    assert one["requests"] == three["requests"] > 400
    for key in ("completed", "rejected", "ttft_slo_attainment", "tbt_slo_attainment", "slo_attainment"):
        assert three[key] == one[key], key
    for key in ("ttft_p50", "ttft_p99", "tbt_p99"):
        assert three[key] == pytest.approx(3 * one[key], rel=1e-6), key
    f1, f3 = one["sim"]["role_flips"], three["sim"]["role_flips"]
    assert len(f1) == len(f3) >= 1  # the slice makes the planner act: its periods are part of the scenario
    for a, b in zip(f1, f3, strict=True):
        assert (b["worker"], b["to"], b["reason"]) == (a["worker"], a["to"], a["reason"])
        assert b["at"] == pytest.approx(3 * a["at"]) and b["out_s"] == pytest.approx(3 * a["out_s"])


def test_slowed_model_scales_steps_and_the_kv_transfer() -> None:
    m = load_profile("h100-llama2-70b-tp4").model
    s = m.slowed(2.5)
    assert s.step_time(64, 64_000) == pytest.approx(2.5 * m.step_time(64, 64_000))
    assert s.xfer_time(8192) == pytest.approx(2.5 * m.xfer_time(8192))
    assert m.scaled(2.5).xfer_time(8192) == pytest.approx(m.xfer_time(8192))  # a slower GPU, the same link
