"""Both Grafana dashboards (Kairos's, and vLLM's example one) against a real Prometheus.

A `kairos up` cluster (simulated engine, loopback ports, the monitor on, every worker on its own
metrics port; the router scraped on its HTTP port, as observability/prometheus.yml does) takes a
short bounded load down both routes while Debian's `prometheus` scrapes it every second; then
every query of every panel of observability/grafana/dashboards/*.json, with Grafana's variables
filled in as Grafana would, must return at least one finite value over the load. Skipped, saying
why, where the `prometheus` binary is missing (scripts/test-all.sh installs it as root).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.ports import free_ports
from kairos.up import Cluster
from tests.monitor.conftest import send_burst, start_monitored, wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "observability" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval is at least 4 scrape intervals; wider is kinder to a loaded CI host
MODEL = "kairos-sim"

pytestmark = pytest.mark.timeout(150)
needs_prometheus = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary: install Debian's prometheus package "
                       "(scripts/test-all.sh does, as root) to check the dashboards against a real Prometheus"),
]


def queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, variables filled in."""
    out = []
    for panel in json.loads(path.read_text())["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$model_name", MODEL).replace("$__rate_interval", RATE_INTERVAL)
            out.append((f"{panel['title']} [{t['refId']}]", expr))
    return out


def test_the_dashboards_are_there() -> None:
    assert {p.name for p in DASHBOARDS} == {"kairos.json", "vllm.json"}
    assert len(queries(ROOT / "observability/grafana/dashboards/vllm.json")) == 27
    for path in DASHBOARDS:
        for title, expr in queries(path):
            assert "$" not in expr, (path.name, title, expr)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    c = start_monitored(tmp_path_factory.mktemp("cluster"), prefill=2, decode=2, metrics_ports=ports)
    yield c
    c.stop(15)


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    # as observability/prometheus.yml does: the router on its HTTP port, the monitor, each worker's
    # metrics port (a router's own metrics port is checked in test_worker_metrics.py)
    targets = [f"127.0.0.1:{p}" for n, p in cluster.spec.metrics_ports.items() if n != "router"]
    targets += [f"127.0.0.1:{cluster.spec.http_port}", f"127.0.0.1:{cluster.spec.monitor_port}"]
    (tmp / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "kairos", "static_configs": [{"targets": targets}]}]}))
    port = free_ports(1)[0]
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def all_up() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                r = httpx.get(url + "/api/v1/targets", timeout=2)
            except httpx.TransportError:  # not listening yet
                return False
            if r.status_code != 200:  # starting: "Service Unavailable" until its storage is ready
                return False
            active = r.json()["data"]["activeTargets"]
            return len(active) == len(targets) and all(t["health"] == "up" for t in active)
        wait_until(all_up, 30, "Prometheus to scrape every router, worker and the monitor")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def load_window(cluster: Cluster, prometheus: str) -> tuple[float, float]:
    """Three bursts, long and short prompts together (both routes), a few seconds apart."""
    start = time.time()
    routes: list[str] = []
    for _ in range(3):
        # 128 output tokens: decodes that outlive several scrapes, so the gauges that exist only
        # while a decode worker runs requests (its TBT slack) are caught by a scrape; with 16
        # tokens a loaded host could finish every burst between two scrapes (CI run 9)
        routes += send_burst(cluster.spec.api, n_long=6, n_short=6, max_tokens=128)
        time.sleep(2)
    assert set(routes) == {"deflect", "disagg"}, routes
    time.sleep(3 * SCRAPE_S + 1)  # the monitor's telemetry, then the last scrapes
    return start, time.time()


def finite_points(url: str, expr: str, window: tuple[float, float]) -> int:
    r = httpx.get(url + "/api/v1/query_range", params={"query": expr, "start": window[0], "end": window[1],
                                                        "step": f"{SCRAPE_S}s"}, timeout=10)
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return sum(1 for series in body["data"]["result"] for _, v in series["values"] if math.isfinite(float(v)))


@pytest.mark.parametrize("dashboard", [pytest.param(p.name, marks=needs_prometheus) for p in DASHBOARDS])
def test_every_panel_has_data(dashboard: str, prometheus: str, load_window: tuple[float, float]) -> None:
    empty = [(title, expr) for title, expr in queries(ROOT / "observability/grafana/dashboards" / dashboard)
             if finite_points(prometheus, expr, load_window) == 0]
    assert not empty, f"{dashboard}: panels without data: {empty}"
