"""Bad input gets a clear error and nothing breaks: HTTP and bus."""

from __future__ import annotations

import time
from collections.abc import Iterator

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
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
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


def test_prompt_too_long(cluster: Cluster) -> None:
    r = post(cluster, "/v1/completions", json={"prompt": "word " * 101})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "101 tokens" in r.json()["error"]["message"]


def test_chat_errors(cluster: Cluster) -> None:
    assert post(cluster, "/v1/chat/completions", json={"messages": []}).status_code == 400
    assert post(cluster, "/v1/chat/completions", json={"messages": [{"content": "x"}]}).status_code == 400
    r = post(cluster, "/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_route_and_method(cluster: Cluster) -> None:
    assert httpx.get(cluster.spec.api + "/v1/nothing", timeout=5).status_code == 404
    assert httpx.get(cluster.spec.api + "/v1/completions", timeout=5).status_code == 405


def test_garbage_on_every_bus_socket_is_dropped(cluster: Cluster) -> None:
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{cluster.spec.work_port}")
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(f"tcp://127.0.0.1:{cluster.spec.heartbeat_port}")
        time.sleep(0.3)
        for frames in ([b"\xc1\xc1"], [b"a", b"b", b"c"], [b'{"json": true}'], [b""]):
            dealer.send_multipart(frames)
        for frames in ([b"hb", b"x", b"\xc1"], [b"hb"], [b"hb", b"1", b"\x81\xa4type\xa5Hello"]):
            pub.send_multipart(frames)
        time.sleep(0.3)
        dealer.close()
        pub.close()
    finally:
        ctx.term()
    r = post(cluster, "/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert r.status_code == 200
    log = (cluster.services["router"].log_path or "").read_text()  # type: ignore[union-attr]
    assert "bad_frame_dropped" in log


def test_no_worker_of_a_needed_kind_is_503(tmp_path_factory: pytest.TempPathFactory) -> None:
    c = start_cluster(tmp_path_factory.mktemp("nodecode"), prefill=1, decode=1, profile="fast",
                      policy="disagg-least-loaded")
    try:
        c.stop_service("decode-0", 10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.get("/ready")[0] == 200:
            time.sleep(0.1)
        r = post(c, "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert "decode worker" in r.json()["error"]["message"]
        assert "retry-after" in r.headers
    finally:
        c.stop(10)
