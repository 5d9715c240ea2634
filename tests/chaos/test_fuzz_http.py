"""Fuzzed bodies to every HTTP route: never a 5xx, never a dead router."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.up import Cluster
from tests.conftest import start_cluster

pytestmark = [pytest.mark.chaos]

OK = {200, 400, 401, 404, 405, 413, 429, 503}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30)
fields = st.sampled_from(["prompt", "messages", "max_tokens", "stream", "temperature", "top_p", "n", "model",
                          "stream_options", "ignore_eos", "ttft_slo", "tbt_slo", "seed", "max_completion_tokens"])
bodies = st.dictionaries(fields, json_values, max_size=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("fuzz"), prefill=1, decode=1, profile="fast", policy="kairos",
                      router_env={"KAIROS_MAX_OUTPUT_TOKENS": "64"})
    yield c
    c.stop(15)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_fuzzed_json_bodies(cluster: Cluster, path: str, body: dict[str, object]) -> None:
    r = httpx.post(cluster.spec.api + path, json=body, timeout=30)
    assert r.status_code in OK, (r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready",
                             "/v1/kairos/stats", "/metrics", "/nope"]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]), raw=st.binary(max_size=300))
def test_fuzzed_raw_requests(cluster: Cluster, path: str, method: str, raw: bytes) -> None:
    r = httpx.request(method, cluster.spec.api + path, content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert r.status_code in OK, (r.status_code, r.text)


def test_router_still_serves_after_fuzzing(cluster: Cluster) -> None:
    r = httpx.post(cluster.spec.api + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    cluster.check_alive()
