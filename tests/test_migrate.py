"""Mid-stream migration at the router: a request whose decode worker dies after streaming
tokens continues on another one, and the client's stream has every token once, in order.

The router core runs without sockets or clock (its sends are captured, time is passed in); the
second decode worker's engine is a real SimEngine fed the router's DecodeWork, so the
continuation is the engine's own.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest

from common import config
from common import messages as m
from common.engines.base import EngineRequest
from common.engines.sim import SimEngine, synthetic_token
from common.perf_model import load_profile
from common.policy import ClusterView, Decision, Policy, RequestSpec
from common.router_core.core import RouterCore
from common.router_core.requests import Event, Request
from tests.router_fakes import FakeOutbox, hello, make_core
from tests.sim_engine_run import run_to_end

NOW = 1000.0  # the router core's time in these tests (it reads no clock)


def make_router(policy: str, **overrides: Any) -> tuple[RouterCore, list[tuple[str, m.Msg]]]:
    r, box = make_core(policy, **overrides)
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    box.sent.clear()  # the Welcomes
    return r, box.sent


def work_for(sent: list[tuple[str, m.Msg]], rid: str, attempt: int) -> tuple[str, m.DecodeWork]:
    found = [(w, msg) for w, msg in sent
             if isinstance(msg, m.DecodeWork) and msg.request_id == rid and msg.attempt == attempt]
    assert len(found) == 1, sent
    return found[0]


def tokens(worker: str, rid: str, attempt: int, ids: list[int], finish: str | None = None) -> m.TokenBatch:
    return m.TokenBatch(worker_id=worker, items=[m.TokenItem(rid, attempt, ids, finish)])


def lose(r: RouterCore, worker: str) -> None:
    """What the liveness tick does when a worker goes silent."""
    w = r.table.remove(worker)
    assert w is not None
    r.membership.worker_gone(w, "heartbeat timeout", NOW)


def drain(req: Request) -> list[Event]:
    items: list[Event] = []
    while req.events._items:
        items += req.events._items
        req.events._items = []
    return items


async def decode_on_sim(work: m.DecodeWork) -> list[m.TokenItem]:
    """Run the DecodeWork on a real simulated decode engine (as the decode worker would) to the end."""
    return await run_on_sim("decode", EngineRequest(
        request_id=work.request_id, attempt=work.attempt, prompt_token_ids=work.prompt_token_ids,
        sampling=work.sampling, mode="deflect", resume_tokens=work.resume_tokens))


async def run_on_sim(role: Literal["prefill", "decode"], request: EngineRequest) -> list[m.TokenItem]:
    """Run one request on a real simulated engine in `role` to its end; the token items it emitted."""
    return await run_to_end(SimEngine(role, load_profile("fast"), time_scale=0.001), request)


@pytest.mark.parametrize("policy", ["deflect-all", "disagg-least-loaded"])
async def test_a_dead_decode_worker_mid_stream_costs_the_client_nothing(policy: str) -> None:
    r, sent = make_router(policy)
    prompt = list(range(100, 140))
    req = r.submit(prompt, m.Sampling(max_tokens=10), NOW)
    rid = req.request_id
    first, _ = work_for(sent, rid, 0)
    want = [synthetic_token(rid, i) for i in range(10)]
    r.on_message(first.encode(), tokens(first, rid, 0, want[:3]), NOW)
    r.on_message(first.encode(), tokens(first, rid, 0, want[3:4]), NOW)
    sent.clear()

    lose(r, first)

    second, work1 = work_for(sent, rid, 1)
    assert second != first
    assert work1.prompt_token_ids == prompt + want[:4]        # prompt + every token already sent
    assert work1.sampling.max_tokens == 6 and work1.resume_tokens == 4
    if policy == "disagg-least-loaded":                        # the same policy decides the new path
        assert work1.mode == "handoff"
        pw = [msg for _, msg in sent if isinstance(msg, m.PrefillWork)]
        assert len(pw) == 1 and pw[0].prompt_token_ids == work1.prompt_token_ids and pw[0].attempt == 1
    else:
        assert work1.mode == "deflect"
    # the dead worker's late tokens (old attempt) never reach the client
    r.on_message(first.encode(), tokens(first, rid, 0, [synthetic_token(rid, 4)]), NOW)
    for item in await decode_on_sim(work1):
        r.on_message(second.encode(), m.TokenBatch(worker_id=second, items=[item]), NOW)

    events = drain(req)
    got = [t for ev in events for t in (ev.token_ids or [])]
    assert got == want                                         # one stream: none repeated, none missing
    assert [ev.finish_reason for ev in events if ev.finish_reason] == ["length"]
    assert not [ev for ev in events if ev.error]
    assert req.done and req.outcome == "ok" and req.n_out == 10 and req.migrations == 1
    rec = req.record(NOW)
    assert rec.output_tokens == 10 and rec.migrations == 1 and rec.prompt_tokens == len(prompt)
    assert r.counts["migrated"] == 1 and r.counts["completed"] == 1 and not r.counts["failed"]


async def test_the_migration_limit_fails_the_request_clearly() -> None:
    r, sent = make_router("deflect-all", max_migrations=1)
    req = r.submit(list(range(100, 120)), m.Sampling(max_tokens=8), NOW)
    rid = req.request_id
    first, _ = work_for(sent, rid, 0)
    r.on_message(first.encode(), tokens(first, rid, 0, [synthetic_token(rid, 0)]), NOW)
    lose(r, first)
    second, _ = work_for(sent, rid, 1)
    r.on_message(second.encode(), tokens(second, rid, 1, [synthetic_token(rid, 1)]), NOW)
    lose(r, second)  # a second loss: over the limit of one
    events = drain(req)
    errors = [ev for ev in events if ev.error]
    assert len(errors) == 1 and errors[0].error_code == "worker_lost_midstream"
    assert "limit 1" in (errors[0].error or "")
    assert req.done and req.migrations == 1 and r.counts["failed"] == 1


@pytest.mark.parametrize("streamed", [True, False])
async def test_with_no_decode_worker_left_the_request_waits_for_one(streamed: bool) -> None:
    """The last decode worker dies (e.g. the other one is restarting): the request is parked, not
    failed, and goes to the first decode worker that registers."""
    r, sent = make_router("deflect-all")
    lose(r, "decode-1")
    req = r.submit(list(range(100, 120)), m.Sampling(max_tokens=8), NOW)
    rid = req.request_id
    if streamed:
        r.on_message(b"decode-0", tokens("decode-0", rid, 0, [synthetic_token(rid, 0)]), NOW)
    sent.clear()
    lose(r, "decode-0")
    assert rid in r.parked and not req.done and not drain(req)[int(streamed):]
    r.on_message(b"decode-0", hello("decode-0", "decode"), NOW)  # back (a new process under the same id)
    r.tick(NOW)
    w, work = work_for(sent, rid, 1)
    assert w == "decode-0" and work.resume_tokens == int(streamed) and rid not in r.parked
    assert not req.done


@pytest.mark.parametrize("streamed", [True, False])
async def test_parked_too_long_fails_clearly(streamed: bool) -> None:
    r, _ = make_router("deflect-all", park_timeout=0.0)
    lose(r, "decode-1")
    req = r.submit(list(range(100, 120)), m.Sampling(max_tokens=8), NOW)
    rid = req.request_id
    if streamed:
        r.on_message(b"decode-0", tokens("decode-0", rid, 0, [synthetic_token(rid, 0)]), NOW)
    lose(r, "decode-0")
    r.tick(NOW)
    errors = [ev for ev in drain(req) if ev.error]
    assert len(errors) == 1 and req.done and rid not in r.parked
    assert errors[0].error_code == ("worker_lost_midstream" if streamed else "unavailable")
    assert "no worker" in (errors[0].error or "")


async def test_before_the_first_token_it_is_a_plain_redispatch() -> None:
    r, sent = make_router("deflect-all")
    req = r.submit(list(range(100, 120)), m.Sampling(max_tokens=8), NOW)
    first, _ = work_for(sent, req.request_id, 0)
    lose(r, first)
    _, work1 = work_for(sent, req.request_id, 1)
    assert work1.resume_tokens == 0 and work1.sampling.max_tokens == 8 and req.migrations == 0
    assert r.counts["redispatched"] == 1 and not r.counts["migrated"]


async def test_a_request_with_a_grammar_is_resumed_with_its_grammar() -> None:
    """The grammar goes with the resumed request, and the decode worker is told how many prompt
    tokens are output the grammar has to accept first (the vLLM engine's side: tests/vllm)."""
    r, sent = make_router("deflect-all")
    grammar = m.StructuredOutputs(json_object=True)
    req = r.submit(list(range(100, 120)), m.Sampling(max_tokens=8, structured=grammar), NOW)
    rid = req.request_id
    first, _ = work_for(sent, rid, 0)
    r.on_message(first.encode(), tokens(first, rid, 0, [synthetic_token(rid, 0), synthetic_token(rid, 1)]), NOW)
    lose(r, first)
    assert not [ev for ev in drain(req) if ev.error]
    _, work1 = work_for(sent, rid, 1)
    assert work1.resume_tokens == 2 and work1.sampling.structured == grammar and work1.sampling.max_tokens == 6
    assert req.migrations == 1 and not req.done


class _RetainWhenNoDecode(Policy):
    """A policy for the test below: deflect to the decode worker while there is one; with none,
    the third path (route "retain": the prefill worker decodes the request itself)."""

    name = "retain-when-no-decode"

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        if view.decode:
            return Decision(route="deflect", decode_worker=view.decode[0].worker_id, prefill_worker=None,
                            reason="test")
        wid = view.prefill[0].worker_id
        return Decision(route="retain", decode_worker=wid, prefill_worker=wid, reason="decode_pool_full")


async def test_a_request_resumed_by_route_retain_continues_its_stream_on_the_prefill_worker() -> None:
    """The chaos run's wrong text (kill decode-0 with the planner on): a streaming request whose
    decode worker died was resumed by route "retain" on a prefill worker, whose PrefillWork did not
    say which prompt tokens were output already streamed; the engine started the output over (the
    client saw its first tokens twice). The PrefillWork carries `resume_tokens`, the prefill
    worker core passes them to its engine, which continues at the client's position."""
    from common.engines.base import EngineLoad
    from common.worker_core import EngineInfo, PrefillCore
    from tests.test_retain import Ports

    cfg = config.load(config.RouterConfig, env={}, overrides={"profile": "fast"})
    box = FakeOutbox()
    r = RouterCore(cfg, box, policy=_RetainWhenNoDecode())
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        r.on_message(wid.encode(), hello(wid, role), NOW)  # type: ignore[arg-type]
    sent = box.sent
    sent.clear()
    prompt = list(range(100, 140))
    req = r.submit(prompt, m.Sampling(max_tokens=10), NOW)
    rid = req.request_id
    assert work_for(sent, rid, 0)[0] == "decode-0"
    want = [synthetic_token(rid, i) for i in range(10)]
    r.on_message(b"decode-0", tokens("decode-0", rid, 0, want[:4]), NOW)
    sent.clear()

    lose(r, "decode-0")

    pws = [msg for w, msg in sent if isinstance(msg, m.PrefillWork) and w == "prefill-0"]
    assert len(pws) == 1 and pws[0].retain and pws[0].attempt == 1
    assert pws[0].prompt_token_ids == prompt + want[:4] and pws[0].resume_tokens == 4
    # the prefill worker core starts it in its engine as a continuation ...
    ports = Ports()
    core = PrefillCore("prefill-0", "inc", EngineInfo(engine="sim", token_budget=2048, kv_capacity_tokens=100_000,
                                                      max_batch=8), ports, model="m")
    assert core.on_work(pws[0], EngineLoad(kv_free_tokens=100_000))
    started = ports.started[-1]
    assert (started.mode, started.resume_tokens) == ("retain", 4)
    # ... and the simulated prefill engine decodes it from there: the client sees each token once
    for item in await run_on_sim("prefill", started):
        r.on_message(b"prefill-0", m.TokenBatch(worker_id="prefill-0", items=[item]), NOW)
    events = drain(req)
    assert [t for ev in events for t in (ev.token_ids or [])] == want
    assert req.done and req.outcome == "ok" and req.n_out == 10 and req.migrations == 1



async def test_a_resumed_request_counts_min_tokens_from_the_client_and_asks_no_prompt_logprobs() -> None:
    """Found by a hostile live run (kill -9 a decode worker mid-stream; `kairos up`, sim engine):
    the resumed attempt's Sampling kept the client's `min_tokens`, which the engine counts from the
    attempt's own first token, so the `stop_token_ids` hit where the client's run stops was
    skipped (13 of 20 such requests ran 120 tokens past it); and it kept `prompt_logprobs`, so the
    new worker scored the resumed prompt (the prompt plus the output already sent) and its longer
    list replaced the client's: non-streamed `prompt_logprobs` ran past the prompt, and `echo`
    with `logprobs` failed with HTTP 500 (openai_render.completion_logprobs: zip strict). The
    resumed attempt asks for the min_tokens left and no prompt logprobs (the client has them)."""
    r, sent = make_router("deflect-all")
    prompt = list(range(100, 140))
    want = [synthetic_token("seed:7", i) for i in range(20)]
    st = want[9]
    stop = next(i for i in range(7, 20) if want[i] == st)  # the client's run: the first hit with 8 generated
    req = r.submit(prompt, m.Sampling(max_tokens=20, min_tokens=8, stop_token_ids=(st,), prompt_logprobs=1,
                                      seed=7), NOW)
    rid = req.request_id
    first, _ = work_for(sent, rid, 0)
    r.on_message(first.encode(), tokens(first, rid, 0, want[:4]), NOW)
    sent.clear()

    lose(r, first)

    second, work1 = work_for(sent, rid, 1)
    assert work1.resume_tokens == 4 and work1.sampling.max_tokens == 16
    assert work1.sampling.min_tokens == 4 and work1.sampling.prompt_logprobs is None
    for item in await decode_on_sim(work1):
        r.on_message(second.encode(), m.TokenBatch(worker_id=second, items=[item]), NOW)
    events = drain(req)
    assert [t for ev in events for t in (ev.token_ids or [])] == want[:stop + 1]
    assert [ev.finish_reason for ev in events if ev.finish_reason] == ["stop"]
    assert not [ev for ev in events if ev.prompt_logprobs]
