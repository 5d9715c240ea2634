"""`python -m services.router` / `kairos router`: the HTTP API and the decision maker."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

import structlog
import uvicorn

from common import config, logging
from common.errors import ConfigError
from common.metrics_http import serve_metrics
from common.policy import REGISTRY
from common.router_core.planner import planner_on
from common.service import HttpServer, install_signals, listen_socket, run, settle_heap
from common.startup import guard
from services.router.edge import EdgeLimits, edge_protocol
from services.router.http import asgi_app
from services.router.service import Router


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound with SO_REUSEPORT: every router replica on this host binds
    the same port and the kernel spreads new connections among them (a killed replica's share
    goes to the others at once)."""
    return listen_socket(host, port, reuse_port=True)


def inherited_socket(fd: int) -> socket.socket:
    """The HTTP listening socket a process manager handed down (kairos up: KAIROS_HTTP_FD). It
    stays open in that process while this router stops and a new one starts, so the kernel keeps
    completing connections and queues them for whichever router accepts next: a restart refuses
    none. (uvicorn's own `--fd`/`Config.fd` takes a file descriptor too, but reads it as a Unix
    socket; this one is TCP, handed to uvicorn as `sockets=`, as for SO_REUSEPORT.)"""
    try:
        sock = socket.socket(fileno=fd)  # family and type read from the descriptor
    except OSError as e:
        raise ConfigError(f"http_fd {fd} is not an open socket ({e}); KAIROS_HTTP_FD is for a process manager "
                          "that hands the router a listening socket (kairos up): unset it to bind --http-port") from e
    if sock.type != socket.SOCK_STREAM or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0:
        sock.detach()
        raise ConfigError(f"http_fd {fd} is not a listening TCP socket; unset KAIROS_HTTP_FD to bind --http-port")
    sock.setblocking(False)
    return sock


def raise_fd_limit(want: int) -> int:
    """Lift this process's open-file limit (soft) towards `want`, up to the hard limit: each HTTP
    connection is a file descriptor, and the usual soft default (1024) is below the connection
    limits. Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def migrate_req() -> str | None:
    """Linux's net.ipv4.tcp_migrate_req ("1": when one of several SO_REUSEPORT listeners closes,
    the connections queued on it go to another instead of being reset); None where unknown."""
    try:
        with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
            return f.read().strip()
    except OSError:
        return None


async def leave(router: Router, server: HttpServer, cfg: config.RouterConfig, log: Any) -> None:
    """SIGTERM: hand the front door to the other routers, answer what is here, then go.

    From now on /ready says 503 and every response closes its connection, so that a client's
    next request opens a new connection. After `drain_grace_s` (time for a balancer's health
    check to take this router out; it serves everything meanwhile) it stops listening: with
    SO_REUSEPORT the kernel gives new connections to the other routers on the port; on a socket
    handed down by kairos up (http_fd) they wait in the kernel's queue for the router kairos up
    starts next; alone on a port of its own, a new connection is refused, which a client can
    retry. Requests on connections it already
    has are still served; once none is in flight and its idle connections have had uvicorn's
    keep-alive timeout to close (or 30 s have passed), intake stops and what is left fails."""
    router.leaving = True
    if cfg.drain_grace_s > 0:
        log.info("router_leaving", grace_s=cfg.drain_grace_s, in_flight=len(router.requests))
        await asyncio.sleep(cfg.drain_grace_s)
    for listener in server.servers:
        listener.close()
    conns = server.server_state.connections
    log.info("router_stopped_listening", in_flight=len(router.requests), connections=len(conns))
    t0 = time.monotonic()
    idle_by = t0 + server.config.timeout_keep_alive + 0.5
    while (router.requests or conns) and time.monotonic() - t0 < 30.0:
        if not router.requests and time.monotonic() > idle_by:
            break  # what is still open never sent a request; uvicorn closes it on exit
        await asyncio.sleep(0.05)
    log.info("router_stopping", in_flight=len(router.requests), connections=len(conns))
    await router.drain(timeout=max(1.0, 30.0 - (time.monotonic() - t0)))


async def serve(cfg: config.RouterConfig, *, ready: asyncio.Event | None = None) -> int:
    logging.configure("router", level=cfg.log_level, fmt=cfg.log_format)
    log = structlog.get_logger()
    files = raise_fd_limit(cfg.http_max_connections + 1024)  # the bus, the log, the workers' sockets
    if files < cfg.http_max_connections + 256:
        log.warning("fd_limit_low", open_files=files, http_max_connections=cfg.http_max_connections,
                    hint="raise the open-file limit (ulimit -n, compose ulimits.nofile) or lower "
                         "--http-max-connections: past the limit new connections fail to be accepted")
    if cfg.http_fd >= 0:
        sockets: list[socket.socket] = [inherited_socket(cfg.http_fd)]
    else:
        sockets = [reuse_port_socket(cfg.http_host, cfg.http_port) if cfg.http_reuse_port
                   else listen_socket(cfg.http_host, cfg.http_port, reuse_port=False, backlog=4096)]
    router = Router(cfg)
    router.open()
    if cfg.http_reuse_port and migrate_req() == "0":
        log.warning("reuse_port_without_migration",
                    hint="when this router drains, connections the kernel queued on it are reset: set sysctl "
                         "net.ipv4.tcp_migrate_req=1 (compose: sysctls) so they go to the other routers")
    stop_metrics = serve_metrics(cfg.http_host, cfg.metrics_port)
    stop = router.stop
    install_signals(stop)
    # the edge's own limits replace uvicorn's limit_concurrency, which counts idle connections (edge.py)
    edge = edge_protocol(EdgeLimits(header_timeout_s=cfg.http_header_timeout_s, body_timeout_s=cfg.http_body_timeout_s,
                                    max_connections=cfg.http_max_connections,
                                    max_per_client=cfg.http_max_connections_per_client))
    server = HttpServer(uvicorn.Config(asgi_app(router, cfg.forwarded_allow_ips), host=cfg.http_host,
                                       port=cfg.http_port, lifespan="off", proxy_headers=False,
                                       access_log=False, log_level="warning", log_config=None, http=edge,
                                       timeout_graceful_shutdown=5, backlog=4096))
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c, name=n) for n, c in router.loops()]
            http = tg.create_task(server.serve(sockets=sockets), name="http")
            while not server.started:
                if http.done():
                    break
                await asyncio.sleep(0.02)
            if not server.started:
                log.error("http_failed_to_start", host=cfg.http_host, port=cfg.http_port,
                          hint="is the port in use? pick another with --http-port")
                stop.set()
            else:
                frozen = settle_heap()  # the start-up heap out of the collector's full passes (service.py)
                log.info("router_ready", api=f"http://{cfg.http_host}:{cfg.http_port}/v1", policy=cfg.policy,
                         planner="on" if planner_on(cfg) else "off", heap_frozen=frozen, **router.cost_model())
                if ready is not None:
                    ready.set()
            await stop.wait()
            await leave(router, server, cfg, log)
            server.should_exit = True
            await http
            for t in tasks:
                t.cancel()
    finally:
        router.close()
        stop_metrics()
    log.info("router_stopped")
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    return guard("router", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = config.flags(argv, config.RouterConfig, "kairos router",
                       "Kairos router: the OpenAI-compatible HTTP API and the per-request deflection decision. "
                       "Binds the bus; workers and the monitor connect to it.",
                       choices={"policy": {name: e.summary for name, e in REGISTRY.items()}})
    return run(lambda: serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
