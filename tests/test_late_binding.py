"""Kairos's late binding in the policy and the simulator: a request bound for a deep prefill
queue waits at the router (`Hold`) and is dispatched when a prefill queue or a decode worker
frees room; a waiting request is always dispatched or rejected with a clear reason."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.perf_model import load_profile
from common.policy import (
    ClusterView,
    DecodeView,
    Hold,
    Kairos,
    KairosConfig,
    NoKvRoom,
    PrefillView,
    RequestSpec,
    make_policy,
)
from common.policy.kairos import holds, retry_order
from common.traces import TraceRequest
from sim.core import SimConfig, Simulation
from sim.knobs import Setup, build

PROF = load_profile("a100-dsv2-lite")
M = PROF.model
BUDGET = PROF.prefill_token_budget  # 2048
LATE = KairosConfig(late_binding=True)


def views(queued: int, *, decode_batch: int = 0) -> ClusterView:
    p = PrefillView(worker_id="prefill-0", queued_tokens=queued, queued_requests=1 if queued else 0,
                    token_budget=BUDGET, model=M)
    d = DecodeView(worker_id="decode-0", batch=decode_batch, kv_tokens=decode_batch * 1000, kv_free_tokens=10**6,
                   kv_capacity_tokens=10**6, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
                   token_budget=PROF.decode_token_budget, model=M)
    return ClusterView((p,), (d,))


def spec(tokens: int, tbt_slo: float = 0.1) -> RequestSpec:
    return RequestSpec(request_id="r", prompt_tokens=tokens, max_tokens=10, ttft_slo=2.0, tbt_slo=tbt_slo)


def test_holds_only_when_on_and_the_queue_is_deep() -> None:
    v = views(BUDGET).prefill[0]
    assert holds(LATE, v) and not holds(KairosConfig(), v)
    assert not holds(LATE, views(BUDGET - 1).prefill[0])
    assert holds(KairosConfig(late_binding=True, late_depth=0.5), views(BUDGET // 2).prefill[0])
    with pytest.raises(ValueError, match="late_depth"):
        KairosConfig(late_depth=0)
    with pytest.raises(ValueError, match="late_order"):
        KairosConfig(late_order="lifo")  # type: ignore[arg-type]


def test_kairos_holds_a_request_bound_for_a_deep_queue() -> None:
    no_slack = spec(3000, tbt_slo=0.001)  # no chunk fits a 1 ms TBT budget: the prefill path it is
    with pytest.raises(Hold, match="late binding"):
        Kairos(LATE, default_model=M).decide(no_slack, views(4 * BUDGET), 0.0)
    assert issubclass(Hold, NoKvRoom)  # the router's wait queue takes it
    # off, or a shallow queue: dispatched to the prefill worker as before
    assert Kairos(KairosConfig(), default_model=M).decide(no_slack, views(4 * BUDGET), 0.0).route == "disagg"
    assert Kairos(LATE, default_model=M).decide(no_slack, views(BUDGET // 2), 0.0).route == "disagg"
    # a decode worker with slack takes it in place even behind a deep queue: never held
    d = Kairos(LATE, default_model=M).decide(spec(3000), views(40 * BUDGET), 0.0)
    assert d.route == "deflect"


def test_retry_order() -> None:
    deadlines = [1.0, 5.0, 2.0, 6.0]  # arrival + TTFT SLO, in arrival order
    assert retry_order(None, deadlines, 3.0) == [0, 1, 2, 3]
    assert retry_order(KairosConfig(late_binding=True, late_order="fifo"), deadlines, 3.0) == [0, 1, 2, 3]
    assert retry_order(LATE, deadlines, 3.0) == [1, 3, 0, 2]  # those that can still make it first
    # "short" (the default): among those that can still make it, the shortest prompt first (ties by
    # arrival); the others after them by arrival, whatever their size; without sizes it is "slack"
    assert LATE.late_order == "short"
    sizes = [100, 4000, 9000, 700]
    assert retry_order(LATE, deadlines, 3.0, sizes) == [3, 1, 0, 2]
    assert retry_order(LATE, [5.0, 6.0, 7.0], 3.0, [700, 300, 700]) == [1, 0, 2]
    slack = KairosConfig(late_binding=True, late_order="slack")
    assert retry_order(slack, deadlines, 3.0, sizes) == [1, 3, 0, 2]
    assert retry_order(KairosConfig(late_binding=True, late_order="fifo"), deadlines, 3.0, sizes) == [0, 1, 2, 3]
    assert Kairos(LATE).wait_order(deadlines, sizes, 3.0) == [3, 1, 0, 2]
    assert Kairos(KairosConfig()).wait_order(deadlines, sizes, 3.0) == [0, 1, 2, 3]  # late binding off: FIFO


def one_p_one_d(kcfg: KairosConfig, trace: list[TraceRequest], **cfg: object) -> Simulation:
    sim = Simulation(PROF, make_policy("kairos", kairos=kcfg, default_model=M),
                     SimConfig(prefill=1, decode=1, **cfg))  # type: ignore[arg-type]
    sim.run(trace)
    return sim


def test_held_requests_wait_at_the_router_then_run_when_the_queue_drops() -> None:
    trace = [TraceRequest(0.0, BUDGET, 3)] * 3
    cfg = {"heartbeat_interval": 0.0, "tbt_slo": 0.001}  # no deflection: every request takes the prefill path
    on = Simulation(PROF, make_policy("kairos", kairos=LATE, default_model=M),
                    SimConfig(prefill=1, decode=1, **cfg))  # type: ignore[arg-type]
    res = on.run(trace)
    off = Simulation(PROF, make_policy("kairos", default_model=M), SimConfig(prefill=1, decode=1, **cfg))
    res_off = off.run(trace)
    step = M.step_time(0, 0, [(BUDGET, 0)])
    first, second, third = res.records
    # the first is dispatched; the others wait at the router, each until the queue ahead drops
    assert first.wait_s is None and second.wait_s == pytest.approx(step) and third.wait_s == pytest.approx(2 * step)
    assert res.stats["held"] == 2 and res.stats["queues"]["router_kv_wait"]["max"] == 2
    assert all(r.route == "disagg" and r.output_tokens == 3 and not r.rejected for r in res.records)
    # with fresh views holding costs nothing: the prefill worker never idles, the TTFTs are the same
    assert [r.ttft for r in res.records] == pytest.approx([r.ttft for r in res_off.records], rel=1e-9)
    assert res_off.stats["held"] == 0 and all(r.wait_s is None for r in res_off.records)


def test_a_held_request_is_deflected_when_a_decode_worker_frees_room() -> None:
    # one deflection slot: the first prompt takes it, a long one finds it taken and goes to the
    # empty prefill queue; the third finds the slot taken and the queue deep, waits at the
    # router, and is deflected the moment the slot frees (the first's first token)
    kcfg = KairosConfig(late_binding=True, max_deflections=1)
    trace = [TraceRequest(0.0, 1500, 2), TraceRequest(0.0, 8 * BUDGET, 2), TraceRequest(0.01, 600, 2)]
    sim = Simulation(PROF, make_policy("kairos", kairos=kcfg, default_model=M),
                     SimConfig(prefill=1, decode=1, heartbeat_interval=0.0))
    first, long, held = sim.run(trace).records
    assert long.route == "disagg" and first.route == "deflect"
    assert held.route == "deflect" and held.wait_s is not None and held.wait_s > 0
    assert first.ttft is not None and held.wait_s == pytest.approx(first.ttft - 0.01)  # the slot's release
    assert held.output_tokens == 2 and long.ttft is not None and held.ttft is not None and held.ttft < long.ttft


def test_a_held_request_is_rejected_clearly_at_the_timeout() -> None:
    trace = [TraceRequest(0.0, 20 * BUDGET, 2), TraceRequest(0.0, BUDGET, 2)]
    sim = Simulation(PROF, make_policy("kairos", kairos=LATE, default_model=M),
                     SimConfig(prefill=1, decode=1, heartbeat_interval=0.0, tbt_slo=0.001, kv_wait_timeout=0.5))
    long, late = sim.run(trace).records
    assert long.ttft is not None and late.ttft is None and late.rejected
    assert late.reason.startswith("rejected: waited 0.5 s for a worker to take it (prefill worker prefill-0 holds")


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 9000), st.integers(1, 30)), min_size=1, max_size=25),
       hb=st.sampled_from([0.0, 0.05, 0.2]), timeout=st.sampled_from([0.2, 1.0, 30.0]),
       kv=st.sampled_from([12_000, 10**6]), depth=st.sampled_from([0.5, 1.0, 2.0]),
       order=st.sampled_from(["slack", "fifo"]), defl=st.sampled_from([1, 4]))
def test_every_waiting_request_is_dispatched_or_rejected_with_a_reason(
        reqs: list[tuple[float, int, int]], hb: float, timeout: float, kv: int, depth: float, order: str,
        defl: int) -> None:
    prof = msgspec.structs.replace(PROF, kv_capacity_tokens=kv)
    trace = sorted((TraceRequest(t, p, o) for t, p, o in reqs), key=lambda r: r.t)
    kcfg = KairosConfig(late_binding=True, late_depth=depth, late_order=order, max_deflections=defl)  # type: ignore[arg-type]
    res = Simulation(prof, make_policy("kairos", kairos=kcfg, default_model=prof.model),
                     SimConfig(prefill=1, decode=1, heartbeat_interval=hb, kv_wait_timeout=timeout)).run(trace)
    for tr, r in zip(trace, res.records, strict=True):
        if r.rejected:
            assert r.ttft is None and r.reason.startswith("rejected: ") and r.reason != "rejected: "
            assert r.wait_s is None or r.wait_s <= timeout + 1e-9
        else:
            assert r.ttft is not None and r.output_tokens == tr.output_length  # dispatched, and completed
            assert r.wait_s is None or r.wait_s <= timeout + 1e-9
    assert res.stats["queues"]["router_kv_wait"]["mean"] >= 0


def test_the_switch_reaches_the_simulator_through_the_knobs() -> None:
    policy, _ = build("kairos", Setup(policy={"late_binding": True, "late_depth": 2.0, "late_order": "fifo"}), PROF)
    assert isinstance(policy, Kairos) and policy.cfg.late_binding and policy.cfg.late_depth == 2.0
    sim = Simulation(PROF, policy, SimConfig())
    core = sim.routers.replicas[0].core  # the live router's core, with this policy
    assert core.policy is policy and core.waiting.policy.orders_waiting()
    off, _ = build("kairos", Setup(), PROF)
    assert isinstance(off, Kairos) and not off.cfg.late_binding and not off.orders_waiting()


def test_the_switch_reaches_kairos_up_and_the_router_config() -> None:
    from common.config import RouterConfig
    from kairos.up import knob_env, parser

    router_env, _ = knob_env(parser().parse_args(["--late-binding", "on", "--late-depth", "2", "--late-order",
                                                  "fifo"]))
    shipped = {"KAIROS_ALPHA": "1.6", "KAIROS_DECODE_ROOM": "true", "KAIROS_DECODE_BETA": "0.95",  # SHIPPED
               "KAIROS_RETAIN": "true", "KAIROS_RETAIN_CHUNK": "64"}
    assert router_env == {"KAIROS_LATE_BINDING": "true", "KAIROS_LATE_DEPTH": "2.0", "KAIROS_LATE_ORDER": "fifo",
                          **shipped}
    assert knob_env(parser().parse_args(["--late-binding", "off"]))[0] == {"KAIROS_LATE_BINDING": "false", **shipped}
    assert RouterConfig().late_binding is True  # on as shipped (compose, Kubernetes)
