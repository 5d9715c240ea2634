"""The held-out shifting workloads (sim/workloads.py `scheduled`, UNSEEN): phases of the lengths
the schedule gives, a ramp that rises, a mixed phase, the conv trace's own windows, deterministic
from a seed, runnable by `python -m sim.shipped_eval` and absent from the fair evaluation's list."""

from __future__ import annotations

import statistics
from itertools import pairwise

import pytest

from sim.workloads import CONV_SCHEDULE, RAMP_SCHEDULE, UNSEEN, WORKLOADS, load, scheduled


def _window(reqs: list, a: float, b: float) -> list:  # type: ignore[type-arg]
    return [r for r in reqs if a <= r.t < b]


def test_a_schedule_gives_its_phases_in_order_with_a_rising_ramp() -> None:
    a = scheduled(RAMP_SCHEDULE, 21)
    assert a == scheduled(RAMP_SCHEDULE, 21) and a != scheduled(RAMP_SCHEDULE, 22)
    assert all(x.t <= y.t for x, y in pairwise(a)) and a[-1].t < 600.0
    burst, ramp, prompt = _window(a, 0, 60), _window(a, 60, 360), _window(a, 360, 420)
    assert statistics.mean(r.output_length for r in burst) < 100
    assert statistics.mean(r.output_length for r in ramp) > 300
    assert statistics.median(r.input_length for r in prompt) > 2000
    # the ramp x0.3 -> x1.3 of 8 req/s: its last minute about three times its first
    first, last = len(_window(a, 60, 120)), len(_window(a, 300, 360))
    assert 2.5 * first < last and 60 * 8 * 1.0 < last < 60 * 8 * 1.4
    mixed = _window(a, 420, 540)  # prompt-heavy and output-heavy requests in the same minutes
    assert any(r.input_length >= 2048 and r.output_length < 100 for r in mixed)
    assert sum(r.output_length > 300 for r in mixed) > 100


def test_conv_phases_are_the_conv_trace_s_later_windows() -> None:
    w = UNSEEN["shift-conv"]
    tune, report = load(w, w.tune, 1.0), load(w, w.report, 1.0)
    assert w.synth["schedule"] == CONV_SCHEDULE
    for reqs in (tune, report):
        assert statistics.mean(r.output_length for r in _window(reqs, 120, 180)) > 300  # output-heavy
        assert len(_window(reqs, 0, 120)) > 120 * 5 * 2 * 0.6  # the conv trace at x2
    assert [r.input_length for r in _window(tune, 0, 120)] != [r.input_length for r in _window(report, 0, 120)]
    with pytest.raises(ValueError):
        scheduled((("conv", 60.0, 0.5, 1.0),), 1)
    assert len(load(w, w.report, 2.0)) == len(report)


def test_held_out_workloads_are_not_in_the_fair_evaluation_but_shipped_eval_runs_them() -> None:
    from sim.shipped_eval import build_parser

    assert not set(UNSEEN) & set(WORKLOADS)
    args = build_parser().parse_args(["--workload", "shift-ramp", "--workload", "shift-conv", "--policy", "kairos"])
    assert args.workload == ["shift-ramp", "shift-conv"]
