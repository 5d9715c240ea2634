"""`kairos plan` (sim/plan.py): the fewest GPUs that meet the SLO on a trace, the split and the
settings there, and a plan file `kairos up` runs. In-process simulations of small synthetic
traces (a few seconds in all)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from common.config import DEFAULT_PROFILE
from common.errors import ConfigError
from common.perf_model import load_profile
from common.traces import TraceRequest
from kairos.cli import COMMANDS
from kairos.up import parser as up_parser
from kairos.up import spec_from_args
from sim import plan as planmod
from sim.core import SimConfig
from sim.plan import Candidate, candidates, main, parse_slo, plan

PROFILE = load_profile("h100-llama2-70b-tp4")
SLO = parse_slo("ttft=2s,tbt=100ms,attainment=90%")


def prompts(n: int, gap: float, prompt: int = 6000, output: int = 50) -> Any:
    """trace_at(x): n long prompts `gap` seconds apart at rate scale 1."""
    return lambda x: [TraceRequest(t=i * gap / x, input_length=prompt + 37 * (i % 7), output_length=output)
                      for i in range(n)]


def write_jsonl(path: Path, reqs: list[TraceRequest]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": r.t * 1000.0, "input_length": r.input_length,
                                        "output_length": r.output_length}) + "\n" for r in reqs))
    return path


def test_candidates_cover_every_split_both_guards_and_the_chunked_pool() -> None:
    names = [c.name for c in candidates(3, ("kairos", "chunked-prefill"), (False, True))]
    assert names == ["1P2D kairos, decode room off", "2P1D kairos, decode room off",
                     "1P2D kairos, decode room on", "2P1D kairos, decode room on", "0P3D chunked-prefill"]
    # one GPU: only the chunked pool (Kairos needs a prefill and a decode worker)
    assert [c.name for c in candidates(1, ("kairos", "chunked-prefill"), (False,))] == ["0P1D chunked-prefill"]


def test_plan_takes_the_cheaper_shape_when_it_meets_the_slo() -> None:
    body = plan(prompts(40, 0.5), PROFILE, SimConfig(), SLO, gpus=[1, 2, 3], finals=1)
    counts = body["per_gpu_count"]
    assert [r["gpus"] for r in counts] == [1, 2]  # stops at the first count that meets it: 3 never tried
    assert not counts[0]["meets"] and counts[1]["meets"]
    chosen = body["chosen"]
    assert (chosen["gpus"], chosen["prefill"], chosen["decode"]) == (2, 1, 1)
    assert chosen["summary"]["slo_attainment"] >= SLO.attainment
    # the goodput curve: every rate of CURVE, and the goodput read off it (holds x1, not x2 here)
    assert [p["rate_scale"] for p in chosen["curve"]] == [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    assert chosen["goodput_rate_scale"] is not None and 1.0 <= chosen["goodput_rate_scale"] < 2.0


def test_plan_takes_more_gpus_when_fewer_cannot_meet_it() -> None:
    body = plan(prompts(40, 0.3), PROFILE, SimConfig(), SLO, gpus=[1, 2, 3, 4], finals=1)
    counts = body["per_gpu_count"]
    assert [(r["gpus"], r["meets"]) for r in counts] == [(1, False), (2, False), (3, True)]
    # every 2-GPU candidate was tried and none met it
    assert all(c["summary"]["slo_attainment"] < SLO.attainment for c in counts[1]["candidates"])
    assert len(counts[1]["candidates"]) == 3  # 1P1D with the guard off and on, 0P2D
    assert body["chosen"]["gpus"] == 3


def test_plan_without_a_shape_that_meets_it() -> None:
    body = plan(prompts(40, 0.3), PROFILE, SimConfig(), SLO, gpus=[1, 2], finals=1)
    assert body["chosen"] is None and [r["meets"] for r in body["per_gpu_count"]] == [False, False]


def test_among_shapes_that_meet_it_the_one_with_more_headroom_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two candidates meet the SLO at the planned rate; the one whose curve holds to the higher
    rate is chosen even though the other ranks first at the planned rate."""

    def fake(job: planmod.Job) -> dict[str, Any]:
        c: Candidate = job.cand
        x = job.trace[-1].t and 19.0 / job.trace[-1].t  # the rate scale the trace was loaded at
        holds = {"1P1D kairos, decode room off": 1.0, "1P1D kairos, decode room on": 1.5}.get(c.name, 0.0)
        att = 0.99 if c.name.endswith("off") else 0.95
        ok = x <= holds + 1e-9
        return {"requests": 20, "rejected": 0, "slo_attainment": att if ok else 0.5, "ttft_slo_attainment": 1.0,
                "tbt_slo_attainment": 1.0, "ttft_p50": 0.1, "ttft_p95": 0.2, "ttft_p99": 0.3, "tbt_p99": 0.05,
                "deflection_rate": 0.0}

    monkeypatch.setattr(planmod, "run_job", fake)
    body = plan(prompts(20, 1.0), PROFILE, SimConfig(), SLO, gpus=[2], finals=3)
    assert [f["name"] for f in body["finalists"]] == ["1P1D kairos, decode room on", "1P1D kairos, decode room off"]
    assert body["chosen"]["name"] == "1P1D kairos, decode room on"
    assert body["chosen"]["goodput_rate_scale"] == 1.5
    assert body["chosen"]["knobs"]["decode_room"] is True


@pytest.mark.parametrize(("text", "want"), [
    ("ttft=2s,tbt=100ms,attainment=90%", (2.0, 0.1, 0.9)),
    ("ttft=500ms,tbt=0.05", (0.5, 0.05, 0.9)),
    ("attainment=0.99", (2.0, 0.1, 0.99)),
    ("TTFT=1.5, TBT=80ms, both=95", (1.5, 0.08, 0.95)),
])
def test_parse_slo(text: str, want: tuple[float, float, float]) -> None:
    s = parse_slo(text)
    assert (s.ttft, s.tbt, s.attainment) == pytest.approx(want)


@pytest.mark.parametrize("text", ["ttft", "ttft=fast", "p99=2", "ttft=2%", "attainment=5ms", "attainment=0",
                                  "ttft=2,ttft=3", "tbt=-1"])
def test_parse_slo_refuses_bad_syntax(text: str) -> None:
    with pytest.raises(ConfigError, match="expected --slo ttft=SECONDS"):
        parse_slo(text)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "attainment=90%" in capsys.readouterr().out


def test_bad_input_gives_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.jsonl" in err and "not found" in err
    trace = write_jsonl(tmp_path / "t.jsonl", prompts(4, 1.0)(1.0))
    assert main(["--trace", str(trace), "--slo", "ttft=2s,tbt=fast", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kairos plan: --slo") and "tbt='fast'" in err
    assert main(["--trace", str(trace), "--gpus", "0-2", "--quiet"]) == 2
    assert "--gpus" in capsys.readouterr().err


def test_the_plan_feeds_kairos_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "plan" in COMMANDS
    trace = write_jsonl(tmp_path / "mine.jsonl", prompts(40, 0.5)(1.0))
    out = tmp_path / "plan.json"
    assert main(["--trace", str(trace), "--gpus", "1-3", "--finalists", "1", "--jobs", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    chosen = res["chosen"]
    assert res["format"] == "kairos-plan/1" and chosen["gpus"] == 2
    assert "figures assume the fitted profile h100-llama2-70b-tp4" in printed
    # --plan: the shape, the policy, the profile and the knobs
    spec = spec_from_args(up_parser().parse_args(["--plan", str(out), "--insecure"]))
    assert (spec.prefill, spec.decode, spec.policy, spec.profile) == (1, 1, "kairos", "h100-llama2-70b-tp4")
    room = "true" if chosen["knobs"]["decode_room"] else "false"
    assert spec.router_env["KAIROS_DECODE_ROOM"] == room
    assert spec.worker_env["KAIROS_DECODE_TOKEN_BUDGET"] == str(chosen["engine"]["decode_token_budget"])
    # ... and the router kairos up starts with it runs that policy with those knobs
    from common import config
    from kairos.up import Cluster
    from services.router.service import Router

    router = Router(config.load(config.RouterConfig, env=Cluster(spec).services["router"].env))
    assert router.policy.name == "kairos"
    assert router.policy.cfg.decode_room is chosen["knobs"]["decode_room"]  # type: ignore[attr-defined]
    # the printed `kairos up` line runs the same cluster
    line = next(ln.strip() for ln in printed.splitlines() if ln.strip().startswith("kairos up --prefill"))
    assert line == res["kairos_up"]
    same = spec_from_args(up_parser().parse_args([*shlex.split(line)[2:], "--insecure"]))
    assert (same.prefill, same.decode, same.policy, same.profile) == (spec.prefill, spec.decode, spec.policy,
                                                                      spec.profile)
    assert same.router_env == spec.router_env and same.worker_env == spec.worker_env
    # the compose override sets what kairos up sets, for the router and for each worker
    override = res["deploy"]["compose_override"]
    where, set_in = "", {}
    for ln in override:
        if ln.startswith("  ") and not ln.startswith("    ") and ln.strip().endswith(":"):
            where = ln.strip()[:-1]
        elif ln.startswith("      KAIROS_"):
            key, _, value = ln.strip().partition(": ")
            set_in.setdefault(where, {})[key] = json.loads(value)
    assert set_in["router"] == {k: v for k, v in spec.router_env.items() if k in set_in["router"]}
    assert {"KAIROS_DECODE_ROOM", "KAIROS_ALPHA"} <= set(set_in["router"])
    assert set(set_in) == {"router", "prefill-0", "decode-0"}  # 1P1D: the compose file's first worker of each
    for name in ("prefill-0", "decode-0"):
        assert set_in[name] == {k: v for k, v in spec.worker_env.items() if k in set_in[name]}
        assert "KAIROS_DECODE_TOKEN_BUDGET" in set_in[name]
    assert "this plan is 1P1D" in override[-1]
    # the kustomize values say the same
    assert "    count: 1" in res["deploy"]["kustomize"] and f"decode_room = {room}" in res["deploy"]["kustomize"]
    # a flag given beside --plan wins; a policy other than the plan's is refused; so is --tuned
    assert spec_from_args(up_parser().parse_args(["--plan", str(out), "--decode", "3", "--insecure"])).decode == 3
    with pytest.raises(ConfigError, match="differs from the plan's kairos"):
        spec_from_args(up_parser().parse_args(["--plan", str(out), "--policy", "chunked-prefill", "--insecure"]))
    with pytest.raises(ConfigError, match="give one of them"):
        spec_from_args(up_parser().parse_args(["--plan", str(out), "--tuned", str(out), "--insecure"]))


def test_kairos_up_refuses_a_file_that_is_not_a_plan(tmp_path: Path) -> None:
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"format": "kairos-tuned/1", "policies": {}}))
    with pytest.raises(ConfigError, match="not a file written by `kairos plan --out`"):
        spec_from_args(up_parser().parse_args(["--plan", str(other), "--insecure"]))
    other.write_text(json.dumps({"format": "kairos-plan/1", "chosen": None}))
    with pytest.raises(ConfigError, match="recommends no shape"):
        spec_from_args(up_parser().parse_args(["--plan", str(other), "--insecure"]))
    # without --plan, kairos up's defaults are as before (the one default profile every command shares)
    spec = spec_from_args(up_parser().parse_args(["--insecure"]))
    assert (spec.prefill, spec.decode, spec.policy, spec.profile) == (2, 2, "kairos", DEFAULT_PROFILE)


def test_the_plan_is_made_under_the_model_error_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--step-noise reaches every simulation of the search, and the plan says what it assumed."""
    seen: list[float] = []
    real = planmod.run_job

    def spy(job: planmod.Job) -> dict[str, Any]:
        seen.append(job.sim.step_noise)
        return real(job)

    monkeypatch.setattr(planmod, "run_job", spy)
    trace = write_jsonl(tmp_path / "mine.jsonl", prompts(40, 0.5)(1.0))
    out = tmp_path / "plan.json"
    assert main(["--trace", str(trace), "--gpus", "1-2", "--finalists", "1", "--jobs", "1", "--step-noise", "0.1",
                 "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert seen and set(seen) == {0.1}
    assert res["model_error"]["step_noise"] == 0.1
    assert "times the injected error: step_noise 0.1" in res["assumes"]
    assert "meets the SLO under that error" in res["assumes"]


def test_several_noise_seeds_judge_a_candidate_by_its_worst_run(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    cand = candidates(2, ("kairos",), (False,))[0]
    trace = prompts(40, 0.4)(1.0)
    sim = SimConfig(step_noise=0.3)

    def run(seeds: tuple[int, ...]) -> dict[str, object]:
        return planmod.run_job(planmod.Job(cand=cand, trace=trace, profile=PROFILE, sim=sim, rate_scale=1.0,
                                           seeds=seeds))

    one, other, both = run((0,)), run((1,)), run((0, 1))
    assert one["ttft_p95"] != other["ttft_p95"]  # the seeds draw different noise (the attainments may tie)
    worst = min(one, other, key=planmod.rank)  # the plan's ranking: both SLOs, TBT, then P95 TTFT
    assert {k: v for k, v in both.items() if k != "seeds"} == {k: v for k, v in worst.items() if k != "seeds"}
    # without random error there is nothing to draw: a clear error, not N identical runs
    f = write_jsonl(tmp_path / "t.jsonl", prompts(4, 1.0)(1.0))
    assert main(["--trace", str(f), "--noise-seeds", "3", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--noise-seeds needs random model error" in err
