"""A bus that trusts no one: the router checks every worker message against the requests it
assigned to the sender (bound to its ZeroMQ identity at Hello), refuses incompatible workers,
rejects at once what no worker can serve, and survives a message it fails to handle.

Router-only, without sockets: frames are handed to the router shell's work-socket callback as
the socket would hand them (identity, payload), and what the core sends goes to a FakeOutbox
(tests/router_fakes.py) that takes everything, as if every worker were connected; tests read it
there (`sent(router)`), with the router's state and its clients' events.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from common import codec, config
from common import messages as m
from common.errors import RequestError
from common.ports import free_port
from common.router_core.requests import Request
from services.router import metrics
from services.router.service import Router
from tests.router_fakes import Clock, FakeOutbox, make_core

SAMPLING = m.Sampling(max_tokens=4, ignore_eos=True)


def hello(worker_id: str, role: m.Role = "decode", **kw: object) -> m.Hello:
    base: dict[str, object] = dict(protocol=m.PROTOCOL_VERSION, worker_id=worker_id, role=role, incarnation="i1",
                                   engine="sim", model="kairos-sim", token_budget=2048,
                                   kv_capacity_tokens=10**6, kv_transport="modeled")
    base.update(kw)
    return m.Hello(**base)  # type: ignore[arg-type]


def make_router(policy: str = "kairos", *, open_bus: bool = False, **overrides: object) -> Router:
    """A router whose core sends to a FakeOutbox; `open_bus`: also bind its sockets on free ports
    (what the CURVE key checks read)."""
    cfg = config.load(config.RouterConfig, env={}, overrides={
        "work_port": free_port(), "heartbeat_port": free_port(), "telemetry_port": free_port(),
        "policy": policy, "profile": "fast", **overrides})
    r = Router(cfg, outbox=FakeOutbox())
    if open_bus:
        r.open()
    return r


def sent(r: Router) -> list[tuple[str, m.Msg]]:
    """What the router's core sent, (worker id, message), since the list was last cleared."""
    box = r.core.outbox
    assert isinstance(box, FakeOutbox)
    return box.sent


@pytest.fixture
def router() -> Iterator[Router]:
    r = make_router()
    yield r
    r.close()


def frame(r: Router, identity: bytes, msg: m.Msg) -> None:
    r._on_work_frames([identity, codec.encode(msg)])


def dropped(reason: str) -> float:
    return metrics.DROPPED.labels(reason)._value.get()  # type: ignore[no-any-return]


def events(req: Request) -> list[object]:
    items = list(req.events._items)
    return items


async def test_forged_token_batch_never_reaches_the_client(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"decode-1", hello("decode-1"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    assert set(router.table.workers) == {"decode-0", "decode-1", "prefill-0"}
    req = router.submit([1, 2, 3], SAMPLING)
    owner = req.decode_worker
    assert owner is not None
    other = "decode-1" if owner == "decode-0" else "decode-0"
    forged = m.TokenBatch(worker_id=owner, items=[m.TokenItem(req.request_id, req.attempt, [666], "stop")])

    before = {r: dropped(r) for r in ("unregistered_peer", "worker_id_mismatch", "not_assigned")}
    frame(router, b"intruder", forged)                        # a peer that never registered
    frame(router, other.encode(), forged)                     # a registered worker claiming another's id
    frame(router, other.encode(), m.TokenBatch(worker_id=other, items=forged.items))  # not its request
    frame(router, b"prefill-0", m.TokenBatch(worker_id="prefill-0", items=forged.items))
    assert events(req) == [] and not req.done
    assert dropped("unregistered_peer") == before["unregistered_peer"] + 1
    assert dropped("worker_id_mismatch") == before["worker_id_mismatch"] + 1
    assert dropped("not_assigned") == before["not_assigned"] + 2

    # the other message kinds from a peer that may not send them change nothing either
    for msg in (m.RequestFailed(request_id=req.request_id, attempt=0, worker_id=other, reason="x", retryable=False),
                m.KvTarget(request_id=req.request_id, attempt=0, decode_worker=other),
                m.Goodbye(worker_id=owner, incarnation="i1", reason="drained")):
        frame(router, other.encode(), msg)
    frame(router, b"intruder", m.Goodbye(worker_id=owner, incarnation="i1", reason="drained"))
    assert not req.done and owner in router.table.workers and not router.table.workers[owner].draining

    # the owner's tokens get through
    frame(router, owner.encode(), m.TokenBatch(worker_id=owner, items=[m.TokenItem(req.request_id, 0, [7, 8])]))
    frame(router, owner.encode(), m.TokenBatch(worker_id=owner, items=[m.TokenItem(req.request_id, 0, [9], "length")]))
    got = events(req)
    assert [e.token_ids for e in got[:2]] == [[7, 8], [9]]  # type: ignore[attr-defined]
    assert req.done and req.outcome == "ok"


async def test_tokens_for_a_request_moved_elsewhere_are_dropped_and_cancelled_there(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"decode-1", hello("decode-1"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    req = router.submit([1, 2, 3], SAMPLING)
    other = "decode-1" if req.decode_worker == "decode-0" else "decode-0"
    sent(router).clear()
    frame(router, other.encode(), m.TokenBatch(worker_id=other, items=[m.TokenItem(req.request_id, 0, [1])]))
    assert events(req) == []
    assert sent(router) == [(other, m.Cancel(request_id=req.request_id, attempt=0, reason="not_assigned"))]


async def test_request_ids_are_random_and_client_ids_only_labels(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    a = router.submit([1], SAMPLING, request_id="mine")
    b = router.submit([1], SAMPLING, request_id="mine")
    assert a.request_id != b.request_id and "mine" not in (a.request_id, b.request_id)
    assert a.client_request_id == b.client_request_id == "mine"
    assert len(a.request_id) == 24 and int(a.request_id, 16) >= 0  # 96 random bits


async def test_prompt_over_every_workers_max_model_len_is_rejected_before_dispatch(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0", max_model_len=64))
    frame(router, b"decode-1", hello("decode-1", max_model_len=128))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    with pytest.raises(RequestError) as e:
        router.submit(list(range(128)), SAMPLING)
    assert e.value.code == "context_length_exceeded" and "128" in str(e.value)
    assert router.counts["accepted"] == 0 and router.routes.total() == 0  # never dispatched
    ok = router.submit(list(range(100)), SAMPLING)  # fits decode-1
    assert ok.decode_worker == "decode-1"
    frame(router, b"decode-2", hello("decode-2"))  # no limit advertised: nothing is judged too long
    router.submit(list(range(500)), SAMPLING)


async def test_more_tokens_than_any_decode_workers_kv_is_rejected_before_dispatch(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0", kv_capacity_tokens=1000))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    with pytest.raises(RequestError) as e:
        router.submit(list(range(900)), m.Sampling(max_tokens=200))
    assert e.value.param == "max_tokens" and "1100" in str(e.value) and "1000" in str(e.value)
    router.submit(list(range(900)), m.Sampling(max_tokens=100))


@pytest.mark.parametrize(("change", "why"), [
    ({"engine": "vllm"}, "engine"),
    ({"kv_transport": "nixl"}, "kv_transport"),
    ({"model": "other-model"}, "model"),
    ({"protocol": m.PROTOCOL_VERSION + 1}, "protocol"),
])
async def test_incompatible_worker_is_refused_at_registration(router: Router, change: dict[str, object],
                                                             why: str) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    before = metrics.REFUSED.labels(why)._value.get()
    frame(router, b"odd-1", hello("odd-1", **change))
    assert "odd-1" not in router.table.workers
    assert metrics.REFUSED.labels(why)._value.get() == before + 1


async def test_a_hello_under_another_identity_is_refused(router: Router) -> None:
    frame(router, b"someone", hello("decode-0"))
    assert "decode-0" not in router.table.workers


async def test_a_handler_error_fails_one_request_not_the_router() -> None:
    """A message the router fails to handle (here a PrefillDone without its KV handle, which the
    decoder would never let through: input nobody foresaw, or a bug) fails the one request it
    concerns and nothing else."""
    router = make_router("disagg-least-loaded")
    frame(router, b"decode-0", hello("decode-0"))
    frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
    bad = router.submit([1, 2], SAMPLING)
    good = router.submit([3, 4], SAMPLING)
    assert bad.prefill_worker == good.prefill_worker == "prefill-0"
    broken = m.PrefillDone(request_id=bad.request_id, attempt=0, worker_id="prefill-0", kv=None,  # type: ignore[arg-type]
                           queue_s=0, prefill_s=0)
    router.core.on_message(b"prefill-0", broken, time.monotonic())
    assert bad.done and bad.outcome == "internal_error" and router.counts["handler_errors"] == 1
    kv = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=2)
    frame(router, b"prefill-0", m.PrefillDone(request_id=good.request_id, attempt=0, worker_id="prefill-0", kv=kv,
                                              queue_s=0, prefill_s=0))
    frame(router, b"decode-0", m.TokenBatch(worker_id="decode-0",
                                            items=[m.TokenItem(good.request_id, 0, [5], "length")]))
    assert good.done and good.outcome == "ok"


async def test_goodbye_drained_is_a_departure(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    lost = metrics.WORKERS_LOST.labels("decode")._value.get()
    departed = metrics.DEPARTED.labels("decode")._value.get()
    frame(router, b"decode-0", m.Goodbye(worker_id="decode-0", incarnation="i1"))
    assert router.table.workers["decode-0"].draining
    frame(router, b"decode-0", m.Goodbye(worker_id="decode-0", incarnation="i1", reason="drained"))
    assert "decode-0" not in router.table.workers
    assert metrics.DEPARTED.labels("decode")._value.get() == departed + 1
    assert metrics.WORKERS_LOST.labels("decode")._value.get() == lost


async def test_welcome_names_the_requests_the_router_does_not_track(router: Router) -> None:
    frame(router, b"decode-0", hello("decode-0"))
    req = router.submit([1, 2], SAMPLING)
    sent(router).clear()
    frame(router, b"decode-0", hello("decode-0", held=[req.request_id, "from-a-router-before-a-restart"]))
    welcome = [msg for _, msg in sent(router) if isinstance(msg, m.Welcome)]
    assert len(welcome) == 1 and welcome[0].drop == ["from-a-router-before-a-restart"]


def test_a_worker_the_router_cannot_reach_is_lost_until_it_says_hello_again() -> None:
    """A send that fails (ZeroMQ: unroutable; e.g. the worker reconnected while its old
    connection lingered) takes the worker out of the view at once; its heartbeats, which still
    arrive on their own socket, do not keep it alive; the liveness tick declares it lost and
    re-dispatches its request; a Hello brings it back. (The router core, driven with explicit time.)"""
    core, box = make_core("kairos", heartbeat_interval=0.02, liveness=10)  # lost after 0.2 s
    clock = Clock()
    core.on_message(b"decode-0", hello("decode-0"), clock.now)
    box.unreachable.add("decode-0")  # its connection is gone (a new one, if any, is ignored as a duplicate)
    req = core.submit([1, 2, 3], SAMPLING, clock.now)
    bad = "decode-0"
    assert req.decode_worker == bad and core.table.workers[bad].unreachable
    assert not core.table.view(use_ledger=True).decode
    core.on_message(b"decode-1", hello("decode-1"), clock.now)
    for seq in range(1, 30):  # it keeps beating, and is still declared lost
        hb = m.DecodeHeartbeat(worker_id=bad, incarnation="i1", seq=seq, batch=0, kv_tokens=0,
                               kv_free_tokens=10**6, kv_capacity_tokens=10**6, resident_prefill_tokens=0,
                               deflections=0, strictest_tbt_slo=None, token_budget=2048)
        core.on_message(bad.encode(), hb, clock.now)
        core.tick(clock.advance(0.02))
        if bad not in core.table.workers:
            break
    assert bad not in core.table.workers
    assert req.decode_worker == "decode-1" and not req.done  # re-dispatched to the reachable one
    box.unreachable.clear()
    core.on_message(bad.encode(), hello(bad), clock.now)
    assert bad in {d.worker_id for d in core.table.view(use_ledger=True).decode}


async def test_held_request_is_served_when_a_worker_registers(router: Router) -> None:
    import asyncio

    task = asyncio.create_task(router.admit([1, 2, 3], SAMPLING))
    await asyncio.sleep(0)  # it is now waiting: no worker
    assert not task.done()
    frame(router, b"decode-0", hello("decode-0"))
    req = await asyncio.wait_for(task, 5)
    assert req.decode_worker == "decode-0"


async def test_first_token_releases_the_kv_a_prefill_worker_holds_for_a_pull() -> None:
    router = make_router("disagg-least-loaded")
    try:
        frame(router, b"decode-0", hello("decode-0"))
        frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
        req = router.submit([1, 2, 3], SAMPLING)
        assert req.prefill_worker == "prefill-0"
        kv = m.KvHandle(transport="vllm", source_worker="prefill-0", tokens=3, params={"remote_block_ids": [1]})
        frame(router, b"prefill-0", m.PrefillDone(request_id=req.request_id, attempt=0, worker_id="prefill-0", kv=kv,
                                                  queue_s=0, prefill_s=0))
        sent(router).clear()
        frame(router, b"decode-0", m.TokenBatch(worker_id="decode-0", items=[m.TokenItem(req.request_id, 0, [5])]))
        assert sent(router) == [("prefill-0", m.Cancel(request_id=req.request_id, attempt=0, reason="kv_consumed"))]
    finally:
        router.close()


def _metric(api: str, name: str, labels: str) -> float:
    import httpx

    text = httpx.get(api + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


def test_forged_token_batch_from_an_unregistered_peer_never_reaches_a_client(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """End to end: a stream is running; a peer that never registered sends tokens (and an end)
    for it, under the decode worker's name; the client gets exactly its own tokens."""
    import json

    import httpx
    import zmq

    from tests.conftest import start_cluster

    c = start_cluster(tmp_path_factory.mktemp("forged"), prefill=1, decode=1, profile="a100-dsv2-lite",
                      policy="kairos", kv_transport="modeled")  # real step times: ~8 s of streaming
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.IDENTITY, b"intruder")
        rogue.connect(f"tcp://127.0.0.1:{c.spec.work_port}")
        # long enough that the stream is still going after the forged batch is counted on a loaded
        # host (at 100 tokens, ~2 s, it had ended by then once, under a CI run and other tests)
        body = {"prompt": "hello there", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", c.spec.api + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
            rid = first["id"].removeprefix("cmpl-")
            words = first["choices"][0]["text"].split()
            before = _metric(c.spec.api, "kairos_router_dropped_messages_total", 'reason="unregistered_peer"')
            forged = codec.encode(m.TokenBatch(worker_id="decode-0", items=[
                m.TokenItem(rid, 0, [7] * 50, "stop")]))
            rogue.send(forged)
            deadline = time.monotonic() + 10
            while _metric(c.spec.api, "kairos_router_dropped_messages_total",
                          'reason="unregistered_peer"') < before + 1:
                assert time.monotonic() < deadline, "the router never counted the forged batch"
                rogue.send(forged)
                time.sleep(0.05)
            assert httpx.get(c.spec.api + "/v1/kairos/stats", timeout=5).json()["in_flight"] == 1  # still going
            finish = None
            for ln in lines:
                if not ln.startswith("data: ") or ln == "data: [DONE]":
                    continue
                ch = json.loads(ln[6:])["choices"][0]
                words += ch["text"].split()
                finish = ch["finish_reason"] or finish
        assert finish == "length" and len(words) == 400  # its own 400 tokens; not the forged 50 and "stop"
        log = (tmp_path_factory.getbasetemp()).glob("forged*/router.log")
        assert any('"message_dropped"' in p.read_text() and "intruder" in p.read_text() for p in log)
    finally:
        ctx.destroy(linger=0)
        c.stop(15)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.conftest import start_cluster

    c = start_cluster(tmp_path_factory.mktemp("live"), prefill=1, decode=2, profile="fast", policy="kairos")
    yield c
    c.stop(15)


def test_a_drained_worker_is_logged_as_a_departure(live: object) -> None:

    from kairos.up import Cluster

    assert isinstance(live, Cluster)
    live.stop_service("decode-1", 20)
    log = live.services["router"].log_path
    assert log is not None
    deadline = time.monotonic() + 10
    while '"worker_departed"' not in log.read_text():
        assert time.monotonic() < deadline, "no worker_departed in the router's log"
        time.sleep(0.05)
    lines = [ln for ln in log.read_text().splitlines() if '"decode-1"' in ln]
    assert any('"worker_departed"' in ln and '"level": "info"' in ln for ln in lines)
    assert not any('"worker_lost"' in ln for ln in lines)
    assert "decode-1" not in live.registered()


def test_bus_sockets_have_heartbeats_and_keepalive() -> None:
    import zmq

    from common.sockets import MonitorBus, RouterBus, WorkerBus

    ports = {"work_port": free_port(), "heartbeat_port": free_port(), "telemetry_port": free_port()}
    rcfg = config.load(config.RouterConfig, env={}, overrides=ports)
    wcfg = config.load(config.WorkerConfig, env={}, overrides=ports)
    mcfg = config.load(config.MonitorConfig, env={}, overrides=ports)
    rb = RouterBus(rcfg)
    wb = WorkerBus(wcfg, "w-1")
    mb = MonitorBus(mcfg)
    try:
        for sock in (rb.work, rb.telemetry, wb.work, mb.telemetry):
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 1000
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 3000
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1 and sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 10
        assert wb.work.getsockopt(zmq.RECONNECT_IVL_MAX) <= 250  # a restarted router hears from it at once
    finally:
        mb.close()
        wb.close()
        rb.close()
