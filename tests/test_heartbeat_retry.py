"""A heartbeat decides the waiting requests again at most once per `heartbeat_retry_ms`.

Each retry decides up to 64 waiting requests (common/wait_queue.py, `SCAN`) when late binding holds
them, so under overload every heartbeat cost the router a retry: 0.5-0.9 ms each with 96 held
6,000-token prompts in process, 2,560 heartbeats a second from a 256-worker fleet. Heartbeats
within the gap are folded into one retry the shell's timer runs (the `retry_later` hook, as a
replica's turn); a request's end still retries at once."""

from __future__ import annotations

from common import config
from common import messages as m
from common.router_core.core import RouterCore
from common.router_core.ports import Hooks
from tests.router_fakes import FakeOutbox, hello

NOW = 1000.0


def _dhb(w: str, seq: int) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=w, incarnation=f"inc-{w}", seq=seq, batch=150, kv_tokens=50_000,
                             kv_free_tokens=50_000, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                             deflections=0, strictest_tbt_slo=0.1, token_budget=2048)


def _phb(seq: int) -> m.PrefillHeartbeat:  # a prefill queue deep enough that late binding holds
    return m.PrefillHeartbeat(worker_id="prefill-0", incarnation="inc-prefill-0", seq=seq, queued_tokens=400_000,
                              queued_requests=60, token_budget=8192)


def _held_router(gap_ms: float) -> tuple[RouterCore, list[float], list[int]]:
    """A Kairos router core with 40 requests held by late binding; the delays it asked its timer
    for, and how many retries ran."""
    cfg = config.load(config.RouterConfig, env={},
                      overrides={"policy": "kairos", "profile": "fast", "heartbeat_retry_ms": gap_ms})
    later: list[float] = []
    r = RouterCore(cfg, FakeOutbox(), hooks=Hooks(retry_later=later.append))
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    r.on_message(b"prefill-0", _phb(1), NOW)
    for w in ("decode-0", "decode-1"):
        r.on_message(w.encode(), _dhb(w, 1), NOW)
    for i in range(40):
        r.submit(list(range(i, i + 6000)), m.Sampling(max_tokens=64), NOW)
    assert len(r.waiting.queue) >= 30 and all(q.held for q in r.waiting.queue)
    retries = [0]
    real = r.retry_now

    def counted(now: float, turn: bool = False) -> None:
        retries[0] += 1
        real(now, turn)

    r.retry_now = counted  # type: ignore[method-assign]
    return r, later, retries


def test_heartbeats_within_the_gap_are_folded_into_one_retry() -> None:
    r, later, retries = _held_router(10.0)
    t = NOW + 1.0
    for k in range(2, 12):  # ten heartbeats in 2 ms
        r.on_message(b"decode-0", _dhb("decode-0", k), t + 0.0002 * k)
    assert retries[0] == 1, "every heartbeat decided the waiting requests again"
    assert later and all(0.0 < d <= 0.010 for d in later)  # the rest: one retry, when the gap is over
    # the gap over, a heartbeat retries at once again
    r.on_message(b"decode-0", _dhb("decode-0", 20), t + 0.011)
    assert retries[0] == 2


def test_a_requests_end_retries_at_once_and_zero_turns_the_gap_off() -> None:
    r, _, retries = _held_router(10.0)
    r.on_message(b"decode-0", _dhb("decode-0", 2), NOW + 1.0)
    assert retries[0] == 1
    r.retry_waiting(NOW + 1.001)  # room from a request's end, not a heartbeat: at once
    assert retries[0] == 2
    off, later_off, retries_off = _held_router(0.0)
    for k in range(2, 12):
        off.on_message(b"decode-0", _dhb("decode-0", k), NOW + 1.0 + 0.0002 * k)
    assert retries_off[0] == 10 and not later_off
