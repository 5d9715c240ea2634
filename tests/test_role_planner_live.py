"""The role planner in the live router and workers (issue 44 item 3): the router core ticks it on
its own (`RouterCore.tick`, on the router that leads), sends SetRole, reports each flip (log,
metrics, telemetry) and abandons one whose worker never comes back; a worker follows SetRole:
it drains (what runs finishes here, new work of the old role is refused), its engine takes the
new role in place, and it says Hello under the new role on the same connection.

Router side: the core alone, a fake clock, fake outbox and metrics. Worker side: a real worker
(simulated engine, in this process) against a fake router socket, synchronised on messages.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio

from common import config
from common import messages as m
from common import worker as worker_mod
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from common.router_core.core import RouterCore
from common.router_core.planner import RolePlanner, planner_config
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker
from services.roles import RoleSwitching
from tests.router_fakes import FakeOutbox, hello
from tests.test_replica_links import Fake

WORKERS = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))


class Recorded:
    """The router's metrics calls (the Metrics port), by name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith(("observe_", "set_")):
            raise AttributeError(name)
        return lambda *args, **kw: self.calls.append((name, args))

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [a for n, a in self.calls if n == name]


def planned_core(**overrides: Any) -> tuple[RouterCore, FakeOutbox, Recorded]:
    cfg = config.load(config.RouterConfig, env={}, overrides={
        "policy": "kairos", "profile": "fast", "planner": True, "planner_interval_s": 1.0, "planner_window_s": 4.0,
        "planner_min_dwell_s": 0.0, "planner_min_gap_s": 0.0, "liveness": 1000, **overrides})
    metrics = Recorded()
    box = FakeOutbox()
    core = RouterCore(cfg, box, metrics=metrics, opened_at=0.0)  # type: ignore[arg-type]
    core.planner = RolePlanner(planner_config(cfg))
    for wid, role in WORKERS:
        core.on_message(wid.encode(), hello(wid, role), 0.0)  # type: ignore[arg-type]
    box.take()
    return core, box, metrics


def beat(core: RouterCore, now: float, routers: tuple[str, ...] = ()) -> None:
    """Every worker's heartbeat: the decode workers step at the TBT SLO (the decode pool is short)."""
    for wid, _role in WORKERS:
        w = core.table.workers.get(wid)
        if w is None:
            continue
        if w.role == "decode":
            hb: m.Msg = m.DecodeHeartbeat(
                worker_id=wid, incarnation=w.incarnation, seq=int(now * 10) + 1, batch=150, kv_tokens=1000,
                kv_free_tokens=90_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0, deflections=0,
                strictest_tbt_slo=0.1, token_budget=2048, step_ms_p50=core.cfg.tbt_slo * 1000.0,
                routers=list(routers))
        else:
            hb = m.PrefillHeartbeat(worker_id=wid, incarnation=w.incarnation, seq=int(now * 10) + 1, queued_tokens=0,
                                    queued_requests=0, token_budget=2048, routers=list(routers))
        core.on_message(wid.encode(), hb, now)  # type: ignore[arg-type]


def run_until_set_role(core: RouterCore, box: FakeOutbox, until: float, routers: tuple[str, ...] = (),
                       start: float = 0.0) -> tuple[float, list[tuple[str, m.SetRole]]]:
    t = start
    while t < until:
        beat(core, t, routers)
        core.tick(t)
        sent = [(peer, msg) for peer, msg in box.take() if isinstance(msg, m.SetRole)]
        if sent:
            return t, sent
        t += 0.5
    return t, []


def test_the_router_core_ticks_the_planner_itself_and_reports_each_flip() -> None:
    core, box, metrics = planned_core()
    t, sent = run_until_set_role(core, box, 30.0)
    assert len(sent) == 1, "the core's own tick never sent a SetRole"
    wid, msg = sent[0]
    assert wid in ("p0", "p1") and msg.role == "decode" and msg.reason == "decode_short"
    assert metrics.named("observe_role_flip") == [("prefill", "decode", "decode_short")]
    started = [x for x in box.published if isinstance(x, m.RoleFlip)]
    assert [(f.worker_id, f.frm, f.to, f.phase) for f in started] == [(wid, "prefill", "decode", "started")]
    assert started[0].evidence["decode_step_of_slo"] >= 0.9  # the measured load that decided it
    assert core.stats()["planner"]["pending"] == {"worker": wid, "to": "decode", "reason": "decode_short"}
    # one flip at a time: nothing more while it is under way
    for dt in (1.0, 2.0, 3.0):
        beat(core, t + dt)
        core.tick(t + dt)
    assert not [x for _, x in box.take() if isinstance(x, m.SetRole)]
    # the worker drains, leaves its role and says Hello under the new one: the flip is over
    inc = core.table.workers[wid].incarnation
    core.on_message(wid.encode(), m.Goodbye(worker_id=wid, incarnation=inc, reason="role_change"), t + 3.5)
    core.on_message(wid.encode(), m.Goodbye(worker_id=wid, incarnation=inc, reason="drained"), t + 4.0)
    core.on_message(wid.encode(), hello(wid, "decode", incarnation="new"), t + 4.5)
    assert core.planner is not None and core.planner.pending is None
    done = [x for x in box.published if isinstance(x, m.RoleFlip) and x.phase == "done"]
    assert len(done) == 1 and done[0].worker_id == wid and done[0].took_s == pytest.approx(4.5)
    assert metrics.named("observe_role_flip_done") == [("decode", pytest.approx(4.5))]
    assert core.table.count("decode") == 3 and core.table.count("prefill") == 1
    core.telemetry(t + 5.0)
    roles = metrics.named("set_worker_roles")[-1][0]
    assert roles == {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"} | {wid: "decode"}


def test_planner_off_or_pinned_moves_nothing() -> None:
    core, box, _ = planned_core(planner=False)
    core.planner = RolePlanner(planner_config(core.cfg))  # a planner whose settings say off
    assert run_until_set_role(core, box, 20.0)[1] == []
    core, box, _ = planned_core(planner_pin="p0,p1")
    assert run_until_set_role(core, box, 20.0)[1] == []


def test_with_several_routers_only_the_first_by_name_decides() -> None:
    core, box, _ = planned_core()
    other = "!" + core.incarnation  # sorts first: that router leads
    assert run_until_set_role(core, box, 20.0, routers=(other, core.incarnation))[1] == []
    assert core.stats()["planner"]["leads"] is False
    # the workers stop naming it (it died): this router leads now
    assert len(run_until_set_role(core, box, 40.0, routers=(core.incarnation,), start=20.0)[1]) == 1


def test_a_flip_whose_worker_never_comes_back_is_abandoned_and_the_planner_goes_on() -> None:
    core, box, metrics = planned_core(planner_flip_timeout_s=10.0)
    t, sent = run_until_set_role(core, box, 30.0)
    assert sent
    wid = sent[0][0]
    for dt in range(1, 13):  # the worker ignores the SetRole (its engine cannot change role)
        beat(core, t + dt)
        core.tick(t + dt)
    assert core.planner is not None and core.planner.pending is None
    gone = [x for x in box.published if isinstance(x, m.RoleFlip) and x.phase == "abandoned"]
    assert len(gone) == 1 and gone[0].worker_id == wid and core.table.workers[wid].role == "prefill"
    assert metrics.named("observe_role_flip_done")[0][0] == "abandoned"


# ------------------------------------------------------------------ the worker


class DrainingEngine(SimEngine):
    # an engine that switches in place only holding nothing (keeps_decodes off): the worker drains its
    # decodes first; the simulated engine and vLLM in kv_both keep them (tests/test_role_flip_keeps_live.py)
    keeps_decodes = False


class NoSwitchEngine(SimEngine):
    # as a vLLM engine started with --no-vllm-kv-both (switch_role would switch: the shell must not call it)
    can_switch_role = False


async def _worker(engine: SimEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[RoleSwitching, Fake, Any, Any]:
    """A worker process (its role the engine's) against a fake router, registered and welcomed."""
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    ctx = zmq.asyncio.Context()
    fake = Fake(ctx, "A")
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "router_host": "127.0.0.1", "work_port": fake.work_port, "heartbeat_port": fake.hb_port,
        "kv_transport": "modeled", "worker_id": "decode-r", "refit_interval": 0, "drain_timeout": 30.0})
    service = DecodeWorker(cfg, engine) if engine.role == "decode" else PrefillWorker(cfg, engine)
    proc = RoleSwitching(cfg, engine.role, service)
    task = asyncio.create_task(proc.run())
    hi = await fake.until(lambda x: isinstance(x, m.Hello))
    assert isinstance(hi, m.Hello) and hi.role == engine.role
    await fake.send(m.Welcome(router_incarnation="A", heartbeat_interval_s=0.05))
    return proc, fake, task, ctx


async def _stop(proc: RoleSwitching, fake: Fake, task: Any, ctx: Any) -> None:
    """Stop the worker process `_worker` started (it exits 0) and its fake router."""
    proc.worker.stop.set()
    assert await asyncio.wait_for(task, 10) == 0
    fake.close()
    ctx.term()


def decode_work(rid: str, dispatch: int, max_tokens: int) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect", prompt_token_ids=[1, 2, 3],
                        sampling=m.Sampling(max_tokens=max_tokens, ignore_eos=True), tbt_slo=0.1, deadline_s=30.0)


def finished(rid: str) -> Any:
    return lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == rid and i.finish_reason for i in x.items)


async def test_a_worker_drains_switches_its_engine_in_place_and_rejoins_under_its_new_role(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = DrainingEngine("decode", load_profile("fast"))
    proc, fake, task, ctx = await _worker(engine, monkeypatch)
    first = proc.worker
    try:
        hb = await fake.beat_until(lambda x: isinstance(x, m.DecodeHeartbeat) and x.routers == ["A"])
        assert isinstance(hb, m.DecodeHeartbeat)  # its heartbeats name the routers it is registered with
        await fake.send(decode_work("running", 1, max_tokens=400))  # still decoding when the SetRole comes
        await fake.until(lambda x: isinstance(x, m.TokenBatch))
        await fake.send(m.SetRole(role="prefill", reason="prefill_short", router_incarnation="A"))
        bye = await fake.until(lambda x: isinstance(x, m.Goodbye))
        assert isinstance(bye, m.Goodbye) and bye.reason == "role_change"
        await fake.send(decode_work("late", 2, max_tokens=3))  # new work of the old role: refused, retryable
        refused = await fake.until(lambda x: isinstance(x, m.RequestFailed) and x.request_id == "late")
        assert isinstance(refused, m.RequestFailed) and refused.retryable
        await fake.until(finished("running"))  # what ran finished here, none of it handed back
        left = await fake.until(lambda x: isinstance(x, m.Goodbye))
        assert isinstance(left, m.Goodbye) and left.reason == "drained"
        assert not [x for x in fake.got if isinstance(x, m.RequestFailed) and x.request_id == "running"]
        again = await fake.until(lambda x: isinstance(x, m.Hello))
        assert isinstance(again, m.Hello)
        assert (again.role, again.worker_id, again.engine) == ("prefill", "decode-r", "sim")
        assert again.incarnation != bye.incarnation and again.token_budget == load_profile("fast").prefill_token_budget
        # the same engine, not restarted, now prefills
        assert proc.worker is not first and proc.worker.engine is engine and engine.role == "prefill"
        await fake.send(m.Welcome(router_incarnation="A", heartbeat_interval_s=0.05))
        await fake.send(m.PrefillWork(request_id="p", attempt=0, dispatch=1, prompt_token_ids=[1] * 64,
                                      sampling=m.Sampling(max_tokens=4), decode_worker="decode-x", deadline_s=30.0))
        done = await fake.until(lambda x: isinstance(x, m.PrefillDone | m.RequestFailed) and x.request_id == "p")
        assert isinstance(done, m.PrefillDone) and done.worker_id == "decode-r"
        hb2 = await fake.beat_until(lambda x: isinstance(x, m.PrefillHeartbeat))
        assert isinstance(hb2, m.PrefillHeartbeat) and hb2.routers == ["A"] and hb2.incarnation == again.incarnation
    finally:
        await _stop(proc, fake, task, ctx)


async def test_an_engine_that_cannot_change_role_refuses_set_role_and_keeps_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proc, fake, task, ctx = await _worker(NoSwitchEngine("decode", load_profile("fast")), monkeypatch)
    first = proc.worker
    try:
        await fake.send(m.SetRole(role="prefill", reason="prefill_short", router_incarnation="A"))
        await fake.send(decode_work("after", 1, max_tokens=3))
        await fake.until(finished("after"))
        assert not [x for x in fake.got if isinstance(x, m.Goodbye)] and proc.worker is first
        assert not first.draining and first.next_role is None and first.engine.role == "decode"
        # its Hello says so, and the router's planner leaves it alone (test_role_planner)
        assert [x.fixed_role for x in fake.got if isinstance(x, m.Hello)][:1] == [True]
    finally:
        await _stop(proc, fake, task, ctx)


async def test_a_worker_told_to_stop_while_it_changes_role_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = DrainingEngine("decode", load_profile("fast"))
    proc, fake, task, ctx = await _worker(engine, monkeypatch)
    first = proc.worker
    try:
        await fake.send(decode_work("running", 1, max_tokens=400))
        await fake.until(lambda x: isinstance(x, m.TokenBatch))
        await fake.send(m.SetRole(role="prefill", reason="prefill_short", router_incarnation="A"))
        await fake.until(lambda x: isinstance(x, m.Goodbye))
        first.signalled.set()  # SIGTERM (kairos up stopping) during the drain
        await fake.until(finished("running"))
        left = await fake.until(lambda x: isinstance(x, m.Goodbye))
        assert isinstance(left, m.Goodbye) and left.reason == "drained"
        assert await asyncio.wait_for(task, 10) == 0  # it left: no service of the new role
        assert proc.worker is first and first.next_role is None and engine.role == "decode"
    finally:
        if not task.done():
            proc.worker.stop.set()
            await asyncio.wait_for(task, 10)
        fake.close()
        ctx.term()
