"""The router's HTTP edge (services/router/edge.py) against idle, slow and greedy clients: the
door stays open for everyone else. Live: a real router on loopback, raw sockets as attackers."""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.conftest import start_cluster

REQ = {"prompt": "hello", "max_tokens": 3}


def _files(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= n, f"this test needs {n} open files (ulimit -n)"


def _closed(s: socket.socket) -> bool:
    """True once the server has closed `s` (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_closed(socks: list[socket.socket], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    done: set[int] = set()
    while time.monotonic() < deadline and len(done) < len(socks):
        for i, s in enumerate(socks):
            if i not in done and _closed(s):
                done.add(i)
        time.sleep(0.05)
    return len(done)


def test_5000_idle_and_500_slowloris_connections_do_not_keep_100_requests_out(tmp_path: Path) -> None:
    """uvicorn's limit_concurrency counted idle connections: with ~4,400 of them open, every
    request and /ready got a plain-text 503. Now 5,500 attackers hold sockets (5,000 silent,
    500 trickling a request's headers) and 100 requests from a client are all served."""
    _files(6000)
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos")
    host, port = "127.0.0.1", c.spec.http_port
    socks: list[socket.socket] = []
    try:
        for _ in range(5000):
            socks.append(socket.create_connection((host, port), timeout=5))
        loris = []
        for _ in range(500):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kairos\r\n")
            loris.append(s)
        socks += loris
        for s in loris:  # one more header byte each: still inside the 10 s header timeout
            s.sendall(b"x")
        ok = 0
        with httpx.Client(base_url=c.spec.api, timeout=20) as client:
            assert client.get("/ready").status_code == 200
            for _ in range(100):
                ok += client.post("/v1/completions", json=REQ).status_code == 200
        assert ok == 100
    finally:
        for s in socks:
            s.close()
        c.stop(15)


def test_timeouts_close_silent_and_trickling_connections_and_a_stalled_body_gets_408(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_HTTP_HEADER_TIMEOUT_S": "1", "KAIROS_HTTP_BODY_TIMEOUT_S": "1"})
    host, port = "127.0.0.1", c.spec.http_port
    opened: list[socket.socket] = []
    try:
        silent = socket.create_connection((host, port), timeout=5)
        trickle = socket.create_connection((host, port), timeout=5)
        opened += [silent, trickle]
        trickle.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        # a byte every 0.2 s resets uvicorn's own keep-alive timer; the header timeout still fires
        while not _closed(trickle) and time.monotonic() - t0 < 6:
            try:
                trickle.sendall(b"x")
            except OSError:
                break
            time.sleep(0.2)
        assert time.monotonic() - t0 < 5, "a trickling header was not cut off"
        assert _wait_closed([silent], 5) == 1, "a connection that never sent a byte was not closed"

        stalled = socket.create_connection((host, port), timeout=5)
        opened.append(stalled)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kairos\r\ncontent-type: application/json\r\n"
                        b"content-length: 100\r\n\r\n{\"prompt\": ")
        stalled.settimeout(5)
        reply = b""
        while b"}}" not in reply:
            got = stalled.recv(4096)
            if not got:
                break
            reply += got
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b'"code":408' in reply and b"x-kairos-error: body_timeout" in reply and b"connection: close" in reply

        # a keep-alive connection that was served gets the header timeout for its next request too
        with httpx.Client(base_url=c.spec.api, timeout=10) as client:
            assert client.post("/v1/completions", json=REQ).status_code == 200
        assert "kairos_router_http_connections_closed_total{reason=\"header_timeout\"}" in \
            httpx.get(c.spec.api + "/metrics").text
    finally:
        for s in opened:
            s.close()
        c.stop(15)


def test_at_the_connection_limit_the_longest_idle_connection_makes_room(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_HTTP_MAX_CONNECTIONS": "100"})
    host, port = "127.0.0.1", c.spec.http_port
    socks: list[socket.socket] = []
    try:
        for _ in range(150):
            socks.append(socket.create_connection((host, port), timeout=5))
            time.sleep(0.002)  # accepted in this order: the first ones are the longest idle
        assert _wait_closed(socks[:50], 5) == 50, "the 50 longest-idle connections were not closed"
        assert _wait_closed(socks[50:], 0.3) == 0, "a connection that was not the longest idle was closed"
        with httpx.Client(base_url=c.spec.api, timeout=10) as client:
            for _ in range(20):
                assert client.post("/v1/completions", json=REQ).status_code == 200
    finally:
        for s in socks:
            s.close()
        c.stop(15)


def test_one_address_over_its_limit_loses_its_idle_connections_then_is_refused_while_all_are_busy(
        tmp_path: Path) -> None:
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_HTTP_MAX_CONNECTIONS_PER_CLIENT": "3"})
    host, port = "127.0.0.1", c.spec.http_port
    idle: list[socket.socket] = []
    try:
        idle += [socket.create_connection((host, port), timeout=5) for _ in range(3)]
        time.sleep(0.1)
        with httpx.Client(base_url=c.spec.api, timeout=10) as client:
            assert client.post("/v1/completions", json=REQ).status_code == 200
        assert _wait_closed(idle, 5) == 1, "the address's longest-idle connection should have made room"
        assert _closed(idle[0]), "not the longest idle"
        time.sleep(0.2)
        # three long streams keep three connections busy
        body = {"prompt": "busy", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        started = threading.Barrier(4)
        checked = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", c.spec.api + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    # the first event is in: hold the request open (unread, so the stream cannot
                    # finish) until the check below is done, however slowly this host runs it
                    started.wait(10)
                    checked.wait(30)
                    break
        threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(10)
        try:
            r = httpx.post(c.spec.api + "/v1/completions", json=REQ, timeout=10)
        finally:
            checked.set()
        assert r.status_code == 429 and r.headers["x-kairos-error"] == "refused_client", r.text
        for t in threads:
            t.join(30)
        with httpx.Client(base_url=c.spec.api, timeout=10) as client:  # busy ones done: served again
            assert client.post("/v1/completions", json=REQ).status_code == 200
    finally:
        for s in idle:
            s.close()
        c.stop(15)
