"""The workers' rules, on the cores alone (common/worker_core/): no socket, no engine, a fake
clock. The live services and the simulator run these same cores."""

from __future__ import annotations

import msgspec
import pytest

from common import messages as m
from common.engines.base import EngineLoad, EngineRequest, Prefilled
from common.perf_model import load_profile
from common.policy.admission import REJECTED_REASON
from common.tokenizer import SimpleTokenizer
from common.worker_core import DecodeCore, EngineInfo, PrefillCore

MODEL = load_profile("a100-dsv2-lite").model
FAST = load_profile("fast").model  # step = 0.5 ms + 0.2 us per token of the step
SAMPLING = m.Sampling(max_tokens=100)
INFO = EngineInfo(engine="fake", token_budget=2048, kv_capacity_tokens=10_000, max_batch=64, max_model_len=16384)


class Ports:
    """What a core did: messages sent, requests started and aborted, heartbeats asked for."""

    def __init__(self) -> None:
        self.sent: list[m.Msg] = []
        self.started: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.beats = 0
        self.at_once = 0  # of which, asked for without the coalescing delay
        self.take = True  # whether the engine takes what it is given
        self.budgets: dict[str, float] = {}  # request -> the TBT budget lower_tbt_slo gave it
        self.routers: dict[str, str] = {}  # request -> its router, where not "router-a"

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)

    def start(self, req: EngineRequest) -> bool:
        if self.take:
            self.started.append(req)
        return self.take

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def beat_now(self, at_once: bool = False) -> None:
        self.beats += 1
        self.at_once += at_once

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        req = next((r for r in reversed(self.started) if r.request_id == request_id), None)
        if req is None or request_id in self.aborted or self.budgets.get(request_id, req.tbt_slo) <= tbt_slo:
            return False
        self.budgets[request_id] = tbt_slo
        return True

    def router_of(self, request_id: str) -> str:
        return self.routers.get(request_id, "router-a")

    def release_kv(self, key: str) -> None:
        self.released.append(key)

    def failed(self) -> list[m.RequestFailed]:
        return [x for x in self.sent if isinstance(x, m.RequestFailed)]


def idle(free: int = 10_000, **kw: object) -> EngineLoad:
    return EngineLoad(kv_free_tokens=free, kv_capacity_tokens=10_000, **kw)  # type: ignore[arg-type]


def decode_core(**kw: object) -> tuple[DecodeCore, Ports]:
    ports = Ports()
    return DecodeCore("decode-0", "inc", INFO, ports, model="m", kv_handoff_timeout=5.0, **kw), ports  # type: ignore[arg-type]


def handoff(rid: str, prompt: int, max_tokens: int = 100, attempt: int = 0, deadline: float = 30.0) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=attempt, dispatch=1, mode="handoff", prompt_token_ids=[1] * prompt,
                        sampling=m.Sampling(max_tokens=max_tokens), tbt_slo=0.1, deadline_s=deadline,
                        prefill_worker="prefill-0")


def deflection(rid: str, schedule: tuple[int, ...], budget: float, tbt_slo: float = 0.1,
               dispatch: int = 1) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect",
                        prompt_token_ids=[1] * sum(schedule), sampling=SAMPLING, tbt_slo=tbt_slo, deadline_s=30.0,
                        chunk_schedule=schedule, step_budget_s=budget)


# ------------------------------------------------------------------ free KV and a full worker


def test_free_kv_is_the_engines_less_prompt_plus_max_tokens_of_every_pending_handoff() -> None:
    core, _ = decode_core()
    assert core.on_work(handoff("a", 1000, 500), 0.0, idle(), MODEL) == "pending"
    assert core.on_work(handoff("b", 2000, 100), 0.0, idle(), MODEL) == "pending"
    hb = core.heartbeat(idle(free=9_000))
    assert hb.kv_free_tokens == 9_000 - 1500 - 2100
    assert hb.waiting_kv == 2 and hb.seq == 1 and hb.held == []
    core.on_cancel(m.Cancel(request_id="a", attempt=0))
    assert core.heartbeat(idle(free=9_000)).kv_free_tokens == 9_000 - 2100


def test_a_full_worker_refuses_kv_full_and_keeps_nothing() -> None:
    """Work that does not fit the free KV (less what pending handoffs keep) is turned away at once,
    retryable, never queued on the worker."""
    core, ports = decode_core()
    core.on_work(handoff("a", 6000, 1000), 0.0, idle(), MODEL)
    for w in (handoff("b", 2500, 600), deflection("c", (2000, 1000), 0.0)):
        assert core.on_work(w, 0.0, idle(), MODEL) == "refused"
        f = ports.failed()[-1]
        assert (f.request_id, f.retryable, f.code) == (w.request_id, True, "")
        assert f.reason.startswith("kv_full: ")
        assert w.request_id not in core.pending and w.request_id not in core.active
    assert core.on_work(handoff("d", 1900, 1000), 0.0, idle(), MODEL) == "pending"  # exactly what is left
    assert core.counters["refused"] == 2 and [r.request_id for r in ports.started] == []


# ------------------------------------------------------------------ deflection admission


def test_a_deflection_is_checked_against_its_own_tbt_slo() -> None:
    """A relaxed request (TBT SLO 0.2 s, budget 0.18 s) beside a resident with a 0.1 s SLO gets
    beta x 0.1 = 0.09 s, not the budget it carries nor one read off a global SLO."""
    core, ports = decode_core()
    chunk = max(c for c in range(64, 16384, 64) if MODEL.step_time(1, 500, [(c, 0)]) <= 0.17)
    assert MODEL.step_time(1, 500, [(chunk, 0)]) > 0.09
    load = idle(batch=1, kv_tokens=500, strictest_tbt_slo=0.1)
    assert core.on_work(deflection("relaxed", (chunk,), 0.18, tbt_slo=0.2), 0.0, load, MODEL) == "rejected"
    f = ports.failed()[-1]
    assert f.code == REJECTED_REASON and f.retryable and "90.0 ms budget" in f.reason
    # the same deflection on a worker with no stricter resident fits its own budget
    core2, _ = decode_core()
    assert core2.on_work(deflection("relaxed", (chunk,), 0.18, tbt_slo=0.2), 0.0,
                         idle(batch=1, kv_tokens=500, strictest_tbt_slo=0.2), MODEL) == "started"


def test_accepted_deflections_reserve_step_time_until_their_first_token() -> None:
    core, ports = decode_core()
    assert core.on_work(deflection("first", (1000, 1000), 0.00085), 0.0, idle(), FAST) == "started"
    assert core.on_work(deflection("second", (1000, 1000), 0.00085, dispatch=2), 0.0, idle(), FAST) == "rejected"
    hb = core.heartbeat(idle())
    assert [(h.router, h.largest_chunk) for h in hb.held] == [("router-a", 1000)] and hb.last_dispatch == 2
    core.on_tokens([m.TokenItem(request_id="first", attempt=0, token_ids=[5])], 0.01)  # its first token
    assert core.accepted == {} and core.heartbeat(idle()).held == []
    assert core.on_work(deflection("third", (1000, 1000), 0.00085, dispatch=3), 0.0, idle(), FAST) == "started"
    batches = [x for x in ports.sent if isinstance(x, m.TokenBatch)]
    assert [it.request_id for it in batches[0].items] == ["first"]


def test_admission_off_or_no_model_admits_unchecked() -> None:
    core, _ = decode_core(deflect_admission=False)
    for i in range(3):
        assert core.on_work(deflection(f"d{i}", (1000, 1000), 0.00085), 0.0, idle(), FAST) == "started"
    core2, _ = decode_core()
    for i in range(3):
        assert core2.on_work(deflection(f"d{i}", (1000, 1000), 0.00085), 0.0, idle(), None) == "started"


def test_a_redispatch_replaces_the_attempt_held_and_a_cancel_frees_its_reservation() -> None:
    core, ports = decode_core()
    assert core.on_work(deflection("r", (1000,) * 5, 0.00085), 0.0, idle(), FAST) == "started"
    core.on_work(m.DecodeWork(request_id="r", attempt=1, dispatch=2, mode="deflect", prompt_token_ids=[1] * 10,
                              sampling=SAMPLING, tbt_slo=0.1, deadline_s=30.0), 0.0, idle(), MODEL)
    assert ports.aborted == ["r"] and core.active["r"].attempt == 1 and "r" not in core.accepted
    assert not core.on_cancel(m.Cancel(request_id="r", attempt=0))  # a stale attempt's cancel: nothing
    assert core.on_cancel(m.Cancel(request_id="r", attempt=-1))
    assert core.held_requests() == [] and ports.aborted == ["r", "r"]


# ------------------------------------------------------------------ a handoff's KV


def test_a_handoff_whose_kv_never_comes_is_prefilled_in_place_at_its_deadline() -> None:
    core, ports = decode_core()
    core.on_work(handoff("late", 100, deadline=2.0), 10.0, idle(), MODEL)  # sooner than kv_handoff_timeout
    core.on_work(handoff("slow", 100), 10.0, idle(), MODEL)
    assert core.expired(11.9) == []
    late = core.expired(12.0)
    assert [p.work.request_id for p in late] == ["late"] and list(core.pending) == ["slow"]
    core.fall_back(late[0].work, "kv_timeout", MODEL)
    assert ports.started[-1].mode == "deflect" and ports.started[-1].chunk_schedule == ()
    core.on_tokens([], 0.01)
    batch = ports.sent[-1]
    assert isinstance(batch, m.TokenBatch) and batch.kv_fallback == ["late"]
    assert batch.kv_fallback_reasons == ["kv_timeout"] and core.counters["kv_fallbacks"] == 1
    assert core.kv_arrived("slow", 1) is None  # another attempt's KV: not this one's
    p = core.kv_arrived("slow", 0)
    assert p is not None and core.admit(p.work, "handoff", (), MODEL)
    assert core.reserved() == 0 and set(core.active) == {"late", "slow"}


# ------------------------------------------------------------------ hello, drain


def test_hello_names_what_it_holds_and_a_welcome_drops_what_the_router_forgot() -> None:
    core, _ = decode_core()
    core.on_work(handoff("kept", 100), 0.0, idle(), MODEL)
    core.on_work(handoff("forgotten", 100), 0.0, idle(), MODEL)
    h = core.hello()
    assert (h.role, h.worker_id, h.incarnation, h.engine, h.token_budget) == ("decode", "decode-0", "inc", "fake",
                                                                             2048)
    assert h.held == ["kept", "forgotten"] and h.max_model_len == 16384 and h.protocol == m.PROTOCOL_VERSION
    assert core.welcomed(["forgotten"]) == 1 and core.hello().held == ["kept"]
    assert core.welcomed(["forgotten"]) == 0  # a second Welcome naming it (a Hello sent twice): nothing more


def test_a_draining_worker_refuses_new_work_and_hands_back_what_is_left() -> None:
    core, ports = decode_core()
    core.on_work(deflection("running", (100,), 0.0), 0.0, idle(), MODEL)
    bye = core.start_drain()
    assert bye.reason == "shutdown" and core.heartbeat(idle()).draining
    assert core.on_work(handoff("new", 10), 0.0, idle(), MODEL) == "refused"
    assert ports.failed()[-1].reason == "worker_draining"
    assert not core.drained(0.0)
    assert core.hand_back().reason == "drained"
    f = ports.failed()[-1]
    assert (f.request_id, f.reason, f.retryable) == ("running", "worker_draining", True)
    assert ports.aborted == ["running"]


def test_a_role_change_drains_like_a_departure_but_keeps_what_runs_until_it_finishes() -> None:
    core, ports = decode_core()
    core.on_work(deflection("running", (100,), 0.0), 0.0, idle(), MODEL)
    assert core.set_role(m.SetRole(role="decode")) is None and not core.draining  # its role already
    bye = core.set_role(m.SetRole(role="prefill", reason="prefill_short"))
    assert bye is not None and bye.reason == "role_change" and core.new_role == "prefill"
    assert core.heartbeat(idle()).draining and ports.beats
    assert core.on_work(handoff("new", 10), 0.0, idle(), MODEL) == "refused"
    assert ports.failed()[-1].reason == "worker_draining"
    assert core.set_role(m.SetRole(role="prefill")) is None  # one change at a time
    assert not core.drained(0.0)  # what it runs finishes here: nothing handed back
    core.finished("running")
    assert core.drained(0.0)
    assert core.hand_back().reason == "drained" and ports.aborted == []


# ------------------------------------------------------------------ the prefill worker


def prefill_core() -> tuple[PrefillCore, Ports]:
    ports = Ports()
    return PrefillCore("prefill-0", "inc", INFO, ports, model="m"), ports


def pwork(rid: str, attempt: int = 0) -> m.PrefillWork:
    return m.PrefillWork(request_id=rid, attempt=attempt, dispatch=attempt + 1, prompt_token_ids=[1] * 100,
                         sampling=SAMPLING, decode_worker="decode-0", deadline_s=30.0)


def test_prefill_core_heartbeat_replays_its_queue_with_its_model() -> None:
    core, _ = prefill_core()
    load = EngineLoad(queued_tokens=3000, queued_requests=2, backlog=[(2000, 0), (1000, 0)], busy_s=0.01)
    hb = core.heartbeat(load, MODEL)
    assert hb.drain is not None and hb.drain.end_s > hb.drain.start_s >= 0.01 and hb.drain.used > 0
    assert (hb.queued_tokens, hb.queued_requests, hb.token_budget, hb.max_batch) == (3000, 2, 2048, 64)
    assert core.heartbeat(load, None).drain is None  # no model: no replay


def test_prefill_core_hand_off_and_the_pulled_kv_a_drain_waits_for() -> None:
    core, ports = prefill_core()
    assert core.on_work(pwork("r", 0))
    assert core.on_work(pwork("r", 1))  # a re-dispatch: the old attempt stops in the engine
    assert ports.aborted == ["r"] and core.work["r"].attempt == 1
    assert not core.on_target(m.KvTarget(request_id="r", attempt=0, decode_worker="decode-0"))
    assert core.on_target(m.KvTarget(request_id="r", attempt=1, decode_worker="decode-0"))
    p = Prefilled(request_id="r", attempt=1, queue_s=0.0, prefill_s=0.1, kv_params={"remote_block_ids": [1]})
    w = core.on_prefilled(p)
    assert w is not None and core.on_prefilled(Prefilled(request_id="r", attempt=0, queue_s=0, prefill_s=0)) is None
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=100, nbytes=0)
    assert core.handed_off(w, p, kv, "", now=100.0, kv_hold_s=5.0)
    assert not core.targets and core.held_requests() == [] and core.held_ids() == ["r"]
    done = ports.sent[-1]
    assert isinstance(done, m.PrefillDone) and done.attempt == 1 and done.kv_error == ""
    core.start_drain()
    assert core.drain_pending(104.9) and not core.drained(104.9)
    core.on_cancel(m.Cancel(request_id="r", attempt=-1, reason="kv_consumed"))
    assert not core.drain_pending(104.9) and core.drained(104.9)
    core.kv_out["unread"] = 200.0  # a pulled KV nobody reads: the drain waits for it until its time is up
    assert not core.drained(199.9) and core.drained(200.0) and not core.kv_out
    assert not core.on_work(pwork("s"))  # draining
    assert ports.failed()[-1].reason == "worker_draining"


# ------------------------------------------------------------------ the worker's own prefix cache


def test_a_plan_made_for_a_prefix_the_worker_does_not_hold_is_redone_with_full_size_chunks() -> None:
    """The router believed 9,216 of 9,822 prompt tokens cached here and planned 606; the worker's
    own cache holds 1,024: the plan is redone to cover the 8,798 tokens with the router's chunk size
    (never one token per step once a short plan runs out), and the admission check sees that plan."""
    core, ports = decode_core()
    w = m.DecodeWork(request_id="r", attempt=0, dispatch=1, mode="deflect", prompt_token_ids=[1] * 9822,
                     sampling=m.Sampling(max_tokens=10), tbt_slo=0.1, deadline_s=30.0,
                     chunk_schedule=(512, 94), step_budget_s=0.09)
    assert core.planned_cached(w) == 9216
    assert core.on_work(w, 0.0, idle(free=20_000), FAST, own_cached=1024) == "started"
    sched = ports.started[-1].chunk_schedule
    assert sum(sched) == 9822 - 1024 and sched[:2] == (512, 94) and set(sched[2:-1]) == {512}
    assert core.counters["replanned"] == 1
    assert core.accepted["r"].reserved_s > 0
    # the same plan with a step budget too small for a 512-token chunk after the worker's real prefix
    core2, _ = decode_core()
    tight = msgspec.structs.replace(w, step_budget_s=FAST.step_time(0, 0, [(512, 1024)]) * 0.99)
    assert core2.on_work(tight, 0.0, idle(free=20_000), FAST, own_cached=1024) == "rejected"
    # a worker that holds what the router thought: the plan stands
    core3, ports3 = decode_core()
    assert core3.on_work(w, 0.0, idle(free=20_000), FAST, own_cached=9216) == "started"
    assert ports3.started[-1].chunk_schedule == (512, 94) and core3.counters["replanned"] == 0


def test_a_plan_for_a_one_token_remainder_is_redone_with_chunks_that_fit_the_step_budget() -> None:
    """The router believed 5,999 of 6,000 prompt tokens cached here and planned one 1-token chunk; the
    worker holds 3,008. Continued with the router's chunk size that is 2,992 one-token steps (a client
    saw nothing for 60 s, wrong44's chaos run); the plan continues with chunks of CONTINUATION_CHUNK,
    or the largest whose step beside the running decodes fits the step budget if that is less."""
    from common.worker_core.decode import CONTINUATION_CHUNK

    core, ports = decode_core()
    load = idle(free=20_000)
    budget = FAST.step_time(0, 0, [(256, 6000)]) * 1.01
    w = m.DecodeWork(request_id="r", attempt=0, dispatch=1, mode="deflect", prompt_token_ids=[1] * 6000,
                     sampling=m.Sampling(max_tokens=10), tbt_slo=0.1, deadline_s=30.0,
                     chunk_schedule=(1,), step_budget_s=budget)
    assert core.on_work(w, 0.0, load, FAST, own_cached=3008) == "started"
    sched = ports.started[-1].chunk_schedule
    assert sum(sched) == 6000 - 3008 and sched[0] == 1 and set(sched[1:-1]) == {CONTINUATION_CHUNK}
    # a step budget that fits fewer tokens than that: the largest chunk that fits, never one token
    core2, ports2 = decode_core()
    small = FAST.step_time(0, 0, [(20, 6000)]) * 1.001
    assert core2.on_work(msgspec.structs.replace(w, step_budget_s=small), 0.0, load, FAST, own_cached=3008) \
        == "started"
    sched2 = ports2.started[-1].chunk_schedule
    assert sum(sched2) == 2992 and 1 < max(sched2[1:]) < CONTINUATION_CHUNK
    assert all(FAST.step_time(load.batch, load.kv_tokens, [(c, 6000)]) <= small for c in sched2)


def test_replan_cuts_or_continues_the_routers_chunks() -> None:
    from common.worker_core.decode import replan

    assert replan((512, 256, 100), 868) == (512, 256, 100)
    assert replan((512, 256, 100), 600) == (512, 88)            # the worker holds more than the router thought
    assert replan((512, 256, 100), 2000) == (512, 256, 100, 512, 512, 108)


async def test_the_live_decode_worker_replans_against_its_engines_own_cache() -> None:
    """The live shell asks its engine what its prefix cache holds (here: nothing) and the core
    plans the deflection again, so the engine runs chunks covering the whole prompt."""
    from common import config
    from common.engines.sim import SimEngine
    from services.decode_worker.service import DecodeWorker

    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_transport": "modeled"})
    engine = SimEngine("decode", load_profile("fast"), prefix_block_tokens=256)
    worker = DecodeWorker(cfg, engine)
    worker.send = lambda msg: None  # type: ignore[method-assign]
    assert engine.prefix_cached([1] * 3000) == 0
    worker.on_message(m.DecodeWork(request_id="r", attempt=0, dispatch=1, mode="deflect",
                                         prompt_token_ids=[1] * 3000, sampling=m.Sampling(max_tokens=4), tbt_slo=0.1,
                                         deadline_s=30.0, chunk_schedule=(512, 488)))  # planned after 2,000 cached
    seq = engine.batcher.get("r")
    assert seq is not None and seq.schedule is not None and sum(seq.schedule) == 3000 - seq.computed
    assert worker.core.counters["replanned"] == 1 and list(seq.schedule)[:2] == [512, 488]


def test_decode_heartbeats_echo_every_router_replicas_queue() -> None:
    """Router replicas take turns at a heartbeat's room by what their queues would decide first
    (common/router_core/waiting.py, `replica_turn`): each tells the decode workers (QueueHead), whose
    heartbeats echo every replica's, each change with the next prompt heartbeat."""
    core, ports = decode_core()
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=7.0, late=False, waiting=2))
    core.on_queue_head(m.QueueHead(router_incarnation="rb", oldest_at=9.0, late=True, waiting=1))
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=0.0, late=False, waiting=0))  # emptied
    assert ports.beats == 3
    assert core.heartbeat(idle()).queues == [m.RouterQueue("ra", 0.0, False, 0), m.RouterQueue("rb", 9.0, True, 1)]


def test_a_change_in_how_many_wait_goes_with_the_next_heartbeat_not_a_prompt_one() -> None:
    """How many wait at a replica and their prompt tokens (what the other replicas' admission
    counts, common/router_core/admission.py) are echoed too; a change of those alone, with the
    same first request, rides on the next heartbeat instead of asking for one."""
    core, ports = decode_core()
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=7.0, late=False, waiting=1, waiting_tokens=900))
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=7.0, late=False, waiting=3, waiting_tokens=5000))
    assert ports.beats == 1
    assert core.heartbeat(idle()).queues == [m.RouterQueue("ra", 7.0, False, 3, 5000)]


def test_a_replicas_first_request_size_is_echoed_and_a_change_of_it_beats_soon() -> None:
    """In an order by size the replicas' turns compare their first requests' prompt tokens
    (`turn_key`): a decode worker echoes them, and a new first request of another size is a change
    of the first request (a prompt heartbeat), as a new arrival time is."""
    core, ports = decode_core()
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=7.0, late=False, waiting=2, first_tokens=300))
    core.on_queue_head(m.QueueHead(router_incarnation="ra", oldest_at=7.0, late=False, waiting=2, first_tokens=90))
    assert ports.beats == 2
    assert core.heartbeat(idle()).queues == [m.RouterQueue("ra", 7.0, False, 2, 0, 90)]


def test_text_deltas_go_with_the_tokens_only_to_a_router_with_the_same_tokenizer() -> None:
    """A request whose router asked for text with this worker's tokenizer (Sampling.text) gets each
    item's text delta; another tokenizer's, a resumed request or a plain one gets ids only; the
    text kept per request goes at its end or cancel."""
    tok = SimpleTokenizer()
    core, ports = decode_core(tokenizer=tok)
    ids = tok.encode("the model and the cache")

    def work(rid: str, text: str, resume: int = 0) -> m.DecodeWork:
        return m.DecodeWork(request_id=rid, attempt=0, dispatch=1, mode="deflect", prompt_token_ids=[1] * 8,
                            sampling=m.Sampling(max_tokens=10, text=text), tbt_slo=0.1, deadline_s=30.0,
                            resume_tokens=resume)

    for rid, text, resume in (("a", "simple", 0), ("other", "hf:0123", 0), ("resumed", "simple", 2), ("ids", "", 0),
                              ("cancelled", "simple", 0)):
        assert core.on_work(work(rid, text, resume), 0.0, idle(), None) == "started"
    rids = ["a", "other", "resumed", "ids", "cancelled"]
    core.on_tokens([m.TokenItem(request_id=r, attempt=0, token_ids=ids[:2]) for r in rids], 0.01)
    core.on_cancel(m.Cancel(request_id="cancelled"))
    core.on_tokens([m.TokenItem(request_id=r, attempt=0, token_ids=ids[2:], finish_reason="length")
                    for r in rids[:4]], 0.01)
    batches = [x for x in ports.sent if isinstance(x, m.TokenBatch)]
    texts = [{it.request_id: it.text for it in b.items} for b in batches]
    assert texts[0] == {"a": " the model", "other": None, "resumed": None, "ids": None, "cancelled": " the model"}
    assert texts[1] == {"a": " and the cache", "other": None, "resumed": None, "ids": None}
    assert core.texts == {}


# ------------------------------------------------------------------ the delivery allowance moves (PlanBudget)
def test_a_moved_delivery_allowance_replans_its_router_s_running_requests_and_later_ones() -> None:
    """Each request is planned to its own SLO (its tbt_slo + the allowance its router took off)
    less the allowance its router last told, capped at `cap` x its SLO, where that is less than
    its budget; another router's requests keep theirs, and a handoff whose KV lands after the news
    starts with the new budget."""
    core, ports = decode_core()
    core.on_work(msgspec.structs.replace(deflection("a", (64,), 0.05, tbt_slo=0.095), allowance_s=0.005), 0.0,
                 idle(), MODEL)
    ports.routers["b"] = "router-b"
    core.on_work(msgspec.structs.replace(deflection("b", (64,), 0.05, tbt_slo=0.1, dispatch=2)), 0.0, idle(), MODEL)
    core.on_work(msgspec.structs.replace(handoff("late", 100), tbt_slo=0.095, allowance_s=0.005), 0.0, idle(), MODEL)
    assert [r.tbt_slo for r in ports.started] == [0.095, 0.1]
    beats = ports.beats
    assert core.on_plan_budget(m.PlanBudget(router_incarnation="router-a", allowance_s=0.012, cap=0.5)) == 1
    assert ports.budgets == {"a": pytest.approx(0.088)} and ports.beats == beats + 1
    p = core.kv_arrived("late", 0)
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=100)
    assert p is not None and core.admit(p.work, "handoff", (), MODEL, kv=kv)
    assert ports.started[-1].tbt_slo == pytest.approx(0.088)
    # the same news again moves nothing (and asks for no heartbeat); a cap of half the SLO holds
    beats = ports.beats
    assert core.on_plan_budget(m.PlanBudget(router_incarnation="router-a", allowance_s=0.012, cap=0.5)) == 0
    assert ports.beats == beats
    assert core.on_plan_budget(m.PlanBudget(router_incarnation="router-a", allowance_s=0.2, cap=0.5)) == 2
    assert ports.budgets["a"] == ports.budgets["late"] == pytest.approx(0.05) and "b" not in ports.budgets
    # it falls back: budgets only fall (a new dispatch gets the smaller allowance; work that starts
    # now keeps the budget of its dispatch)
    assert core.on_plan_budget(m.PlanBudget(router_incarnation="router-a", allowance_s=0.0, cap=0.5)) == 0
    assert ports.budgets["a"] == pytest.approx(0.05)
    core.on_work(msgspec.structs.replace(handoff("later", 100), tbt_slo=0.095, allowance_s=0.005), 0.0, idle(), MODEL)
    p = core.kv_arrived("later", 0)
    assert p is not None and core.admit(p.work, "handoff", (), MODEL, kv=kv)
    assert ports.started[-1].tbt_slo == 0.095


def test_a_prefill_worker_replans_the_requests_it_decodes_itself_not_its_prefills() -> None:
    core, ports = prefill_core()
    retained = m.PrefillWork(request_id="kept", attempt=0, dispatch=1, prompt_token_ids=[1] * 10, sampling=SAMPLING,
                             decode_worker="prefill-0", deadline_s=30.0, retain=True, tbt_slo=0.094,
                             allowance_s=0.006)
    plain = msgspec.structs.replace(retained, request_id="plain", retain=False, dispatch=2)
    assert core.on_work(retained, idle()) and core.on_work(plain)
    assert core.on_plan_budget(m.PlanBudget(router_incarnation="router-a", allowance_s=0.010, cap=0.5)) == 1
    assert ports.budgets == {"kept": pytest.approx(0.090)}
