"""Role flips in the simulator (sim/core.py, the role planner of common/router_core/planner.py run
by router 0): a worker drains, changes role and rejoins, and no request is lost across it."""

from __future__ import annotations

import msgspec

from common.perf_model import load_profile
from common.router_core.planner import PlannerConfig, RolePlanner
from sim.core import SimConfig, Simulation
from sim.knobs import Setup, build, shipped
from sim.workloads import shifting

PROFILE = load_profile("h100-llama2-70b-tp4")


def _run(phases: tuple[str, ...], n_p: int, n_d: int, duration: float, planner: bool, speed: float = 2.0) -> Simulation:
    policy, prof = build("kairos", shipped("kairos", Setup(), None), PROFILE)
    sim = Simulation(prof, policy, SimConfig(prefill=n_p, decode=n_d, planner=planner))
    if planner:  # a short window and no dwell: the test's trace is short
        sim.planner = RolePlanner(PlannerConfig(enabled=True, interval_s=1.0, window_s=4.0, min_dwell_s=0.0,
                                                min_gap_s=10.0))
    # twice the phase's rate (output: 16 requests/s): two decode workers are short within seconds
    trace = [msgspec.structs.replace(r, t=r.t / speed)
             for r in shifting(phases, 3, duration=duration, phase_s=duration)]
    res = sim.run(trace)
    sim.result = res  # type: ignore[attr-defined]
    return sim


def test_output_heavy_traffic_moves_a_prefill_worker_to_decode_and_loses_no_request() -> None:
    sim = _run(("output",), 2, 2, 40.0, planner=True)
    res = sim.result  # type: ignore[attr-defined]
    flips = res.stats["role_flips"]
    assert flips and flips[0]["to"] == "decode" and flips[0]["reason"] in ("decode_busy", "decode_short")
    assert res.stats["final_split"] == "1P3D"
    assert [w.wid for w in sim.decode][-1] == flips[0]["worker"]  # the same worker, now a decode worker
    served = [r for r in res.records if not r.rejected]
    assert len(served) == len(res.records)  # nothing rejected, nothing lost: every request ran to its end
    assert all(r.output_tokens and r.ttft is not None for r in served)
    # the rejoined worker took decodes: the run's requests went to three decode workers
    assert sim.planner is not None and sim.planner.pending is None


def test_without_the_planner_the_split_stays() -> None:
    sim = _run(("output",), 2, 2, 20.0, planner=False)
    assert "role_flips" not in sim.result.stats  # type: ignore[attr-defined]
    assert len(sim.prefill) == len(sim.decode) == 2


def test_prompt_heavy_traffic_moves_a_decode_worker_to_prefill_after_it_finishes_its_decodes() -> None:
    # six times the phase's rate (12 long prompts a second): the prefill queue stays long (twice or three
    # times that rate is a burst the decode workers absorb by prefilling in place: no flip)
    sim = _run(("prompt",), 1, 3, 60.0, planner=True, speed=6.0)
    res = sim.result  # type: ignore[attr-defined]
    flips = res.stats["role_flips"]
    assert flips and flips[0]["to"] == "prefill" and flips[0]["reason"] == "prefill_short"
    assert flips[0]["out_s"] >= flips[0]["drain_s"] + 2.0  # drained, then the engine out planner_switch_s
    assert any(w.wid == flips[0]["worker"] for w in sim.prefill)
    assert not any(r.rejected for r in res.records)
    assert all(r.output_tokens and r.ttft is not None for r in res.records)


def test_no_planner_on_a_cluster_without_prefill_workers() -> None:
    policy, prof = build("chunked-prefill", shipped("chunked-prefill", Setup(), None), PROFILE)
    assert Simulation(prof, policy, SimConfig(prefill=0, decode=4, planner=True)).planner is None
