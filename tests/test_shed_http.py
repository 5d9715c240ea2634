"""The HTTP shell's part of admission (services/router/http.py), in process: the router with a fake
outbox behind the ASGI app, no socket. A refusal is a 429 with Retry-After and the reason in
x-kairos-error before any byte of a stream; a batch's sub-requests each count against the
client's share as they are made, with the event loop free between slices; a batch over the limit
is a 400."""

from __future__ import annotations

import asyncio
import itertools
import types
from typing import Any

import httpx
import pytest

from common import config
from common import messages as m
from services.router import http
from services.router import openai_serve as serve
from services.router.service import Router
from tests.router_fakes import FakeOutbox, hello


def router(**overrides: Any) -> Router:
    cfg = config.load(config.RouterConfig, env={},
                      overrides={"policy": "deflect-all", "profile": "fast", "liveness": 10_000, **overrides})
    r = Router(cfg, outbox=FakeOutbox())
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), 1.0)
    return r


def client(r: Router) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=http.App(r), client=("10.0.0.7", 1234)),
                             base_url="http://router")


def body(prompts: int, stream: bool = False) -> dict[str, object]:
    return {"prompt": [[5, 6, 7]] * prompts if prompts > 1 else [5, 6, 7], "max_tokens": 2, "stream": stream}


async def test_past_the_clients_share_a_batch_is_refused_whole_with_429_before_any_stream_byte() -> None:
    r = router(max_in_flight=400, client_share=0.25)  # a client's share: 100
    async with client(r) as c:
        held = [r.submit([1, 2, 3], m.Sampling(max_tokens=2), client="addr:10.0.0.7") for _ in range(60)]
        resp = await c.post("/v1/completions", json=body(50, stream=True))  # 40 fit, the 41st does not
        assert resp.status_code == 429, resp.text
        assert resp.headers["x-kairos-error"] == "client_share" and int(resp.headers["retry-after"]) >= 1
        assert resp.headers["content-type"] == "application/json" and b"data:" not in resp.content
        assert resp.json()["error"]["type"] == "RateLimitError"
        # the 40 admitted before the refusal are gone again; the 60 are untouched
        assert r.core.admission.clients["addr:10.0.0.7"] == 60 and len(r.requests) == 60
    assert all(not q.done for q in held)


async def test_a_client_with_its_own_key_has_its_own_share() -> None:
    r = router(max_in_flight=8, client_share=0.25)  # 2 each
    for _ in range(2):
        r.submit([1, 2, 3], m.Sampling(max_tokens=2), client="addr:10.0.0.7")
    async with client(r) as c:
        refused = await c.post("/v1/completions", json=body(1))
        assert refused.status_code == 429 and refused.headers["x-kairos-error"] == "client_share"
        # another key from the same address is another client: admitted (it then waits for tokens)
        task = asyncio.create_task(c.post("/v1/completions", json=body(1),
                                          headers={"authorization": "Bearer user-b"}))
        for _ in range(100):
            await asyncio.sleep(0)
            if len(r.requests) == 3:
                break
        assert len(r.requests) == 3 and any(k.startswith("key:") for k in r.core.admission.clients)
        task.cancel()


async def test_a_batch_is_admitted_in_slices_with_the_loop_free_between_them() -> None:
    r = router()
    turns = 0  # times another task got the loop
    seen: list[int] = []  # `turns` at each sub-request's admission
    admit = r.admit

    async def recording(*a: Any, **kw: Any) -> Any:
        seen.append(turns)
        return await admit(*a, **kw)

    r.admit = recording  # type: ignore[method-assign]

    async def ticker() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    t = asyncio.create_task(ticker())
    async with client(r) as c:
        task = asyncio.create_task(c.post("/v1/completions", json=body(64, stream=True)))
        for _ in range(1000):
            await asyncio.sleep(0)
            if len(seen) == 64:
                break
        task.cancel()
    t.cancel()
    assert len(seen) == 64
    # the other task ran between the slices (without yields the 64 are admitted in one go)
    slices = [seen[i:i + http.ADMIT_SLICE] for i in range(0, 64, http.ADMIT_SLICE)]
    assert all(len(set(s)) == 1 for s in slices)  # one slice at once
    assert all(a[0] < b[0] for a, b in itertools.pairwise(slices))  # the loop free between slices


async def test_a_batch_over_the_limit_is_a_400_and_nothing_is_admitted() -> None:
    r = router(max_batch=32)
    async with client(r) as c:
        resp = await c.post("/v1/completions", json=body(33))
    assert resp.status_code == 400 and resp.headers["x-kairos-error"] == "batch_too_large"
    assert "retry-after" not in resp.headers and not r.requests


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
async def test_a_stream_that_waited_past_its_budget_is_refused_429_before_any_byte_not_failed_inside(path: str) -> None:
    """A request let wait at the router (its wait unpredicted, or predicted within its budget) whose
    budget runs out before it is placed gets a 429 with Retry-After and what was short, not a
    `200 OK` stream with an error event inside (issue 48: 'never a stream that waits and then
    fails'): a streamed request's status line waits while the router holds it."""
    r = router(queue_budget=0.3)
    r.core.on_message(b"decode-0", m.DecodeHeartbeat(
        worker_id="decode-0", incarnation="inc-decode-0", seq=1, batch=0, kv_tokens=100_000, kv_free_tokens=0,
        kv_capacity_tokens=100_000, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
        token_budget=2048, last_dispatch=0), 1.0)  # KV full, and none of this router's requests decoding
    async with client(r) as c:
        req_body = body(1, stream=True) if path == "/v1/completions" else \
            {"input": "hello", "max_output_tokens": 2, "stream": True}
        task = asyncio.create_task(c.post(path, json=req_body))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if r.core.stats()["kv_waiting"] == 1:
                break
        assert r.core.stats()["kv_waiting"] == 1 and not task.done()  # waiting, and no status line yet
        (req,) = r.requests.values()
        r.core.tick(req.kv_wait_until + 0.01)  # its budget (less its lead to a first token) ran out
        resp = await asyncio.wait_for(task, 5.0)
    assert resp.status_code == 429, resp.text
    assert resp.headers["x-kairos-error"] == "kv_full" and int(resp.headers["retry-after"]) >= 1
    assert b"data:" not in resp.content and "budget of 0.3 s" in resp.json()["error"]["message"]


async def test_a_waiting_stream_whose_request_ended_without_an_event_stops_waiting_for_placement() -> None:
    """A request aborted while it waits (its client went away: no event is put) must not keep the
    stream's task polling for a placement that never comes."""
    r = router(queue_budget=-1.0)
    req = r.submit([1, 2, 3], m.Sampling(max_tokens=2))
    req.kv_wait_until = 1e9  # as if waiting in the router's queue
    req.done = True  # ended by an abort: no event
    choice = types.SimpleNamespace(req=req)
    assert await asyncio.wait_for(serve.placed([choice]), 1.0) is None  # type: ignore[list-item]


async def through(app: Any, peer: str, forwarded: str) -> str:
    """The client key the router books a request under, sent from `peer` with X-Forwarded-For."""
    r = app.app.router if hasattr(app, "app") else app.router
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(peer, 1234)),
                                 base_url="http://router") as c:
        task = asyncio.create_task(c.post("/v1/completions", json=body(1),
                                          headers={"x-forwarded-for": forwarded}))
        for _ in range(200):
            await asyncio.sleep(0)
            if r.core.admission.clients:
                break
        task.cancel()
    keys = list(r.core.admission.clients)
    assert len(keys) == 1, keys
    return keys[0]


async def test_x_forwarded_for_counts_only_from_the_proxies_the_router_trusts() -> None:
    # the default trusts a proxy on the same host: its clients are told apart
    assert await through(http.asgi_app(router(), "127.0.0.1,::1"), "127.0.0.1", "10.9.9.9") == "addr:10.9.9.9"
    # from any other peer the header is ignored: a client cannot pose as many to escape its share
    assert await through(http.asgi_app(router(), "127.0.0.1,::1"), "10.0.0.7", "10.9.9.9") == "addr:10.0.0.7"
    # a balancer on another network, named by its network
    assert await through(http.asgi_app(router(), "10.0.0.0/8"), "10.0.0.7", "192.0.2.5") == "addr:192.0.2.5"
    # empty: believe no one, not even the host itself
    assert await through(http.asgi_app(router(), ""), "127.0.0.1", "10.9.9.9") == "addr:127.0.0.1"
