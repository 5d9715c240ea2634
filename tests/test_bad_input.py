"""Bad input gets a clear error and nothing breaks: HTTP and bus."""

from __future__ import annotations

import contextlib
import re
import threading
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


def test_prompt_over_every_workers_max_model_len_is_400_at_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The only decode worker advertises max_model_len 64 at registration: a longer prompt is a
    400 naming the limit, never dispatched (so never retried); a shorter one is dispatched to it.
    That worker is this test's socket and sends no heartbeat: the router's liveness window is set
    past the test's length (600 x 0.1 s), else a loaded machine taking over 1 s between the Hello
    and the last request gets a 503 for a worker found dead, which is not what this checks."""
    from common import codec
    from common import messages as m

    c = start_cluster(tmp_path_factory.mktemp("maxlen"), prefill=1, decode=0, profile="fast",
                      policy="disagg-least-loaded", router_env={"KAIROS_LIVENESS": "600"})
    ctx = zmq.Context()
    try:
        w = ctx.socket(zmq.DEALER)
        w.setsockopt(zmq.LINGER, 0)
        w.setsockopt(zmq.IDENTITY, b"small-decode")
        w.connect(f"tcp://127.0.0.1:{c.spec.work_port}")
        w.send(codec.encode(m.Hello(protocol=m.PROTOCOL_VERSION, worker_id="small-decode", role="decode",
                                    incarnation="x", engine="sim", model="kairos-sim", token_budget=512,
                                    kv_capacity_tokens=10**6, kv_transport="nixl", max_model_len=64)))
        assert w.poll(10_000), "no answer to Hello"
        assert isinstance(codec.decode_inbox.decode(w.recv()), m.Welcome)
        r = post(c, "/v1/completions", json={"prompt": "word " * 80, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == 400 and r.headers["x-kairos-error"] == "context_length_exceeded"
        assert "64" in err["message"] and err["param"] == "prompt"
        assert "retry-after" not in r.headers
        stats = httpx.get(c.spec.api + "/v1/kairos/stats", timeout=5).json()
        assert stats["counts"].get("accepted", 0) == 0 and "redispatched" not in stats["counts"]
        r = post(c, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 80}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        # a prompt that fits goes to that worker
        def short() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the cluster stops before it is answered
                post(c, "/v1/completions", json={"prompt": "hi", "max_tokens": 1})

        t = threading.Thread(target=short, daemon=True)
        t.start()
        assert w.poll(10_000), "the short prompt was not dispatched"
        assert isinstance(codec.decode_inbox.decode(w.recv()), m.DecodeWork)
    finally:
        ctx.destroy(linger=0)
        c.stop(10)
    t.join(10)
