"""The Dynamo-style threshold planner (common/router_core/planner.py ThresholdPlanner), the
baseline `dynamo-planner` of the simulator: its rule on synthetic load, with a fake clock."""

from __future__ import annotations

from common.router_core.planner import Load, ThresholdPlanner, WorkerLoad, threshold_config
from common.router_core.ports import NullLog
from sim.knobs import PLANNED, SIM_POLICIES, planner_rule, routing, shape, with_planner
from sim.state import SimConfig


def fleet(n_p: int, n_d: int) -> tuple[WorkerLoad, ...]:
    return (*(WorkerLoad(f"p{i}", "prefill", 1000.0 * (n_p - i)) for i in range(n_p)),
            *(WorkerLoad(f"d{i}", "decode", 10.0 * (n_d - i)) for i in range(n_d)))


def load(queue: float, step: float, workers: tuple[WorkerLoad, ...]) -> Load:
    # estimated TTFT = queue + one full-budget prefill step (0.2 s here); ITL = the decode step
    return Load(prefill_queue_s=queue, decode_step_s=step, waits_decode=0, waits_prefill=0, workers=workers,
                prefill_step_s=0.2)


def planner() -> ThresholdPlanner:
    return ThresholdPlanner(threshold_config(2.0, 0.1), log=NullLog())


def test_a_role_over_its_sla_gets_a_worker_from_the_other_every_five_seconds_at_most() -> None:
    p = planner()
    w = fleet(2, 2)
    flips = [(t, f) for t in range(0, 12) if (f := p.observe(load(2.5, 0.09, w), float(t))) is not None]
    # TTFT 2.7 s > 2 s, ITL 90 ms within its band: decode gives one to prefill, the least loaded one
    assert [(t, f.worker_id, f.to, f.reason) for t, f in flips] == [(0, "d1", "prefill", "prefill_short")]
    assert flips[0][1].evidence["ttft_est_s"] == 2.7
    p.flip_done("d1", "prefill", 12.0)  # no decision until an interval after the new shape started
    assert p.observe(load(2.5, 0.09, fleet(3, 1)), 13.0) is None  # and never below one worker a role
    p = planner()
    f = p.observe(load(0.5, 0.12, w), 0.0)  # ITL over its SLA, TTFT within: prefill gives one
    assert f is not None and (f.worker_id, f.to, f.reason) == ("p1", "decode", "decode_short")


def test_a_role_under_0_8_of_its_sla_gives_one_up_and_a_role_in_its_band_keeps_the_split() -> None:
    w = fleet(2, 2)
    p = planner()
    f = p.observe(load(1.7, 0.05, w), 0.0)  # TTFT 1.9 s in [1.6, 2] s (0), ITL 50 ms < 80 ms (-1)
    assert f is not None and (f.to, f.reason) == ("prefill", "decode_spare")
    for queue, step in ((1.7, 0.09), (2.5, 0.12), (0.5, 0.05)):  # both in band; both over; both under
        assert planner().observe(load(queue, step, w), 0.0) is None
    p = planner()
    assert p.observe(load(1.7, 0.09, w), 0.0) is None
    assert p.observe(load(2.5, 0.09, w), 2.0) is None  # decisions every 5 s, on the interval's mean
    f = p.observe(load(2.5, 0.09, w), 5.0)  # mean TTFT over (0, 5]: 2.7 s
    assert f is not None and f.to == "prefill"


def test_dynamo_planner_is_a_simulator_baseline_over_least_loaded_routing() -> None:
    assert "dynamo-planner" in SIM_POLICIES and PLANNED["dynamo-planner"] == ("disagg-least-loaded", "threshold")
    assert routing("dynamo-planner") == "disagg-least-loaded" and routing("kairos") == "kairos"
    assert planner_rule("kairos") is None and shape("dynamo-planner", 2, 2) == (2, 2)
    sim = SimConfig(prefill=2, decode=2)
    got = with_planner("dynamo-planner", sim)
    assert got.planner and got.planner_rule == "threshold"
    assert with_planner("kairos", sim) is sim
