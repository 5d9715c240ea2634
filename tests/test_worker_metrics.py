"""Every router and worker on its own /metrics port: `kairos up --metrics-port`, KAIROS_METRICS_PORT."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.errors import ConfigError
from common.metrics_http import serve_metrics
from common.ports import free_ports
from kairos.up import Cluster, ClusterSpec, parser, spec_from_args
from tests.conftest import start_cluster


def test_metrics_port_flag_numbers_every_service() -> None:
    spec = spec_from_args(parser().parse_args(["--prefill", "2", "--decode", "1", "--routers", "2",
                                               "--metrics-port", "9200"]))
    assert spec.metrics_ports == {"router": 9200, "router-1": 9201, "prefill-0": 9202, "prefill-1": 9203,
                                  "decode-0": 9204}
    assert spec_from_args(parser().parse_args([])).metrics_ports == {}
    c = Cluster(spec)
    assert c.services["decode-0"].env["KAIROS_METRICS_PORT"] == "9204"
    assert "KAIROS_METRICS_PORT" not in c.services["monitor"].env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ports = dict(zip(("router", "prefill-0", "decode-0"), free_ports(3), strict=True))
    c = start_cluster(tmp_path_factory.mktemp("cluster"), prefill=1, decode=1, profile="fast", metrics_ports=ports)
    yield c
    c.stop(15)


def scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_each_service_serves_its_own(cluster: Cluster) -> None:
    r = httpx.post(cluster.spec.api + "/v1/completions", json={"prompt": "a b c " * 30, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200, r.text
    ports = cluster.spec.metrics_ports
    router = scrape(ports["router"])
    assert sum(v for n, _, v in router["vllm:request_success"] if n.endswith("_total")) == 1
    deadline = time.monotonic() + 10  # workers sample their state twice a second
    while (decode := scrape(ports["decode-0"]))["kairos_engine_steps"][0][2] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "vllm:request_success" not in decode  # vLLM's names are the router's: never counted twice
    labels = {"model_name": "kairos-sim", "worker": "decode-0", "role": "decode"}
    kv = decode["kairos_engine_kv_cache_usage_perc"]
    assert len(kv) == 1 and kv[0][1] == labels and 0.0 <= kv[0][2] <= 1.0
    assert decode["kairos_engine_num_requests_running"][0][1] == labels
    steps = {s[1]["stat"]: s[2] for s in decode["kairos_engine_step_seconds"]}
    assert set(steps) == {"p50", "max"}
    assert decode["kairos_engine_steps"][0][2] > 0  # it decoded the request above
    prefill = scrape(ports["prefill-0"])  # the policy may have deflected the request: no prefill step to wait for
    waiting = prefill["kairos_engine_num_requests_waiting"]
    assert waiting[0][1] == {"model_name": "kairos-sim", "worker": "prefill-0", "role": "prefill"}
    assert prefill["kairos_engine_steps"][0][1]["worker"] == "prefill-0"


def test_port_in_use_is_a_clear_error() -> None:
    import services.router.vllm_metrics  # noqa: F401 (registers vLLM's gauges)


    port = free_ports(1)[0]
    stop = serve_metrics("127.0.0.1", port)
    try:
        with pytest.raises(ConfigError, match="cannot serve /metrics") as e:
            serve_metrics("127.0.0.1", port)
        assert "--metrics-port" in e.value.fix and e.value.event == "metrics_failed_to_start"
        # a Prometheus server asks for OpenMetrics; vLLM's names must keep their colons all the same
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "vllm:kv_cache_usage_perc" in r.text and "vllm_kv_cache" not in r.text
        # this process's own health check (one router replica among several on a shared HTTP port)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/nothing", timeout=5).status_code == 404
    finally:
        stop()
    assert ClusterSpec().metrics_ports == {}


def test_router_replicas_each_count_their_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two routers on one HTTP port: each serves its own vLLM series, and their sum is the cluster's."""
    ports = dict(zip(("router", "router-1"), free_ports(2), strict=True))
    c = start_cluster(tmp_path_factory.mktemp("replicas"), prefill=1, decode=1, profile="fast", routers=2,
                      metrics_ports=ports)
    try:
        n = 8
        for _ in range(n):  # a new connection each: the kernel spreads them over the two routers
            r = httpx.post(c.spec.api + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30,
                           headers={"connection": "close"})
            assert r.status_code == 200, r.text
        per_router = [sum(v for name, _, v in scrape(p)["vllm:request_success"] if name.endswith("_total"))
                      for p in ports.values()]
        assert sum(per_router) == n, per_router
    finally:
        c.stop(15)
