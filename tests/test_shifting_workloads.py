"""The shifting-mix workloads of the fair evaluation (sim/workloads.py `shifting`, issue 44): the
mix changes every phase, deterministic from a seed, the tune and report slices disjoint, and
`python -m sim.shipped_eval` reads them."""

from __future__ import annotations

import statistics
from itertools import pairwise

from sim.workloads import PHASE_S, WORKLOADS, load, shifting


def _phases(reqs: list, n: int) -> list[list]:  # type: ignore[type-arg]
    return [[r for r in reqs if i * PHASE_S <= r.t < (i + 1) * PHASE_S] for i in range(n)]


def test_the_mix_shifts_every_phase_and_a_seed_gives_the_same_trace() -> None:
    a = shifting(("prompt", "output", "burst"), 11)
    assert a == shifting(("prompt", "output", "burst"), 11)  # deterministic from the seed
    assert a != shifting(("prompt", "output", "burst"), 12)
    assert all(x.t <= y.t for x, y in pairwise(a)) and a[-1].t < 600.0
    kinds = []
    for ph in _phases(a, 4):
        assert ph, "no phase is empty"
        out = statistics.mean(r.output_length for r in ph)
        prompt = statistics.median(r.input_length for r in ph)
        kinds.append("output" if out > 200 else "prompt" if prompt > 2000 else "burst")
    assert all(k != j for k, j in pairwise(kinds))  # never the same kind twice in a row
    assert "output" in kinds


def test_code_phases_are_the_code_trace_s_own_windows_alternating_with_output_heavy_ones() -> None:
    w = WORKLOADS["shift-code"]
    tune, report = load(w, w.tune, 1.0), load(w, w.report, 1.0)
    assert w.tune != w.report
    for reqs in (tune, report):
        ph = _phases(reqs, 4)
        assert all(ph), "a code phase starts at the trace's next request: never empty"
        assert statistics.mean(r.output_length for r in ph[1]) > 300  # output-heavy
        assert statistics.mean(r.output_length for r in ph[0]) < 100  # the code trace's short answers
    # the report slice's code windows come from later trace time than the tune slice's
    assert [(r.input_length, r.output_length) for r in _phases(tune, 1)[0]] != \
        [(r.input_length, r.output_length) for r in _phases(report, 1)[0]]


def test_a_rate_scale_compresses_the_slice() -> None:
    w = WORKLOADS["shift"]
    x1, x2 = load(w, w.report, 1.0), load(w, w.report, 2.0)
    assert len(x1) == len(x2) and all(abs(a.t / 2 - b.t) < 1e-9 for a, b in zip(x1, x2, strict=True))
    assert w.fixed_regime("h100-llama2-70b-tp4") == 1.0 and w.prefill == w.decode == 2


def test_shipped_eval_reads_splits_and_takes_goodput_as_the_highest_rate_kept() -> None:
    import pytest

    from common.errors import ConfigError
    from sim.shipped_eval import goodput, parse_split

    assert parse_split("2P2D") == (2, 2) and parse_split("0p4d") == (0, 4)
    for bad in ("2D2P", "P2D", "2P0D", "x"):
        with pytest.raises(ConfigError):
            parse_split(bad)
    row = {"workload": "shift", "policy": "kairos", "cluster": "2P2D", "condition": "exact"}
    rows = [{**row, "rate": 0.5, "slo_attainment": 0.99}, {**row, "rate": 1.0, "slo_attainment": 0.91},
            {**row, "rate": 1.5, "slo_attainment": 0.5}, {**row, "policy": "chunked-prefill", "rate": 1.0,
                                                          "slo_attainment": 0.2}]
    gp = goodput(rows, 0.9)
    assert gp[("shift", "kairos", "2P2D", "exact")] == 1.0
    assert gp[("shift", "chunked-prefill", "2P2D", "exact")] is None


def test_shipped_eval_runs_the_slice_it_is_asked_for() -> None:
    import argparse

    import pytest

    from sim.shipped_eval import build_parser, cells, main, slice_arg

    assert [slice_arg(x) for x in ("report", "tune", "13")] == ["report", "tune", "13"]
    with pytest.raises(argparse.ArgumentTypeError):
        slice_arg("seed13")
    args = build_parser().parse_args(["--workload", "shift", "--policy", "kairos", "--slice", "tune"])
    args.split, args.condition, args.rate = [(2, 2)], ["exact"], [1.0]
    (cell,) = cells(args, {})
    assert cell.slice == "tune"
    assert build_parser().parse_args(["--workload", "shift", "--policy", "kairos"]).slice == "report"
    assert main(["--workload", "code", "--policy", "kairos", "--slice", "13"]) == 2  # a trace has no seeds


def test_shipped_eval_runs_the_tune_slice_when_asked_and_says_where_the_misses_are() -> None:
    from sim.shipped_eval import build_parser, cells, misses, table
    from sim.stats import RequestTiming

    args = build_parser().parse_args(["--workload", "shift", "--policy", "kairos", "--slice", "tune"])
    args.split, args.condition, args.rate = [(2, 2)], ["noise"], [0.35]
    assert [c.slice for c in cells(args, {})] == ["tune"]
    args = build_parser().parse_args(["--workload", "shift", "--policy", "kairos"])
    args.split, args.condition, args.rate = [(2, 2)], ["noise"], [0.35]
    assert [c.slice for c in cells(args, {})] == ["report"]  # what results are judged on, unless asked
    recs = [RequestTiming(ttft=0.5, tbt_gaps=[0.05, 0.06], route="disagg"),   # met both
            RequestTiming(ttft=3.0, tbt_gaps=[0.05], route="disagg"),         # late first token
            RequestTiming(ttft=0.5, tbt_gaps=[0.05, 0.12], route="deflect"),  # one gap over
            RequestTiming(ttft=3.0, tbt_gaps=[0.12], route="retain"),         # both
            RequestTiming(ttft=None, rejected=True)]
    got = misses(recs, 2.0, 0.1)
    assert (got["ttft"], got["tbt"], got["both"], got["rejected"]) == (1, 1, 1, 1)
    assert got["by_route"] == {"disagg": {"ttft": 1}, "deflect": {"tbt": 1}, "retain": {"both": 1},
                               "none": {"rejected": 1}}
    row = {"workload": "shift", "slice": "tune", "condition": "noise", "policy": "kairos", "cluster": "2P2D",
           "rate": 0.35, "slo_attainment": 0.8, "tbt_slo_attainment": 1.0, "ttft_p95": 3.0, "rejected": 1}
    assert "| shift (tune slice) |" in table([row], None)
