"""`kairos health`: one-shot health checks for operators and container health checks.

Each check makes one HTTP request, prints one line and exits 0 (healthy) or 1 (not healthy, or
it could not tell). Defaults come from the same KAIROS_* environment (or KAIROS_CONFIG file) the
checked service reads, so inside a container `kairos health router` checks the router that
container runs.

Workers serve no HTTP: a worker is healthy when the router lists it as registered and not
draining. Workers register only after their engine has started, so registered implies the
engine is ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from common import config
from common.errors import ConfigError

OK, UNHEALTHY = 0, 1
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

EPILOG = """\
checks:
  router   GET <url>/health: the router process is up (with --ready: GET <url>/ready, at least
           one decode worker registered and the router accepting requests)
  monitor  GET <url>/health on the monitor's port
  worker   GET <router-url>/v1/kairos/stats: the worker is registered with the router (its
           engine has started) and is not draining

exit codes:
  0  healthy
  1  not healthy: the service answered with a failure, is draining, is not registered, or
     could not be reached within --timeout
  2  usage error (bad arguments, invalid KAIROS_* configuration)

examples:
  kairos health router                              # inside the router container
  kairos health router --url http://10.0.0.5:8000 --ready
  kairos health monitor --url http://127.0.0.1:9100
  kairos health worker --worker-id decode-0 --router-url http://10.0.0.5:8000
"""


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no HTTP answer at all
    body: Any
    error: str = ""


def http_get(url: str, timeout: float, api_key: str = "") -> Reply:
    req = urllib.request.Request(url, headers={"accept": "application/json"})
    if api_key:
        req.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, _json(r.read()))
    except urllib.error.HTTPError as e:
        return Reply(e.code, _json(e.read()), f"HTTP {e.code}")
    except urllib.error.URLError as e:
        return Reply(None, None, str(getattr(e.reason, "strerror", None) or e.reason))
    except (OSError, ValueError) as e:  # timeouts, resets, a malformed URL
        return Reply(None, None, str(e) or type(e).__name__)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return None


def local_url(host: str, port: int) -> str:
    """The URL to reach a server bound to `host`: a wildcard bind is reached on loopback."""
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


# ------------------------------------------------------------------------------ the checks


def check_router(url: str, *, ready: bool, timeout: float) -> tuple[int, str]:
    if ready:
        r = http_get(f"{url}/ready", timeout)
        if r.status is None:
            return UNHEALTHY, f"router unreachable: {url}/ready: {r.error}"
        body = r.body if isinstance(r.body, dict) else {}
        workers = f"{body.get('prefill_workers', '?')} prefill, {body.get('decode_workers', '?')} decode workers"
        if r.status == 200:
            return OK, f"router ready: {url} ({workers} registered)"
        return UNHEALTHY, f"router not ready: {url}/ready answered HTTP {r.status} ({workers} registered)"
    r = http_get(f"{url}/health", timeout)
    if r.status is None:
        return UNHEALTHY, f"router unreachable: {url}/health: {r.error}"
    if r.status != 200:
        return UNHEALTHY, f"router unhealthy: {url}/health answered HTTP {r.status}"
    body = r.body if isinstance(r.body, dict) else {}
    if body.get("accepting") is False:
        return OK, f"router up: {url} (draining: not accepting new requests)"
    return OK, f"router ok: {url} is up and accepting requests"


def check_monitor(url: str, *, timeout: float) -> tuple[int, str]:
    r = http_get(f"{url}/health", timeout)
    if r.status is None:
        return UNHEALTHY, f"monitor unreachable: {url}/health: {r.error}"
    if r.status != 200:
        return UNHEALTHY, f"monitor unhealthy: {url}/health answered HTTP {r.status}"
    return OK, f"monitor ok: {url} is up"


def check_worker(worker_id: str, router_url: str, *, timeout: float, api_key: str = "") -> tuple[int, str]:
    r = http_get(f"{router_url}/v1/kairos/stats", timeout, api_key)
    if r.status is None:
        return UNHEALTHY, f"worker {worker_id} unknown: router unreachable at {router_url}: {r.error}"
    if r.status == 401:
        return UNHEALTHY, (f"worker {worker_id} unknown: the router at {router_url} wants an API key "
                           "(pass --api-key)")
    workers = r.body.get("workers") if isinstance(r.body, dict) else None
    if r.status != 200 or not isinstance(workers, dict):
        return UNHEALTHY, f"worker {worker_id} unknown: {router_url}/v1/kairos/stats answered HTTP {r.status}"
    w = workers.get(worker_id)
    if not isinstance(w, dict):
        others = ", ".join(sorted(workers)) or "none"
        return UNHEALTHY, f"worker {worker_id} not registered with the router at {router_url} (registered: {others})"
    what = f"{w.get('role', '?')}, engine {w.get('engine', '?')}, holding {w.get('holding', '?')} requests"
    if w.get("draining"):
        return UNHEALTHY, f"worker {worker_id} draining: registered with {router_url} but taking no new work ({what})"
    return OK, f"worker {worker_id} ok: registered with the router at {router_url} ({what})"


# ------------------------------------------------------------------------------ command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos health", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="target", required=True, metavar="{router,monitor,worker}")
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")

    r = sub.add_parser("router", parents=[timeout], help="is the router up (or ready)?",
                       description="Check the router's GET /health (or /ready).", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--url", help="router base URL (default: from KAIROS_HTTP_HOST and KAIROS_HTTP_PORT)")
    r.add_argument("--ready", action="store_true",
                   help="check GET /ready instead: at least one decode worker registered, accepting requests")

    m = sub.add_parser("monitor", parents=[timeout], help="is the monitor up?",
                       description="Check the monitor's GET /health.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--url", help="monitor base URL (default: from KAIROS_HTTP_HOST and KAIROS_HTTP_PORT)")

    w = sub.add_parser("worker", parents=[timeout], help="is the worker registered with the router?",
                       description="Check that a worker is registered with the router (GET /v1/kairos/stats) "
                                   "and not draining. Workers register only after their engine started.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--worker-id", help="the worker's id (default: KAIROS_WORKER_ID)")
    w.add_argument("--router-url",
                   help="router base URL (default: http://<KAIROS_ROUTER_HOST>:8000)")
    w.add_argument("--api-key", default="", help="the router's API key, if it requires one")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.target == "router":
            url = a.url or _url_from(config.RouterConfig)
            rc, line = check_router(url.rstrip("/"), ready=a.ready, timeout=a.timeout)
        elif a.target == "monitor":
            url = a.url or _url_from(config.MonitorConfig)
            rc, line = check_monitor(url.rstrip("/"), timeout=a.timeout)
        else:
            wid, router_url = a.worker_id, a.router_url
            if not wid or not router_url:
                wcfg = config.load(config.WorkerConfig)
                wid = wid or wcfg.worker_id
                router_url = router_url or local_url(wcfg.router_host, 8000)
            if not wid:
                print("error: no worker id: pass --worker-id or set KAIROS_WORKER_ID", file=sys.stderr)
                return 2
            rc, line = check_worker(wid, router_url.rstrip("/"), timeout=a.timeout, api_key=a.api_key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(line, flush=True)
    return rc


def _url_from(cls: type[config.RouterConfig] | type[config.MonitorConfig]) -> str:
    cfg = config.load(cls)
    return local_url(cfg.http_host, cfg.http_port)


if __name__ == "__main__":
    sys.exit(main())
