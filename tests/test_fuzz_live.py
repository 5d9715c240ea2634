"""Fuzzing the live HTTP edge and the live bus (hypothesis, derandomized, bounded).

A real cluster (router, one prefill and one decode worker, simulated engine). Fuzzed request
bodies over the real fields of every body-taking route, raw bytes as bodies, raw bytes as whole
HTTP requests on a socket, and fuzzed msgpack messages sent to the router's work socket from an
unregistered peer: no answer is a 5xx, nothing hangs (every request has a bound), the router's
log gets no error line or traceback from any of it, and the cluster serves a normal request
afterwards, its workers still registered. tests/test_fuzz.py fuzzes the same decoders in process.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.up import Cluster
from services.router import openai_schema as schema
from services.router.openai_responses import ResponsesBody
from tests.conftest import start_cluster
from tests.test_fuzz import INBOXES, _members, message, values

LIVE = settings(max_examples=120, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

ROUTES = {  # route -> the body's fields
    "/v1/completions": sorted(schema.CompletionBody.__struct_fields__),
    "/v1/chat/completions": sorted(schema.ChatBody.__struct_fields__),
    "/tokenize": sorted(schema.TokenizeBody.__struct_fields__),
    "/detokenize": ["model", "tokens"],
    "/v1/responses": sorted(ResponsesBody.__struct_fields__),
}
INPUT_ITEM = st.one_of(message, st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                                               "reasoning", "message"])}, optional={
    "call_id": values, "name": values, "arguments": values, "output": values, "role": values, "content": values,
    "status": values}))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("fuzzlive"), prefill=1, decode=1, profile="fast",
                      router_env={"KAIROS_MAX_OUTPUT_TOKENS": "16", "KAIROS_MAX_PROMPT_TOKENS": "2048"})
    yield c
    c.stop(15)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.spec.api, timeout=20) as c:
        yield c


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    body: dict[str, Any] = draw(st.dictionaries(st.sampled_from(ROUTES[route]), values, max_size=6))
    if route == "/v1/chat/completions":
        body.setdefault("messages", draw(st.lists(message, max_size=3)))
    elif route == "/v1/completions":
        body.setdefault("prompt", draw(st.text(max_size=30)))
    elif route == "/v1/responses":
        body.setdefault("input", draw(st.one_of(st.text(max_size=30), st.lists(INPUT_ITEM, max_size=3))))
    return route, json.dumps(body).encode()


def _no_5xx(r: httpx.Response, what: object) -> None:
    assert r.status_code < 500, f"{r.status_code} for {what!r}: {r.text[:300]}"


@LIVE
@given(bodies())
def test_fuzzed_bodies_get_an_answer_never_a_5xx(client: httpx.Client, case: tuple[str, bytes]) -> None:
    route, raw = case
    with client.stream("POST", route, content=raw, headers={"content-type": "application/json"}) as r:
        r.read()  # a stream, too, to its end
        _no_5xx(r, raw[:300])


@LIVE
@given(st.sampled_from(sorted(ROUTES)), st.binary(max_size=300))
def test_raw_bytes_as_bodies_get_a_4xx(client: httpx.Client, route: str, raw: bytes) -> None:
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    _no_5xx(r, raw)
    assert r.status_code >= 400 or raw.strip().startswith(b"{")


@LIVE
@given(st.binary(max_size=400), st.sampled_from([b"", b"\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\n"]))
def test_raw_bytes_as_http_get_a_4xx_or_a_close(cluster: Cluster, junk: bytes, prefix: bytes) -> None:
    with socket.create_connection(("127.0.0.1", cluster.spec.http_port), timeout=15) as s:
        s.sendall(prefix + junk + b"\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    if answer:  # a close without an answer is fine too
        status = answer.split(b"\r\n", 1)[0].split(b" ")
        assert len(status) >= 2 and status[0].startswith(b"HTTP/1.") and not status[1].startswith(b"5"), answer[:200]


@st.composite
def bus_messages(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(_members(INBOXES[0][1])))  # what the router's work socket takes
    msg: dict[str, Any] = {"type": kind.__name__}
    for f in draw(st.lists(st.sampled_from(list(kind.__struct_fields__)), unique=True)):
        msg[f] = draw(values)
    if draw(st.booleans()):
        return msgspec.msgpack.encode(msg)
    return draw(st.binary(max_size=200))


def test_fuzzed_bus_messages_change_nothing(cluster: Cluster, client: httpx.Client) -> None:
    """Fuzzed messages of every type the router's work socket takes, and raw bytes, from a peer
    that never registered (a sender under a worker's id, too): dropped; the workers stay registered."""
    payloads: list[bytes] = []

    @LIVE
    @given(bus_messages())
    def collect(p: bytes) -> None:
        payloads.append(p)

    collect()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for ident in (b"fuzzer", b"fuzzer-2"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, ident)
            s.connect(f"tcp://127.0.0.1:{cluster.spec.work_port}")
            for p in payloads:
                s.send(p)
            while s.poll(300):  # whatever it answers (Refused, Reregister): read and ignore
                s.recv()
            s.close(0)
    finally:
        ctx.destroy(linger=0)
    stats = client.get("/v1/kairos/stats").json()
    assert set(stats["workers"]) == {"prefill-0", "decode-0"}


def test_after_the_fuzzing_the_cluster_serves_and_logged_no_error(cluster: Cluster, client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "after the fuzz " * 8, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    lines = [json.loads(x) for x in (Path(cluster.spec.log_dir) / "router.log").read_text().splitlines()
             if x.startswith("{")]
    errors = [x for x in lines if x.get("level") in ("error", "critical") and x.get("event") != "worker_refused"]
    assert errors == [], errors[:3]
    text = (Path(cluster.spec.log_dir) / "router.log").read_text()
    assert "Traceback" not in text
