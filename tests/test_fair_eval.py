"""The fair-comparison driver: its must-show check and its choice of the regime load."""

from __future__ import annotations

from typing import Any

import pytest

from common.traces import TraceRequest
from sim.fair_eval import by_reason, choose_regime, must_show
from sim.fair_report import splice
from sim.stats import RequestTiming


def _s(both: float, tbt: float, p95: float | None) -> dict[str, Any]:
    return {"slo_attainment": both, "tbt_slo_attainment": tbt, "ttft_p95": p95}


def test_must_show_holds_and_fails() -> None:
    k = _s(0.95, 1.0, 1.5)
    ok = must_show({"kairos": k, "a": _s(0.90, 1.0, 3.0), "b": _s(0.94, 0.95, 1.0)})
    assert ok is not None and ok["holds"]
    # b's TBT is 5 points below Kairos's: its lower P95 does not count against Kairos
    assert ok["baselines"]["b"] == {"attainment_ok": True, "p95_lower": False, "baseline_tbt_worse": True,
                                    "p95_ok": True}
    lower = must_show({"kairos": k, "a": _s(0.96, 1.0, 3.0)})
    assert lower is not None and not lower["holds"] and not lower["baselines"]["a"]["attainment_ok"]
    slower = must_show({"kairos": k, "a": _s(0.90, 0.995, 1.2)})
    assert slower is not None and not slower["holds"] and not slower["baselines"]["a"]["p95_ok"]
    rejected = must_show({"kairos": _s(0.95, 1.0, None), "a": _s(0.90, 1.0, 3.0)})  # Kairos P95 infinite
    assert rejected is not None and not rejected["holds"]
    # Kairos rejects, the baseline's TBT is barely lower: the P95 is still compared, and fails
    hidden = must_show({"kairos": _s(0.95, 1.0, None), "a": _s(0.90, 0.995, 60.0)})
    assert hidden is not None and not hidden["holds"] and not hidden["baselines"]["a"]["p95_lower"]
    assert must_show({"a": _s(0.9, 1.0, 1.0)}) is None


def test_choose_regime() -> None:
    def probe(x: float, ttft: float, tbt: float, ok: bool) -> dict[str, Any]:
        return {"rate_scale": x, "ttft_slo_attainment": ttft, "tbt_slo_attainment": tbt, "in_regime": ok}
    assert choose_regime([probe(0.5, 1.0, 1.0, False), probe(1, 0.9, 1.0, True), probe(2, 0.5, 1.0, True)]) == 1
    # none in the regime: the highest load whose decode pool still holds TBT
    assert choose_regime([probe(0.5, 1.0, 1.0, False), probe(1, 0.97, 1.0, False), probe(2, 0.9, 0.5, False)]) == 1


def test_splice_replaces_only_its_block() -> None:
    doc = ("intro\n<!-- fair-eval p1 -->\nold\n<!-- /fair-eval p1 -->\nmiddle\n"
           "<!-- fair-eval p2 -->\nkeep\n<!-- /fair-eval p2 -->\n")
    out = splice(doc, "p1", "## p1\nnew table\n### w1")
    assert out == ("intro\n<!-- fair-eval p1 -->\nnew table\n#### w1\n<!-- /fair-eval p1 -->\nmiddle\n"
                   "<!-- fair-eval p2 -->\nkeep\n<!-- /fair-eval p2 -->\n")
    with pytest.raises(ValueError, match="fair-eval p3"):
        splice(doc, "p3", "x")


def test_by_reason_counts_rejected_as_infinite() -> None:
    recs = [RequestTiming(ttft=0.5, route="deflect", reason="decode_faster", ttft_pred=0.4),
            RequestTiming(ttft=3.0, route="disagg", reason="no_decode_slack", ttft_pred=6.0),
            RequestTiming(ttft=None, route="disagg", reason="no_decode_slack", rejected=True)]
    reqs = [TraceRequest(0.0, 100, 5), TraceRequest(1.0, 3000, 5), TraceRequest(2.0, 5000, 5)]
    out = by_reason(recs, reqs, 2.0)
    assert out["decode_faster"]["missed_ttft"] == 0 and out["decode_faster"]["missed_ttft_p50"] is None
    slack = out["no_decode_slack"]
    assert slack["requests"] == 2 and slack["missed_ttft"] == 2 and slack["prompt_p50"] == 4000
    assert slack["ttft_p95"] == float("inf") and slack["missed_pred_p50"] == 6.0


def test_goodput_is_the_highest_rate_kept_from_the_bottom_up() -> None:
    from sim.fair_report import goodput

    def pt(x: float, k: float, b: float) -> dict[str, Any]:
        return {"rate_scale": x, "policies": {"kairos": {"slo_attainment": k, "tbt_slo_attainment": 1.0},
                                              "b": {"slo_attainment": b, "tbt_slo_attainment": 0.99}}}
    w = {"sweep": [pt(0.5, 0.99, 0.95), pt(1.0, 0.95, 0.85), pt(1.5, 0.91, 0.92), pt(2.0, 0.6, 0.5)]}
    assert goodput(w, "kairos")[0] == 1.5
    assert goodput(w, "b")[0] == 0.5  # 1.5 is above 90 % again, but 1.0 was not: the goodput stops at 0.5
    w["sweep"][0]["policies"]["b"]["slo_attainment"] = 0.8
    assert goodput(w, "b") == (None, None)


def test_splice_takes_a_condition_under_its_own_marker() -> None:
    doc = "a\n<!-- fair-eval p1 -->\nold\n<!-- /fair-eval p1 -->\n<!-- fair-eval p1/noise -->\nold\n" \
          "<!-- /fair-eval p1/noise -->\nb\n"
    out = splice(doc, "p1/noise", "## p1, noise\nnew\n### w")
    assert "<!-- fair-eval p1 -->\nold\n" in out and "<!-- fair-eval p1/noise -->\nnew\n#### w\n" in out


def test_session_workloads_replay_kairos_sessions_files(tmp_path: Any) -> None:
    """chat and agent are `kairos sessions`'s traces (section 5's settings), sliced by trace time
    into disjoint tune and report windows, with their prefix structure."""
    from common.sessions import sessions, write_jsonl
    from common.traces import load_trace
    from sim.workloads import WORKLOADS, load

    for name, rate in (("chat", 2.0), ("agent", 0.5)):
        w = WORKLOADS[name]
        assert w.trace == "sessions" and w.synth == {"kind": name, "rate": rate, "duration": 900.0, "seed": 0}
        assert "kv-aware" in w.policies and w.policies[0] == "kairos"
        assert isinstance(w.tune, tuple) and isinstance(w.report, tuple) and w.tune[1] <= w.report[0]
        path = tmp_path / f"{name}.jsonl"
        write_jsonl(sessions(name, rate=rate, duration=900.0, seed=0), path)
        for which in (w.tune, w.report):
            assert isinstance(which, tuple)
            got = load(w, which, 0.5)
            want = load_trace(path, start=which[0], duration=which[1] - which[0], rate_scale=0.5)
            assert got == want and len(got) > 100
            assert all(r.hash_ids for r in got) and max(r.t for r in got) < (which[1] - which[0]) / 0.5
    assert WORKLOADS["chat"].regime == 0.75 and WORKLOADS["agent"].regime == 0.25


def test_session_workload_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few seconds of chat through the whole procedure (probe, tune, sweep), prefix caching on:
    every session policy is tuned and swept, kv-aware among them, and the caches are hit. Each
    knob is searched over two values (tests/small_grids.py): the whole grids are about 70 more
    simulations of the tune slice and prove nothing more here."""
    import argparse
    import dataclasses

    from common.perf_model import load_profile
    from sim import fair_eval
    from sim.core import SimConfig
    from sim.fair_eval import evaluate_workload
    from sim.fair_report import goodput_table, headline
    from sim.workloads import SESSION_POLICIES, WORKLOADS
    from tests.small_grids import small_grids

    monkeypatch.setattr(fair_eval, "GRIDS", small_grids("h100-llama2-70b-tp4", list(SESSION_POLICIES)))

    w = dataclasses.replace(WORKLOADS["chat"], synth={**WORKLOADS["chat"].synth, "duration": 40.0},
                            tune=(20.0, 40.0), report=(40.0, 60.0), probe=(0.75,))
    args = argparse.Namespace(regime={}, policy=None, passes=1, stress=(1.0,), jobs=1)
    sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1)
    r = evaluate_workload(w, load_profile("h100-llama2-70b-tp4"), sim, args, lambda _msg: None)
    assert r["regime"] == 0.75 and r["regime_chosen_by"] == "fixed" and r["regime_why"]
    assert list(r["tuned"]) == list(SESSION_POLICIES)
    assert [pt["rate_scale"] for pt in r["sweep"]] == [0.375, 0.5625, 0.75, 0.9375, 1.125, 1.5]
    at = next(pt for pt in r["sweep"] if pt["rate_scale"] == 0.75)["policies"]
    assert set(at) == set(SESSION_POLICIES) and at["kv-aware"]["requests"] > 20
    assert all((s["sim"]["prefix_hit_rate"] or 0) > 0.2 for s in at.values())
    assert r["must_show"] is not None and set(r["must_show"]["baselines"]) == set(SESSION_POLICIES) - {"kairos"}
    # a result mixing workloads of different policy sets: every policy gets a column, '-' where absent
    two = ("kairos", "chunked-prefill")
    code = {**r, "settings": {p: {} for p in two},
            "sweep": [{**pt, "policies": {p: pt["policies"][p] for p in two}} for pt in r["sweep"]]}
    res = {"workloads": {"code": code, "chat": r}}
    head = headline(res)
    assert "kv-aware: both / P95 s / TBT" in head[0] and head[2].count(" - ") >= 3
    assert "kv-aware: goodput x" in goodput_table(res)[0]


def test_the_late_binding_ablation_replays_kairos_tuned_setting_with_it_off() -> None:
    """Each sweep point gets Kairos's tuned setting once more with late binding off (nothing
    retuned), as a row the report shows beside the policies but never compares Kairos with; when
    the tuner left late binding off there is no row, and the report says so."""
    import dataclasses

    from common.perf_model import load_profile
    from sim.core import SimConfig
    from sim.fair_eval import Run, ablate, execute, must_show
    from sim.fair_report import ABLATION, goodput_table, headline
    from sim.tune import _setup
    from sim.workloads import WORKLOADS

    w = dataclasses.replace(WORKLOADS["bursty"], synth={**WORKLOADS["bursty"].synth, "duration": 30.0})
    prof = load_profile("h100-llama2-70b-tp4")
    sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1)
    knobs = {"late_binding": True, "late_depth": 0.25, "alpha": 1.6}
    tuned = {"kairos": {"engine": {"prefill_token_budget": 512}, "policy": knobs}, "chunked-prefill":
             {"engine": {"decode_token_budget": 512}, "policy": {}}}
    sweep = []
    for x in (0.7, 1.4):
        pols = {p: execute(Run(w, w.report, x, p, _setup(p, {**e["engine"], **e["policy"]}), prof, sim))
                for p, e in tuned.items()}
        sweep.append({"rate_scale": x, "prefill_load": 0.0, "peak_load": 0.0, "policies": pols})
    ablate(w, prof, sim, tuned, sweep, jobs=1)
    off = execute(Run(w, w.report, 1.4, "kairos", _setup("kairos", {"prefill_token_budget": 512, **knobs,
                                                          "late_binding": False}), prof, sim))
    row = sweep[1]["ablation"][ABLATION]
    assert row["slo_attainment"] == off["slo_attainment"] and row["ttft_p95"] == off["ttft_p95"]
    assert row["requests"] == off["requests"] > 20
    assert set(sweep[1]["policies"]) == {"kairos", "chunked-prefill"}  # never a baseline
    wr = {"regime": 1.4, "cluster": "2P2D", "settings": {p: {} for p in tuned}, "sweep": sweep,
          "must_show": must_show(sweep[1]["policies"])}
    res = {"workloads": {"bursty": wr}}
    assert f"{ABLATION}: both / P95 s / TBT" in headline(res)[0] and f"{ABLATION}: goodput x" in goodput_table(res)[0]
    # tuned with late binding off: no row, and a result that has ablations elsewhere says why
    plain = [{**pt, "ablation": {}} for pt in sweep]
    ablate(w, prof, sim, {**tuned, "kairos": {**tuned["kairos"], "policy": {**knobs, "late_binding": False}}},
           plain, jobs=1)
    assert all(not pt["ablation"] for pt in plain)
    res["workloads"]["other"] = {**wr, "sweep": plain}
    assert "(tuned off)" in headline(res)[3]


def test_session_regimes_are_fixed_per_profile() -> None:
    """The A100's steps are slower: its session regimes are its own, not the H100's."""
    from sim.workloads import WORKLOADS

    chat, agent, code = WORKLOADS["chat"], WORKLOADS["agent"], WORKLOADS["code"]
    assert chat.fixed_regime("h100-llama2-70b-tp4") == 0.75 and chat.fixed_regime("a100-llama2-70b-tp4") == 0.25
    assert agent.fixed_regime("a100-llama2-70b-tp4") == 0.08 and code.fixed_regime("a100-llama2-70b-tp4") is None


def test_fair_report_says_how_to_use_it_and_what_it_cannot_read(capsys: pytest.CaptureFixture[str]) -> None:
    from sim.fair_report import main

    assert main(["--help"]) == 0 and "--splice DOC.md" in capsys.readouterr().out
    assert main(["/nonexistent/result.json"]) == 2
    assert "cannot read /nonexistent/result.json" in capsys.readouterr().err


def test_reports_refuse_a_json_file_that_is_not_a_result(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from sim.fair_eval import main as eval_main
    from sim.fair_report import main

    bad = tmp_path / "other.json"
    bad.write_text('{"format": "kairos-tuned/1"}')
    for args in (["--matrix", str(bad)], [str(bad)]):
        assert main(args) == 2
        assert f"{bad} is not a result of python -m sim.fair_eval (no 'profile')" in capsys.readouterr().err
    assert eval_main(["--ablate", str(bad)]) == 2
    assert "not a result of python -m sim.fair_eval (no 'profile')" in capsys.readouterr().err


def test_matrix_reads_each_condition_and_marks_what_kairos_loses(tmp_path: Any) -> None:
    """The cross-condition table: one column per condition, a bold goodput where Kairos's is below
    the best baseline's and a bold TBT under 99 %; a workload a run lacks shows "-"."""
    import json

    from sim.fair_report import ABLATION, main, matrix

    def w(k: tuple[float, float, float], b: tuple[float, float, float], tbt: float, holds: bool) -> dict[str, Any]:
        sweep = [{"rate_scale": x, "policies": {"kairos": {"slo_attainment": ka, "tbt_slo_attainment": tbt},
                                                "base": {"slo_attainment": ba, "tbt_slo_attainment": 1.0}}}
                 for x, ka, ba in zip((0.5, 1.0, 1.5), k, b, strict=True)]
        return {"regime": 1.0, "cluster": "2P2D", "settings": {"kairos": {}, "base": {}}, "sweep": sweep,
                "must_show": {"holds": holds}}

    exact = {"profile": "p1", "condition": "exact", "date": "d0", "command": "c0",
             "workloads": {"code": w((0.99, 0.95, 0.91), (0.99, 0.8, 0.8), 1.0, True),
                           "long": w((0.5, 0.4, 0.3), (0.5, 0.4, 0.3), 1.0, True)}}
    noise = {"profile": "p1", "condition": "noise", "date": "d1", "command": "c1",
             "workloads": {"code": w((0.99, 0.8, 0.8), (0.99, 0.95, 0.5), 0.985, False)}}
    for pt in exact["workloads"]["code"]["sweep"]:  # the late-binding ablation, on this run only
        pt["ablation"] = {ABLATION: {"slo_attainment": pt["policies"]["kairos"]["slo_attainment"] - 0.042}}
    text = matrix([noise, exact])["p1"]  # columns in the conditions' order, not the files'
    assert "| workload | exact model | 10 % step noise |" in text
    assert ("| code (2P2D) | x1: holds · x1.5 / x0.5 · 100.0% · late binding +4.2 pt | "
            "x1: **fails** · **x0.5 / x1** · **98.5%** |") in text
    assert "| long (2P2D) | x1: holds · none reaches 90 % · - · late binding tuned off | - |" in text
    assert "exact model d0 (`c0`)" in text
    files = []
    for i, r in enumerate((exact, noise)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    doc = tmp_path / "doc.md"
    doc.write_text("a\n<!-- fair-eval p1/matrix -->\nSTALE\n<!-- /fair-eval p1/matrix -->\nb\n")
    assert main(["--matrix", "--splice", str(doc), *map(str, files)]) == 0
    out = doc.read_text()
    assert "STALE" not in out and "| code (2P2D) | x1: holds" in out and "every condition" not in out
    assert out.startswith("a\n<!-- fair-eval p1/matrix -->\n") and out.endswith("<!-- /fair-eval p1/matrix -->\nb\n")


def test_detail_writes_each_result_to_its_own_file_and_keeps_the_text_around_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--detail DIR: a result's full tables go to DIR/PROFILE-CONDITION.md, between the file's
    markers when it exists (its title and notes kept), else into a new file with the markers."""
    import json

    import sim.fair_report as fr

    monkeypatch.setattr(fr, "markdown", lambda res: f"## {res['profile']}\n### code\nTABLES {res['condition']}\n")
    results = []
    for cond in ("exact", "noise"):
        results.append(tmp_path / f"{cond}.json")
        results[-1].write_text(json.dumps({"profile": "p1", "condition": cond, "workloads": {}}))
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "p1-exact.md").write_text("# p1 by hand\n\nA note.\n\n<!-- fair-eval p1 -->\nSTALE\n"
                                        "<!-- /fair-eval p1 -->\n\nAfter.\n")
    assert fr.main(["--detail", str(folder), *map(str, results)]) == 0
    assert (folder / "p1-exact.md").read_text() == ("# p1 by hand\n\nA note.\n\n<!-- fair-eval p1 -->\n"
                                                    "#### code\nTABLES exact\n<!-- /fair-eval p1 -->\n\nAfter.\n")
    new = (folder / "p1-noise.md").read_text()
    assert new.startswith("# p1, 10 % step noise: every workload in detail\n")
    assert "<!-- fair-eval p1/noise -->\n#### code\nTABLES noise\n<!-- /fair-eval p1/noise -->\n" in new
    assert fr.main(["--detail", str(folder), str(results[1])]) == 0  # again: replaced, not appended
    assert (folder / "p1-noise.md").read_text() == new


def test_the_committed_tuned_files_load_with_every_knob_known() -> None:
    """docs/results.md and the README replay their headline from sim/tuned/: a knob renamed or
    removed must fail here, not in a reader's first command."""
    from pathlib import Path

    from sim.knobs import load_tuned

    files = sorted((Path(__file__).resolve().parent.parent / "sim" / "tuned").glob("*.json"))
    assert files
    for f in files:
        tuned = load_tuned(str(f))
        assert set(tuned) == {"kairos", "conditional-disagg", "disagg-least-loaded", "chunked-prefill"}, f
        assert tuned["kairos"].policy["late_binding"] is True, f


def test_search_split_tunes_each_policys_split_and_reports_it_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m sim.fair_eval --search-split`: each policy's tuner gets the split as its first
    knob (the workload's worker total fixed), and its report sweep runs at the split it chose;
    without the flag every policy stays at the workload's split (the published tables)."""
    import argparse

    from common.perf_model import load_profile
    from sim import fair_eval
    from sim.core import SimConfig
    from sim.tune import SPLIT
    from sim.workloads import WORKLOADS

    grids: dict[str, Any] = {}
    ran: list[tuple[str, int, int]] = []
    keep = {"requests": 1, "prefill_load": 0.0, "peak_load": 0.0, "slo_attainment": 1.0, "ttft_p95": 1.0,
            "tbt_slo_attainment": 1.0, "ttft_slo_attainment": 1.0, "tbt_p99": 0.05,
            "sim": {"decode_busy": 0.0, "prefill_busy": 0.0}}

    def tune(job: Any) -> dict[str, Any]:
        grids[job.policy] = job.grid
        searched = SPLIT in job.grid
        p = 1 if searched else job.sim.prefill
        return {"engine": {}, "policy": {}, "cluster": f"{p}P{4 - p}D",
                "split": {"prefill": p, "decode": 4 - p, "searched": searched}}

    def execute(run: Any) -> dict[str, Any]:
        if run.which == run.workload.report:  # not the probe (disagg-least-loaded on the tune slice, 2P2D)
            ran.append((run.policy, run.sim.prefill, run.sim.decode))
        return dict(keep)

    monkeypatch.setattr(fair_eval, "timed_tune", tune)
    monkeypatch.setattr(fair_eval, "execute", execute)
    monkeypatch.setattr(fair_eval, "load", lambda *a: [])
    w = WORKLOADS["shift"]
    sim = SimConfig(prefill=2, decode=2, ttft_slo=2.0, tbt_slo=0.1)
    prof = load_profile("h100-llama2-70b-tp4")
    for flag, want in ((True, (1, 3)), (False, (2, 2))):
        grids.clear()
        ran.clear()
        args = argparse.Namespace(regime={}, policy=["disagg-least-loaded", "chunked-prefill"], passes=1,
                                  stress=(1.0,), jobs=1, search_split=flag)
        fair_eval.evaluate_workload(w, prof, sim, args, lambda _msg: None)
        assert (SPLIT in grids["disagg-least-loaded"]) is flag and SPLIT not in grids["chunked-prefill"]
        report = {(p, n_p, n_d) for p, n_p, n_d in ran if p == "disagg-least-loaded"}
        assert report == {("disagg-least-loaded", *want)}, report
    assert "--search-split" in fair_eval.build_parser().format_help()
