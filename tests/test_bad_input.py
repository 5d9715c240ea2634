"""Bad input gets a clear error and nothing breaks: HTTP and bus."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from kairos.up import Cluster
from tests.conftest import start_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("bad"), prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_MAX_PROMPT_TOKENS": "100"})
    yield c
    c.stop(15)


def post(c: Cluster, path: str, **kw: object) -> httpx.Response:
    return httpx.post(c.spec.api + path, timeout=10, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"max_tokens": 5}', 400, "prompt"),
    (b'{"prompt": 5}', 400, "body.prompt"),  # a wrong type: vLLM's schema validation names it so
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "body.max_tokens"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "body.stream"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    (b'{"prompt": "hi", "n": 0}', 400, "n"),
    (b'{"prompt": [1, -5]}', 400, "prompt"),
    (b'{"prompt": ""}', 400, "prompt"),
])
def test_completion_errors(cluster: Cluster, body: bytes, status: int, param: str | None) -> None:
    r = post(cluster, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param


DEEP = 5000  # beyond msgspec's nesting bound (it raises RecursionError there)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"1": ' + b"[" * DEEP + b"]" * DEEP + b"}}"),
    ("/v1/completions", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                             b'"function": {"name": "f", "parameters": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP
                             + b"}}]}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
                             b'"json_schema", "json_schema": {"name": "a", "schema": ' + b'{"items": ' * DEEP + b"{}"
                             + b"}" * DEEP + b"}}}"),
    ("/tokenize", b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
])
def test_deeply_nested_json_is_a_400_not_a_500(cluster: Cluster, path: str, body: bytes) -> None:
    r = post(cluster, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["type"] == "Bad Request" and r.json()["error"]["code"] == 400
    log = (cluster.services["router"].log_path or Path("/nonexistent")).read_text()
    assert "Traceback" not in log and "RecursionError" not in log


def test_prompt_too_long(cluster: Cluster) -> None:
    r = post(cluster, "/v1/completions", json={"prompt": "word " * 101})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400 and r.headers["x-kairos-error"] == "context_length_exceeded"
    assert "101 tokens" in r.json()["error"]["message"]


def test_chat_errors(cluster: Cluster) -> None:
    assert post(cluster, "/v1/chat/completions", json={"messages": []}).status_code == 400
    assert post(cluster, "/v1/chat/completions", json={"messages": [{"content": "x"}]}).status_code == 400
    r = post(cluster, "/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_route_and_method(cluster: Cluster) -> None:
    assert httpx.get(cluster.spec.api + "/v1/nothing", timeout=5).status_code == 404
    assert httpx.get(cluster.spec.api + "/v1/completions", timeout=5).status_code == 405


def bad_frames(c: Cluster) -> dict[str, float]:
    """The router's count of dropped bus frames, by socket (its /metrics)."""
    text = httpx.get(c.spec.api + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^kairos_router_bad_frames_total\{socket="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def wait_until(cond: Callable[[], bool], timeout: float, what: str, *, each: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f}s"
        if each is not None:
            each()
        time.sleep(0.02)


def test_garbage_on_every_bus_socket_is_dropped(cluster: Cluster) -> None:
    before = bad_frames(cluster)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{cluster.spec.work_port}")
        # a DEALER queues until connected: each of these reaches the router once, and is dropped
        for frames in ([b"\xc1\xc1"], [b"a", b"b", b"c"], [b'{"json": true}'], [b""]):
            dealer.send_multipart(frames)
        wait_until(lambda: bad_frames(cluster).get("work", 0) >= before.get("work", 0) + 4, 10,
                   "4 bad frames dropped on the work socket")
        dealer.close()
    finally:
        ctx.term()
    r = post(cluster, "/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    log = (cluster.services["router"].log_path or "").read_text()  # type: ignore[union-attr]
    assert '"socket": "work"' in log and "bad_frame_dropped" in log
    cluster.check_alive()


def test_a_junk_flood_is_counted_but_logged_once_per_interval(cluster: Cluster) -> None:
    log_path = cluster.services["router"].log_path
    assert log_path is not None
    lines_before = log_path.read_text().count('"bad_frame_dropped"')
    before = bad_frames(cluster).get("work", 0)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{cluster.spec.work_port}")
        for i in range(2000):
            dealer.send_multipart([b"\xc1junk%d" % i])
        wait_until(lambda: bad_frames(cluster).get("work", 0) >= before + 2000, 20, "2000 junk frames counted")
        dealer.close()
    finally:
        ctx.term()
    time.sleep(0.5)  # the router's log is line-buffered JSON: let it flush
    assert log_path.read_text().count('"bad_frame_dropped"') - lines_before <= 3  # not one line per frame


def test_no_worker_of_a_needed_kind_is_503(tmp_path_factory: pytest.TempPathFactory) -> None:
    c = start_cluster(tmp_path_factory.mktemp("nodecode"), prefill=1, decode=1, profile="fast",
                      policy="disagg-least-loaded")
    try:
        c.stop_service("decode-0", 10)
        wait_until(lambda: c.get("/ready")[0] == 503, 10, "/ready answering 503 once the decode worker left")
        r = post(c, "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert "decode worker" in r.json()["error"]["message"]
        assert "retry-after" in r.headers
    finally:
        c.stop(10)


async def test_prompt_over_every_workers_max_model_len_is_400_at_once() -> None:
    """The only decode worker advertises max_model_len 64 at registration: a longer prompt is a
    400 naming the limit, never dispatched (so never retried); a shorter one is dispatched to it.
    The rule and its HTTP answer are the router's: its HTTP app on the router shell in-process
    (tests/test_trust.py's router, whose core sends to a FakeOutbox), no process, socket or clock
    (it took 10-15 s as a live cluster, and a socket-only worker without heartbeats there was
    found dead after 1 s on a loaded machine, a 503 with no defect)."""
    import asyncio

    from common import messages as m
    from services.router.http import App
    from tests.test_trust import frame, hello, make_router, sent

    router = make_router("disagg-least-loaded")
    try:
        frame(router, b"prefill-0", hello("prefill-0", role="prefill"))
        frame(router, b"small-decode", hello("small-decode", max_model_len=64))
        sent(router).clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=App(router)), base_url="http://router",
                                     timeout=10) as client:
            # in-process, httpx's timeout does not apply: a request that was dispatched (the defect this
            # looks for) would wait for the worker's answer forever, so each refusal gets 10 s
            r = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "word " * 80,
                                                                             "max_tokens": 4}), 10)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == 400 and r.headers["x-kairos-error"] == "context_length_exceeded"
            assert "64" in err["message"] and err["param"] == "prompt"
            assert "retry-after" not in r.headers
            long_chat = {"messages": [{"role": "user", "content": "word " * 80}]}
            r = await asyncio.wait_for(client.post("/v1/chat/completions", json=long_chat), 10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert router.counts.get("accepted", 0) == 0 and "redispatched" not in router.counts
            assert not sent(router)  # never dispatched
            # a prompt that fits goes to that worker (its answer never comes: the request is dropped after)
            short = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
            for _ in range(500):
                if any(isinstance(msg, m.DecodeWork) for _, msg in sent(router)):
                    break
                await asyncio.sleep(0.01)
            assert [w for w, msg in sent(router) if isinstance(msg, m.DecodeWork)] == ["small-decode"]
            short.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await short
    finally:
        router.close()
