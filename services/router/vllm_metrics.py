"""The request-level series vLLM's OpenAI server exports, under vLLM's names, on the router's /metrics.

So that a dashboard, alert or autoscaler written for vLLM (its example Grafana dashboard among
them) works on Kairos unchanged: same names (`vllm:` prefix), types, buckets and labels
(`model_name`, `engine`; `finished_reason` on `vllm:request_success_total`). What only Kairos
knows (route, deflection reason, prediction error) stays in `kairos_router_*` (metrics.py) and on
the monitor (`kairos_*`).

How each series is computed from what the router sees (docs/observability.md says the same for
operators):

- one observation per finished request, when it ends (`observe_finished`): TTFT, every
  inter-token gap, e2e latency, prompt and generation lengths, and the phase times: queue =
  waiting in the router (held for KV room or late binding) plus the prefill worker's queue;
  prefill = the rest of the TTFT (prefill, KV transfer, first decode step); decode = first to
  last token; inference = prefill + decode.
- `vllm:num_requests_running` / `_waiting`: this router's requests, dispatched or held in its
  queue (`engine="0"`); summed over router replicas they are the cluster's.
- `vllm:kv_cache_usage_perc`: one series per decode worker (`engine=<worker id>`) from its latest
  heartbeat; every router replica reports the same value, so aggregate it with `max`.

Buckets: vLLM's, token-count buckets from its 1-2-5 rule up to the router's `max_prompt_tokens`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from common import messages as m
from common.promfast import child, observe_many

# The router (services.router.service.Router) and its requests (common.router_core.requests.Request)
# are read duck-typed: importing them here would close an import cycle through the service.
Router = Any
Request = Any

LABELS = ["model_name", "engine"]
ENGINE = "0"  # the router's own series; per-worker gauges carry the worker id instead
FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
MAX_GAPS_OBSERVED = 8192  # per request: bounds the work one request can cost
TOKEN_BUCKETS_MAX = 131072  # the token histograms' buckets stop here (vLLM: its max_model_len)


def one_two_five(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    out: list[int] = []
    scale = 1
    while True:
        for mant in (1, 2, 5):
            if mant * scale > max_value:
                return out
            out.append(mant * scale)
        scale *= 10


TOKEN_BUCKETS = one_two_five(TOKEN_BUCKETS_MAX)


class _Fold:
    """Folds the requests ended since the last scrape into the series below before they are
    collected: registered before them, so the registry collects it first (its own output is
    nothing). A request's end costs a tuple on a list (`observe_finished`), not 11 histogram
    observations and 3 counter increments, each taking a lock and walking its buckets (about
    20-35 µs per request on the 2-core VM, the largest single item of a request's end)."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fold()
        return iter(())


REGISTRY.register(_Fold())


def _hist(name: str, text: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
    return Histogram(name, text, LABELS, buckets=buckets)


TTFT = _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
ITL = _hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
TPOT = _hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per "
             "request.", ITL_BUCKETS)
E2E = _hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
QUEUE = _hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              REQUEST_LATENCY_BUCKETS)
INFERENCE = _hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                  REQUEST_LATENCY_BUCKETS)
PREFILL = _hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS)
DECODE = _hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
               REQUEST_LATENCY_BUCKETS)
PROMPT_LEN = _hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
GEN_LEN = _hist("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS)
MAX_GEN = _hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation "
                "tokens.", TOKEN_BUCKETS)
MAX_TOKENS = _hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                   TOKEN_BUCKETS)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS)
GEN_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS)
SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.",
                  [*LABELS, "finished_reason"])


class _Gauges:
    """vLLM's scheduler and KV gauges, read from the live router at scrape time."""

    def __init__(self) -> None:
        self.router: weakref.ReferenceType[Any] | None = None

    def collect(self) -> Iterator[Metric]:
        router = self.router() if self.router is not None else None
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=LABELS)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=LABELS)
        if router is not None:
            model = router.cfg.served_model_name
            held = sum(1 for r in router.kv_waiting if not r.done) + len(router.parked)
            waiting.add_metric([model, ENGINE], held)
            running.add_metric([model, ENGINE], max(0, len(router.requests) - held))
            for wid, w in sorted(router.table.workers.items()):
                hb = w.hb
                if isinstance(hb, m.DecodeHeartbeat) and hb.kv_capacity_tokens > 0:
                    used = 1.0 - hb.kv_free_tokens / hb.kv_capacity_tokens
                    kv.add_metric([model, wid], min(1.0, max(0.0, used)))
        yield running
        yield waiting
        yield kv


_GAUGES = _Gauges()
REGISTRY.register(_GAUGES)


def attach(router: Router) -> None:
    """Serve `router`'s gauges, and create its finish-reason series at 0 as vLLM does."""
    _GAUGES.router = weakref.ref(router)
    model = router.cfg.served_model_name
    for reason in FINISH_REASONS:
        SUCCESS.labels(model, ENGINE, reason)
    for c in (PROMPT_TOKENS, GEN_TOKENS):
        c.labels(model, ENGINE)


# requests ended and not yet folded into the series: (model, finished_reason, prompt tokens, output
# tokens, max_tokens, e2e, queue, ttft or None, decode, inter-token gaps)
_pending: list[tuple[str, str, int, int, int, float, float, float | None, float, list[float]]] = []
FOLD_AT = 1024  # fold at once past this many (memory stays bounded between scrapes)


def observe_finished(model: str, req: Request, finished_reason: str | None) -> None:
    """A request's end. `finished_reason` is "stop", "length" or "abort" (the client went away);
    None for a request that failed (Kairos counts those in kairos_router_requests_total{outcome}).
    Kept as one tuple, folded into the series at the next scrape (`fold`)."""
    if finished_reason is None:
        return
    now = time.monotonic()
    queue = max(0.0, req.decided_at - req.arrival) if req.decided_at else 0.0
    if req.prefill is not None:
        queue += max(0.0, req.prefill.queue_s)
    first = req.first_token_at
    n_out = req.n_out
    end = req.last_token_at if n_out else 0.0
    gaps = req.gaps
    _pending.append((model, finished_reason, len(req.prompt_token_ids), n_out, req.sampling.max_tokens,
                     max(0.0, now - req.arrival), queue, None if first is None else first - req.arrival,
                     0.0 if first is None else max(0.0, end - first),
                     gaps if len(gaps) <= MAX_GAPS_OBSERVED else gaps[:MAX_GAPS_OBSERVED]))
    if len(_pending) >= FOLD_AT:
        fold()


def fold() -> None:
    """The requests ended since the last fold, into vLLM's series: the same counts and sums one
    observation per value gives (common/promfast.py `observe_many`), a bucket increment per
    bucket touched."""
    if not _pending:
        return
    batch = _pending[:]
    del _pending[:]
    by_model: dict[str, list[tuple[str, str, int, int, int, float, float, float | None, float, list[float]]]] = {}
    for e in batch:
        by_model.setdefault(e[0], []).append(e)
    for model, ends in by_model.items():
        lv = (model, ENGINE)
        reasons: dict[str, int] = {}
        for e in ends:
            reasons[e[1]] = reasons.get(e[1], 0) + 1
        for reason, k in reasons.items():
            child(SUCCESS, *lv, reason).inc(k)
        prompts = [e[2] for e in ends]
        outs = [e[3] for e in ends]
        child(PROMPT_TOKENS, *lv).inc(sum(prompts))
        child(GEN_TOKENS, *lv).inc(sum(outs))
        observe_many(child(PROMPT_LEN, *lv), prompts)
        observe_many(child(GEN_LEN, *lv), outs)
        observe_many(child(MAX_GEN, *lv), outs)
        observe_many(child(MAX_TOKENS, *lv), [e[4] for e in ends])
        observe_many(child(E2E, *lv), [e[5] for e in ends])
        observe_many(child(QUEUE, *lv), [e[6] for e in ends])
        started = [(e, e[7]) for e in ends if e[7] is not None]
        prefills = [max(0.0, ttft - e[6]) for e, ttft in started]
        decodes = [e[8] for e, _ in started]
        observe_many(child(TTFT, *lv), [max(0.0, ttft) for _, ttft in started])
        observe_many(child(PREFILL, *lv), prefills)
        observe_many(child(DECODE, *lv), decodes)
        observe_many(child(INFERENCE, *lv), [a + b for a, b in zip(prefills, decodes, strict=True)])
        observe_many(child(TPOT, *lv), [e[8] / (e[3] - 1) for e, _ in started if e[3] > 1])
        # every token's gap: one array, not a list of up to FOLD_AT x MAX_GAPS_OBSERVED floats
        observe_many(child(ITL, *lv), np.fromiter(chain.from_iterable(e[9] for e, _ in started), dtype=float))
