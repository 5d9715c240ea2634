"""The router process's own Prometheus metrics (served on the router's GET /metrics).

The monitor holds the cluster-wide picture from telemetry; these are what one router saw
itself, available even with no monitor running, and exact where telemetry is not (every
inter-token gap, admission rejections). Names carry `kairos_router_` so the two never mix when
one Prometheus scrapes both. Module-level metrics in prometheus_client's default registry, as
the router's /metrics serves that registry; the service calls the functions below, nothing else
touches the metric objects. Every function is cheap and never raises on odd input.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from common import messages as m
from common.promfast import child, observe_many

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
KV_XFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_GAPS_OBSERVED = 8192

DECISIONS = Counter("kairos_router_decisions", "Routing decisions by route and reason (re-dispatches included).",
                    ["route", "reason"])
DECISION_TIME = Histogram("kairos_router_decision_seconds", "Time to take one routing decision.",
                          buckets=DECISION_BUCKETS)
REQUESTS = Counter("kairos_router_requests", "Finished requests by route and outcome (ok, or the error code).",
                   ["route", "outcome"])
REJECTED = Counter("kairos_router_rejected_requests", "Requests refused at admission (429 overloaded, 503 no "
                   "worker or shutting down).", ["reason"])
TTFT = Histogram("kairos_router_time_to_first_token_seconds", "Time to first token sent to the client.", ["route"],
                 buckets=TTFT_BUCKETS)
ITL = Histogram("kairos_router_inter_token_latency_seconds", "Gaps between consecutive tokens of a request.",
                ["route"], buckets=ITL_BUCKETS)
E2E = Histogram("kairos_router_e2e_request_latency_seconds", "End-to-end latency of requests that finished ok.",
                ["route"], buckets=E2E_BUCKETS)
IN_FLIGHT = Gauge("kairos_router_requests_in_flight", "Requests admitted and not finished.")
DELIVERY_ALLOWANCE = Gauge("kairos_tbt_delivery_allowance_seconds",
                           "The part of the TBT SLO the decode guard leaves for delivery (configured "
                           "tbt_delivery_allowance_ms plus the measured P99.9 of the router's write gap less the "
                           "worker's step): steps are planned to the SLO less this.")
WORKERS = Gauge("kairos_router_workers", "Registered workers by role (draining ones excluded).", ["role"])
REDISPATCHES = Counter("kairos_router_redispatches", "Requests sent again after a worker died or refused.")
MIGRATIONS = Counter("kairos_router_migrations", "Streaming requests whose decode worker died or froze: resumed "
                     "on another one, parked (no worker free yet), or failed (limit reached, no worker in time).",
                     ["outcome"])
DEFLECT_REJECTED = Counter("kairos_router_deflections_rejected", "Deflections a decode worker's admission turned "
                           "away (no room beside its decodes and accepted deflections): decided again without it.")
KV_FALLBACKS = Counter("kairos_router_kv_fallbacks", "Requests whose KV transfer failed and were prefilled in "
                       "place by their decode worker.")
KV_BYTES = Counter("kairos_router_kv_transfer_bytes", "KV-cache bytes prefill workers reported moving to decode "
                   "workers.")
KV_TIME = Histogram("kairos_router_kv_transfer_seconds", "One request's KV transfer, as its prefill worker timed it.",
                    buckets=KV_XFER_BUCKETS)
KV_FAILURES = Counter("kairos_router_kv_transfer_failures", "KV transfers a prefill worker reported failed, by "
                      "reason.", ["reason"])
QUEUE_TIME = Histogram("kairos_router_request_queue_time_seconds", "Time a request waited in a prefill worker's "
                       "queue.", buckets=TTFT_BUCKETS)
PREFILL_TIME = Histogram("kairos_router_request_prefill_time_seconds", "Time a prefill worker spent prefilling a "
                         "request.", buckets=TTFT_BUCKETS)
WORKERS_LOST = Counter("kairos_router_workers_lost", "Workers removed (heartbeat timeout, restart).", ["role"])
BAD_FRAMES = Counter("kairos_router_bad_frames", "Bus frames that did not decode and were dropped.", ["socket"])
DROPPED = Counter("kairos_router_dropped_messages", "Worker messages dropped because the sender may not send them "
                  "(unregistered peer, a request not assigned to it, a worker id not its own), by reason.",
                  ["reason"])
REFUSED = Counter("kairos_router_workers_refused", "Registrations refused (protocol, identity, or an engine, model "
                  "or KV transport incompatible with the cluster's), by reason.", ["reason"])
DEPARTED = Counter("kairos_router_workers_departed", "Workers that drained and left cleanly (Goodbye).", ["role"])
HELD = Counter("kairos_router_held_requests", "Requests held at admission because no worker could take them yet, "
               "by how the wait ended (served, or timeout: HTTP 503).", ["outcome"])

ROLE_FLIPS = Counter("kairos_router_role_flips", "Workers the role planner moved, by direction and reason (counted "
                     "when the router sends the SetRole).", ["from_role", "to_role", "reason"])
ROLE_FLIP_SECONDS = Histogram("kairos_router_role_flip_seconds", "From a flip's SetRole to the worker's Hello under "
                              "its new role (outcome done), or to the flip's abandonment (abandoned).", ["outcome"],
                              buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
WORKER_ROLE = Gauge("kairos_router_worker_role", "1 for each registered worker under its current role (the role "
                    "planner moves workers between roles).", ["worker", "role"])
_roles: dict[str, str] = {}


def observe_decision(rec: m.DecisionRecord) -> None:
    child(DECISIONS, rec.route, rec.reason).inc()
    DECISION_TIME.observe(max(0.0, rec.decision_us) / 1e6)


def observe_migration(outcome: str) -> None:
    MIGRATIONS.labels(outcome).inc()


def observe_request(rec: m.RequestRecord, gaps: Sequence[float] = ()) -> None:
    """A request's end (any outcome); `gaps` are its inter-token gaps in seconds (Request.gaps)."""
    route = rec.route or "none"
    child(REQUESTS, route, rec.outcome or "unknown").inc()
    if rec.ttft_s is not None:
        child(TTFT, route).observe(rec.ttft_s)
    if rec.outcome == "ok":
        child(E2E, route).observe(rec.e2e_s)
    if gaps:
        observe_many(child(ITL, route), gaps[:MAX_GAPS_OBSERVED])


def kv_reason(error: str) -> str:
    """A bounded label from a KV error text such as "kv_timeout: no notification after 10 s"."""
    return error.split(":", 1)[0].strip()[:40] or "unknown"


def observe_prefill_done(p: m.PrefillDone) -> None:
    """Every PrefillDone, stale attempts included (their bytes moved all the same)."""
    QUEUE_TIME.observe(max(0.0, p.queue_s))
    PREFILL_TIME.observe(max(0.0, p.prefill_s))
    error: str = getattr(p, "kv_error", "")  # PrefillDone.kv_error is newer than protocol 1's first cut
    if error:
        KV_FAILURES.labels(kv_reason(error)).inc()
        return
    if p.kv.nbytes > 0:
        KV_BYTES.inc(p.kv.nbytes)
    if p.kv.transfer_s > 0:
        KV_TIME.observe(p.kv.transfer_s)


def observe_rejected(reason: str) -> None:
    REJECTED.labels(reason).inc()


def observe_redispatch() -> None:
    REDISPATCHES.inc()


def observe_deflect_rejected() -> None:
    DEFLECT_REJECTED.inc()


def observe_kv_fallback() -> None:
    KV_FALLBACKS.inc()


def observe_worker_lost(role: str) -> None:
    WORKERS_LOST.labels(role).inc()


def observe_bad_frame(socket: str) -> None:
    BAD_FRAMES.labels(socket).inc()


def observe_dropped(reason: str) -> None:
    DROPPED.labels(reason).inc()


def observe_refused(reason: str) -> None:
    REFUSED.labels(reason).inc()


def observe_departed(role: str) -> None:
    DEPARTED.labels(role).inc()


def observe_held(outcome: str) -> None:
    HELD.labels(outcome).inc()


def set_in_flight(n: int) -> None:
    IN_FLIGHT.set(n)


def set_delivery_allowance(seconds: float) -> None:
    DELIVERY_ALLOWANCE.set(seconds)


def set_workers(prefill: int, decode: int) -> None:
    WORKERS.labels("prefill").set(prefill)
    WORKERS.labels("decode").set(decode)


def observe_role_flip(frm: str, to: str, reason: str) -> None:
    ROLE_FLIPS.labels(frm, to, reason).inc()


def observe_role_flip_done(outcome: str, seconds: float) -> None:
    ROLE_FLIP_SECONDS.labels("abandoned" if outcome == "abandoned" else "done").observe(max(0.0, seconds))


def set_worker_roles(roles: dict[str, str]) -> None:
    """Each registered worker's role now (a worker gone, or under another role, loses its old series)."""
    for worker, role in list(_roles.items()):
        if roles.get(worker) != role:
            WORKER_ROLE.remove(worker, role)
            del _roles[worker]
    for worker, role in roles.items():
        if worker not in _roles:
            WORKER_ROLE.labels(worker, role).set(1)
            _roles[worker] = role
