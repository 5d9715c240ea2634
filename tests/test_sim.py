"""The discrete-event simulator: exact timings of lone requests, invariants over traces, the
heartbeat/ledger model, determinism, the summary statistics and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from common.perf_model import Profile, load_profile
from common.policy import POLICIES, KairosConfig, RequestSpec, make_policy
from common.traces import TraceRequest, find_bursty_window, load_trace, synthetic, trace_path
from sim.cli import main
from sim.core import SimConfig, Simulation, simulate
from sim.load import fastest_prefill, lower_bound
from sim.stats import RequestTiming, summarize

PROF = load_profile("a100-dsv2-lite")
M = PROF.model


def run(trace: list[TraceRequest], policy: str, profile: Profile = PROF, kairos: KairosConfig | None = None,
        **cfg: object) -> list[RequestTiming]:
    return simulate(trace, profile, make_policy(policy, kairos=kairos, default_model=profile.model),
                    SimConfig(**cfg)).records  # type: ignore[arg-type]


# ------------------------------------------------------------------ exact timings of one request


def test_lone_disaggregated_request_timing() -> None:
    (r,) = run([TraceRequest(0.0, 1000, 5)], "disagg-least-loaded")
    prefill = M.step_time(0, 0, [(1000, 0)])
    first_decode = M.step_time(1, 1000)
    assert r.ttft == pytest.approx(prefill + M.xfer_time(1000) + first_decode, rel=1e-12)
    assert list(r.tbt_gaps) == pytest.approx([M.step_time(1, 1000 + j) for j in range(1, 5)], rel=1e-12)
    assert (r.route, r.output_tokens, r.queue_s, r.prefill_s) == ("disagg", 5, 0.0, pytest.approx(prefill))
    assert r.xfer_s == pytest.approx(M.xfer_time(1000))


def test_lone_prompt_over_the_budget_is_chunked() -> None:
    (r,) = run([TraceRequest(0.0, 5000, 1)], "disagg-least-loaded")
    steps = M.step_time(0, 0, [(2048, 0)]) + M.step_time(0, 0, [(2048, 2048)]) + M.step_time(0, 0, [(904, 4096)])
    assert r.ttft == pytest.approx(steps + M.xfer_time(5000) + M.step_time(1, 5000))
    assert list(r.tbt_gaps) == []


def test_lone_deflected_request_uses_the_default_chunk() -> None:
    (r,) = run([TraceRequest(0.0, 1300, 3)], "deflect-all")
    chunks = M.step_time(0, 0, [(512, 0)]) + M.step_time(0, 0, [(512, 512)]) + M.step_time(0, 0, [(276, 1024)])
    assert r.ttft == pytest.approx(chunks)  # the last chunk's step samples the first token; no transfer
    assert list(r.tbt_gaps) == pytest.approx([M.step_time(1, 1301), M.step_time(1, 1302)])
    assert r.route == "deflect" and r.xfer_s is None


def test_kairos_runs_its_schedule_and_predicts_ttft() -> None:
    (r,) = run([TraceRequest(0.0, 3000, 2)], "kairos")
    assert r.route == "deflect" and r.reason == "decode_faster"
    spec = RequestSpec(request_id="x", prompt_tokens=3000, max_tokens=2, ttft_slo=2.0, tbt_slo=0.1)
    view = Simulation(PROF, make_policy("kairos"), SimConfig()).routers.replicas[0].view(0.0)
    found = make_policy("kairos").decide(spec, view, 0.0)
    actual = 0.0
    done = 0
    for chi in found.chunk_schedule:
        actual += M.step_time(0, 0, [(chi, done)])
        done += chi
    assert r.ttft == pytest.approx(actual)
    assert r.ttft_pred == pytest.approx(r.ttft, rel=1e-12)  # the replay predictor: exact here
    # the paper's step sum charges the prompt's own KV as decode reads too, so it is a bit higher
    (p,) = run([TraceRequest(0.0, 3000, 2)], "kairos", kairos=KairosConfig(predictor="paper"))
    assert p.ttft_pred is not None and p.ttft == r.ttft and r.ttft < p.ttft_pred <= r.ttft * 1.01


# ------------------------------------------------------------------ invariants over a trace

SYN = synthetic(rate=6.0, duration=60.0, arrival="onoff", cv=2.2, seed=5)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_with_its_tokens(policy: str) -> None:
    recs = run(SYN, policy)
    assert len(recs) == len(SYN)
    for tr, r in zip(SYN, recs, strict=True):
        assert r.ttft is not None and r.output_tokens == tr.output_length
        assert len(r.tbt_gaps) == tr.output_length - 1
        assert r.ttft >= fastest_prefill(M, tr.input_length) - 1e-12  # never beats the physical limit
        assert all(g >= M.a0 for g in r.tbt_gaps)
        assert r.e2e is not None and r.e2e >= r.ttft + sum(r.tbt_gaps) - 1e-9
    s = summarize(recs, ttft_slo=2.0, tbt_slo=0.1)
    assert s["output_tokens"] == sum(tr.output_length for tr in SYN)
    if policy in ("disagg-least-loaded", "disagg-round-robin"):
        assert s["deflection_rate"] == 0.0
    if policy == "deflect-all":
        assert s["deflection_rate"] == 1.0


def test_deterministic() -> None:
    def summary(**cfg: object) -> dict[str, object]:
        return summarize(run(SYN, "kairos", **cfg), ttft_slo=2.0, tbt_slo=0.1)
    assert summary() == summary()
    assert summary(step_noise=0.1, seed=1) == summary(step_noise=0.1, seed=1)
    assert summary(step_noise=0.1, seed=1) != summary(step_noise=0.1, seed=2)


def test_lower_bound() -> None:
    lb = lower_bound(SYN, PROF, ttft_slo=2.0, tbt_slo=0.1)
    assert lb["requests"] == len(SYN)
    assert lb["ttft_p95"] <= summarize(run(SYN, "kairos"), ttft_slo=2.0, tbt_slo=0.1)["ttft_p95"]
    # the fastest chunking of a lone prompt beats the prefill worker's 2048-token chunks
    assert fastest_prefill(M, 7436) < M.prefill_exec(7436, 2048)
    assert fastest_prefill(M, 7436) == pytest.approx(min(M.prefill_exec(7436, c) for c in range(256, 2049)))


# ------------------------------------------------------------------ heartbeats and the ledger


def _busy(policy: str, **cfg: object) -> list[float]:
    burst = [TraceRequest(0.0001 * i, 2000, 4) for i in range(8)]
    sim = Simulation(PROF, make_policy(policy), SimConfig(**cfg))  # type: ignore[arg-type]
    sim.run(burst)
    return [w.busy_s for w in sim.prefill]


def test_stale_heartbeats_herd_without_the_ledger() -> None:
    """Eight requests within 0.8 ms, heartbeats every second only (no prompt beats): without the
    ledger least-loaded sends them all to the prefill worker that looked idle; the ledger spreads
    them. Workers that heartbeat 2 ms after work reaches them (the default, as live) do not help
    within a burst shorter than that; the ledger is what spreads it."""
    herd = _busy("disagg-least-loaded", heartbeat_interval=1.0, ledger=False, prompt_beat=-1)
    spread = _busy("disagg-least-loaded", heartbeat_interval=1.0, ledger=True, prompt_beat=-1)
    assert _busy("disagg-least-loaded", heartbeat_interval=1.0, ledger=False) == herd
    fresh = _busy("disagg-least-loaded", heartbeat_interval=0.0, ledger=False)
    assert min(herd) == 0.0 and max(herd) > 0
    assert min(spread) > 0 and min(fresh) > 0
    assert max(spread) == pytest.approx(min(spread), rel=0.05)


def test_each_router_keeps_the_live_worker_table() -> None:
    """The simulator's routers keep their workers in the live router's WorkerTable, fed with the
    workers' heartbeats: each acknowledges every dispatch its router sent before it (what the
    ledger still holds came after), every deflection's record ends at its first token, and each
    decode worker's dispatches are counted once, by the router that sent them."""
    from common.router_core.core import RouterCore
    from common.router_core.workers import WorkerTable
    from sim import state

    assert not [name for name in vars(state) if "Ledger" in name]
    trace = [TraceRequest(0.004 * i, 1500 + 700 * (i % 5), 20) for i in range(60)]
    # (the planner off: a worker it flips carries the dispatches it took under its old role away)
    sim = Simulation(PROF, make_policy("kairos", default_model=M),
                     SimConfig(routers=2, heartbeat_interval=0.05, planner=False))
    records = sim.run(trace).records
    assert all(r.output_tokens == 20 for r in records)
    placed = 0
    for rt in sim.routers.replicas:
        assert isinstance(rt.core, RouterCore) and isinstance(rt.core.table, WorkerTable)  # the live router's
        assert not rt.core.requests and not rt.core.kv_waiting  # every request ended at its router
        for e in rt.core.table.workers.values():
            assert e.hb is not None and all(k > e.hb.last_dispatch for k in e.ledger)
            assert not e.deflecting
            if e.role == "decode":
                placed += e.dispatch_no
    assert placed == len(trace)
    assert {r.route for r in records} == {"deflect", "disagg"}


def test_stale_views_let_kairos_stack_deflections() -> None:
    """Without the ledger (and without decode-side admission), a stale heartbeat shows no
    deflection in flight, so Kairos puts several on one decode worker and the stacked chunks
    fill its steps to the TBT SLO itself (the worker's chunk guard holds each step there: a chunk
    not one token of fits waits, where until branch noise44c it ran one token a step over the
    SLO) and the last first token comes later; the decode workers' admission alone also keeps it."""
    burst = [TraceRequest(0.0, 200, 50)] * 10 + [TraceRequest(0.01 + 0.002 * i, 3000, 10) for i in range(6)]
    with_ledger = summarize(run(burst, "kairos", heartbeat_interval=0.5, admission=False), ttft_slo=2.0, tbt_slo=0.1)
    stale = summarize(run(burst, "kairos", heartbeat_interval=0.5, ledger=False, admission=False), ttft_slo=2.0,
                      tbt_slo=0.1)
    admitted = summarize(run(burst, "kairos", heartbeat_interval=0.5, ledger=False), ttft_slo=2.0, tbt_slo=0.1)
    assert with_ledger["tbt_max"] <= 0.1
    assert 0.09 < stale["tbt_max"] <= 0.1 and stale["tbt_max"] > 2 * with_ledger["tbt_max"]
    assert stale["ttft_max"] > with_ledger["ttft_max"] + 0.05
    assert stale["routes"]["deflect"] > with_ledger["routes"]["deflect"]
    assert admitted["tbt_max"] <= 0.1


def test_a_request_without_kv_room_waits_then_completes() -> None:
    small = msgspec.structs.replace(PROF, kv_capacity_tokens=1500)
    trace = [TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 2000, 1)]
    sim = Simulation(small, make_policy("disagg-least-loaded"),
                     SimConfig(heartbeat_interval=0.0, decode=1, kv_wait_timeout=5.0))
    res = sim.run(trace)
    first, second, too_big = res.records
    # fresh views: the second finds no KV room, waits at the router, and is placed the instant
    # the first finishes; then it completes with all its tokens
    assert first.e2e is not None and second.wait_s == pytest.approx(first.e2e)
    assert second.ttft is not None and second.ttft > first.e2e and second.output_tokens == 10
    assert first.wait_s is None and not second.rejected
    # one that can never fit is refused at once, as the live router answers it (HTTP 400)
    assert too_big.ttft is None and too_big.rejected and too_big.wait_s is None
    assert too_big.reason.startswith("rejected: the prompt (2000 tokens) plus max_tokens (1) needs 2001 tokens")
    assert res.stats["queues"]["router_kv_wait"]["max"] == 1
    s = summarize(res.records, ttft_slo=60.0, tbt_slo=1.0)
    assert (s["rejected"], s["failed"], s["completed"], s["waited_for_kv"]) == (1, 1, 2, 1)
    assert s["slo_attainment"] == pytest.approx(2 / 3)  # the rejected one misses both SLOs
    assert s["ttft_p99"] == float("inf") and s["ttft_p99_served"] == pytest.approx(second.ttft, rel=0.05)
    # one that waits longer than kv_wait_timeout for room is rejected at its timeout, clearly
    short = Simulation(small, make_policy("disagg-least-loaded"),
                       SimConfig(heartbeat_interval=0.0, decode=1, kv_wait_timeout=0.01)).run(trace[:2])
    assert not short.records[0].rejected
    late = short.records[1]
    assert late.rejected and late.ttft is None and late.wait_s == pytest.approx(0.01)
    assert late.reason.startswith("rejected: waited 0.01 s for KV room")
    assert short.stats["makespan_s"] > 0.01
    assert s["ttft_p50"] == pytest.approx(second.ttft)  # the rejected one ranks above every served one


def test_heartbeats_delay_the_retry_and_a_zero_timeout_rejects_at_once() -> None:
    small = msgspec.structs.replace(PROF, kv_capacity_tokens=1500)
    trace = [TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 1000, 10)]
    sim = Simulation(small, make_policy("disagg-least-loaded"),
                     SimConfig(heartbeat_interval=10.0, decode=1, prompt_beat=-1))
    res = sim.run(trace)
    first, second = res.records
    # with the ledger the router knows the first holds the KV; it sees it freed at the next heartbeat
    assert first.e2e is not None and first.e2e < sim.decode[0].phase
    assert second.wait_s == pytest.approx(sim.decode[0].phase) and second.ttft is not None
    assert second.e2e is not None and res.stats["makespan_s"] == pytest.approx(second.e2e)  # not the 30 s timeout
    # a worker that heartbeats 2 ms after a request finishes (the default, as live) shows it then
    first, second = run(trace, "disagg-least-loaded", profile=small, heartbeat_interval=10.0, decode=1)
    assert first.e2e is not None and second.wait_s == pytest.approx(first.e2e + 0.002)
    first, second = run(trace, "disagg-least-loaded", profile=small, heartbeat_interval=0.0, decode=1,
                        kv_wait_timeout=0.0)
    assert first.ttft is not None and second.ttft is None and second.rejected


def test_a_full_wait_queue_rejects_at_once() -> None:
    small = msgspec.structs.replace(PROF, kv_capacity_tokens=1500)
    recs = run([TraceRequest(0.0, 1000, 10)] * 3, "disagg-least-loaded", profile=small, heartbeat_interval=0.0,
               decode=1, kv_wait_max=1)
    assert [r.ttft is not None for r in recs] == [True, True, False]
    assert recs[2].rejected and "already waiting" in recs[2].reason and recs[2].wait_s is None


def test_stale_views_a_full_decode_worker_refuses_kv_full_as_live() -> None:
    """Stale views and no ledger: the router sends both; the decode worker's core refuses the
    second (kv_full, retryable) instead of queueing it, as the live worker does; the router
    re-dispatches it (one decode worker: the same one) until its attempts run out."""
    small = msgspec.structs.replace(PROF, kv_capacity_tokens=1500)
    recs = run([TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 1000, 10)], "disagg-least-loaded", profile=small,
               heartbeat_interval=10.0, ledger=False, decode=1)
    assert recs[0].ttft is not None and recs[1].ttft is None
    assert recs[1].rejected and "turned away by every decode worker" in recs[1].reason
    # with two decode workers the refused one goes to the other, and both are served
    recs = run([TraceRequest(0.0, 1000, 10), TraceRequest(0.0, 1000, 10)], "disagg-least-loaded", profile=small,
               heartbeat_interval=10.0, ledger=False, decode=2)
    assert all(r.ttft is not None for r in recs)


# ------------------------------------------------------------------ the headline claim


def test_kairos_beats_least_loaded_on_a_bursty_code_slice() -> None:
    full = load_trace(trace_path("code"))
    start = find_bursty_window(full, 120.0)
    trace = load_trace(trace_path("code"), start=start, duration=120.0)
    assert len(trace) > 500
    k = summarize(run(trace, "kairos"), ttft_slo=2.0, tbt_slo=0.1)
    ll = summarize(run(trace, "disagg-least-loaded"), ttft_slo=2.0, tbt_slo=0.1)
    assert k["ttft_p95"] < 0.8 * ll["ttft_p95"]
    assert k["tbt_slo_attainment"] >= ll["tbt_slo_attainment"] - 0.01
    assert k["slo_attainment"] > ll["slo_attainment"]
    assert 0 < k["deflection_rate"] < 1


def test_concurrent_deflections_keep_the_tbt_budget() -> None:
    """max_deflections=4: the ledger reserves each in-flight deflection's costliest chunk, so
    stacked deflections still keep every resident's gaps within the TBT SLO (the router's
    ledger alone: decode-side admission off)."""
    full = load_trace(trace_path("code"))
    trace = load_trace(trace_path("code"), start=find_bursty_window(full, 120.0), duration=120.0)
    # (at the fixed 2P2D split, planner off: a flip would change the shape the two runs compare on)
    one = summarize(run(trace, "kairos", kairos=KairosConfig(max_deflections=1), admission=False, planner=False),
                    ttft_slo=2.0, tbt_slo=0.1)
    four = summarize(run(trace, "kairos", kairos=KairosConfig(max_deflections=4), admission=False, planner=False),
                     ttft_slo=2.0, tbt_slo=0.1)
    assert four["tbt_slo_attainment"] == 1.0 and four["tbt_max"] <= 0.1
    assert four["deflection_rate"] > one["deflection_rate"]


def test_decode_steps_over_the_slo_are_counted_by_their_cause() -> None:
    """`decode_steps_over_tbt_slo` (sim stats): the exact model keeps every Kairos step within the
    SLO; with 30 % step noise some steps overrun, and the count matches the TBT misses' cause."""
    full = load_trace(trace_path("code"))
    trace = load_trace(trace_path("code"), start=find_bursty_window(full, 60.0), duration=60.0)
    policy = make_policy("kairos", default_model=PROF.model)
    exact = simulate(trace, PROF, policy, SimConfig()).stats["decode_steps_over_tbt_slo"]
    assert exact["decode_steps"] > 100 and exact["decode_only"] == exact["with_prefill_chunk"] == 0
    # without the closed loop (no measured margin: steps planned by the model alone), as a worker
    # plans a step beside running decodes for a 2e-5 chance at most whatever its overrun target
    # (issue 44), so that is what makes steps overrun in this minute of trace
    res = simulate(trace, PROF, make_policy("kairos", default_model=PROF.model),
                   SimConfig(step_noise=0.3, closed_loop=False))
    noisy = res.stats["decode_steps_over_tbt_slo"]
    over = noisy["decode_only"] + noisy["with_prefill_chunk"]
    assert over > 0
    missed = [r for r in res.records if r.tbt_gaps and max(r.tbt_gaps) > 0.1]
    assert missed  # a step over the SLO is a gap over it for every decode in its batch
    strict = simulate(trace, PROF, make_policy("kairos", default_model=PROF.model),
                      SimConfig(step_noise=0.3)).stats["decode_steps_over_tbt_slo"]  # the default target
    assert strict["decode_only"] + strict["with_prefill_chunk"] < over


# ------------------------------------------------------------------ summary statistics


def test_summarize_definitions() -> None:
    recs = [
        RequestTiming(ttft=0.5, tbt_gaps=[0.02, 0.03], route="disagg"),   # meets both
        RequestTiming(ttft=3.0, tbt_gaps=[0.02], route="disagg"),         # misses TTFT
        RequestTiming(ttft=1.0, tbt_gaps=[0.05, 0.2, 0.05], route="deflect", reason="decode_faster"),  # misses TBT
        RequestTiming(ttft=0.1, tbt_gaps=[], route="deflect", reason="decode_faster"),  # one token: meets both
        RequestTiming(ttft=None, route=None, reason="rejected: no room"),  # failed: misses both
    ]
    s = summarize(recs, ttft_slo=2.0, tbt_slo=0.1)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["ttft_slo_attainment"] == pytest.approx(3 / 5)
    assert s["tbt_slo_attainment"] == pytest.approx(3 / 4)  # of the served: the rejected one is a TTFT miss only
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["deflection_rate"] == pytest.approx(2 / 5)
    # the rejected request counts as an infinite TTFT: median of 0.1, 0.5, 1.0, 3.0, inf
    assert s["ttft_p50"] == pytest.approx(1.0)
    assert s["ttft_p95"] == float("inf") and s["ttft_p95_served"] == pytest.approx(2.7)  # served: 0.1 .. 3.0
    assert s["ttft_mean"] == pytest.approx(4.6 / 4)  # of the served ones
    assert s["tbt_p99_slo_attainment"] == pytest.approx(3 / 4)  # of the served; the third's P99 gap is 0.197 s
    assert s["tbt_p50"] == pytest.approx(0.04)   # pooled gaps 0.02 0.02 0.03 0.05 0.05 0.2
    assert s["tbt_max"] == pytest.approx(0.2)
    assert s["routes"] == {"deflect": 2, "disagg": 2}
    assert s["reasons"] == {"decode_faster": 2, "rejected: no room": 1}
    parts = [RequestTiming(ttft=1.0, queue_s=0.5, prefill_s=0.3, xfer_s=0.1),
             RequestTiming(ttft=4.0, queue_s=3.0, prefill_s=0.6, xfer_s=0.2)] + [RequestTiming(ttft=0.1)] * 38
    tail = summarize(parts, ttft_slo=2.0, tbt_slo=0.1)  # P95 = 0.145: both requests with parts are the tail
    assert tail["ttft_tail_queue_share"] == pytest.approx((0.5 + 0.75) / 2)
    assert tail["ttft_tail_prefill_share"] == pytest.approx((0.3 + 0.15) / 2)
    assert tail["ttft_tail_xfer_share"] == pytest.approx((0.1 + 0.05) / 2)
    # one slow gap among 200: misses the max-gap TBT SLO, meets the P99-gap one
    one_bad = summarize([RequestTiming(ttft=0.5, tbt_gaps=[0.02] * 199 + [0.3])], ttft_slo=2.0, tbt_slo=0.1)
    assert (one_bad["tbt_slo_attainment"], one_bad["tbt_p99_slo_attainment"]) == (0.0, 1.0)
    assert (one_bad["slo_attainment"], one_bad["slo_attainment_p99"]) == (0.0, 1.0)
    empty = summarize([], ttft_slo=1.0, tbt_slo=0.1)
    assert empty["requests"] == 0 and empty["ttft_p95"] is None and empty["slo_attainment"] is None


# ------------------------------------------------------------------ CLI


def test_cli_writes_results_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 40 * i, "input_length": 300 + 97 * i % 4000,
                                           "output_length": 5 + i % 30}) for i in range(300)))
    out = tmp_path / "r.json"
    rc = main(["--trace", str(trace), "--policy", "kairos", "--policy", "disagg-least-loaded", "--rate-scale",
               "1,3", "--out", str(out), "--plot", str(tmp_path / "plots"), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) == {"config", "lower_bound", "policies", "sweep"}
    assert list(res["policies"]) == ["kairos", "disagg-least-loaded"]
    for key in ("ttft_p50", "ttft_p95", "ttft_p99", "tbt_p95", "tbt_p99", "ttft_slo_attainment",
                "tbt_slo_attainment", "slo_attainment", "deflection_rate", "requests"):
        assert key in res["policies"]["kairos"]
    assert res["policies"]["kairos"]["requests"] == 300
    assert [p["rate_scale"] for p in res["sweep"]] == [1.0, 3.0]
    assert res["sweep"][1]["prefill_load"] == pytest.approx(3 * res["sweep"][0]["prefill_load"], rel=0.01)
    assert res["config"]["profile"] == "h100-llama2-70b-tp4" and res["config"]["ledger"] is True  # the default
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "attainment_vs_load.png", "ttft_cdf_x1.png", "ttft_cdf_x3.png"]


@pytest.mark.parametrize("argv", [
    ["--trace", "synthetic", "--duration", "5", "--alpha", "0.5"],
    ["--trace", "nope.csv"],
    ["--trace", "synthetic", "--duration", "5", "--rate-scale", "0"],
    ["--trace", "synthetic", "--duration", "5", "--candidates", "a,b"],
    ["--trace", "synthetic", "--duration", "5", "--overrun-target", "0"],
])
def test_cli_rejects_bad_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--quiet"]) == 2
    assert "kairos sim:" in capsys.readouterr().err


def test_cli_synthetic(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["--trace", "synthetic", "--rate", "5", "--duration", "20", "--arrival", "gamma", "--cv", "2",
                 "--lengths", "conv", "--policy", "conditional-disagg", "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["arrival"] == "gamma" and res["policies"]["conditional-disagg"]["requests"] > 50


def test_an_error_inside_the_router_core_stops_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Live, the core logs a handler's exception and goes on; in the simulator that would hide a
    bug in a result, so the simulator's log raises (sim/router.py STRICT_LOG)."""
    from sim import router

    def broken(self: router.SimRouter, *args: object) -> None:
        raise ValueError("broken shell")

    monkeypatch.setattr(router.SimRouter, "_done", broken)
    with pytest.raises(RuntimeError, match="message_handler_failed") as e:
        run([TraceRequest(0.0, 500, 3)], "kairos")
    assert isinstance(e.value.__context__, ValueError)
