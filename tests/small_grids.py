"""Tuner grids cut small for tests that run the tuner end to end (tests/test_tune.py,
tests/test_fair_eval.py): what they prove (every knob searched, written and replayed; every
policy tuned and swept) holds for any grid, and the whole grids cost minutes of CPU."""

from __future__ import annotations

from typing import Any

from common.perf_model import load_profile
from sim import tune
from sim.core import SimConfig


def small_grids(profile: str, policies: list[str]) -> dict[str, dict[str, tuple[Any, ...]]]:
    """Each policy's grid cut to two values per knob: the shipped value and its neighbour in the
    real grid (the next one up, else the one below). Every knob is still searched, written to the
    tuned file and replayed; only the number of settings tried shrinks."""
    prof = load_profile(profile)
    out: dict[str, dict[str, tuple[Any, ...]]] = {}
    for name in policies:
        grid = tune.GRIDS[name]
        start = tune.defaults(tune.Job(policy=name, profile=prof, sim=SimConfig(), tune_trace=[], report_trace=[],
                                       grid=grid))
        out[name] = {}
        for knob, vals in grid.items():
            i = vals.index(start[knob]) if start[knob] in vals else 0
            other = vals[i + 1] if i + 1 < len(vals) else vals[i - 1]
            out[name][knob] = (start[knob], other) if start[knob] != other else (other,)
    return out
