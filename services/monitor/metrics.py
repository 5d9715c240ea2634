"""The monitor's Prometheus metrics: the cluster as the router's telemetry describes it.

Event metrics (counters, histograms) are updated as messages arrive. Level metrics (per-worker
gauges, live workers, the router's own counts) are read from `MonitorState` at scrape time by a
collector, so a worker that is lost, or that the router stops reporting, disappears from
/metrics with nothing left to remove by hand.

Names follow vLLM's (`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:kv_cache_usage_perc`) with our `kairos_` prefix where
the meaning is the same; seconds and ratios in [0, 1] everywhere. The full list with help texts
is in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common import messages as m
from common.prediction_error import REL_ERROR_BUCKETS, relative_error
from services.monitor.state import MonitorState, record_gaps, slo_verdict

# vLLM's buckets, extended below 10 ms for the simulated engine's fast steps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ERR = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PRED_ERROR_BUCKETS = (*(-x for x in reversed(_ERR)), 0.0, *_ERR)  # predicted - actual: both signs
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
KV_XFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_GAPS_OBSERVED = 8192  # per request: bounds the work one record can cost

# WorkerSeen.state key -> (metric name, help, scale to base units). Unknown keys still appear, in
# kairos_worker_state{key=...}, so a new heartbeat field is visible before anyone names it here.
WORKER_GAUGES: dict[str, tuple[str, str, float]] = {
    "queued_tokens": ("kairos_worker_prefill_queue_tokens", "Prompt tokens queued on a prefill worker.", 1.0),
    "queued_requests": ("kairos_worker_prefill_queue_requests", "Requests queued on a prefill worker.", 1.0),
    "batch": ("kairos_worker_decode_batch", "Requests in a decode worker's running batch.", 1.0),
    "kv_tokens": ("kairos_worker_kv_cache_tokens", "Tokens resident in a decode worker's KV cache.", 1.0),
    "kv_used": ("kairos_worker_kv_cache_usage_perc", "KV-cache usage of a decode worker; 1 means 100 percent.",
                1.0),
    "deflections": ("kairos_worker_deflections_in_flight", "In-place (deflected) prefills running on a decode "
                    "worker.", 1.0),
    "loop_lag_ms": ("kairos_worker_event_loop_lag_seconds", "The worst lag of a worker's event loop (how late it "
                    "woke a task) since its previous heartbeat.", 1e-3),
    "step_err_p50": ("kairos_worker_step_prediction_error_p50", "Median of |predicted - measured| / measured step "
                     "time over a worker's recent steps (the model it reports; common/prediction_error.py).", 1.0),
    "step_err_p90": ("kairos_worker_step_prediction_error_p90", "90th percentile of |predicted - measured| / "
                     "measured step time over a worker's recent steps.", 1.0),
    "tbt_slack_ms": ("kairos_worker_tbt_slack_seconds", "Headroom of a decode worker's step time under the "
                     "strictest resident TBT SLO (absent when it has no residents).", 1e-3),
}
STEP_KEYS = {"step_ms_p50": "p50", "step_ms_max": "max"}


def kv_reason(error: str) -> str:
    """A bounded label from a KV error text such as "kv_timeout: no notification after 10 s"."""
    return error.split(":", 1)[0].strip()[:40] or "unknown"


class _StateCollector:
    """Level metrics, read from the monitor state at scrape time."""

    def __init__(self, state: MonitorState, clock: Callable[[], float]) -> None:
        self.state = state
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        st = self.state
        now = self.clock()
        st.expire(now)
        live = GaugeMetricFamily("kairos_workers", "Live workers by role, as the router reports them.",
                                 labels=["role"])
        for role in ("prefill", "decode"):
            live.add_metric([role], sum(1 for w in st.workers.values() if w.seen.role == role))
        yield live
        info = GaugeMetricFamily("kairos_worker_info", "One series per live worker (value 1).",
                                 labels=["worker", "role", "engine", "incarnation"])
        age = GaugeMetricFamily("kairos_worker_report_age_seconds",
                                "Seconds since the router last reported this worker.", labels=["worker", "role"])
        step = GaugeMetricFamily("kairos_worker_step_seconds", "A worker's measured engine step time.",
                                 labels=["worker", "role", "stat"])
        other = GaugeMetricFamily("kairos_worker_state", "Worker load fields without a dedicated metric.",
                                  labels=["worker", "role", "key"])
        named = {key: GaugeMetricFamily(name, text, labels=["worker", "role"])
                 for key, (name, text, _) in WORKER_GAUGES.items()}
        for wid, w in sorted(st.workers.items()):
            role = w.seen.role
            info.add_metric([wid, role, w.seen.engine, w.seen.incarnation], 1.0)
            age.add_metric([wid, role], max(0.0, now - w.last_seen))
            for key, value in w.seen.state.items():
                if key in WORKER_GAUGES:
                    if key == "tbt_slack_ms" and value < 0:  # the router's "unknown"
                        continue
                    named[key].add_metric([wid, role], value * WORKER_GAUGES[key][2])
                elif key in STEP_KEYS:
                    step.add_metric([wid, role, STEP_KEYS[key]], value / 1000.0)
                else:
                    other.add_metric([wid, role, key], value)
        yield info
        yield age
        yield step
        yield from named.values()
        yield other
        r = st.router
        inflight = GaugeMetricFamily("kairos_requests_in_flight", "Requests in flight at the router.")
        lag = GaugeMetricFamily("kairos_router_event_loop_lag_seconds", "The worst lag of the router's event loop "
                                "(how late it woke a task) in its last second, the worst of the live replicas.")
        counts = CounterMetricFamily("kairos_router_reported_requests",
                                     "The router's own request counts since it started (resets with it).",
                                     labels=["state"])
        if r is not None:
            inflight.add_metric([], r.in_flight)
            lag.add_metric([], r.loop_lag_ms / 1000.0)
            for name in ("accepted", "completed", "failed", "rejected"):
                counts.add_metric([name], getattr(r, name))
        yield inflight
        yield lag
        yield counts
        tel = CounterMetricFamily("kairos_telemetry_messages", "Telemetry messages received by the monitor.",
                                  labels=["type"])
        for name, n in sorted(st.totals.items()):
            if name not in ("bad_frames", "missed"):
                tel.add_metric([name], n)
        yield tel
        yield CounterMetricFamily("kairos_telemetry_bad_frames", "Telemetry frames that did not decode.",
                                  value=st.totals["bad_frames"])
        yield CounterMetricFamily("kairos_telemetry_missed", "Telemetry messages lost on the way (sequence gaps: "
                                  "the router's send queue was full).", value=st.totals["missed"])


class MonitorMetrics:
    """The monitor's registry: event metrics updated by `observe`, level metrics by a collector."""

    def __init__(self, state: MonitorState, clock: Callable[[], float]) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("kairos_routing_decisions", "Routing decisions by route and reason.",
                                 ["route", "reason"], registry=r)
        self.decision_time = Histogram("kairos_routing_decision_seconds", "Time the router took to decide.",
                                       buckets=DECISION_BUCKETS, registry=r)
        self.requests = Counter("kairos_requests", "Finished requests by route and outcome (ok, or the error "
                                "code).", ["route", "outcome"], registry=r)
        self.ttft = Histogram("kairos_time_to_first_token_seconds", "Time to first token, measured at the router.",
                              ["route"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kairos_inter_token_latency_seconds", "Gaps between consecutive tokens of a request, "
                             "measured at the router.", ["route"], buckets=ITL_BUCKETS, registry=r)
        self.tbt_p99 = Histogram("kairos_request_tbt_p99_seconds", "Per-request 99th percentile of the gaps "
                                 "between tokens (what a TBT SLO is judged on).", ["route"], buckets=ITL_BUCKETS,
                                 registry=r)
        self.e2e = Histogram("kairos_e2e_request_latency_seconds", "End-to-end latency of finished requests.",
                             ["route"], buckets=E2E_BUCKETS, registry=r)
        self.pred_err = Histogram("kairos_ttft_prediction_error_seconds", "Predicted minus actual TTFT of the "
                                  "chosen route (negative: slower than predicted).", ["route"],
                                  buckets=PRED_ERROR_BUCKETS, registry=r)
        self.pred_rel_err = Histogram("kairos_ttft_prediction_relative_error", "|Predicted - actual| / actual TTFT "
                                      "of the chosen route (0.1: 10 percent off).", ["route"],
                                      buckets=REL_ERROR_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kairos_prompt_tokens", "Prompt tokens of finished requests.", ["route"],
                                     registry=r)
        self.generation_tokens = Counter("kairos_generation_tokens", "Tokens generated for finished requests.",
                                         ["route"], registry=r)
        self.redispatches = Counter("kairos_request_redispatches", "Extra dispatch attempts (a worker died or "
                                    "refused before the first token).", registry=r)
        self.kv_fallbacks = Counter("kairos_kv_fallbacks", "Requests whose KV transfer failed and whose prefill "
                                    "the decode worker redid in place.", ["route"], registry=r)
        self.kv_failures = Counter("kairos_kv_transfer_failures", "Failed KV transfers by reason.", ["reason"],
                                   registry=r)
        self.kv_bytes = Counter("kairos_kv_transfer_bytes", "KV-cache bytes moved from prefill to decode "
                                "workers.", registry=r)
        self.kv_time = Histogram("kairos_kv_transfer_seconds", "Duration of one request's KV transfer.",
                                 buckets=KV_XFER_BUCKETS, registry=r)
        self.queue_time = Histogram("kairos_request_queue_time_seconds", "Time a request waited in a prefill "
                                    "worker's queue.", ["route"], buckets=TTFT_BUCKETS, registry=r)
        self.prefill_time = Histogram("kairos_request_prefill_time_seconds", "Time a prefill worker spent "
                                      "prefilling a request.", ["route"], buckets=TTFT_BUCKETS, registry=r)
        self.slo_judged = Counter("kairos_slo_judged_requests", "Finished requests that carried TTFT and TBT SLOs.",
                                  ["route"], registry=r)
        self.slo_attained = Counter("kairos_slo_attained_requests", "Requests that met their SLO: ttft, tbt (p99 "
                                    "gap), or both.", ["route", "slo"], registry=r)
        self.role_flips = Counter("kairos_role_flips", "The role planner's flips, by direction, reason and phase "
                                  "(started: SetRole sent; done: back under the new role; abandoned).",
                                  ["from_role", "to_role", "reason", "phase"], registry=r)
        r.register(_StateCollector(state, clock))

    def observe(self, msg: m.TelemetryInbox) -> None:
        match msg:
            case m.DecisionRecord():
                self.decisions.labels(msg.route, msg.reason).inc()
                self.decision_time.observe(msg.decision_us / 1e6)
            case m.RequestRecord():
                self._on_request(msg)
            case m.RoleFlip():
                self.role_flips.labels(msg.frm, msg.to, msg.reason, msg.phase).inc()
            case _:
                pass  # level messages: read from the state at scrape time

    def _on_request(self, rec: m.RequestRecord) -> None:
        route = rec.route or "none"
        self.requests.labels(route, rec.outcome).inc()
        self.prompt_tokens.labels(route).inc(rec.prompt_tokens)
        self.generation_tokens.labels(route).inc(rec.output_tokens)
        if rec.attempts > 1:
            self.redispatches.inc(rec.attempts - 1)
        if rec.ttft_s is not None:
            self.ttft.labels(route).observe(rec.ttft_s)
            if rec.ttft_pred_s is not None:
                self.pred_err.labels(route).observe(rec.ttft_pred_s - rec.ttft_s)
                rel = relative_error(rec.ttft_pred_s, rec.ttft_s)
                if rel is not None:
                    self.pred_rel_err.labels(route).observe(abs(rel))
        if rec.outcome == "ok":
            self.e2e.labels(route).observe(rec.e2e_s)
        if rec.tbt_p99_s is not None:
            self.tbt_p99.labels(route).observe(rec.tbt_p99_s)
        gaps = record_gaps(rec)
        if gaps is not None:
            itl = self.itl.labels(route)
            for g in gaps[:MAX_GAPS_OBSERVED]:
                itl.observe(g)
        elif rec.tbt_p50_s is not None:
            # without the gaps, one sample per request: its median gap (see docs/observability.md)
            self.itl.labels(route).observe(rec.tbt_p50_s)
        # Fields below are proposed additions to RequestRecord (docs/observability.md, "What the
        # telemetry still lacks"); until the router sends them, getattr finds their absence.
        queue_s = getattr(rec, "prefill_queue_s", None)
        if queue_s is not None:
            self.queue_time.labels(route).observe(queue_s)
        prefill_s = getattr(rec, "prefill_s", None)
        if prefill_s is not None:
            self.prefill_time.labels(route).observe(prefill_s)
        verdict = slo_verdict(rec)
        if verdict is not None:
            self.slo_judged.labels(route).inc()
            for slo, met in (("ttft", verdict[0]), ("tbt", verdict[1]), ("both", verdict[0] and verdict[1])):
                if met:
                    self.slo_attained.labels(route, slo).inc()
        kv_error = getattr(rec, "kv_error", "")
        if rec.kv_fallback:
            self.kv_fallbacks.labels(route).inc()
        if rec.kv_fallback or kv_error:
            self.kv_failures.labels(kv_reason(kv_error)).inc()
        kv_bytes = getattr(rec, "kv_bytes", 0)
        if kv_bytes:
            self.kv_bytes.inc(kv_bytes)
        kv_s = getattr(rec, "kv_transfer_s", None)
        if kv_s is not None:
            self.kv_time.observe(kv_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
