"""The router's /metrics carries vLLM's request-level series under vLLM's names, labels and buckets."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kairos.up import Cluster
from services.router import vllm_metrics

MODEL = "kairos-sim"  # the cluster's served model name (the default)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_one_two_five_buckets_are_vllms() -> None:
    assert vllm_metrics.one_two_five(100) == [1, 2, 5, 10, 20, 50, 100]
    assert vllm_metrics.one_two_five(2048)[-1] == 2000


@pytest.fixture(scope="module")
def scraped(fast_cluster: Cluster) -> str:
    api = fast_cluster.spec.api
    with httpx.Client(base_url=api, timeout=30) as c:
        for i, n in enumerate((1, 4, 9)):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * (5 + 40 * i), "max_tokens": n})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "stream", "max_tokens": 6,
                                                       "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        return c.get("/metrics").text


def test_vllm_series_with_model_name(scraped: str) -> None:
    fam = families(scraped)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_max_num_generation_tokens"):
        f = fam[name]
        assert f.type == "histogram", name
        count = [s for s in f.samples if s.name == name + "_count"]
        assert count and all(s.labels == {"model_name": MODEL, "engine": "0"} for s in count), name
        if name != "vllm:inter_token_latency_seconds":  # one per gap, counted below
            assert count[0].value == 4, (name, count[0].value)
    for name, kind in (("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
                       ("vllm:request_success", "counter"), ("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"), ("vllm:kv_cache_usage_perc", "gauge")):
        assert fam[name].type == kind, name


def test_counts_and_finish_reasons(scraped: str) -> None:
    fam = families(scraped)
    gen = [s for s in fam["vllm:generation_tokens"].samples if s.name == "vllm:generation_tokens_total"]
    assert gen[0].value == 1 + 4 + 9 + 6
    success = {s.labels["finished_reason"]: s.value for s in fam["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert success == {"stop": 0, "length": 4, "abort": 0}
    # 1 + 3 + 8 + 5 gaps between the tokens of the four requests, in vLLM's buckets
    itl = fam["vllm:inter_token_latency_seconds"]
    buckets = [s for s in itl.samples if s.name.endswith("_bucket")]
    assert [float(s.labels["le"]) for s in buckets][:-1] == list(vllm_metrics.ITL_BUCKETS)
    assert next(s for s in itl.samples if s.name.endswith("_count")).value == 0 + 3 + 8 + 5


def test_kv_usage_per_decode_worker(scraped: str) -> None:
    kv = families(scraped)["vllm:kv_cache_usage_perc"]
    samples = {s.labels["engine"]: s.value for s in kv.samples}
    assert set(samples) == {"decode-0"} and all(0.0 <= v <= 1.0 for v in samples.values())


def test_request_ends_are_folded_into_the_series_before_any_scrape_reads_them() -> None:
    """observe_finished keeps a tuple; the next collection (a scrape, or get_sample_value) folds it
    in first: the counts, sums and buckets one observation per value gives."""
    import types

    from prometheus_client import REGISTRY, generate_latest

    from common import messages as m

    model = "fold-test"
    lv = {"model_name": model, "engine": vllm_metrics.ENGINE}

    def req(first: float | None, gaps: list[float], n_out: int) -> Any:
        return types.SimpleNamespace(prompt_token_ids=[1] * 16, n_out=n_out, sampling=m.Sampling(max_tokens=50),
                                     arrival=100.0, decided_at=100.002, prefill=None, first_token_at=first,
                                     last_token_at=(first or 0.0) + sum(gaps), gaps=gaps)

    vllm_metrics.observe_finished(model, req(100.004, [0.02, 0.03, 0.2], 4), "length")
    vllm_metrics.observe_finished(model, req(None, [], 0), "abort")
    vllm_metrics.observe_finished(model, req(100.004, [], 1), None)  # failed: not vLLM's to count
    assert model in generate_latest().decode()  # a scrape sees them at once

    def v(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**lv, **extra})

    assert v("vllm:request_success_total", finished_reason="length") == 1
    assert v("vllm:request_success_total", finished_reason="abort") == 1
    assert v("vllm:prompt_tokens_total") == 32 and v("vllm:generation_tokens_total") == 4
    assert v("vllm:time_to_first_token_seconds_count") == 1
    assert v("vllm:time_to_first_token_seconds_bucket", le="0.005") == 1
    assert v("vllm:time_to_first_token_seconds_bucket", le="0.001") == 0
    assert v("vllm:inter_token_latency_seconds_count") == 3
    assert v("vllm:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert v("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert v("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25 / 3)
    assert v("vllm:request_queue_time_seconds_count") == 2 and v("vllm:e2e_request_latency_seconds_count") == 2
    assert v("vllm:request_prefill_time_seconds_sum") == pytest.approx(0.002)
    assert v("vllm:request_params_max_tokens_bucket", le="50.0") == 2
    assert vllm_metrics._pending == []
