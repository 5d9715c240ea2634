"""A worker's own /metrics: what its engine says about itself, on the worker's metrics port.

The router's /metrics has the request-level view (vLLM's series) and each decode worker's KV
usage as its heartbeats report it; this is the engine's side, scraped from the worker itself, so
that it is there when the router is not: running and waiting requests, KV use, step times, steps
taken. It is the heartbeat the worker sends (the same numbers the router decides with), sampled
on the worker's event loop every `interval` and served from the latest sample, so a scrape never
touches the engine from another thread.

With the vllm engine the port serves the process's whole default registry, so whatever vLLM's
own stat loggers registered there is served beside these.

Names are `kairos_engine_*` and not vLLM's: vLLM's names are the router's (one series per
request there), and a Prometheus that scrapes routers and workers would otherwise count twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common import messages as m
from common.config import WorkerConfig
from common.metrics_http import serve_metrics

LABELS = ["model_name", "worker", "role"]
SAMPLE_INTERVAL_S = 0.5  # a prefill heartbeat replays its queue: not worth doing at the 100 ms beat


class EngineMetrics:
    """The latest heartbeat of this worker, as Prometheus metrics (a collector)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.hb: m.PrefillHeartbeat | m.DecodeHeartbeat | None = None

    def collect(self) -> Iterator[Metric]:
        hb = self.hb
        g = {name: GaugeMetricFamily(name, text, labels=LABELS) for name, text in (
            ("kairos_engine_num_requests_running", "Requests in the engine's running batch (decode workers)."),
            ("kairos_engine_num_requests_waiting", "Requests waiting: queued for prefill (prefill workers) or for "
             "their KV to arrive (decode workers)."),
            ("kairos_engine_queued_tokens", "Prompt tokens queued on a prefill worker."),
            ("kairos_engine_kv_cache_usage_perc", "KV-cache usage of a decode worker. 1 means 100 percent."),
            ("kairos_engine_kv_cache_tokens", "Tokens resident in a decode worker's KV cache."),
            ("kairos_engine_deflections", "In-place (deflected) prefills running on a decode worker."),
            ("kairos_engine_tbt_slack_seconds", "Step-time headroom under the strictest resident TBT SLO."),
        )}
        step = GaugeMetricFamily("kairos_engine_step_seconds", "Measured engine step time (recent p50, max).",
                                 labels=[*LABELS, "stat"])
        err = GaugeMetricFamily("kairos_engine_step_prediction_error", "|Predicted - measured| / measured step time "
                                "over the recent steps (p50, p90), predicted by the model this worker reports "
                                "(common/prediction_error.py).", labels=[*LABELS, "stat"])
        steps = CounterMetricFamily("kairos_engine_steps", "Engine steps taken since the worker started.",
                                    labels=LABELS)
        if hb is not None:
            if isinstance(hb, m.DecodeHeartbeat):
                lv = [self.model_name, hb.worker_id, "decode"]
                g["kairos_engine_num_requests_running"].add_metric(lv, hb.batch)
                g["kairos_engine_num_requests_waiting"].add_metric(lv, hb.waiting_kv)
                if hb.kv_capacity_tokens > 0:
                    used = 1.0 - hb.kv_free_tokens / hb.kv_capacity_tokens
                    g["kairos_engine_kv_cache_usage_perc"].add_metric(lv, min(1.0, max(0.0, used)))
                g["kairos_engine_kv_cache_tokens"].add_metric(lv, hb.kv_tokens)
                g["kairos_engine_deflections"].add_metric(lv, hb.deflections)
                if hb.tbt_slack_ms is not None:
                    g["kairos_engine_tbt_slack_seconds"].add_metric(lv, hb.tbt_slack_ms / 1000.0)
                step.add_metric([*lv, "max"], hb.step_ms_max / 1000.0)
            else:
                lv = [self.model_name, hb.worker_id, "prefill"]
                g["kairos_engine_num_requests_waiting"].add_metric(lv, hb.queued_requests)
                g["kairos_engine_queued_tokens"].add_metric(lv, hb.queued_tokens)
            step.add_metric([*lv, "p50"], hb.step_ms_p50 / 1000.0)
            if hb.step_err_p50 is not None and hb.step_err_p90 is not None:
                err.add_metric([*lv, "p50"], hb.step_err_p50)
                err.add_metric([*lv, "p90"], hb.step_err_p90)
            steps.add_metric(lv, hb.steps)
        yield from g.values()
        yield step
        yield err
        yield steps

    async def sample(self, heartbeat: Callable[[], m.Msg], interval: float) -> None:
        """Keep the latest heartbeat (built as the worker builds its own; no message is sent)."""
        while True:
            try:
                hb = heartbeat()
            except Exception:  # an engine still starting has no load yet: metrics never end a worker
                hb = None
            if isinstance(hb, m.PrefillHeartbeat | m.DecodeHeartbeat):
                self.hb = hb
            await asyncio.sleep(interval)


class _Worker(Protocol):
    def heartbeat(self) -> m.Msg: ...
    async def run(self) -> int: ...


async def run_with_metrics(cfg: WorkerConfig, worker: _Worker) -> int:
    """`worker.run()`, with /metrics on cfg.metrics_port while it runs (none when the port is 0)."""
    if cfg.metrics_port <= 0:
        return await worker.run()
    em = EngineMetrics(cfg.served_model_name)
    REGISTRY.register(em)
    stop = serve_metrics(cfg.metrics_host, cfg.metrics_port)
    sampler = asyncio.create_task(em.sample(worker.heartbeat, SAMPLE_INTERVAL_S), name="metrics")
    try:
        return await worker.run()
    finally:
        sampler.cancel()
        stop()
        REGISTRY.unregister(em)
