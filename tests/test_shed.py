"""Admission that sheds (common/router_core/admission.py), on the router core with a fake clock:
a request predicted to wait past its budget is refused at once (Overloaded: HTTP 429) with a
Retry-After from the predicted drain time and a code naming what is short; one client holds at
most its share of max_in_flight; a batched prompt list over the limit is a 400 before any work."""

from __future__ import annotations

import math

import msgspec
import pytest
from structlog.testing import capture_logs

import tests.test_router_pins as pins
from common import messages as m
from common.config import RouterConfig
from common.errors import Overloaded, RequestError
from common.perf_model import load_profile
from common.router_core.admission import ROOM_MARGIN
from common.router_core.requests import Request
from services.router import openai_schema as schema
from services.router import openai_serve as serve

BUDGET = pins.BUDGET
SLOW = m.Sampling(max_tokens=4)


def prefill_rate() -> float:
    """The prefill pool's rate in the bench (one prefill worker, the fast profile, BUDGET)."""
    model = load_profile("fast").model
    return BUDGET / model.prefill_exec(BUDGET, BUDGET)


def late(**overrides: object) -> pins.Bench:
    """Kairos with late binding, one prefill and one decode worker; requests with a TBT SLO no chunk
    fits in, so only the prefill path serves them (as tests/test_router_pins.py's `late`)."""
    overrides.setdefault("kv_wait_timeout", 30.0)
    return pins.Bench("kairos", [("prefill-0", 0), ("decode-0", pins.BIG)], late_binding=True, **overrides)


def held_one(b: pins.Bench, **kw: object) -> object:
    return b.submit(pins.long_prompt(), SLOW, tbt_slo=pins.NO_SLACK, **kw)


def test_a_request_predicted_to_wait_past_the_budget_is_refused_with_retry_after_from_the_drain_time() -> None:
    b = late(queue_budget=1.0)
    rate = prefill_rate()
    queued = int(rate * 0.995)  # a deep prefill queue (late binding holds new ones): 0.995 s of work
    b.beat("prefill-0", queued_tokens=queued)
    ahead = []
    # the first ones fit the budget and wait (held); each one held adds its prompt to the backlog
    # half a prefill step (a step boundary), and the decode step that brings the first token
    step = 0.5 * BUDGET / rate + b.core.admission.first_step(BUDGET)
    assert step > 0
    while (queued + (len(ahead) + 1) * BUDGET) / rate + step <= 1.0:
        ahead.append(held_one(b))
    assert ahead and b.stats()["held"] == len(ahead)
    with pytest.raises(Overloaded) as e:
        held_one(b)
    predicted = (queued + len(ahead) * BUDGET + BUDGET) / rate + step
    assert predicted > 1.0
    assert e.value.code == "prefill_busy"
    assert e.value.retry_after_s == max(1.0, math.ceil(predicted - 1.0))
    assert "prefill workers hold" in str(e.value) and "add prefill workers" in str(e.value)
    assert b.stats()["held"] == len(ahead) and b.stats()["counts"]["shed"] == 1  # nothing of it was kept


def test_the_retry_after_grows_with_the_backlog() -> None:
    def retry_after(queued: int) -> float:
        b = late(queue_budget=0.5)
        b.beat("prefill-0", queued_tokens=queued)
        with pytest.raises(Overloaded) as e:
            held_one(b)
        return e.value.retry_after_s

    rate = prefill_rate()
    small, big = int(rate * 3), int(rate * 30)  # 3 s and 30 s of prefill work queued
    step = 0.5 * BUDGET / rate + late().core.admission.first_step(BUDGET)
    assert retry_after(small) == math.ceil((small + BUDGET) / rate + step - 0.5)
    assert retry_after(big) == math.ceil((big + BUDGET) / rate + step - 0.5) > retry_after(small)


def test_the_default_budget_is_the_requests_own_ttft_slo() -> None:
    b = late()  # queue_budget 0: each request's TTFT SLO
    rate = prefill_rate()
    b.beat("prefill-0", queued_tokens=int(rate * 5))  # about 5 s of prefill work queued
    with pytest.raises(Overloaded):
        held_one(b, ttft_slo=2.0)
    r = held_one(b, ttft_slo=60.0)  # a client that accepts the wait is held, not refused
    assert not r.done and b.stats()["held"] == 1


def test_a_negative_budget_never_sheds_the_request_waits_as_before() -> None:
    b = late(queue_budget=-1.0)
    b.beat("prefill-0", queued_tokens=10**7)
    r = held_one(b, ttft_slo=0.1)
    assert not r.done and b.stats()["held"] == 1 and "shed" not in b.stats()["counts"]


def test_a_held_request_that_times_out_names_the_prefill_pool_not_kv() -> None:
    b = late(queue_budget=-1.0, kv_wait_timeout=5.0)
    b.beat("prefill-0", queued_tokens=10 * BUDGET)
    held = held_one(b)
    b.tick(6.0)
    ((code, message),) = pins.errors(held)  # type: ignore[arg-type]
    assert code == "prefill_wait_timeout" and "prefill workers' queues stayed full" in message
    assert "KV" not in message.split("(late binding")[0]


def no_kv_bench(**overrides: object) -> pins.Bench:
    """One decode worker whose KV is full (deflect-all: decode workers only)."""
    b = pins.Bench("deflect-all", [("decode-0", 1000)], **overrides)
    b.beat("decode-0", kv_used=1000)
    return b


def test_with_nothing_of_this_router_decoding_the_first_without_kv_room_waits_bounded_by_its_budget() -> None:
    """No request of this router decodes (another router's fill the decode worker): nothing
    predicts when room frees, so the request waits, but no longer than its budget from arrival;
    then it fails as a refusal (429 kv_full, Retry-After) that names the budget."""
    b = no_kv_bench(queue_budget=0.5)
    r = b.submit()
    assert not r.done and b.stats()["kv_waiting"] == 1
    # placed after its budget less its lead to a first token, it would miss its budget
    until = b.core.admission.wait_until(r)
    assert until == pytest.approx(r.arrival + 0.5 - b.core.admission.lead(len(pins.PROMPT)))
    assert r.arrival < until < r.arrival + 0.5
    b.tick(until - 0.01 - b.clock.now)
    assert not r.done
    b.tick(0.02)
    ((code, message),) = pins.errors(r)  # type: ignore[arg-type]
    assert code == "kv_full" and "in time for its budget of 0.5 s (queue_budget" in message
    assert serve.error_status(code) == (429, 2.0)  # what was short, as at the door
    assert b.stats()["counts"]["budget_wait_timeouts"] == 1


def test_behind_a_queue_waiting_for_kv_the_wait_is_the_decoding_requests_remaining_tokens() -> None:
    b = pins.Bench("deflect-all", [("decode-0", 1000)])  # the budget: each request's TTFT SLO
    b.beat("decode-0")
    # three requests decoding, with 10, 40 and 100 tokens left
    running = [b.submit(pins.PROMPT[:10], m.Sampling(max_tokens=n + 1)) for n in (10, 40, 100)]
    for r in running:
        b.tokens("decode-0", r, [1])
    b.beat("decode-0", kv_used=1000, batch=3)  # and KV full
    step = b.core.admission.decode_ends(b.clock.now)[0] / 10  # the worker's step time
    assert sorted(b.core.admission.decode_ends(b.clock.now)) == pytest.approx([10 * step, 40 * step, 100 * step])
    first = b.submit(ttft_slo=1000.0)  # a client that accepts the wait: it waits
    assert not first.done
    tokens = len(pins.PROMPT)
    rest = b.core.admission.lead(tokens)
    assert rest == b.core.admission.alone_s(tokens) + b.core.admission.first_step(tokens)  # nothing measured yet
    # the second waits for the second request to end: 40 steps (each room seen at a heartbeat: two
    # rooms, two intervals at most), then its own prefill and first step
    hb = b.core.cfg.heartbeat_interval
    predicted = 40 * step + 2 * hb + rest
    with pytest.raises(Overloaded) as e:
        b.submit(ttft_slo=0.001)
    assert e.value.code == "kv_full" and "1 requests wait for room before it" in str(e.value)
    text = str(e.value)
    assert f"predicted in {40 * step + 2 * hb:.1f} s" in text and f"time to first token {predicted:.1f} s" in text
    assert e.value.retry_after_s == max(1.0, math.ceil(predicted - 0.001 * (1 - ROOM_MARGIN)))


def test_a_queue_longer_than_the_requests_decoding_adds_a_service_time_per_round() -> None:
    """With the decode guard on, a decode pool may hold few requests; a queue that outgrows them is
    predicted too (each round of rooms past the ones decoding now: one request's prefill and its
    max_tokens steps), not left to wait until kv_wait_timeout (the live overload test's 30 s waits)."""
    b = pins.Bench("deflect-all", [("decode-0", 1000)])
    b.beat("decode-0")
    running = b.submit(pins.PROMPT[:10], m.Sampling(max_tokens=11))
    b.tokens("decode-0", running, [1])
    b.beat("decode-0", kv_used=1000, batch=1)  # one request decoding, and KV full
    (end,) = b.core.admission.decode_ends(b.clock.now)
    first = b.submit(ttft_slo=1000.0)  # it waits for the end of the one decoding
    assert not first.done
    # the second room: after the first waiter's turn (each seen at a heartbeat)
    wait = end + b.core.admission.service_s(first) + 2 * b.core.cfg.heartbeat_interval
    with pytest.raises(Overloaded) as e:
        b.submit(ttft_slo=0.001)
    assert "1 requests wait for room before it, 1 decode now" in str(e.value)
    assert f"predicted in {wait:.1f} s" in str(e.value)


def guarded(**overrides: object) -> tuple[pins.Bench, Request]:
    """Kairos with the decode guard on, as shipped (decode_room, decode_beta 0.95): one prefill and
    one decode worker, one request decoding there (10 tokens left), and the decode worker's residents'
    TBT SLO so strict that no decode step with another request added fits it: decode step time is
    short, KV is not (the decode worker's KV is nearly empty)."""
    b = pins.Bench("kairos", [("prefill-0", 0), ("decode-0", pins.BIG)], **overrides)
    assert b.core.cfg.decode_room and b.core.cfg.decode_beta == 0.95  # the shipped guard
    b.beat("prefill-0")
    b.beat("decode-0")
    running = b.submit(pins.PROMPT[:10], m.Sampling(max_tokens=11))
    b.tokens("decode-0", running, [1])
    b.beat("prefill-0")
    b.beat("decode-0", kv_used=20, batch=1, strictest_tbt_slo=1e-5)
    return b, running


def test_behind_a_queue_waiting_for_decode_step_room_the_429_says_decode_busy_not_kv_full() -> None:
    """With the decode guard on, what is short is decode step time, not KV: a request refused
    behind the ones waiting for decode room is refused `decode_busy` (x-kairos-error, the
    overload_shed line, the rejected metric's label), never `kv_full` (issue 48: the reason named a
    KV shortage while every decode worker's KV was nearly empty)."""
    b, _ = guarded()
    first = b.submit(ttft_slo=1000.0)  # a client that accepts a long wait: it waits for room
    assert not first.done and b.stats()["kv_waiting"] == 1
    assert b.stats()["counts"]["decode_room_waited"] == 1
    with capture_logs() as logs, pytest.raises(Overloaded) as e:
        b.submit(ttft_slo=0.001)
    assert e.value.code == "decode_busy", e.value
    assert "decode step room" in str(e.value) and "KV room" not in str(e.value)
    (shed,) = [x for x in logs if x["event"] == "overload_shed"]
    assert shed["code"] == "decode_busy"


def test_the_first_request_to_wait_for_decode_room_is_predicted_and_refused_past_its_budget() -> None:
    """Issue 48: on the shipped defaults (decode guard on) a decode-pool overload served some
    requests at 18 s because the first to wait for decode room was never predicted. It is: its
    wait is the soonest end of the requests decoding (their max_tokens at the worker's recent step
    time), then its prefill and first decode step; past its budget it is refused at once (429
    decode_busy, Retry-After from the prediction)."""
    b, _ = guarded()
    (end,) = b.core.admission.decode_ends(b.clock.now)
    assert end > 0
    tokens = len(pins.PROMPT)
    predicted = end + b.core.cfg.heartbeat_interval + b.core.admission.lead(tokens)  # room seen at a heartbeat
    slo = predicted / 2
    with pytest.raises(Overloaded) as e:
        b.submit(ttft_slo=slo)  # nobody waits before it: the first to wait
    assert e.value.code == "decode_busy"
    assert "0 requests wait for room before it, 1 decode now" in str(e.value)
    assert f"time to first token {predicted:.1f} s" in str(e.value)
    assert e.value.retry_after_s == max(1.0, math.ceil(predicted - slo * (1 - ROOM_MARGIN)))
    assert b.stats()["kv_waiting"] == 0 and b.stats()["counts"]["shed"] == 1
    with pytest.raises(Overloaded):  # a decode-room wait keeps a margin: within the budget, not within 90 % of it
        b.submit(ttft_slo=predicted / (1 - ROOM_MARGIN) * 0.99)
    ok = b.submit(ttft_slo=predicted / (1 - ROOM_MARGIN) * 1.01)  # predicted within it: it waits
    assert not ok.done and b.stats()["kv_waiting"] == 1


def test_a_request_let_wait_for_decode_room_fails_fast_at_its_budget_never_served_past_it() -> None:
    """A prediction can be short (the decode guard keeps the room closed after the request it
    counted on ends): the request admitted to wait waits at most its budget from arrival (less its
    lead to a first token), then fails as a refusal (429 decode_busy, Retry-After) instead of
    waiting kv_wait_timeout (30 s) and being served past its budget."""
    b, running = guarded()
    r = b.submit(ttft_slo=1.0)
    assert not r.done and b.stats()["kv_waiting"] == 1
    b.tokens("decode-0", running, [1] * 10, "length")  # the one decoding ends ...
    b.beat("decode-0", kv_used=20, batch=1, strictest_tbt_slo=1e-5)  # ... and another router's takes its room
    lead = b.core.admission.lead(len(pins.PROMPT))
    assert 0 < lead < 0.5
    b.tick(1.0 - lead - 0.01)
    assert not r.done
    b.tick(0.02)  # placed now, its first token would come past its budget
    ((code, message),) = pins.errors(r)  # type: ignore[arg-type]
    assert code == "decode_busy" and "in time for its budget of 1 s (its TTFT SLO" in message
    assert serve.error_status(code) == (429, 2.0)


def test_while_decode_room_is_short_a_held_request_is_predicted_from_decode_room_too() -> None:
    """Late binding holds a request while the prefill queue is deep, and decides decode room only
    after: under a decode-pool overload the held request then waits for decode room as well. While
    a decision lately found no decode room, a held request's prediction is the later of the prefill
    pool's and decode room's (before: the prefill pool's alone, so it was let in and waited)."""
    b, _ = guarded()
    first = b.submit(ttft_slo=1000.0)  # no decode room: it waits (and decode room is known short) ...
    assert not first.done and not first.held
    held_pred = b.core.admission.predict_prefill(first, [])
    b.core.abort(first, b.clock.now)  # ... and goes (its client left): nobody waits for room now
    b.beat("decode-0", kv_used=20, batch=1)  # the decode worker's view shows room this instant ...
    b.beat("prefill-0", queued_tokens=BUDGET)  # ... but the prefill queue is deep: late binding holds the next
    assert held_pred is not None
    with pytest.raises(Overloaded) as e:
        # within the prefill pool's prediction, not decode room's (a TBT SLO no chunk fits: no deflection)
        b.submit(ttft_slo=held_pred.ttft_s * 2, tbt_slo=pins.NO_SLACK)
    assert e.value.code == "decode_busy" and "0 requests wait for room before it" in str(e.value)
    assert "late binding" in str(e.value)  # held, as the policy said


def test_one_client_holds_at_most_its_share_of_max_in_flight() -> None:
    b = pins.Bench("deflect-all", [("decode-0", pins.BIG)], max_in_flight=8, client_share=0.25)
    a = [b.submit(client="addr:10.0.0.1") for _ in range(2)]  # its share: 0.25 x 8 = 2
    with pytest.raises(Overloaded) as e:
        b.submit(client="addr:10.0.0.1")
    assert e.value.code == "client_share" and "10.0.0.1" in str(e.value)
    other = b.submit(client="addr:10.0.0.2")  # another client is not refused
    assert not other.done
    b.tokens("decode-0", a[0], [1], "length")  # one of the first client's ends: room for one more
    b.submit(client="addr:10.0.0.1")
    assert b.core.admission.clients["addr:10.0.0.1"] == 2
    b.core.abort(other, b.clock.now)
    assert "addr:10.0.0.2" not in b.core.admission.clients  # nothing left behind for a client gone


def test_a_share_of_one_is_no_share() -> None:
    b = pins.Bench("deflect-all", [("decode-0", pins.BIG)], max_in_flight=8, client_share=1.0)
    for _ in range(8):
        b.submit(client="addr:10.0.0.1")
    with pytest.raises(Overloaded) as e:
        b.submit(client="addr:10.0.0.1")
    assert e.value.code == "overloaded"  # max_in_flight itself


class _NoTokenizer:
    """A tokenizer that fails if used: a refused batch must not be tokenized."""

    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("a refused batch was tokenized")


def test_a_batched_prompt_list_over_the_limit_is_a_400_before_any_prompt_is_tokenized() -> None:
    cfg = RouterConfig(max_batch=256, client_share=0.25, max_in_flight=4096)
    body = schema.decode(msgspec_json({"prompt": ["hi"] * 10_000, "max_tokens": 1}), chat=False)
    with pytest.raises(RequestError) as e:
        schema.plan(body, cfg, _NoTokenizer())  # type: ignore[arg-type]
    assert e.value.code == "batch_too_large" and "10000 sub-requests" in str(e.value)
    body = schema.decode(msgspec_json({"prompt": ["hi"] * 100, "n": 3, "max_tokens": 1,
                                       "temperature": 1.0}), chat=False)
    with pytest.raises(RequestError):  # 300 sub-requests: prompts x n counts
        schema.plan(body, cfg, _NoTokenizer())  # type: ignore[arg-type]


def test_the_batch_limit_is_never_above_one_clients_share() -> None:
    assert schema.batch_limit(RouterConfig(max_batch=256, client_share=0.25, max_in_flight=400)) == 100
    assert schema.batch_limit(RouterConfig(max_batch=256, client_share=1.0, max_in_flight=4096)) == 256


def msgspec_json(obj: object) -> bytes:
    return msgspec.json.encode(obj)
