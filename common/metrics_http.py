"""A process's Prometheus /metrics on a port of its own (router replicas, workers).

Served from a daemon thread: scraping never waits on the event loop and never delays a step or
a token. Used where one process needs its own scrape target: each router replica (replicas share
the HTTP port, so a scrape there reaches one of them at random) and each worker (which has no
HTTP server otherwise). It also answers GET /health (200 while the process runs): the health
check of one router replica among several on a shared port (docker-compose.yml: `kairos health
router --url` this port).

Always Prometheus's text format 0.0.4, whatever the scraper's Accept header asks, as the router's
HTTP /metrics does: prometheus_client's own server answers a Prometheus server with OpenMetrics,
and its OpenMetrics writer (0.26) turns the colons of `vllm:` sample names into underscores,
which no dashboard made for vLLM would find.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from common.errors import ConfigError


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    if environ.get("PATH_INFO") == "/health":  # this process is up: a health check that reaches it alone
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"status": "ok"}']
    if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics\n"]
    body = generate_latest(REGISTRY)
    start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
    return [body]


def serve_metrics(host: str, port: int) -> Callable[[], None]:
    """Serve the default registry on host:port (0: do nothing). Returns a function that stops it."""
    if port <= 0:
        return lambda: None
    try:
        server = make_server(host, port, _app, server_class=_Server, handler_class=_Quiet)
    except OSError as e:
        raise ConfigError(f"cannot serve /metrics on {host}:{port} ({e.strerror or e})",
                          event="metrics_failed_to_start", host=host, port=port,
                          fix=f"stop what holds port {port} or pick another with --metrics-port / "
                              "KAIROS_METRICS_PORT (0 turns it off)") from e
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
