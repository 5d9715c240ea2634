"""Pins of the router's behaviour before issue 27's refactor: every way it cannot place a request
now (no worker, no KV room, late binding's hold, a rejected deflection, a worker lost before or
after streaming tokens) and what becomes of the request.

They look at what can be seen from outside the router: the messages it sends to each worker,
the events its client gets (tokens, the finish, an error and its code), the exceptions `submit`
and `admit` raise (the HTTP layer's 503s) and `Router.stats()` (/v1/kairos/stats); not at its
private state. Everything they do to the router goes through the small adapter `Bench` below
(a message from a worker, a heartbeat, a lost worker, one liveness tick), so a refactor that
changes how the router is driven changes `Bench`, not the tests.

Behaviour that looks accidental is pinned as it is and marked "today:" in a comment: a change
to it should be deliberate and change the test with it. See also tests/test_migrate.py
(migration with a real engine, the migration limit) and tests/test_admission.py (a rejected
deflection taking the disaggregated path).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from structlog.testing import capture_logs

from common import config
from common import messages as m
from common.errors import NoWorkerYet, Unavailable
from common.perf_model import load_profile
from common.policy.admission import REJECTED_REASON
from common.router_core.requests import Request
from services.router.service import Router
from tests.router_fakes import Clock, FakeOutbox, hello, make_core

CAP = 300  # KV tokens of a small decode worker: one request of 100 + 100 fits, a second does not
BIG = 10**6
PROMPT = list(range(100, 200))  # 100 tokens
SAMPLING = m.Sampling(max_tokens=100)
BUDGET = 2048  # every worker's token budget (Hello)


# ------------------------------------------------------------------ the adapter


class _Outbox(FakeOutbox):
    """Also keeps the highest dispatch number sent to each worker (what its heartbeats acknowledge)."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatched: Counter[str] = Counter()

    def send(self, identity: bytes, msg: m.Msg) -> bool:
        ok = super().send(identity, msg)
        if ok and isinstance(msg, m.DecodeWork | m.PrefillWork):
            wid = identity.decode()
            self.dispatched[wid] = max(self.dispatched[wid], msg.dispatch)
        return ok


class Bench:
    """One router core, no sockets and no clock: what it sends to workers is captured, workers are
    driven by hand, and time is `clock.now`, moved by `tick`. The liveness window is long (no
    worker is declared lost unless a test says so with `lose`)."""

    def __init__(self, policy: str, workers: list[tuple[str, int]], **overrides: Any) -> None:
        overrides.setdefault("liveness", 10_000)
        self.out = _Outbox()
        self.core, _ = make_core(policy, self.out, **overrides)
        self.clock = Clock()
        self.seq: Counter[str] = Counter()
        self.caps: dict[str, int] = {}
        self.incarnations: dict[str, str] = {}
        for wid, cap in workers:
            self.join(wid, cap)
        self.take()  # the Welcomes

    def join(self, wid: str, cap: int = BIG, incarnation: str = "i1") -> None:
        """A worker says Hello (a new incarnation under a known id: it restarted)."""
        role: m.Role = "prefill" if wid.startswith("prefill") else "decode"
        self.caps[wid], self.incarnations[wid] = cap, incarnation
        self.hear(wid, m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=wid, role=role, incarnation=incarnation,
                               engine="sim", model="kairos-sim", token_budget=BUDGET,
                               kv_capacity_tokens=cap if role == "decode" else 0, max_batch=64,
                               kv_transport="modeled"))

    def hear(self, wid: str, msg: m.Msg) -> None:
        """A message from worker `wid`, as its connection hands it over."""
        self.core.on_message(wid.encode(), msg, self.clock.now)  # type: ignore[arg-type]

    def beat(self, wid: str, *, kv_used: int = 0, queued_tokens: int = 0, batch: int = 0,
             strictest_tbt_slo: float | None = None) -> None:
        """A heartbeat that acknowledges every dispatch sent to it; idle unless told otherwise."""
        self.seq[wid] += 1
        inc, ack = self.incarnations[wid], self.out.dispatched[wid]
        if wid.startswith("prefill"):
            self.hear(wid, m.PrefillHeartbeat(worker_id=wid, incarnation=inc, seq=self.seq[wid],
                                              queued_tokens=queued_tokens, queued_requests=int(queued_tokens > 0),
                                              token_budget=BUDGET, last_dispatch=ack))
        else:
            cap = self.caps[wid]
            self.hear(wid, m.DecodeHeartbeat(worker_id=wid, incarnation=inc, seq=self.seq[wid], batch=batch,
                                             kv_tokens=kv_used, kv_free_tokens=cap - kv_used, kv_capacity_tokens=cap,
                                             resident_prefill_tokens=0, deflections=0,
                                             strictest_tbt_slo=strictest_tbt_slo,
                                             token_budget=BUDGET, last_dispatch=ack))

    def tokens(self, wid: str, req: Request, ids: list[int], finish: str | None = None, attempt: int = -1) -> None:
        att = req.attempt if attempt < 0 else attempt
        self.hear(wid, m.TokenBatch(worker_id=wid, items=[m.TokenItem(req.request_id, att, ids, finish)]))

    def lose(self, wid: str) -> None:
        """The liveness loop finds `wid` silent past the liveness window."""
        w = self.core.table.remove(wid)
        assert w is not None
        self.core.membership.worker_gone(w, "heartbeat timeout", self.clock.now)

    def tick(self, later_s: float = 0.0) -> None:
        """`later_s` pass, then one liveness tick: parked requests are tried again, those waiting
        past their wait timeout fail."""
        self.core.tick(self.clock.advance(later_s))

    def submit(self, prompt: list[int] = PROMPT, sampling: m.Sampling = SAMPLING, **kw: Any) -> Request:
        return self.core.submit(prompt, sampling, self.clock.now, **kw)

    def take(self) -> list[tuple[str, m.Msg]]:
        """What the router sent since the last call."""
        return self.out.take()

    def stats(self) -> dict[str, Any]:
        return self.core.stats()


def work(sent: list[tuple[str, m.Msg]], req: Request | None = None) -> list[tuple[str, str, int]]:
    """(worker, kind, attempt) of each DecodeWork / PrefillWork sent (for `req` only, if given);
    kind: the DecodeWork's mode, or "prefill"."""
    out: list[tuple[str, str, int]] = []
    for wid, msg in sent:
        if isinstance(msg, m.DecodeWork | m.PrefillWork) and (req is None or msg.request_id == req.request_id):
            out.append((wid, msg.mode if isinstance(msg, m.DecodeWork) else "prefill", msg.attempt))
    return out


def decode_work(sent: list[tuple[str, m.Msg]], req: Request) -> m.DecodeWork:
    (dw,) = [msg for _, msg in sent if isinstance(msg, m.DecodeWork) and msg.request_id == req.request_id]
    return dw


def client(req: Request) -> tuple[list[int], list[str], list[str]]:
    """What the request's client got: every token, finish reasons and error codes (taken)."""
    evs, req.events._items = req.events._items, []
    return ([t for e in evs for t in (e.token_ids or [])], [e.finish_reason for e in evs if e.finish_reason],
            [e.error_code for e in evs if e.error])


def errors(req: Request) -> list[tuple[str, str]]:
    evs, req.events._items = req.events._items, []
    return [(e.error_code, e.error or "") for e in evs if e.error]


def waiting_untouched(b: Bench, req: Request) -> None:
    """Accepted, nothing sent for it, nothing told to its client."""
    assert not work(b.take(), req) and not req.done and client(req) == ([], [], [])


# ------------------------------------------------------------------ no worker


def shell(**overrides: Any) -> tuple[Router, list[tuple[str, m.Msg]]]:
    """The router's shell (admission's wait for a worker is the shell's), its core sending to a list."""
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "deflect-all", "profile": "fast", **overrides})
    box = FakeOutbox()
    return Router(cfg, outbox=box), box.sent


async def test_with_no_worker_submit_says_no_worker_yet_and_admit_waits_for_a_hello() -> None:
    r, sent = shell(worker_wait=5.0)
    with pytest.raises(NoWorkerYet) as e:
        r.submit(PROMPT, SAMPLING)
    assert e.value.retry_after_s == 1.0 and r.stats()["in_flight"] == 0
    task = asyncio.create_task(r.admit(PROMPT, SAMPLING))
    await asyncio.sleep(0)
    assert not task.done()
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), time.monotonic())
    req = await asyncio.wait_for(task, 2)
    assert work(sent, req) == [("decode-0", "deflect", 0)]


async def test_with_no_worker_admit_gives_up_after_worker_wait() -> None:
    r, sent = shell(worker_wait=0.01)
    with pytest.raises(NoWorkerYet):
        await asyncio.wait_for(r.admit(PROMPT, SAMPLING), 2)
    assert r.stats()["in_flight"] == 0 and not sent


# ------------------------------------------------------------------ no KV room


async def test_no_kv_room_the_request_waits_and_goes_out_when_a_heartbeat_shows_room() -> None:
    b = Bench("deflect-all", [("decode-0", CAP)])
    a = b.submit()
    assert work(b.take(), a) == [("decode-0", "deflect", 0)]
    w = b.submit()  # 100 + 100 more than the 100 left
    waiting_untouched(b, w)
    assert b.stats()["kv_waiting"] == 1 and b.stats()["held"] == 0
    b.beat("decode-0", kv_used=200)  # a still holds its KV: no room yet
    waiting_untouched(b, w)
    b.tokens("decode-0", a, [7], "length")
    b.beat("decode-0")  # a's KV is free
    assert work(b.take(), w) == [("decode-0", "deflect", 0)]
    assert b.stats()["kv_waiting"] == 0
    b.tokens("decode-0", w, [8, 9], "length")
    assert client(w) == ([8, 9], ["length"], []) and w.done


async def test_nobody_overtakes_a_request_waiting_for_kv_room() -> None:
    b = Bench("deflect-all", [("decode-0", CAP)])
    a = b.submit()
    first = b.submit()
    small = b.submit(PROMPT[:10], m.Sampling(max_tokens=10))  # would fit the 100 tokens left
    waiting_untouched(b, small)
    assert b.stats()["kv_waiting"] == 2
    b.tokens("decode-0", a, [7], "length")
    b.beat("decode-0")
    assert [(wid, msg.request_id) for wid, msg in b.take() if isinstance(msg, m.DecodeWork)] == [
        ("decode-0", first.request_id), ("decode-0", small.request_id)]


async def test_a_full_wait_queue_or_no_waiting_answers_503_at_once() -> None:
    b = Bench("deflect-all", [("decode-0", CAP)], kv_wait_max=1)
    b.submit()
    b.submit()  # waits
    with pytest.raises(Unavailable) as e:
        b.submit()
    assert e.value.retry_after_s == 1.0 and "limit 1" in str(e.value)
    assert b.stats()["in_flight"] == 2 and b.stats()["kv_waiting"] == 1
    b = Bench("deflect-all", [("decode-0", CAP)], kv_wait_timeout=0.0)
    b.submit()
    with pytest.raises(Unavailable):
        b.submit()
    assert b.stats()["in_flight"] == 1


async def test_waiting_too_long_for_kv_room_fails_with_kv_wait_timeout() -> None:
    # queue_budget -1: no admission budget bounds the wait sooner (tests/test_shed.py pins that)
    b = Bench("deflect-all", [("decode-0", CAP)], kv_wait_timeout=5.0, queue_budget=-1.0)
    b.submit()
    w = b.submit()
    b.take()
    b.tick(4.0)
    assert not w.done
    b.tick(6.0)
    assert w.done and not b.take()
    ((code, message),) = errors(w)
    assert code == "kv_wait_timeout" and "no decode worker had room" in message and "KV room" in message
    assert b.stats()["kv_waiting"] == 0 and b.stats()["in_flight"] == 1


async def test_a_waiting_request_is_parked_like_the_others_once_no_decode_worker_is_left() -> None:
    """One rule for every request that cannot be placed (RouterCore.unplaced): with no decode worker
    left, the one that was waiting for room is parked like the one that lost its worker, and both
    fail as unavailable only after park_timeout (until 2026-12-04 the waiting one failed at once)."""
    b = Bench("deflect-all", [("decode-0", CAP), ("prefill-0", 0)], park_timeout=10.0)
    a = b.submit()
    w = b.submit()
    b.take()
    b.lose("decode-0")
    assert not a.done and not w.done and not b.take()  # a: no worker to go to (parked); w: still waiting
    b.beat("prefill-0")  # any heartbeat decides the waiting ones again
    assert not w.done and client(w) == ([], [], []) and b.stats()["kv_waiting"] == 0  # parked now
    b.tick(5.0)
    assert not a.done and not w.done
    b.tick(6.0)
    for req in (a, w):
        ((code, message),) = errors(req)
        assert req.done and code == "unavailable" and "no worker left to retry on" in message


# ------------------------------------------------------------------ late binding (Kairos holds it)


def late() -> Bench:
    # queue_budget -1: waits bounded by kv_wait_timeout only (admission's budget bounds: tests/test_shed.py)
    return Bench("kairos", [("prefill-0", 0), ("decode-0", BIG)], late_binding=True, kv_wait_timeout=5.0,
                 queue_budget=-1.0)


def long_prompt() -> list[int]:
    return list(range(1000, 1000 + BUDGET))  # one whole prefill token budget


NO_SLACK = 0.0001  # a TBT SLO no chunk fits in: only the prefill path can serve it


async def test_late_binding_holds_a_request_bound_for_a_deep_prefill_queue_until_the_queue_drops() -> None:
    b = late()
    a = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    assert sorted(work(b.take(), a)) == [("decode-0", "handoff", 0), ("prefill-0", "prefill", 0)]
    held = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)  # the queue holds a budget now
    waiting_untouched(b, held)
    assert b.stats()["kv_waiting"] == 1 and b.stats()["held"] == 1
    b.beat("prefill-0", queued_tokens=BUDGET)  # still deep
    waiting_untouched(b, held)
    b.beat("prefill-0")  # drained
    assert sorted(work(b.take(), held)) == [("decode-0", "handoff", 0), ("prefill-0", "prefill", 0)]
    assert b.stats()["kv_waiting"] == 0 and b.stats()["held"] == 0


async def test_a_held_request_does_not_block_new_arrivals() -> None:
    b = late()
    b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    held = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    b.take()
    short = b.submit(PROMPT[:20], m.Sampling(max_tokens=4))  # a decode worker can prefill it in place
    assert work(b.take(), short) == [("decode-0", "deflect", 0)]
    assert not held.done and b.stats()["held"] == 1


async def test_a_request_held_too_long_fails_with_prefill_wait_timeout_saying_late_binding_held_it() -> None:
    b = late()
    b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    held = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    b.tick(6.0)
    ((code, message),) = errors(held)
    assert held.done and code == "prefill_wait_timeout" and "late binding held it" in message


# ------------------------------------------------------------------ a worker lost before any token was streamed


async def test_lost_before_the_first_token_it_is_sent_again_elsewhere_as_a_new_attempt() -> None:
    b = Bench("deflect-all", [("decode-0", BIG), ("decode-1", BIG)])
    req = b.submit()
    ((first, _, _),) = work(b.take(), req)
    b.lose(first)
    sent = b.take()
    ((second, mode, attempt),) = work(sent, req)
    dw = decode_work(sent, req)
    assert second != first and (mode, attempt) == ("deflect", 1)
    assert dw.prompt_token_ids == PROMPT and dw.sampling.max_tokens == 100 and dw.resume_tokens == 0
    b.tokens(second, req, [5, 6], "length")
    assert client(req) == ([5, 6], ["length"], []) and req.done and req.record(b.clock.now).attempts == 2


async def test_a_prefill_worker_lost_before_its_prefill_is_done_sends_both_halves_again() -> None:
    b = Bench("disagg-least-loaded", [("prefill-0", 0), ("prefill-1", 0), ("decode-0", BIG)])
    req = b.submit()
    assert sorted(work(b.take(), req)) == [("decode-0", "handoff", 0), ("prefill-0", "prefill", 0)]
    b.lose("prefill-0")
    sent = b.take()
    assert ("decode-0", m.Cancel(request_id=req.request_id, attempt=0, reason="redispatched")) in sent
    assert sorted(work(sent, req)) == [("decode-0", "handoff", 1), ("prefill-1", "prefill", 1)]


async def test_a_prefill_worker_lost_after_its_prefill_is_done_changes_nothing() -> None:
    b = Bench("disagg-least-loaded", [("prefill-0", 0), ("decode-0", BIG)])
    req = b.submit()
    b.take()
    b.hear("prefill-0", m.PrefillDone(request_id=req.request_id, attempt=0, worker_id="prefill-0", queue_s=0,
                                      prefill_s=0, kv=m.KvHandle(transport="modeled", source_worker="prefill-0",
                                                                 tokens=100)))
    assert [type(msg) for _, msg in b.take()] == [m.KvReady]
    b.lose("prefill-0")
    assert not b.take()
    b.tokens("decode-0", req, [5], "length")
    assert client(req) == ([5], ["length"], []) and req.record(b.clock.now).attempts == 1


async def test_lost_before_the_first_token_with_no_kv_room_elsewhere_it_waits_first_in_line() -> None:
    b = Bench("deflect-all", [("decode-0", CAP), ("decode-1", CAP)])
    a = b.submit()
    other = b.submit()
    late_comer = b.submit()  # waits: both are full
    assert work(b.take()) == [("decode-0", "deflect", 0), ("decode-1", "deflect", 0)]
    b.lose("decode-0")
    waiting_untouched(b, a)
    assert b.stats()["kv_waiting"] == 2
    b.tokens("decode-1", other, [5], "length")
    b.beat("decode-1")
    assert work(b.take()) == [("decode-1", "deflect", 1)]  # a, ahead of the one that waited before it
    assert a.decode_worker == "decode-1" and not late_comer.done


async def test_lost_before_the_first_token_with_no_worker_left_it_is_parked_until_one_registers() -> None:
    b = Bench("deflect-all", [("decode-0", BIG)])
    req = b.submit()
    b.take()
    b.lose("decode-0")
    waiting_untouched(b, req)
    assert b.stats()["kv_waiting"] == 0
    b.join("decode-1")
    b.tick()  # today: a parked request goes out at the liveness tick after a worker came
    assert work(b.take(), req) == [("decode-1", "deflect", 1)]


async def test_parked_too_long_before_the_first_token_fails_as_unavailable() -> None:
    b = Bench("deflect-all", [("decode-0", BIG)], park_timeout=0.0)
    req = b.submit()
    b.lose("decode-0")
    b.tick()
    ((code, message),) = errors(req)
    assert req.done and code == "unavailable" and "no worker left to retry on" in message


async def test_attempts_are_bounded_by_max_attempts() -> None:
    b = Bench("deflect-all", [("decode-0", BIG), ("decode-1", BIG)], max_attempts=2)
    req = b.submit()
    ((first, _, _),) = work(b.take(), req)
    b.lose(first)
    ((second, _, _),) = work(b.take(), req)
    b.lose(second)
    ((code, message),) = errors(req)
    assert req.done and code == "retries_exhausted" and "after 2 attempts" in message
    assert not work(b.take(), req)


@pytest.mark.parametrize(("retryable", "code", "outcome"), [
    (False, "invalid_request", "invalid_request"), (False, "", "worker_error")])
async def test_a_final_failure_from_the_worker_fails_the_request(retryable: bool, code: str, outcome: str) -> None:
    b = Bench("deflect-all", [("decode-0", BIG), ("decode-1", BIG)])
    req = b.submit()
    ((wid, _, _),) = work(b.take(), req)
    b.hear(wid, m.RequestFailed(request_id=req.request_id, attempt=0, worker_id=wid, reason="no", retryable=retryable,
                                code=code))
    assert [c for c, _ in errors(req)] == [outcome] and req.done and not work(b.take(), req)


async def test_a_retryable_failure_from_the_only_worker_waits_for_room_then_goes_back_to_it() -> None:
    """e.g. the decode worker refused it for KV room its heartbeat did not show: the request waits
    first in line and goes back to the same worker (no other) once a heartbeat shows room."""
    b = Bench("deflect-all", [("decode-0", CAP)])
    req = b.submit()
    b.take()
    b.hear("decode-0", m.RequestFailed(request_id=req.request_id, attempt=0, worker_id="decode-0",
                                       reason="kv_full: 200 tokens needed", retryable=True))
    waiting_untouched(b, req)  # today: its own first attempt still counts against the room in the view
    b.beat("decode-0")
    assert work(b.take(), req) == [("decode-0", "deflect", 1)]


# ------------------------------------------------------------------ a worker lost after tokens were streamed


@pytest.mark.parametrize("policy", ["deflect-all", "disagg-least-loaded"])
async def test_lost_mid_stream_it_resumes_elsewhere_and_the_client_sees_one_stream(policy: str) -> None:
    b = Bench(policy, [("prefill-0", 0), ("decode-0", BIG), ("decode-1", BIG)])
    req = b.submit(PROMPT, m.Sampling(max_tokens=5))
    first = req.decode_worker
    assert first is not None
    b.tokens(first, req, [11, 12])
    b.take()
    b.lose(first)
    sent = b.take()
    dw = decode_work(sent, req)
    second = req.decode_worker
    assert second not in (None, first) and dw.attempt == 1
    assert dw.prompt_token_ids == [*PROMPT, 11, 12] and dw.sampling.max_tokens == 3 and dw.resume_tokens == 2
    if policy == "disagg-least-loaded":
        assert sorted(work(sent, req)) == [(second, "handoff", 1), ("prefill-0", "prefill", 1)]
    assert second is not None
    b.tokens(second, req, [13, 14, 15], "length")
    assert client(req) == ([11, 12, 13, 14, 15], ["length"], [])
    assert req.done and req.record(b.clock.now).migrations == 1 and req.record(b.clock.now).output_tokens == 5


async def test_a_worker_restart_mid_stream_is_a_loss_and_the_old_attempts_tokens_are_cancelled() -> None:
    b = Bench("deflect-all", [("decode-0", BIG)])
    req = b.submit(PROMPT, m.Sampling(max_tokens=5))
    b.tokens("decode-0", req, [11])
    b.take()
    b.join("decode-0", incarnation="i2")  # the same id, a new process
    sent = b.take()
    assert work(sent, req) == [("decode-0", "deflect", 1)] and decode_work(sent, req).resume_tokens == 1
    b.tokens("decode-0", req, [99], attempt=0)  # the old attempt, late
    assert b.take() == [("decode-0", m.Cancel(request_id=req.request_id, attempt=0, reason="stale_attempt"))]
    b.tokens("decode-0", req, [12, 13, 14, 15], "length")
    assert client(req) == ([11, 12, 13, 14, 15], ["length"], [])


async def test_lost_after_every_token_was_streamed_it_finishes_with_length() -> None:
    b = Bench("deflect-all", [("decode-0", BIG), ("decode-1", BIG)])
    req = b.submit(PROMPT, m.Sampling(max_tokens=3))
    assert req.decode_worker is not None
    b.tokens(req.decode_worker, req, [1, 2, 3])  # the end event was lost with the worker
    b.take()
    b.lose(req.decode_worker)
    assert client(req) == ([1, 2, 3], ["length"], []) and req.done and not work(b.take(), req)


async def test_lost_mid_stream_with_no_kv_room_elsewhere_it_waits_first_in_line_and_resumes_when_room_shows() -> None:
    with capture_logs() as logs:
        b = Bench("deflect-all", [("decode-0", CAP), ("decode-1", CAP)])
        a = b.submit()
        other = b.submit()
        b.tokens("decode-0", a, [11, 12])
        b.take()
        b.lose("decode-0")
    assert client(a) == ([11, 12], [], []) and not a.done and not work(b.take(), a)
    # the operator's log says where the request went: waiting, with why (not silence)
    moved = [e for e in logs if e["event"] == "request_migrated" and e["request_id"] == a.request_id]
    assert len(moved) == 1 and moved[0]["decode_worker"] is None and moved[0]["sent_tokens"] == 2
    assert moved[0]["bad_worker"] == "decode-0" and moved[0]["waiting"]
    # it waits for room first in line, as a request that had not streamed does (RouterCore.unplaced;
    # until 2026-12-04 it was parked, tried again only at liveness ticks, within park_timeout)
    assert b.stats()["kv_waiting"] == 1
    b.tokens("decode-1", other, [5], "length")
    b.beat("decode-1")  # the heartbeat that shows the room sends it: no tick needed
    sent = b.take()
    assert work(sent, a) == [("decode-1", "deflect", 1)] and decode_work(sent, a).resume_tokens == 2


async def test_lost_mid_stream_with_no_kv_room_elsewhere_for_too_long_fails_worker_lost_midstream() -> None:
    b = Bench("deflect-all", [("decode-0", CAP), ("decode-1", CAP)], kv_wait_timeout=5.0)
    a = b.submit()
    b.submit()
    b.tokens("decode-0", a, [11])
    b.lose("decode-0")
    b.tick(4.0)
    assert not a.done
    b.tick(2.0)
    ((code, message),) = errors(a)
    assert a.done and code == "worker_lost_midstream" and "no decode worker had KV room to resume it" in message


async def test_lost_mid_stream_with_no_worker_left_it_is_parked_until_one_registers() -> None:
    b = Bench("deflect-all", [("decode-0", BIG)])
    req = b.submit(PROMPT, m.Sampling(max_tokens=5))
    b.tokens("decode-0", req, [11])
    b.take()
    b.lose("decode-0")
    assert not req.done and not b.take()
    b.join("decode-1")
    b.tick()
    sent = b.take()
    assert work(sent, req) == [("decode-1", "deflect", 1)] and decode_work(sent, req).resume_tokens == 1


async def test_a_parked_request_whose_workers_come_back_full_waits_for_room_first_in_line() -> None:
    b = Bench("deflect-all", [("decode-0", CAP)])
    a = b.submit()
    b.take()
    b.lose("decode-0")  # no worker left: parked
    b.join("decode-1", CAP)
    b.beat("decode-1", kv_used=250)  # back, but with no room for it
    b.tick()
    assert not a.done and b.stats()["kv_waiting"] == 1 and not work(b.take(), a)
    b.beat("decode-1")  # room
    assert work(b.take(), a) == [("decode-1", "deflect", 1)]


# ------------------------------------------------------------------ a rejected deflection


async def test_a_rejected_deflection_with_no_kv_room_waits_first_in_line() -> None:
    b = Bench("deflect-all", [("prefill-0", 0), ("decode-0", CAP)])
    a = b.submit()
    w = b.submit()  # waits for room
    assert work(b.take()) == [("decode-0", "deflect", 0)]
    b.hear("decode-0", m.RequestFailed(request_id=a.request_id, attempt=0, worker_id="decode-0", reason="no room",
                                       code=REJECTED_REASON, retryable=True))
    waiting_untouched(b, a)  # the disaggregated path needs the KV room its own deflection still holds
    assert b.stats()["kv_waiting"] == 2
    b.beat("decode-0")
    sent = b.take()
    # a, ahead of w, with the same attempt; today: decided afresh, so deflected again to the worker
    # that rejected it (the wait queue forgets which workers rejected it)
    assert work(sent) == [("decode-0", "deflect", 0)] and decode_work(sent, a).attempt == 0
    assert not w.done


async def test_a_request_put_back_first_in_line_does_not_hold_back_the_timeouts_behind_it() -> None:
    """Changed on purpose (was: only the queue's head was checked, so a request behind one put
    back first in line, with its later deadline, waited past its own kv_wait_timeout)."""
    b = Bench("deflect-all", [("prefill-0", 0), ("decode-0", CAP)], kv_wait_timeout=10.0, queue_budget=-1.0)
    a = b.submit()
    w = b.submit()  # waits for room until t=10
    assert work(b.take()) == [("decode-0", "deflect", 0)]
    b.tick(6.0)
    b.hear("decode-0", m.RequestFailed(request_id=a.request_id, attempt=0, worker_id="decode-0", reason="no room",
                                       code=REJECTED_REASON, retryable=True))
    waiting_untouched(b, a)  # first in line again, waiting until t=16
    b.tick(4.5)  # t=10.5
    assert w.done and errors(w)[0][0] == "kv_wait_timeout"
    assert not a.done and b.stats()["kv_waiting"] == 1
    b.tick(6.0)  # t=16.5
    assert a.done and errors(a)[0][0] == "kv_wait_timeout"


async def test_a_rejected_deflection_leaves_no_cached_prompt_in_the_prefix_index() -> None:
    """Changed on purpose (found running the simulator on this core): the dispatch told the prefix
    index that the decode worker will cache the prompt; when its admission turns the deflection
    away, the blocks only that dispatch added are taken back (they stayed, and priced later
    requests with the same prefix as cached on a worker that never held them)."""
    b = Bench("deflect-all", [("prefill-0", 0), ("decode-0", BIG), ("decode-1", BIG)])
    for wid in ("decode-0", "decode-1"):  # caches of 16-token blocks, empty
        b.seq[wid] += 1
        b.hear(wid, m.DecodeHeartbeat(worker_id=wid, incarnation="i1", seq=b.seq[wid], batch=0, kv_tokens=0,
                                      kv_free_tokens=BIG, kv_capacity_tokens=BIG, resident_prefill_tokens=0,
                                      deflections=0, strictest_tbt_slo=None, token_budget=BUDGET,
                                      prefix=m.PrefixSummary(block_tokens=16)))
    a = b.submit()
    first = a.decode_worker
    assert first is not None and dict(b.core.prefix.lookup(PROMPT)[0]) == {first: 96}
    b.take()
    b.hear(first, m.RequestFailed(request_id=a.request_id, attempt=0, worker_id=first, reason="no room",
                                  code=REJECTED_REASON, retryable=True))
    second = a.decode_worker
    assert second not in (None, first)  # deflected to the other decode worker
    assert dict(b.core.prefix.lookup(PROMPT)[0]) == {second: 96}


async def test_a_deflection_rejected_by_a_draining_worker_with_no_other_is_parked_until_one_registers() -> None:
    b = Bench("deflect-all", [("prefill-0", 0), ("decode-0", BIG)])
    a = b.submit()
    b.take()
    b.hear("decode-0", m.Goodbye(worker_id="decode-0", incarnation="i1"))  # draining: no new work
    b.hear("decode-0", m.RequestFailed(request_id=a.request_id, attempt=0, worker_id="decode-0", reason="no room",
                                       code=REJECTED_REASON, retryable=True))
    waiting_untouched(b, a)
    assert b.stats()["kv_waiting"] == 0
    b.join("decode-1")
    b.tick()
    assert work(b.take(), a) == [("decode-1", "deflect", 0)]  # the same attempt: it never ran anywhere


async def test_with_decode_room_a_request_waits_while_a_decode_step_would_pass_the_slo() -> None:
    """`decode_room` (on by default): the only decode worker reports a batch whose decode-only
    step, with one more, would pass decode_beta x its residents' TBT SLO: the request waits at the
    router, saying why (its wait reason, the `decode_room_waited` count), and goes out once a
    heartbeat shows a smaller batch."""
    assert config.RouterConfig().decode_room is True and config.RouterConfig().decode_beta == 0.95
    b = Bench("kairos", [("prefill-0", 0), ("decode-0", BIG)], late_binding=False)
    model = load_profile("fast").model
    slo = 0.001  # the fast profile's steps are short: a strict SLO makes a batch of a few thousand too big
    n = next(k for k in range(1, 100_000) if model.decode_time(k + 1, (k + 1) * 10) > 0.95 * slo)

    b.beat("decode-0", batch=n, kv_used=n * 10, strictest_tbt_slo=slo)
    w = b.submit(tbt_slo=slo)
    waiting_untouched(b, w)
    assert b.stats()["kv_waiting"] == 1 and "decode pool full" in w.wait_reason
    assert b.stats()["counts"]["decode_room_waited"] == 1  # type: ignore[index]
    b.beat("decode-0", batch=n // 2, kv_used=n // 2 * 10, strictest_tbt_slo=slo)
    assert {kind for _, kind, _ in work(b.take(), w)} & {"prefill", "deflect"}
    assert b.stats()["kv_waiting"] == 0


# ------------------------------------------------------------------ what the router counts


async def test_stats_count_decisions_in_routes_and_each_request_once_in_ended() -> None:
    """`routes` counts decisions: a deflection the decode worker turned away and that was decided
    again counts twice there. `ended` counts each request once, by the route that served it:
    what a client of a held stream (header `x-kairos-route: held`) cannot see, and what the demo
    compares with the simulator's routes."""
    b = Bench("deflect-all", [("prefill-0", 0), ("decode-0", BIG), ("decode-1", BIG)])
    a = b.submit()
    first = a.decode_worker
    b.take()
    b.hear(first, m.RequestFailed(request_id=a.request_id, attempt=0, worker_id=first, reason="no room",
                                  code=REJECTED_REASON, retryable=True))
    second = a.decode_worker
    assert work(b.take(), a) == [(second, "deflect", 0)]
    b.tokens(second, a, [1, 2], "length")
    assert a.done and b.stats()["routes"] == {"deflect": 2} and b.stats()["ended"] == {"deflect": 1}


async def test_a_held_request_is_counted_in_ended_by_the_route_it_got_after_the_hold() -> None:
    b = late()
    a = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    held = b.submit(long_prompt(), m.Sampling(max_tokens=4), tbt_slo=NO_SLACK)
    b.take()
    assert held.decision is None and b.stats()["ended"] == {}  # still held: its headers would say "held"
    b.beat("prefill-0")  # drained: it goes to the prefill queue
    assert sorted(work(b.take(), held)) == [("decode-0", "handoff", 0), ("prefill-0", "prefill", 0)]
    for r in (a, held):
        b.tokens("decode-0", r, [1], "length")
    assert a.done and held.done and b.stats()["ended"] == {"disagg": 2}
