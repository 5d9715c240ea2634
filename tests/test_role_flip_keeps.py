"""A role flip that keeps the worker's running decodes (issue 44 item 3): they go on streaming
from the same engine under the new role, the drain waits only for what the new role cannot do,
and the router moves its records to the worker's new entry: none lost, none run twice."""

from __future__ import annotations

import msgspec

from common import messages as m
from common.engines.base import EngineLoad
from common.engines.batcher import Batcher, Seq
from common.perf_model import load_profile
from common.router_core.planner import Flip, Load, PlannerConfig, RolePlanner
from common.router_core.ports import NULL_LOG
from common.worker_core import DecodeCore, EngineInfo, PrefillCore
from sim.core import SimConfig, Simulation
from sim.knobs import Setup, build, shipped
from sim.workloads import shifting
from tests.router_fakes import hello, make_core
from tests.test_worker_core import MODEL, Ports, deflection, handoff, idle, pwork

INFO = EngineInfo(engine="fake", token_budget=2048, kv_capacity_tokens=10_000, max_batch=64, max_model_len=16384)


def retained(rid: str) -> m.PrefillWork:
    return msgspec.structs.replace(pwork(rid), retain=True, decode_worker="prefill-0")


# ------------------------------------------------------------------ the worker cores


def test_prefill_to_decode_keeps_its_streaming_decodes_and_waits_only_for_its_prefills() -> None:
    ports = Ports()
    core = PrefillCore("prefill-0", "inc", INFO, ports, model="m")
    load = EngineLoad(kv_free_tokens=10_000, kv_capacity_tokens=10_000)
    assert core.on_work(retained("streams"), load) and core.on_work(retained("prefilling"), load)
    assert core.on_work(pwork("handoff"), load)
    core.on_tokens([m.TokenItem("streams", 0, [7])], 0.02)  # past its first token
    bye = core.set_role(m.SetRole(role="decode", reason="decode_short"), keep=True)
    assert bye is not None and bye.reason == "role_change"
    assert core.kept() == [("streams", 0)]
    assert not core.drained(0.0)  # a retained request still prefilling and a hand-off: the new role can't
    core.on_tokens([m.TokenItem("prefilling", 0, [8])], 0.02)
    core.forget("handoff")  # (its KV handed off)
    assert core.drained(0.0)  # what streams does not hold the drain
    assert sorted(core.kept()) == [("prefilling", 0), ("streams", 0)]
    bye = core.hand_back()
    assert bye.reason == "role_switch" and ports.aborted == [] and ports.failed() == []
    new = DecodeCore("prefill-0", "inc", INFO, ports, model="m")
    assert sorted(new.adopt(core)) == ["prefilling", "streams"]
    assert sorted(new.hello().held) == ["prefilling", "streams"] and new.hello().role == "decode"
    assert sorted(new.running_decodes()) == [("prefilling", 0), ("streams", 0)]
    new.on_tokens([m.TokenItem("streams", 0, [9], "length")], 0.02)  # it goes on streaming, and ends here
    assert [b.items[0].request_id for b in ports.sent if isinstance(b, m.TokenBatch)][-1] == "streams"
    assert list(new.active) == ["prefilling"]
    assert not ports.started[3:]  # nothing started again: the engine kept them


def test_decode_to_prefill_keeps_what_streams_as_its_own_decodes() -> None:
    ports = Ports()
    core = DecodeCore("decode-0", "inc", INFO, ports, model="m")
    assert core.on_work(handoff("h", 100), 0.0, idle(), MODEL) == "pending"
    assert core.kv_arrived("h", 0) is not None
    core.admit(handoff("h", 100), "handoff", (), MODEL)
    assert core.on_work(deflection("d", (100,), 0.0), 0.0, idle(), MODEL) == "started"
    core.set_role(m.SetRole(role="prefill", reason="prefill_short"), keep=True)
    assert core.kept() == [("h", 0)] and not core.drained(0.0)  # the deflection still prefills
    core.prefilled("d")  # its first token
    assert core.drained(0.0) and sorted(core.kept()) == [("d", 0), ("h", 0)]
    assert core.hand_back().reason == "role_switch" and ports.aborted == []
    new = PrefillCore("decode-0", "inc", INFO, ports, model="m")
    assert sorted(new.adopt(core)) == ["d", "h"]
    assert new.decoding == {"d", "h"} and all(new.work[r].retain for r in ("d", "h"))
    new.on_tokens([m.TokenItem("h", 0, [1], "length")], 0.02)
    assert set(new.work) == {"d"}


def test_a_resumed_request_stays_a_resumed_request_across_flips_both_ways() -> None:
    """A migrated request (its prompt ends with output already streamed, `resume_tokens`) kept by
    a flip keeps saying so in the new role's books, and back: the next core never takes its
    prompt's tail for its own output (text deltas, a re-dispatch in place)."""
    ports = Ports()
    core = DecodeCore("w", "inc", INFO, ports, model="m")
    dw = msgspec.structs.replace(deflection("r", (100,), 0.0), resume_tokens=7)
    assert core.on_work(dw, 0.0, idle(), MODEL) == "started"
    assert ports.started[-1].resume_tokens == 7
    core.prefilled("r")
    core.set_role(m.SetRole(role="prefill", reason="prefill_short"), keep=True)
    assert core.drained(0.0) and core.hand_back().reason == "role_switch"
    pre = PrefillCore("w", "inc", INFO, ports, model="m")
    assert pre.adopt(core) == ["r"] and pre.work["r"].resume_tokens == 7
    pre.set_role(m.SetRole(role="decode", reason="decode_short"), keep=True)
    assert pre.drained(0.0) and pre.hand_back().reason == "role_switch"
    back = DecodeCore("w", "inc", INFO, ports, model="m")
    assert back.adopt(pre) == ["r"] and back.active["r"].resume_tokens == 7


def test_without_keep_a_flip_still_drains_what_runs() -> None:
    ports = Ports()
    core = PrefillCore("prefill-0", "inc", INFO, ports, model="m")
    assert core.on_work(retained("streams"), EngineLoad(kv_free_tokens=10_000, kv_capacity_tokens=10_000))
    core.on_tokens([m.TokenItem("streams", 0, [7])], 0.02)
    core.set_role(m.SetRole(role="decode"))
    assert core.kept() == [] and not core.drained(0.0)
    assert core.hand_back().reason == "drained" and ports.aborted == ["streams"]


def test_the_batcher_of_the_new_role_takes_over_a_running_decode() -> None:
    seq = Seq(request_id="r", attempt=0, prompt_len=100, max_tokens=10, computed=100, generated=3, retain=True)
    new = Batcher(role="decode", token_budget=2048, max_batch=8, kv_capacity_tokens=10_000, default_chunk=512)
    new.adopt(seq)
    assert new.kv_free() == 10_000 - 110
    plan = new.plan()
    assert plan is not None and plan.decodes == [seq] and not plan.chunks
    assert new.commit(plan).tokens == [seq] and seq.generated == 4
    back = Batcher(role="prefill", token_budget=2048, max_batch=8, kv_capacity_tokens=10_000, default_chunk=512)
    new.remove("r")
    back.adopt(seq)
    plan = back.plan()
    assert plan is not None and plan.decodes == [seq] and seq.retain


# ------------------------------------------------------------------ the router core


def test_the_router_moves_the_kept_requests_to_the_new_role_and_redispatches_only_the_rest() -> None:
    core, box = make_core("deflect-all")
    for wid, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        core.on_message(wid.encode(), hello(wid, role), 0.0)
    reqs = [core.submit([1] * 50, m.Sampling(max_tokens=20), 0.1 + i * 0.01) for i in range(4)]
    on_d0 = [r for r in reqs if r.decode_worker == "d0"]
    assert len(on_d0) >= 2
    kept, lost = on_d0[0], on_d0[1]
    for r in on_d0:
        core.on_message(b"d0", m.TokenBatch(worker_id="d0", items=[m.TokenItem(r.request_id, r.attempt, [5])]), 0.2)
    box.take()
    core.on_message(b"d0", m.Goodbye(worker_id="d0", incarnation="inc-d0", reason="role_change"), 1.0)
    core.on_message(b"d0", m.Goodbye(worker_id="d0", incarnation="inc-d0", reason="role_switch"), 2.0)
    assert "d0" in core.table.workers and core.table.workers["d0"].draining  # still there, its decodes on
    core.on_message(b"d0", hello("d0", "prefill", held=[kept.request_id]), 4.0)
    e = core.table.workers["d0"]
    assert e.role == "prefill" and e.holding == {kept.request_id}
    work = [(peer, msg) for peer, msg in box.take() if isinstance(msg, (m.DecodeWork, m.PrefillWork))]
    assert [msg.request_id for _, msg in work] == [lost.request_id]  # only the one it no longer holds
    assert kept.decode_worker == "d0" and not kept.done
    core.on_message(b"d0", m.TokenBatch(worker_id="d0", items=[m.TokenItem(kept.request_id, kept.attempt, [6],
                                                                           "length")]), 5.0)
    assert kept.done and kept.request_id not in core.requests and core.counts["completed"] == 1


def test_a_keeping_flip_that_outlasts_the_liveness_window_leaves_one_source_of_tokens() -> None:
    """keep44's open question: the worker's switch stalls past the liveness window, so the router
    declares the old entry lost and resumes the kept request elsewhere (next attempt) while the
    worker goes on decoding it and says Hello naming it. The client must still get one stream:
    the old attempt's tokens are dropped, the Welcome tells the worker to drop it."""
    core, box = make_core("deflect-all")
    for wid, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        core.on_message(wid.encode(), hello(wid, role), 0.0)
    reqs = [core.submit([1] * 50, m.Sampling(max_tokens=6), 0.1 + i * 0.01) for i in range(2)]
    kept = next(r for r in reqs if r.decode_worker == "d0")
    rid = kept.request_id
    core.on_message(b"d0", m.TokenBatch(worker_id="d0", items=[m.TokenItem(rid, 0, [1, 2])]), 0.2)
    core.on_message(b"d0", m.Goodbye(worker_id="d0", incarnation="inc-d0", reason="role_change"), 0.3)
    core.on_message(b"d0", m.Goodbye(worker_id="d0", incarnation="inc-d0", reason="role_switch"), 0.4)
    for w in ("d1", "p0"):  # (they stay alive)
        core.table.workers[w].last_seen = 5.0
    box.take()
    core.tick(5.0)  # d0 silent past the liveness window: lost, its kept request resumed on d1
    assert "d0" not in core.table.workers and kept.attempt == 1 and kept.decode_worker == "d1"
    resumed = [msg for peer, msg in box.take() if isinstance(msg, m.DecodeWork) and peer == "d1"]
    assert [(w.request_id, w.resume_tokens) for w in resumed] == [(rid, 2)]
    # the worker, switched, says Hello still naming it: told to drop it
    core.on_message(b"d0", hello("d0", "prefill", held=[rid]), 5.1)
    welcome = [msg for peer, msg in box.take() if peer == "d0" and isinstance(msg, m.Welcome)]
    assert welcome and welcome[-1].drop == [rid]
    # its tokens (old attempt) before it dropped it never reach the client; d1's do
    core.on_message(b"d0", m.TokenBatch(worker_id="d0", items=[m.TokenItem(rid, 0, [3])]), 5.2)
    core.on_message(b"d1", m.TokenBatch(worker_id="d1", items=[m.TokenItem(rid, 1, [3, 4, 5, 6], "length")]), 5.3)
    got = [t for ev in kept.events._items for t in (ev.token_ids or [])]
    assert got == [1, 2, 3, 4, 5, 6] and kept.done and kept.outcome == "ok"


# ------------------------------------------------------------------ the simulator


class FlipAt(RolePlanner):
    """Flips the prefill worker that decodes the most of its own requests to decode at `at`."""

    def __init__(self, at: float) -> None:
        super().__init__(PlannerConfig(enabled=True), log=NULL_LOG)
        self.at = at
        self.fired = False

    def observe(self, load: Load, now: float) -> Flip | None:
        if self.fired or now < self.at:
            return None
        pick = max((w for w in load.workers if w.role == "prefill"), key=lambda w: w.decodes)
        self.fired = True
        self.pending = Flip(worker_id=pick.worker_id, to="decode", reason="decode_short", evidence={})
        self.last_flip_at = now
        return self.pending


def _flip_run(keep: bool) -> tuple[Simulation, object]:
    prof_ = load_profile("h100-llama2-70b-tp4")
    policy, prof = build("kairos", shipped("kairos", Setup(), None), prof_)
    sim = Simulation(prof, policy, SimConfig(prefill=2, decode=1, planner=True, planner_keep=keep))
    sim.planner = FlipAt(6.0)
    trace = [msgspec.structs.replace(r, t=r.t / 2.0) for r in shifting(("output",), 3, duration=24.0, phase_s=24.0)]
    return sim, sim.run(trace)


def test_in_the_simulator_a_flip_keeps_the_decodes_streaming_with_no_gap_over_the_slo() -> None:
    sim, res = _flip_run(keep=True)
    flips = res.stats["role_flips"]  # type: ignore[attr-defined]
    assert len(flips) == 1 and flips[0]["kept"] > 0 and flips[0]["drain_s"] < 1.0
    records = res.records  # type: ignore[attr-defined]
    assert all(not r.rejected and r.output_tokens for r in records)  # none lost
    slo = SimConfig().tbt_slo
    assert max(max(r.tbt_gaps) for r in records if r.tbt_gaps) <= slo  # exact model: the guard's plan holds
    assert res.stats["final_split"] == "1P2D"  # type: ignore[attr-defined]
    assert any(w.wid == flips[0]["worker"] for w in sim.decode)
    core = sim.routers.replicas[0].core  # nothing re-dispatched behind the flip: no second attempt, none left
    assert not core.requests and not core.kv_waiting
    assert core.counts["redispatched"] == 0 and core.counts["migrated"] == 0
    # the same flip finishing those decodes first (SimConfig.planner_keep off): the drain they cost
    _, drained = _flip_run(keep=False)
    flip = drained.stats["role_flips"][0]  # type: ignore[attr-defined]
    assert flip["kept"] == 0 and flip["drain_s"] > 10.0


def test_a_worker_stopped_during_a_keeping_flip_keeps_nothing_and_drains_or_hands_back_all() -> None:
    ports = Ports()
    core = DecodeCore("decode-0", "inc", INFO, ports, model="m")
    assert core.on_work(handoff("h", 100), 0.0, idle(), MODEL) == "pending"
    assert core.kv_arrived("h", 0) is not None
    core.admit(handoff("h", 100), "handoff", (), MODEL)
    core.set_role(m.SetRole(role="prefill", reason="prefill_short"), keep=True)
    assert core.kept() == [("h", 0)] and core.drained(0.0)
    core.leave_instead()  # SIGTERM: the worker leaves instead of changing role
    assert core.kept() == [] and not core.drained(0.0)  # the drain waits for the running decode again
    bye = core.hand_back()  # ... until drain_timeout: then it goes back to its router, retryable
    assert bye.reason == "drained" and ports.aborted == ["h"] and [f.request_id for f in ports.failed()] == ["h"]


def test_a_handoff_whose_kv_is_still_verified_is_not_kept_the_drain_waits_for_it() -> None:
    ports = Ports()
    core = DecodeCore("decode-0", "inc", INFO, ports, model="m")
    core.active["v"] = handoff("v", 100)  # the NIXL shell verifies its KV: held, not in the engine yet
    core.landing.add("v")
    core.set_role(m.SetRole(role="prefill", reason="prefill_short"), keep=True)
    assert core.kept() == [] and not core.drained(0.0)
    core.landing.discard("v")  # verified: the shell admits it to the engine; now it decodes
    assert core.kept() == [("v", 0)] and core.drained(0.0)
