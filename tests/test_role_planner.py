"""The role planner (common/router_core/planner.py): its rules on synthetic load, with a fake clock."""

from __future__ import annotations

import pytest

from common.router_core.planner import Flip, Load, PlannerConfig, RolePlanner, WorkerLoad, leader
from common.router_core.ports import NullLog


class Rec(NullLog):
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))


def fleet(n_p: int, n_d: int) -> tuple[WorkerLoad, ...]:
    return (*(WorkerLoad(f"p{i}", "prefill", 1000.0 * i) for i in range(n_p)),
            *(WorkerLoad(f"d{i}", "decode", 10.0 * i) for i in range(n_d)))


DECODE_SHORT = dict(prefill_queue_s=0.05, decode_step_s=0.095, waits_decode=5, waits_prefill=0)
PREFILL_SHORT = dict(prefill_queue_s=1.8, decode_step_s=0.02, waits_decode=0, waits_prefill=3)
CALM = dict(prefill_queue_s=0.1, decode_step_s=0.03, waits_decode=0, waits_prefill=0)


def run(p: RolePlanner, load: dict[str, float], workers: tuple[WorkerLoad, ...], t0: float, t1: float,
        step: float = 5.0) -> tuple[list[tuple[float, Flip]], float]:
    flips = []
    t = t0
    while t < t1:
        f = p.observe(Load(workers=workers, **load), t)  # type: ignore[arg-type]
        if f is not None:
            flips.append((t, f))
        t += step
    return flips, t


def cfg(**kw: object) -> PlannerConfig:
    return PlannerConfig(enabled=True, **kw)  # type: ignore[arg-type]


def test_flips_toward_decode_when_decode_waits_dominate_and_back_when_prefill_does() -> None:
    log = Rec()
    p = RolePlanner(cfg(), log=log)
    flips, t = run(p, DECODE_SHORT, fleet(2, 2), 0.0, 120.0)
    assert len(flips) == 1  # one at a time: none while the first is carried out
    at, f = flips[0]
    assert (f.worker_id, f.to, f.reason) == ("p0", "decode", "decode_short")  # the least loaded prefill worker
    assert at == 10.0  # half a window of evidence; no dwell before a worker's first flip (it never changed role)
    assert any(e == "role_flip" and kw["reason"] == "decode_short" for e, kw in log.lines)
    p.flip_done("p0", "decode", t)
    after = (WorkerLoad("p1", "prefill", 0.0), WorkerLoad("p0", "decode", 0.0), *fleet(0, 2))
    back, _ = run(p, PREFILL_SHORT, after, t, t + 200.0)
    assert back and back[0][1].to == "prefill" and back[0][1].reason == "prefill_short"
    assert back[0][1].worker_id != "p0" or back[0][0] - t >= 60.0


def test_calm_load_and_the_gap_between_thresholds_flip_nothing() -> None:
    p = RolePlanner(cfg(min_dwell_s=0.0, min_gap_s=0.0))
    assert run(p, CALM, fleet(2, 2), 0.0, 300.0)[0] == []
    # decode steps at 0.8 of the SLO: between step_lo and step_hi, no waits, and a prefill pool that
    # cannot spare a worker (its queue at 0.15 of the TTFT SLO would be 0.3 with one fewer): no flip
    between = dict(CALM, decode_step_s=0.08, prefill_queue_s=0.3)
    assert run(RolePlanner(cfg(min_dwell_s=0.0, min_gap_s=0.0)), between, fleet(2, 2), 0.0, 300.0)[0] == []
    # ... nor with the decode-leaning rule off
    assert run(RolePlanner(cfg(min_dwell_s=0.0, decode_lean=False)), dict(CALM, decode_step_s=0.08), fleet(2, 2),
               0.0, 300.0)[0] == []


def test_a_busy_decode_pool_takes_a_prefill_worker_the_prefill_pool_can_spare_before_it_is_short() -> None:
    # decode steps at 0.7 of the SLO (under step_hi: not short yet), nothing waits, prefill queue at 0.05
    busy = dict(CALM, decode_step_s=0.07)
    flips, _ = run(RolePlanner(cfg()), busy, fleet(2, 2), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_busy")]
    # never the last prefill worker, and not when one fewer would leave the queue past queue_lo
    assert run(RolePlanner(cfg()), busy, fleet(1, 3), 0.0, 300.0)[0] == []
    assert run(RolePlanner(cfg()), dict(busy, prefill_queue_s=0.3), fleet(2, 2), 0.0, 300.0)[0] == []


def test_the_decode_step_is_judged_as_the_guard_plans_it() -> None:
    # under step noise the guard keeps the measured step at ~0.6 of the SLO when the pool is full; planned
    # with its margin (x1.5) it is 0.9 of the SLO: short
    noisy = dict(CALM, decode_step_s=0.06, decode_step_planned_s=0.09, prefill_queue_s=0.3)
    flips, _ = run(RolePlanner(cfg()), noisy, fleet(3, 1), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_short")]
    measured = RolePlanner(cfg(decode_lean=False))  # (0.6 of the SLO is busy enough to lean)
    assert run(measured, dict(noisy, decode_step_planned_s=None), fleet(3, 1), 0.0, 60.0)[0] == []


def test_the_decode_step_is_judged_against_the_budget_the_guard_plans_to() -> None:
    """With a delivery allowance the guard plans decode steps to the SLO less it (delivery.py):
    a pool full at that budget is short, though its steps stay under step_hi of the SLO itself."""
    full = dict(CALM, decode_step_s=0.082, prefill_queue_s=0.3)  # 0.95 x (100 - 14) ms: as full as planned
    p = RolePlanner(cfg(decode_lean=False))
    assert run(p, full, fleet(3, 1), 0.0, 60.0)[0] == []  # judged against 100 ms: 0.82, not short
    p = RolePlanner(cfg(decode_lean=False))
    p.tbt_budget = 0.086
    flips, _ = run(p, full, fleet(3, 1), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_short")]


def test_off_switch_bounds_and_pins() -> None:
    assert run(RolePlanner(PlannerConfig(enabled=False)), DECODE_SHORT, fleet(2, 2), 0.0, 300.0)[0] == []
    log = Rec()
    bounded = RolePlanner(cfg(min_dwell_s=0.0, max_decode=2), log=log)
    assert run(bounded, DECODE_SHORT, fleet(2, 2), 0.0, 300.0)[0] == []
    assert [kw["held_by"] for e, kw in log.lines if e == "role_flip_held"] == ["max_decode"]  # logged once
    assert run(RolePlanner(cfg(min_dwell_s=0.0)), DECODE_SHORT, fleet(1, 3), 0.0, 300.0)[0] == []  # min_prefill 1
    pinned = RolePlanner(cfg(min_dwell_s=0.0, pinned=frozenset({"p0"})))
    flips, _ = run(pinned, DECODE_SHORT, fleet(2, 2), 0.0, 300.0)
    assert [f.worker_id for _, f in flips] == ["p1"]
    both = RolePlanner(cfg(min_dwell_s=0.0, pinned=frozenset({"p0", "p1"})))
    assert run(both, DECODE_SHORT, fleet(2, 2), 0.0, 300.0)[0] == []


def test_a_worker_whose_engine_cannot_change_role_is_never_moved() -> None:
    # a vLLM worker without kv_both says so in its Hello (fixed_role): the planner moves another, or
    # none, instead of asking it and waiting planner_flip_timeout_s for a refusal
    one_fixed = (WorkerLoad("p0", "prefill", 0.0, fixed=True), WorkerLoad("p1", "prefill", 1000.0),
                 *fleet(0, 2))
    flips, _ = run(RolePlanner(cfg(min_dwell_s=0.0)), DECODE_SHORT, one_fixed, 0.0, 300.0)
    assert [f.worker_id for _, f in flips] == ["p1"]
    all_fixed = tuple(WorkerLoad(w.worker_id, w.role, w.load, fixed=True) for w in fleet(2, 2))
    assert run(RolePlanner(cfg(min_dwell_s=0.0)), DECODE_SHORT, all_fixed, 0.0, 300.0)[0] == []


def test_a_bound_of_zero_moves_the_last_worker_only_when_its_pool_is_idle() -> None:
    # min_prefill 0 lets the last prefill worker go; with a prefill queue it cannot be spared (none would
    # be left to carry it), and the check must not divide by the zero workers left
    zero = cfg(min_dwell_s=0.0, min_prefill=0)
    assert run(RolePlanner(zero), DECODE_SHORT, fleet(1, 3), 0.0, 300.0)[0] == []
    flips, _ = run(RolePlanner(zero), dict(DECODE_SHORT, prefill_queue_s=0.0), fleet(1, 3), 0.0, 300.0)
    assert [(f.worker_id, f.to) for _, f in flips][:1] == [("p0", "decode")]


def test_no_flip_that_would_starve_the_other_role() -> None:
    # decode short, but the prefill queue at 0.2 of the TTFT SLO would be 0.4 with one prefill worker fewer
    p = RolePlanner(cfg(min_dwell_s=0.0))
    assert run(p, dict(DECODE_SHORT, prefill_queue_s=0.4), fleet(2, 2), 0.0, 300.0)[0] == []


def test_rate_limit_and_fresh_evidence_after_a_flip() -> None:
    p = RolePlanner(cfg(min_dwell_s=0.0, min_gap_s=100.0))
    flips, _ = run(p, DECODE_SHORT, fleet(3, 1), 0.0, 30.0)
    assert len(flips) == 1 and flips[0][0] == 10.0  # half a window of samples first (3 of 30 s at 5 s)
    p.flip_done(flips[0][1].worker_id, "decode", 20.0)
    again, _ = run(p, DECODE_SHORT, (*fleet(2, 1), WorkerLoad("p2", "decode", 0.0)), 20.0, 300.0)
    assert again[0][0] >= 110.0  # min_gap_s after the first decision


def test_settings_are_checked_and_one_router_leads() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        PlannerConfig(wait_lo=0.3, wait_hi=0.2)
    with pytest.raises(ValueError):
        PlannerConfig(min_decode=0)
    assert leader(["router-b", "router-a"]) == "router-a" and leader([]) == ""


def test_the_router_core_sends_set_role_and_the_workers_hello_under_its_new_role_ends_the_flip() -> None:
    from common import messages as m
    from tests.router_fakes import hello, make_core

    core, box = make_core("kairos")
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        core.on_message(wid.encode(), hello(wid, role), 0.0)  # type: ignore[arg-type]
    box.take()
    assert core.plan_roles(0.0) is None  # no planner: nothing
    planner = core.planner = RolePlanner(cfg(min_dwell_s=0.0, tbt_slo=core.cfg.tbt_slo))
    for d in ("d0", "d1"):  # decode steps at the TBT SLO
        core.on_message(d.encode(), m.DecodeHeartbeat(
            worker_id=d, incarnation=f"inc-{d}", seq=1, batch=150, kv_tokens=1000, kv_free_tokens=90_000,
            kv_capacity_tokens=100_000, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1,
            token_budget=2048, step_ms_p50=core.cfg.tbt_slo * 1000.0), 0.0)
    t, flip = 0.0, None
    while flip is None and t < 60.0:
        flip = core.plan_roles(t)
        t += 5.0
    assert flip is not None and flip.to == "decode" and flip.reason == "decode_short"
    sent = [(peer, msg) for peer, msg in box.take() if isinstance(msg, m.SetRole)]
    assert sent == [(flip.worker_id, m.SetRole(role="decode", reason="decode_short",
                                               router_incarnation=core.incarnation))]
    assert core.plan_roles(t) is None and planner.pending is flip  # one at a time
    core.on_message(flip.worker_id.encode(), m.Goodbye(worker_id=flip.worker_id, incarnation=f"inc-{flip.worker_id}",
                                                       reason="drained"), t)
    core.on_message(flip.worker_id.encode(), hello(flip.worker_id, "decode"), t + 2.0)
    assert planner.pending is None and core.table.count("decode") == 3 and core.counts["role_flips"] == 1


def test_requests_a_prefill_worker_decodes_itself_are_decode_shortage_evidence() -> None:
    # the third path (route retain) hides the decode pool's shortage from the wait queue: nothing waits,
    # the steps stay under the guard's limit, but prefill workers decode what no decode worker could take
    spilled = dict(prefill_queue_s=0.05, decode_step_s=0.05, waits_decode=0, waits_prefill=0, retained=12)
    flips, _ = run(RolePlanner(cfg()), spilled, fleet(2, 2), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_short")]
    assert flips[0][1].evidence["decode_wait_share"] == 1.0
    # ... and they keep a decode worker from leaving for prefill while they last
    assert run(RolePlanner(cfg()), dict(PREFILL_SHORT, retained=3), fleet(2, 2), 0.0, 300.0)[0] == []
    assert run(RolePlanner(cfg()), PREFILL_SHORT, fleet(2, 2), 0.0, 300.0)[0]  # (without them it goes)


def test_the_prefill_worker_with_the_fewest_own_decodes_moves_first() -> None:
    # its drain waits for the requests it decodes itself: the one with fewer drains sooner
    workers = (WorkerLoad("p0", "prefill", 0.0, decodes=40), WorkerLoad("p1", "prefill", 5000.0, decodes=2),
               *fleet(0, 2))
    flips, _ = run(RolePlanner(cfg()), DECODE_SHORT, workers, 0.0, 60.0)
    assert [f.worker_id for _, f in flips] == ["p1"]


def test_the_dwell_counts_from_a_role_change_the_planner_saw() -> None:
    p = RolePlanner(cfg(min_gap_s=0.0))
    flips, t = run(p, DECODE_SHORT, fleet(3, 1), 0.0, 15.0)
    assert [(at, f.worker_id) for at, f in flips] == [(10.0, "p0")]
    p.flip_done("p0", "decode", t)
    moved = (WorkerLoad("p0", "decode", 0.0), *fleet(3, 1)[1:])
    back, _ = run(p, PREFILL_SHORT, moved, t, t + 120.0)
    # p0 came back as a decode worker at 15 s: it stays there min_dwell_s, d0 (never moved) may go at once
    assert [f.worker_id for _, f in back] == ["d0"] and back[0][0] < t + 60.0


def test_measure_reads_the_requests_each_prefill_worker_decodes() -> None:
    from common import messages as m
    from common.router_core.planner import measure
    from tests.router_fakes import hello, make_core

    core, _ = make_core("kairos")
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        core.on_message(wid.encode(), hello(wid, role), 0.0)  # type: ignore[arg-type]
    core.on_message(b"p0", m.PrefillHeartbeat(worker_id="p0", incarnation="inc-p0", seq=1, queued_tokens=100,
                                              queued_requests=1, token_budget=2048, decodes=7), 0.0)
    core.on_message(b"d0", m.DecodeHeartbeat(
        worker_id="d0", incarnation="inc-d0", seq=1, batch=90, kv_tokens=1000, kv_free_tokens=90_000,
        kv_capacity_tokens=100_000, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1,
        token_budget=2048, step_ms_p50=60.0, step_margin=1.65, step_bias=1.1), 0.0)
    load = measure(core.table, [])
    assert load.retained == 7
    assert load.decode_step_s == pytest.approx(0.06) and load.decode_step_planned_s == pytest.approx(0.09)
    assert [(w.worker_id, w.decodes) for w in load.workers if w.role == "prefill"] == [("p0", 7)]


def test_an_idle_decode_pool_on_a_slow_gpu_is_not_busy() -> None:
    # A100 under step noise: a lone sequence's step, planned with its margin, is 0.62 of the SLO (the
    # weights read every step). Above that fixed cost the pool uses nothing: no decode_busy flip
    idle = dict(CALM, decode_step_s=0.044, decode_step_planned_s=0.062, decode_step_floor_s=0.062)
    assert run(RolePlanner(cfg()), idle, fleet(2, 2), 0.0, 300.0)[0] == []
    # the same step with a fixed cost of 0.03: 0.46 of the room above it, still under step_lo ...
    assert run(RolePlanner(cfg()), dict(idle, decode_step_floor_s=0.03), fleet(2, 2), 0.0, 300.0)[0] == []
    # ... and with a batch that fills the room above the fixed cost, busy
    full = dict(idle, decode_step_planned_s=0.09)
    flips, _ = run(RolePlanner(cfg()), full, fleet(2, 2), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_busy")]


def test_a_decode_load_that_rises_is_judged_on_its_recent_samples() -> None:
    # an output-heavy phase starts: 20 s of an idle decode pool, then its step climbs toward the SLO
    steps = [0.03] * 4 + [0.03, 0.05, 0.07, 0.08, 0.09]
    p, q = RolePlanner(cfg()), RolePlanner(cfg(recent=1.0))  # recent=1.0: the window's mean only, as before
    at = {}
    for planner, name in ((p, "recent"), (q, "window")):
        for i, s in enumerate(steps):
            f = planner.observe(Load(workers=fleet(2, 2), **dict(CALM, decode_step_s=s, decode_step_floor_s=0.03)),
                                5.0 * i)  # type: ignore[arg-type]
            if f is not None:
                at[name] = (5.0 * i, f.reason)
                break
    # the last two samples' mean at 35 s, of the room above the 0.03 fixed cost: (0.57 + 0.71) / 2
    assert at["recent"] == (35.0, "decode_busy")
    assert "window" not in at  # the window's mean (0.35 at 40 s) had not reached step_lo yet
    with pytest.raises(ValueError, match="recent"):
        PlannerConfig(recent=0.0)


def test_the_planner_is_on_by_default_for_kairos_and_off_for_the_baselines() -> None:
    """One default for the live router, `kairos up` and the simulator: Kairos plans roles as the
    router ships it, a baseline keeps its fixed split; `--planner on/off` sets it for any policy."""
    from common.config import RouterConfig
    from common.config import load as load_config
    from common.perf_model import load_profile
    from common.policy import make_policy
    from common.router_core.planner import planner_on, shipped_planner
    from kairos.up import parser, spec_from_args
    from sim.core import Simulation
    from sim.state import SimConfig

    assert RouterConfig().planner is None  # unset: the policy's default
    assert shipped_planner("kairos") and not shipped_planner("disagg-least-loaded")
    # a router started by hand (compose, Kubernetes) with a baseline policy keeps its split unless told
    assert planner_on(RouterConfig()) and not planner_on(RouterConfig(policy="disagg-least-loaded"))
    assert planner_on(RouterConfig(policy="disagg-least-loaded", planner=True))
    assert not planner_on(RouterConfig(planner=False))

    def plans(*argv: str) -> bool:
        """Whether the router `kairos up` starts with these flags plans roles (its environment, loaded)."""
        a = parser().parse_args(["--no-monitor", *argv])
        env = {**spec_from_args(a).router_env, "KAIROS_POLICY": a.policy}
        return planner_on(load_config(RouterConfig, env=env))

    assert plans()  # the router's own default for kairos: on
    assert not plans("--policy", "disagg-least-loaded")
    assert plans("--policy", "disagg-least-loaded", "--planner", "on")
    assert not plans("--planner", "off")
    prof = load_profile("h100-llama2-70b-tp4")
    for name, on in (("kairos", True), ("disagg-least-loaded", False)):
        sim = Simulation(prof, make_policy(name, default_model=prof.model), SimConfig())
        assert (sim.planner is not None) is on and sim.cfg.planner is on
    off = Simulation(prof, make_policy("kairos", default_model=prof.model), SimConfig(planner=False))
    assert off.planner is None


def test_a_step_floor_over_the_tbt_slo_is_no_reason_to_flip() -> None:
    # the SLO (10 us) is under a lone sequence's step (1 ms): no room above the fixed cost at all.
    # One decode worker more cannot lower that floor, so the step is no evidence for a flip (a loaded
    # host's step margins once put the floor past the SLO and the planner took a prefill worker)
    tight = dict(CALM, decode_step_s=0.001, decode_step_floor_s=0.001)
    assert run(RolePlanner(cfg(tbt_slo=0.00001)), tight, fleet(2, 1), 0.0, 60.0)[0] == []
    # ... while requests waiting for decode room still are
    waiting = dict(tight, waits_decode=3)
    flips, _ = run(RolePlanner(cfg(tbt_slo=0.00001)), waiting, fleet(2, 1), 0.0, 60.0)
    assert [(f.to, f.reason) for _, f in flips] == [("decode", "decode_short")]


def test_the_decodes_a_flipped_worker_kept_are_no_sign_of_a_decode_shortage() -> None:
    # a decode worker moved to prefill keeps its running decodes (planner_keep): its heartbeat counts them
    # with the requests it decodes itself, but they say nothing about the decode pool's room now
    p = RolePlanner(cfg(min_gap_s=0.0))
    p.observe(Load(workers=fleet(2, 2), **CALM), 0.0)  # type: ignore[arg-type]
    p.flip_done("d0", "prefill", 1.0)
    moved = (*fleet(2, 0), WorkerLoad("d0", "prefill", 0.0, decodes=14), WorkerLoad("d1", "decode", 0.0))
    # its 14 kept decodes finish over the next half minute, nothing else changes: no decode shortage
    t = 5.0
    for kept in (14, 11, 8, 5, 2, 0):
        workers = (*moved[:2], WorkerLoad("d0", "prefill", 0.0, decodes=kept), moved[3])
        assert p.observe(Load(workers=workers, retained=kept, **CALM), t) is None  # type: ignore[arg-type]
        t += 5.0
    assert p._judge(Load(workers=moved, **CALM)).decode_wait == 0.0  # type: ignore[arg-type]
    # a request it decodes beyond what it kept is one no decode worker could take: evidence again
    q = RolePlanner(cfg(min_gap_s=0.0))
    q.flip_done("d0", "prefill", 0.0)
    more = (*moved[:2], WorkerLoad("d0", "prefill", 0.0, decodes=9), moved[3])
    q.observe(Load(workers=more, retained=9, **CALM), 5.0)  # type: ignore[arg-type]
    grown = (*moved[:2], WorkerLoad("d0", "prefill", 0.0, decodes=12), moved[3])
    q.observe(Load(workers=grown, retained=12, **CALM), 10.0)  # type: ignore[arg-type]
    assert [x.retained for _, x in q.samples] == [0, 3]
