"""`kairos health`: one line, exit 0 or 1, against stub servers and a real cluster."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from common.ports import free_port
from kairos import health
from kairos.up import Cluster

Routes = dict[str, tuple[int, Any]]


@pytest.fixture
def stub() -> Iterator[tuple[str, Routes]]:
    """An HTTP server answering GET <path> with routes[path] = (status, JSON body)."""
    routes: Routes = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path, (404, {"error": "no route"}))
            if self.path.startswith("/v1/") and routes.get("key") and \
                    self.headers.get("authorization") != f"Bearer {routes['key'][1]}":
                status, body = 401, {"error": "api key"}
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = health.main(list(argv))
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 1, f"one line for the operator, got {out!r}"
    return rc, out.strip()


def test_router(stub: tuple[str, Routes], capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    routes["/health"] = (200, {"status": "ok", "accepting": True})
    assert run(capsys, "router", "--url", url) == (0, f"router ok: {url} is up and accepting requests")
    routes["/health"] = (200, {"status": "ok", "accepting": False})
    rc, line = run(capsys, "router", "--url", url + "/")
    assert rc == 0 and "draining" in line
    routes["/health"] = (500, {})
    rc, line = run(capsys, "router", "--url", url)
    assert rc == 1 and "HTTP 500" in line


def test_router_ready(stub: tuple[str, Routes], capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    routes["/ready"] = (503, {"ready": False, "prefill_workers": 2, "decode_workers": 0})
    rc, line = run(capsys, "router", "--url", url, "--ready")
    assert rc == 1 and "not ready" in line and "0 decode" in line
    routes["/ready"] = (200, {"ready": True, "prefill_workers": 2, "decode_workers": 2})
    rc, line = run(capsys, "router", "--url", url, "--ready")
    assert rc == 0 and "2 prefill, 2 decode workers registered" in line


def test_monitor(stub: tuple[str, Routes], capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    routes["/health"] = (200, {"status": "ok"})
    assert run(capsys, "monitor", "--url", url)[0] == 0
    routes["/health"] = (503, {})
    assert run(capsys, "monitor", "--url", url)[0] == 1


def test_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["router", "--url", url], ["monitor", "--url", url],
                 ["worker", "--worker-id", "decode-0", "--router-url", url]):
        rc, line = run(capsys, *argv, "--timeout", "1")
        assert rc == 1 and "unreachable" in line, line


def test_worker(stub: tuple[str, Routes], capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    w = {"role": "decode", "engine": "sim", "draining": False, "holding": 3}
    routes["/v1/kairos/stats"] = (200, {"workers": {"decode-0": w, "prefill-0": {**w, "role": "prefill"}}})
    rc, line = run(capsys, "worker", "--worker-id", "decode-0", "--router-url", url)
    assert rc == 0 and line.startswith("worker decode-0 ok") and "holding 3" in line
    rc, line = run(capsys, "worker", "--worker-id", "decode-9", "--router-url", url)
    assert rc == 1 and "not registered" in line and "decode-0, prefill-0" in line
    routes["/v1/kairos/stats"] = (200, {"workers": {"decode-0": {**w, "draining": True}}})
    rc, line = run(capsys, "worker", "--worker-id", "decode-0", "--router-url", url)
    assert rc == 1 and "draining" in line


def test_worker_api_key(stub: tuple[str, Routes], capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    routes["key"] = (0, "s3cret")
    routes["/v1/kairos/stats"] = (200, {"workers": {"decode-0": {"role": "decode"}}})
    rc, line = run(capsys, "worker", "--worker-id", "decode-0", "--router-url", url)
    assert rc == 1 and "--api-key" in line
    rc, _ = run(capsys, "worker", "--worker-id", "decode-0", "--router-url", url, "--api-key", "s3cret")
    assert rc == 0


def test_defaults_come_from_the_service_environment(stub: tuple[str, Routes], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    url, routes = stub
    port = url.rsplit(":", 1)[1]
    routes["/health"] = (200, {"status": "ok", "accepting": True})
    routes["/v1/kairos/stats"] = (200, {"workers": {"prefill-1": {"role": "prefill"}}})
    monkeypatch.setenv("KAIROS_HTTP_HOST", "0.0.0.0")  # a wildcard bind is checked on loopback
    monkeypatch.setenv("KAIROS_HTTP_PORT", port)
    assert run(capsys, "router")[0] == 0
    assert run(capsys, "monitor")[0] == 0  # the monitor reads the same two variables
    monkeypatch.setenv("KAIROS_WORKER_ID", "prefill-1")
    rc, line = run(capsys, "worker", "--router-url", url)
    assert rc == 0 and "prefill-1" in line


def test_usage_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KAIROS_WORKER_ID", raising=False)
    assert health.main(["worker", "--router-url", "http://127.0.0.1:1"]) == 2
    monkeypatch.setenv("KAIROS_HTTP_PORT", "eighty")
    assert health.main(["router"]) == 2
    assert "http_port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        health.main(["router", "--bogus"])
    assert e.value.code == 2


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        health.main(["worker", "--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "0  healthy" in out and "--worker-id" in out


def test_against_a_real_cluster(fast_cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    api = fast_cluster.spec.api
    assert run(capsys, "router", "--url", api)[0] == 0
    assert run(capsys, "router", "--url", api, "--ready")[0] == 0
    for wid in ("prefill-0", "decode-0"):
        rc, line = run(capsys, "worker", "--worker-id", wid, "--router-url", api)
        assert rc == 0, line
    assert run(capsys, "worker", "--worker-id", "decode-7", "--router-url", api)[0] == 1
