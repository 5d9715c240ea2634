"""A process's Prometheus /metrics on a port of its own (router replicas, workers).

prometheus_client's server runs in a daemon thread: scraping never waits on the event loop and
never delays a step or a token. Used where one process needs its own scrape target: each router
replica (replicas share the HTTP port, so a scrape there reaches one of them at random) and each
worker (which has no HTTP server otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, start_http_server

from common.errors import ConfigError


def serve_metrics(host: str, port: int) -> Callable[[], None]:
    """Serve the default registry on host:port (0: do nothing). Returns a function that stops it."""
    if port <= 0:
        return lambda: None
    try:
        server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as e:
        raise ConfigError(f"cannot serve /metrics on {host}:{port} ({e}): is the port in use? pick another "
                          "metrics port (0 turns it off)") from e

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
