"""Restarts refuse and fail nothing: a rolling restart of every service of a `kairos up` cluster
(one router) under streamed load, one service at a time, leaves no connection refused and no
request failed (the router's listening socket is kairos up's, handed to each router it starts);
a restarted router hears from every worker within a fraction of a second, and holds what arrives
until they have re-registered instead of answering 503 for want of workers."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path

import pytest

from bench.router_restart import load, rolling_order
from tests.conftest import start_cluster


def _events(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _t(ev: dict[str, object]) -> float:
    return datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
def test_rolling_restart_of_every_service_under_load_refuses_and_fails_nothing(tmp_path: Path) -> None:
    """Router, prefill-0, decode-0, decode-1, monitor: each SIGTERMed (it drains), started again
    and back (router answering, worker registered) before the next, under streamed requests,
    each tried once; every one is served in full. Without the handed-down socket the router's
    restart alone refused a tenth of them (docs/benchmarks/restart.md)."""
    # modeled KV transport: workers start in about half the time (no NIXL agent); the NIXL path
    # through the same rolling restart is bench/router_restart.py's default (restart.md)
    c = start_cluster(tmp_path, prefill=1, decode=2, profile="fast", policy="kairos", monitor=True,
                      kv_transport="modeled")
    order = rolling_order(c)
    assert order == ["router", "prefill-0", "decode-0", "decode-1", "monitor"]
    try:
        result = asyncio.run(load(c, rate=3.0, duration=4.0, restart_at=0.5, seed=3, max_tokens=8,
                                  services=order, gap=0.2))
    finally:
        c.stop(20)
    assert set(result["restarts"]) == set(order), result  # type: ignore[arg-type]
    sent = result["sent"]
    # the load runs for at least `duration` (seed 3: about 13 arrivals) and on while the restarts
    # last; how many more it sends depends on the machine's speed, so only the floor is checked
    assert isinstance(sent, int) and sent >= 10, result
    assert result["outcomes"] == {"ok": sent}, f"refused or failed during the rolling restart: {result}"

    events = _events(tmp_path / "router.log")
    bound = [i for i, ev in enumerate(events) if ev["event"] == "router_bus_bound"]
    assert len(bound) == 2, "the router did not restart"
    start = _t(events[bound[1]])
    joined: dict[str, float] = {}  # each worker's first registration with the restarted router
    for ev in events[bound[1]:]:
        if ev["event"] == "worker_joined":
            joined.setdefault(str(ev["worker"]), _t(ev) - start)
    assert set(joined) == {"prefill-0", "decode-0", "decode-1"}
    # Each saw its connection come back and said Hello on its own (not only when the router, seeing
    # a heartbeat from a worker it does not know, asked it to).
    for name in joined:
        ev = [e["event"] for e in _events(tmp_path / f"{name}.log")]
        assert "router_reconnected" in ev and "registered" in ev[ev.index("router_reconnected"):], (name, ev)
    # ~0.1 s on an idle machine (BENCHMARKS.md); the bound only catches a regression to seconds
    assert max(joined.values()) < 3.0, f"re-registration took {joined}"


def test_drain_grace_keeps_serving_while_a_balancer_takes_the_router_out(tmp_path: Path) -> None:
    """With drain_grace_s, a SIGTERMed router first answers /ready with 503 (a balancer's health
    check takes it out) while it still serves what arrives, each response closing its connection
    (a client's keep-alive connection then reconnects through the balancer); then it refuses new
    requests, drains and exits 0."""
    import signal
    import time

    import httpx

    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_DRAIN_GRACE_S": "3"})
    body = {"prompt": "still here", "max_tokens": 3}
    try:
        with httpx.Client(base_url=c.spec.api, timeout=10) as client:
            assert client.get("/ready").status_code == 200
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers.get("connection") != "close"
            c.signal("router", signal.SIGTERM)
            deadline = time.monotonic() + 2
            while client.get("/ready").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            started = time.monotonic()
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.headers.get("connection") == "close"
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers.get("connection") == "close" and r.json()["usage"]["completion_tokens"] == 3
            assert time.monotonic() - started < 2.5  # still within the grace
        assert c.wait_exit("router", 15) == 0
    finally:
        c.stop(10)


def test_without_a_grace_a_draining_router_stops_listening_and_serves_its_open_connections(tmp_path: Path) -> None:
    """With no drain grace a SIGTERMed router stops accepting at once, and still serves a request
    that arrives on a connection it already has, closing that connection with the response: the
    client's next request then opens a new connection instead of going out on a kept-alive one
    that the exiting server closes under it (seen in a chaos run as a connection_dropped
    ReadError). It exits once what is in flight is done. A connection made meanwhile is not
    refused: the listening socket is kairos up's (KAIROS_HTTP_FD), so the kernel queues it, and
    the router started next serves it (issue 48: a restart refused connections for 4-8 s)."""
    import signal
    import threading
    import time

    import httpx

    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos")
    long_body = {"prompt": "keep the router draining", "max_tokens": 3000, "ignore_eos": True}
    done: list[int] = []
    queued: list[object] = []

    def new_connection() -> None:
        try:
            r = httpx.post(c.spec.api + "/v1/completions", json={"prompt": "wait for me", "max_tokens": 3},
                           timeout=httpx.Timeout(60.0, connect=2.0))
            queued.append(r.status_code)
        except httpx.HTTPError as e:
            queued.append(repr(e))

    try:
        with httpx.Client(base_url=c.spec.api, timeout=30) as client:
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200 and r.headers.get("connection") != "close"
            in_flight = threading.Thread(target=lambda: done.append(httpx.post(
                c.spec.api + "/v1/completions", json=long_body, timeout=60).status_code), daemon=True)
            in_flight.start()
            deadline = time.monotonic() + 10
            while c.get("/v1/kairos/stats")[1].get("in_flight", 0) == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            c.signal("router", signal.SIGTERM)
            deadline = time.monotonic() + 5
            while "router_stopped_listening" not in [e["event"] for e in _events(tmp_path / "router.log")]:
                assert time.monotonic() < deadline, "the router kept listening after SIGTERM"
                time.sleep(0.02)
            waiting = threading.Thread(target=new_connection, daemon=True)
            waiting.start()  # a new connection while the router drains: queued, not refused
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})  # the kept-alive one
            assert r.status_code == 200, r.text
            assert r.headers.get("connection") == "close"
            in_flight.join(60)
        assert done == [200], "the request in flight at SIGTERM was not finished"
        assert c.wait_exit("router", 40) == 0
        assert queued == [], f"the draining router answered a connection made after it stopped listening: {queued}"
        c.restart("router")  # as kairos up's supervisor does
        waiting.join(60)
        assert queued == [200], f"the connection made while no router listened: {queued}"
    finally:
        c.stop(10)


def test_a_response_started_after_sigterm_closes_its_connection_even_if_its_request_came_before() -> None:
    """The close decision is taken when the response starts: a request read before SIGTERM and
    answered after it must still close its kept-alive connection (CI saw a 503 go out without
    `connection: close` when the request raced the signal)."""
    import asyncio
    from types import SimpleNamespace

    from services.router.http import _closing

    router = SimpleNamespace(leaving=False)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def go() -> None:
        wrapped = _closing(send, router)  # type: ignore[arg-type]
        await wrapped({"type": "http.response.start", "status": 200, "headers": []})
        router.leaving = True  # SIGTERM arrives between this connection's requests
        await wrapped({"type": "http.response.start", "status": 503, "headers": []})
        await wrapped({"type": "http.response.body", "body": b"{}"})

    asyncio.run(go())
    assert (b"connection", b"close") not in sent[0]["headers"]
    assert (b"connection", b"close") in sent[1]["headers"]
    assert sent[2] == {"type": "http.response.body", "body": b"{}"}


def test_the_handed_down_socket_is_checked_and_a_taken_port_is_named(tmp_path: Path) -> None:
    """KAIROS_HTTP_FD must be a listening TCP socket (else a ConfigError saying to unset it), and
    kairos up, which binds the one router's port itself now, names a taken port before it starts
    anything."""
    import socket

    from common.errors import ConfigError
    from kairos.up import Cluster, ClusterSpec
    from services.router.__main__ import inherited_socket

    with socket.socket() as unbound:
        with pytest.raises(ConfigError, match="not a listening TCP socket"):
            inherited_socket(unbound.fileno())
    with pytest.raises(ConfigError, match="not an open socket"):
        inherited_socket(10**6)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        got = inherited_socket(listening.fileno())
        assert got.getsockname() == listening.getsockname()
        got.detach()  # the descriptor stays `listening`'s
        c = Cluster(ClusterSpec.ephemeral(http_port=listening.getsockname()[1], monitor=False, log_dir=str(tmp_path)))
        with pytest.raises(ConfigError, match=f"cannot listen on the HTTP port 127.0.0.1:{listening.getsockname()[1]}"):
            c.start(timeout=10)
        assert all(svc.proc is None for svc in c.services.values())  # nothing was started
