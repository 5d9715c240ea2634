"""`kairos tune` and the knobs it tunes: a tuned file's settings reach the simulator's policy and
batchers, the winner is never judged on the tune slice, and the chunked-prefill baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.engines.batcher import Batcher, StepPlan
from common.errors import ConfigError
from common.perf_model import load_profile
from common.policy.baselines import ConditionalDisagg
from common.policy.kairos import Kairos
from common.traces import synthetic
from sim import cli as sim_cli
from sim import tune
from sim.core import SimConfig, Simulation
from sim.knobs import TUNED_FORMAT, build, load_tuned
from tests.small_grids import small_grids

PROF = load_profile("a100-dsv2-lite")


def tuned_file(tmp_path: Path, policies: dict[str, Any]) -> Path:
    f = tmp_path / "tuned.json"
    f.write_text(json.dumps({"format": TUNED_FORMAT, "policies": policies}))
    return f


def simulations(argv: list[str], policies: list[str]) -> dict[str, Simulation]:
    """What `kairos sim ARGV` builds for each policy, before it runs a trace."""
    args = sim_cli.build_parser().parse_args(argv)
    setups = sim_cli.resolve_setups(args, policies)
    out = {}
    for name in policies:
        policy, prof = build(name, setups[name], PROF)
        out[name] = Simulation(prof, policy, SimConfig())
    return out


def test_tuned_knobs_reach_the_policy_and_the_batchers(tmp_path: Path) -> None:
    f = tuned_file(tmp_path, {
        "kairos": {"engine": {"prefill_token_budget": 1024, "decode_token_budget": 640},
                   "policy": {"alpha": 2.0, "beta": 0.8, "max_deflections": 4}},
        "conditional-disagg": {"engine": {"decode_token_budget": 700, "decode_chunk": 256},
                               "policy": {"eff_isl_threshold": 512, "prefill_busy_threshold": 8.0}},
        "chunked-prefill": {"engine": {"decode_token_budget": 900, "decode_chunk": 300}, "policy": {}},
    })
    sims = simulations(["--tuned", str(f)], ["kairos", "conditional-disagg", "chunked-prefill",
                                             "disagg-least-loaded"])
    k = sims["kairos"]
    assert isinstance(k.policy, Kairos)
    assert (k.policy.cfg.alpha, k.policy.cfg.beta, k.policy.cfg.max_deflections) == (2.0, 0.8, 4)
    assert {w.batcher.token_budget for w in k.prefill} == {1024}
    assert {w.batcher.token_budget for w in k.decode} == {640}
    assert k.routers.replicas[0].view(0.0).decode[0].token_budget == 640  # and what the policy sees
    c = sims["conditional-disagg"]
    assert isinstance(c.policy, ConditionalDisagg)
    assert (c.policy.cfg.eff_isl_threshold, c.policy.cfg.prefill_busy_threshold) == (512, 8.0)
    assert {(w.batcher.token_budget, w.batcher.default_chunk) for w in c.decode} == {(700, 256)}
    assert {w.batcher.token_budget for w in c.prefill} == {PROF.prefill_token_budget}  # not in the file
    cp = sims["chunked-prefill"]
    assert {(w.batcher.token_budget, w.batcher.default_chunk) for w in cp.decode} == {(900, 300)}
    ll = sims["disagg-least-loaded"]  # not in the file: the profile's settings
    assert {w.batcher.token_budget for w in ll.decode} == {PROF.decode_token_budget}
    # a knob flag given explicitly overrides the file, for the policies it applies to
    sims = simulations(["--tuned", str(f), "--alpha", "1.5", "--decode-token-budget", "512"],
                       ["kairos", "conditional-disagg"])
    assert isinstance(sims["kairos"].policy, Kairos) and sims["kairos"].policy.cfg.alpha == 1.5
    assert sims["kairos"].policy.cfg.max_deflections == 4
    assert {w.batcher.token_budget for w in sims["conditional-disagg"].decode} == {512}
    assert {w.batcher.default_chunk for w in sims["conditional-disagg"].decode} == {256}


def test_a_bad_tuned_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown knob"):
        load_tuned(str(tuned_file(tmp_path, {"kairos": {"policy": {"alpah": 2.0}}})))
    with pytest.raises(ConfigError, match="no knobs of its own"):
        load_tuned(str(tuned_file(tmp_path, {"chunked-prefill": {"policy": {"alpha": 2.0}}})))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a file written by `kairos tune`"):
        load_tuned(str(tmp_path / "other.json"))
    assert sim_cli.main(["--tuned", str(tmp_path / "missing.json"), "--quiet"]) == 2


def test_tune_judges_the_winner_only_on_the_disjoint_report_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    real = tune.evaluate

    def spy(job: tune.Job, values: dict[str, Any], trace: Any) -> dict[str, Any]:
        which = "tune" if trace is job.tune_trace else "report" if trace is job.report_trace else "?"
        seen.append((job.policy, which, dict(values)))
        return real(job, values, trace)

    monkeypatch.setattr(tune, "evaluate", spy)
    args = tune.build_parser().parse_args(["--trace", "code", "--duration", "60", "--tune-start", "600"])
    slices, tune_trace, report_trace, _ = tune.load_slices(args)
    assert slices.tune == (600.0, 660.0) and slices.report == (660.0, 720.0)
    assert tune.disjoint(slices.tune, slices.report)  # type: ignore[arg-type]
    grid = {"decode_token_budget": (512, 1024), "decode_chunk": (256, 512)}
    job = tune.Job(policy="chunked-prefill", profile=PROF, sim=SimConfig(), tune_trace=tune_trace,
                   report_trace=report_trace, grid=grid)
    out = tune.tune_one(job)
    reports = [s for s in seen if s[1] == "report"]
    assert len(reports) == 1 and all(s[1] in ("tune", "report") for s in seen)
    winner = reports[0][2]
    assert {**out["engine"]} == {k: winner[k] for k in grid}  # what is reported is what was judged
    assert out["evaluated"] == sum(1 for s in seen if s[1] == "tune")  # each setting once (cached)
    with pytest.raises(ConfigError, match="overlap"):
        tune.load_slices(tune.build_parser().parse_args(["--duration", "60", "--tune-start", "600",
                                                         "--report-start", "630"]))
    assert tune.main(["--duration", "60", "--report-start", "30", "--quiet", "--out", "/dev/null"]) == 2


def test_tune_then_sim_reproduces_the_report_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tuned.json"
    policies = ["chunked-prefill", "disagg-least-loaded", "kairos", "conditional-disagg"]
    argv = ["--trace", "synthetic", "--rate", "4", "--duration", "40", "--seed", "3",
            *(a for p in policies for a in ("--policy", p)), "--passes", "1", "--out", str(out), "--quiet",
            "--fixed-split"]
    # the whole grid is 90 simulations (62 s on 2 cores); what this proves (the file's settings and
    # figures are what `kairos sim` reproduces) holds for any grid, so each knob gets two values; the
    # split is held (its search and replay: test_tune_searches_the_split_with_the_worker_total_fixed)
    monkeypatch.setattr(tune, "GRIDS", small_grids(tune.DEFAULT_PROFILE, policies))
    assert tune.main(argv) == 0
    tuned = json.loads(out.read_text())
    assert tuned["slices"] == {"tune": 3, "report": 4, "unit": "seed"}
    assert tuned["policies"]["chunked-prefill"]["cluster"] == "0P4D"
    assert tuned["policies"]["disagg-least-loaded"]["evaluated"] == len(tune.GRIDS["disagg-least-loaded"]
                                                                        ["prefill_token_budget"])
    res = tmp_path / "res.json"
    cmd = tune.replay_command(tune.build_parser().parse_args(argv), out).split()
    assert cmd[:2] == ["kairos", "sim"]
    assert sim_cli.main([*cmd[2:], "--out", str(res), "--quiet"]) == 0
    got = json.loads(res.read_text())
    for name, entry in tuned["policies"].items():
        s = got["policies"][name]
        assert got["config"]["settings"][name]["cluster"] == entry["cluster"]
        for k, v in entry["engine"].items():
            assert got["config"]["settings"][name]["engine"][k] == v
        for k, v in entry["policy"].items():
            assert got["config"]["settings"][name]["policy"][k] == v
        for k in ("slo_attainment", "ttft_p95", "tbt_slo_attainment", "rejected"):
            assert s[k] == entry["report"][k], (name, k)


def test_chunked_prefill_never_uses_a_prefill_worker_and_keeps_the_budget() -> None:
    budget = 600
    policy, prof = build("chunked-prefill", sim_cli.setups_from_flags(
        sim_cli.build_parser().parse_args(["--decode-token-budget", str(budget), "--decode-chunk", "4096"]),
        ["chunked-prefill"])["chunked-prefill"], PROF)
    sim = Simulation(prof, policy, SimConfig(prefill=2, decode=2))
    plans: list[StepPlan] = []
    for w in sim.decode:
        def planner(b: Batcher = w.batcher, plan: Any = w.batcher.plan) -> StepPlan | None:
            p = plan()
            if p is not None:
                plans.append(p)
            return p
        w.batcher.plan = planner  # type: ignore[method-assign]
    trace = synthetic(rate=6.0, duration=30.0, arrival="onoff", cv=2.2, seed=2)
    recs = sim.run(trace).records
    assert all(r.ttft is not None and r.route == "deflect" for r in recs)
    assert all(w.busy_s == 0.0 and w.batcher.steps == 0 for w in sim.prefill)
    assert plans and max(p.num_tokens for p in plans) <= budget
    # the chunk fills the budget: Sarathi-style, not the profile's 512-token chunk
    assert max(chi for p in plans for _, chi, _ in p.chunks) == budget
    with pytest.raises(ConfigError, match="needs prefill workers"):
        sim_cli._run(sim_cli.build_parser().parse_args(["--prefill", "0", "--policy", "disagg-least-loaded"]),
                     sim_cli.Console(quiet=True))


def test_sim_runs_chunked_prefill_on_the_same_gpu_count(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert sim_cli.main(["--trace", "synthetic", "--duration", "20", "--policy", "chunked-prefill", "--policy",
                         "kairos", "--out", str(out), "--quiet"]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["settings"]["chunked-prefill"]["cluster"] == "0P4D" and cfg["settings"]["kairos"]["cluster"] == "2P2D"
    res = json.loads(out.read_text())["policies"]["chunked-prefill"]
    assert res["routes"] == {"deflect": res["requests"]}
    assert set(res["sim"]["queues"]) == {"router_kv_wait", "prefill"}
    assert res["sim"]["queues"]["prefill"] == {"max": 0, "mean": 0.0}


def test_kairos_up_passes_the_tuned_knobs_to_the_router_and_the_workers(tmp_path: Path) -> None:
    from common import config
    from common.engines import make_engine
    from common.engines.sim import SimEngine
    from kairos import up
    from services.router.service import Router

    f = tuned_file(tmp_path, {
        "kairos": {"engine": {"prefill_token_budget": 1024, "decode_token_budget": 640, "decode_chunk": 384},
                   "policy": {"alpha": 2.0, "max_deflections": 4, "candidates": [1024, 512, 128]}},
        "conditional-disagg": {"engine": {"decode_token_budget": 700},
                               "policy": {"eff_isl_threshold": 512, "prefill_busy_threshold": 8.0}}})
    def envs(*argv: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """The environments `kairos up ARGV` starts the router and the workers with."""
        svc = up.Cluster(up.spec_from_args(up.parser().parse_args(list(argv)))).services
        return svc["router"].env, svc["prefill-0"].env, svc["decode-0"].env

    router_env, prefill_env, decode_env = envs("--policy", "kairos", "--tuned", str(f), "--beta", "0.8",
                                               "--kv-transport", "modeled", "--kv-wait-timeout", "5")
    r = Router(config.load(config.RouterConfig, env=router_env))
    assert r.cfg.kv_wait_timeout == 5.0
    assert isinstance(r.policy, Kairos)
    assert (r.policy.cfg.alpha, r.policy.cfg.beta, r.policy.cfg.max_deflections) == (2.0, 0.8, 4)
    assert r.policy.cfg.candidates == (1024, 512, 128)
    p = make_engine(config.load(config.WorkerConfig, env=prefill_env), "prefill")
    d = make_engine(config.load(config.WorkerConfig, env=decode_env), "decode")
    assert isinstance(p, SimEngine) and isinstance(d, SimEngine)
    assert (p.token_budget, d.token_budget, d.batcher.default_chunk) == (1024, 640, 384)
    router_env, _, decode_env = envs("--policy", "conditional-disagg", "--tuned", str(f))
    r = Router(config.load(config.RouterConfig, env=router_env))
    assert isinstance(r.policy, ConditionalDisagg)
    assert (r.policy.cfg.eff_isl_threshold, r.policy.cfg.prefill_busy_threshold) == (512, 8.0)
    assert decode_env["KAIROS_DECODE_TOKEN_BUDGET"] == "700" and "KAIROS_PREFILL_TOKEN_BUDGET" not in decode_env
    with pytest.raises(ConfigError, match="no settings for policy 'chunked-prefill'"):
        envs("--policy", "chunked-prefill", "--prefill", "0", "--tuned", str(f))
    with pytest.raises(ConfigError, match=r"kairos knob\(s\) alpha given, but --policy is conditional-disagg"):
        envs("--policy", "conditional-disagg", "--alpha", "2")
    with pytest.raises(ConfigError, match="needs prefill workers"):
        envs("--prefill", "0", "--policy", "disagg-least-loaded")


def test_kairos_up_refuses_a_file_tuned_for_another_profile_and_the_router_names_what_it_runs(
        tmp_path: Path) -> None:
    from common import config
    from common.config import DEFAULT_PROFILE
    from kairos import up
    from services.router.service import Router

    f = tmp_path / "tuned.json"
    f.write_text(json.dumps({"format": TUNED_FORMAT, "profile": "a100-dsv2-lite", "policies": {
        "kairos": {"engine": {"decode_token_budget": 640}, "policy": {"alpha": 2.0}}}}))

    def router(*argv: str) -> Router:
        svc = up.Cluster(up.spec_from_args(up.parse_args(["--insecure", *argv]))).services
        return Router(config.load(config.RouterConfig, env=svc["router"].env))

    with pytest.raises(ConfigError, match=f"tuned for profile 'a100-dsv2-lite', but the cluster runs profile "
                                          f"'{DEFAULT_PROFILE}'.*--tuned-profile-mismatch ok"):
        router("--tuned", str(f))
    stats = router("--tuned", str(f), "--profile", "a100-dsv2-lite").stats()
    assert stats["profile"] == "a100-dsv2-lite"
    assert stats["tuned"] == {"file": str(f.resolve()), "profile": "a100-dsv2-lite", "policy": "kairos",
                              "knobs": {"alpha": 2.0}, "engine": {"decode_token_budget": 640}}
    stats = router("--tuned", str(f), "--tuned-profile-mismatch", "ok").stats()
    assert (stats["profile"], stats["tuned"]["profile"]) == (DEFAULT_PROFILE, "a100-dsv2-lite")
    assert router().stats()["tuned"] is None


def test_one_default_profile_everywhere() -> None:
    from common import config
    from common.config import DEFAULT_PROFILE
    from kairos import demo, up

    assert config.RouterConfig().profile == config.WorkerConfig().profile == DEFAULT_PROFILE
    assert up.DEFAULTS["profile"] == up.ClusterSpec().profile == DEFAULT_PROFILE  # --profile's, unless --plan's
    assert up.parse_args([]).profile is None
    assert up.spec_from_args(up.parse_args(["--insecure"])).profile == DEFAULT_PROFILE
    assert sim_cli.build_parser().parse_args([]).profile == DEFAULT_PROFILE
    assert tune.DEFAULT_PROFILE == DEFAULT_PROFILE
    assert demo.build_parser().get_default("profile") == DEFAULT_PROFILE
    for compose in Path(__file__).resolve().parent.parent.glob("docker-compose*.yml"):
        text = compose.read_text()
        assert "KAIROS_PROFILE:-" not in text or f"KAIROS_PROFILE:-{DEFAULT_PROFILE}}}" in text, compose


def test_report_shows_the_settings_that_differ(tmp_path: Path) -> None:
    from sim import report

    files = []
    for budget in ("512", "1024"):
        out = tmp_path / f"r{budget}.json"
        assert sim_cli.main(["--trace", "synthetic", "--duration", "10", "--policy", "chunked-prefill", "--policy",
                             "kairos", "--decode-token-budget", budget, "--out", str(out), "--quiet"]) == 0
        files.append(json.loads(out.read_text()))
    head, _, *rows = report.table(files).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert "cluster" in cols and "decode_token_budget" in cols and "alpha" not in cols  # alpha did not vary
    assert "TBT SLO (p99 gap)" in cols and "rejected" in cols
    cells = [dict(zip(cols, (c.strip() for c in r.strip("|").split("|")), strict=True)) for r in rows]
    assert {(c["policy"], c["cluster"], c["decode_token_budget"]) for c in cells} == {
        ("chunked-prefill", "0P4D", "512"), ("kairos", "2P2D", "512"),
        ("chunked-prefill", "0P4D", "1024"), ("kairos", "2P2D", "1024")}


def test_stress_tunes_on_the_tune_slice_at_each_load_and_reports_once(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, float]] = []
    real = tune.evaluate

    def spy(job: tune.Job, values: dict[str, Any], trace: Any) -> dict[str, Any]:
        if trace is job.report_trace:
            seen.append(("report", 1.0))
        else:
            assert len(trace) == len(job.tune_trace)  # the tune slice, maybe compressed
            seen.append(("tune", job.tune_trace[-1].t / trace[-1].t))
        return real(job, values, trace)

    monkeypatch.setattr(tune, "evaluate", spy)
    args = tune.build_parser().parse_args(["--trace", "code", "--duration", "60", "--tune-start", "600"])
    _, tune_trace, report_trace, _ = tune.load_slices(args)
    job = tune.Job(policy="chunked-prefill", profile=PROF, sim=SimConfig(), tune_trace=tune_trace,
                   report_trace=report_trace, grid={"decode_token_budget": (512, 1024)}, stress=(1.0, 2.0))
    out = tune.tune_one(job)
    tunes = [m for which, m in seen if which == "tune"]
    assert sorted(set(round(m, 9) for m in tunes)) == [1.0, 2.0] and len(tunes) == 2 * out["evaluated"]
    assert [w for w, _ in seen].count("report") == 1
    both = out["tune_stress"]
    assert set(both) == {"x1", "x2"}
    assert out["tune"]["slo_attainment"] == pytest.approx((both["x1"]["slo_attainment"]
                                                           + both["x2"]["slo_attainment"]) / 2)
    with pytest.raises(ConfigError, match="stress"):
        tune.parse_stress("1,-2")


def test_compress_keeps_the_prompts_and_their_prefix_ids() -> None:
    from common.traces import TraceRequest
    trace = [TraceRequest(t=2.0, input_length=100, output_length=5, hash_ids=(1, 2, 3)),
             TraceRequest(t=4.0, input_length=80, output_length=3, hash_ids=(1, 2))]
    fast = tune.compress(trace, 2.0)
    assert [r.t for r in fast] == [1.0, 2.0]
    assert [r.hash_ids for r in fast] == [(1, 2, 3), (1, 2)]  # the x2 stress run still hits the cache
    assert [(r.input_length, r.output_length) for r in fast] == [(100, 5), (80, 3)]


def test_tuned_knobs_on_a_grid_edge_are_named() -> None:
    grid = {"a": (1, 2, 4), "b": (0.5, 1.0, 2.0), "flag": (False, True),
            "prefill_busy_threshold": (1.0, 2.0, 4.0, 1000.0)}
    assert tune.edges(grid, {"a": 4, "b": 1.0, "flag": True, "prefill_busy_threshold": 1000.0}) == ["a"]
    # off is not an edge, but the largest real threshold is
    assert tune.edges(grid, {"a": 2, "b": 0.5, "flag": False, "prefill_busy_threshold": 4.0}) == [
        "b", "prefill_busy_threshold"]
    assert tune.edges(grid, {"a": 8, "b": 1.0, "flag": True, "prefill_busy_threshold": 2.0}) == ["a"]  # beyond
    # a knob at the bound the policy allows (alpha >= 1, beta <= 1) is not on an edge
    assert tune.edges({"alpha": (1.0, 1.3, 2.0), "beta": (0.5, 0.9, 1.0)}, {"alpha": 1.0, "beta": 1.0}) == []
    assert tune.edges({"alpha": (1.0, 1.3, 2.0), "beta": (0.5, 0.9, 1.0)}, {"alpha": 2.0, "beta": 0.5}) == [
        "alpha", "beta"]
    text = tune._knobs_text("x", {"engine": {}, "policy": {"a": 4, "b": 1.0}, "edges": ["a"]}, {"a": (), "b": ()})
    assert text == "a 4 (grid edge), b 1"


def test_tuning_starts_from_the_shipped_settings() -> None:
    job = tune.Job(policy="kairos", profile=load_profile("h100-llama2-70b-tp4"), sim=SimConfig(), tune_trace=[],
                   report_trace=[], grid=tune.GRIDS["kairos"], passes=1, fixed={}, stress=(1.0,))
    start = tune.defaults(job)
    assert (start["prefill_token_budget"], start["decode_token_budget"]) == (2048, 2048)
    assert start["alpha"] == 1.6 and start["late_binding"] is True


def test_tune_searches_the_decode_guard_and_its_margin(tmp_path: Path) -> None:
    """Issue 44: `kairos tune` searches the decode room (on/off) and decode_beta, from the shipped
    room (on, 0.95), and a tuned file's setting reaches the policy."""
    grid = tune.GRIDS["kairos"]
    assert set(grid["decode_room"]) == {False, True} and 0.95 in grid["decode_beta"] and len(grid["decode_beta"]) > 1
    job = tune.Job(policy="kairos", profile=load_profile("h100-llama2-70b-tp4"), sim=SimConfig(), tune_trace=[],
                   report_trace=[], grid=grid, passes=1, fixed={}, stress=(1.0,))
    start = tune.defaults(job)
    assert start["decode_room"] is True and start["decode_beta"] == 0.95
    f = tuned_file(tmp_path, {"kairos": {"engine": {}, "policy": {"decode_room": True, "decode_beta": 0.85}}})
    k = simulations(["--tuned", str(f)], ["kairos"])["kairos"]
    assert isinstance(k.policy, Kairos) and (k.policy.cfg.decode_room, k.policy.cfg.decode_beta) == (True, 0.85)


def _decode_heavy_trace(tmp_path: Path) -> Path:
    """40 s of the shifting workloads' output-heavy phase (8 req/s, answers of ~500 tokens) as a
    JSON-lines file: two decode workers step past a 45 ms TBT SLO, three do not."""
    from sim.workloads import PHASES

    rate, arrival, cv, lengths = PHASES["output"]
    rows = [(r.t, r) for r in synthetic(rate=rate, duration=20, arrival=arrival, cv=cv, seed=3, **lengths)]  # type: ignore[arg-type]
    rows += [(20.0 + r.t, r) for r in synthetic(rate=rate, duration=20, arrival=arrival, cv=cv, seed=4,
                                                 **lengths)]  # type: ignore[arg-type]
    f = tmp_path / "decode-heavy.jsonl"
    f.write_text("".join(json.dumps({"timestamp": round(t * 1000.0, 3), "input_length": r.input_length,
                                     "output_length": r.output_length}) + "\n" for t, r in rows))
    return f


def test_tune_searches_the_split_with_the_worker_total_fixed(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: `kairos tune` searches the split (prefill vs decode workers of a fixed total). On
    decode-heavy traffic 1P3D keeps a 45 ms TBT that 2P2D cannot: the tuner leaves the given 2P2D
    for it, writes it, and `kairos sim --tuned` replays the report slice there with the same figures;
    --fixed-split holds 2P2D."""
    trace = _decode_heavy_trace(tmp_path)
    monkeypatch.setattr(tune, "GRIDS", {"disagg-least-loaded": {"prefill_token_budget": (8192,)}})
    out = tmp_path / "tuned.json"
    argv = ["--trace", str(trace), "--duration", "20", "--profile", "h100-llama2-70b-tp4", "--tbt-slo", "0.045",
            "--policy", "disagg-least-loaded", "--passes", "1", "--quiet", "--out", str(out)]
    assert tune.main(argv) == 0
    tuned = json.loads(out.read_text())
    e = tuned["policies"]["disagg-least-loaded"]
    assert tuned["grids"]["disagg-least-loaded"][tune.SPLIT] == [1, 2, 3] and tuned["split_searched"] is True
    assert e["cluster"] == "1P3D" and e["split"] == {"prefill": 1, "decode": 3, "searched": True}
    assert e["tune"]["slo_attainment"] > e["defaults_tune"]["slo_attainment"] + 0.5  # 2P2D: under 10 %
    assert e["evaluated"] == 3 and e["edges"] == []  # the split's ends are bounds, not grid edges
    res = tmp_path / "res.json"
    cmd = tune.replay_command(tune.build_parser().parse_args(argv), out).split()
    assert "--prefill" in cmd and cmd[cmd.index("--prefill") + 1] == "2"  # the given shape: the file moves it
    assert sim_cli.main([*cmd[2:], "--out", str(res), "--quiet"]) == 0
    got = json.loads(res.read_text())
    assert got["config"]["settings"]["disagg-least-loaded"]["cluster"] == "1P3D"
    for k in ("slo_attainment", "ttft_p95", "tbt_slo_attainment", "rejected"):
        assert got["policies"]["disagg-least-loaded"][k] == e["report"][k], k
    # another worker total: the tuned split does not apply
    assert sim_cli.tuned_splits(str(out), 5) == {} and sim_cli.tuned_splits(str(out), 4) == {
        "disagg-least-loaded": (1, 3)}
    assert tune.main([*argv, "--fixed-split"]) == 0
    held = json.loads(out.read_text())["policies"]["disagg-least-loaded"]
    assert held["cluster"] == "2P2D" and held["split"]["searched"] is False and held["evaluated"] == 1


def test_tune_can_choose_a_split_and_a_decode_guard_off_the_shipped_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kairos's search covers its split (first), the decode room, decode_beta and the third path,
    from the shipped values: when another split and guard score better, the tuner takes them and
    reports them (an objective that prefers 1P3D, decode_beta 0.85 and the retain path off)."""
    prof = load_profile("h100-llama2-70b-tp4")
    grid = tune.with_split("kairos", tune.GRIDS["kairos"], 4)
    assert next(iter(grid)) == tune.SPLIT and grid[tune.SPLIT] == (1, 2, 3)
    assert {"decode_room", "decode_beta", "retain"} <= set(grid)
    assert tune.with_split("chunked-prefill", tune.GRIDS["chunked-prefill"], 4) == tune.GRIDS["chunked-prefill"]
    keep = dict.fromkeys(tune.KEEP, 0.0)

    def fake(job: tune.Job, values: dict[str, Any], trace: Any) -> dict[str, Any]:
        good = (values[tune.SPLIT] == 1) + (values["decode_beta"] == 0.85) + (values["retain"] is False)
        return {**keep, "slo_attainment": 0.5 + good / 10, "ttft_p95": 1.0}

    monkeypatch.setattr(tune, "evaluate", fake)
    job = tune.Job(policy="kairos", profile=prof, sim=SimConfig(prefill=2, decode=2), tune_trace=[],
                   report_trace=[], grid=grid, passes=1)
    start = tune.defaults(job)
    assert (start[tune.SPLIT], start["decode_room"], start["decode_beta"], start["retain"]) == (2, True, 0.95, True)
    out = tune.tune_one(job)
    assert out["cluster"] == "1P3D" and out["split"] == {"prefill": 1, "decode": 3, "searched": True}
    assert out["policy"]["decode_beta"] == 0.85 and out["policy"]["retain"] is False
    assert tune.SPLIT not in out["policy"]  # the split is the cluster's, never a policy knob
    assert out["tune"]["slo_attainment"] == pytest.approx(0.8)


def test_tune_help_says_it_searches_the_split_and_the_decode_guard() -> None:
    text = tune.build_parser().format_help()
    assert "--fixed-split" in text and "split" in text and "decode room" in text and "decode_beta" in text


def test_a_tuned_policy_runs_its_shipped_knobs_where_the_search_does_not_reach() -> None:
    """What tuning evaluates (and the fair evaluation reports) is what `kairos sim --tuned`
    replays: the searched knobs over the policy's shipped settings, not over its config class's
    defaults. Kairos ships `retain_chunk` 64 (the class says 512, which the search does not
    reach): the fair evaluation of 2026-12-07 ran its tuned Kairos with 512."""
    from sim.knobs import SHIPPED, Setup, shipped
    from sim.tune import _setup

    values = {"alpha": 2.0, "prefill_token_budget": 1024}
    got = _setup("kairos", values)
    replayed = shipped("kairos", Setup(), tuned=Setup(engine=got.engine, policy={"alpha": 2.0}))
    assert got == replayed
    assert got.policy["retain_chunk"] == SHIPPED["kairos"].policy["retain_chunk"] == 64
    assert got.policy["alpha"] == 2.0 and got.engine.prefill_token_budget == 1024
    assert got.engine.decode_token_budget == SHIPPED["kairos"].engine.decode_token_budget
    assert _setup("disagg-least-loaded", {"prefill_token_budget": 1024}).policy == {}  # ships nothing of its own
