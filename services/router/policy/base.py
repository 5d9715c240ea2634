"""Snapshots in, a decision out: the types every routing policy shares.

A policy sees immutable views of the live workers (latest heartbeat plus the router's ledger
of work dispatched since) and the request; it returns a `Decision`. No sockets, no clock, no
global randomness: the live router and `kairos sim` call the same code.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from common.messages import Route
from common.perf_model import PerfModel


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_tokens: int
    max_tokens: int
    ttft_slo: float
    tbt_slo: float
    cached_tokens: int = 0


class PrefillView(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    queued_tokens: int
    queued_requests: int
    token_budget: int
    model: PerfModel


class DecodeView(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    batch: int
    kv_tokens: int
    kv_free_tokens: int
    kv_capacity_tokens: int
    resident_prefill_tokens: int
    deflections: int
    strictest_tbt_slo: float | None
    token_budget: int
    model: PerfModel
    reserved_step_s: float = 0.0  # added step time of deflections already in flight (ledger)
    pending: int = 0              # handoffs dispatched, not yet decoding


class ClusterView(msgspec.Struct, frozen=True):
    prefill: tuple[PrefillView, ...]
    decode: tuple[DecodeView, ...]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    route: Route
    decode_worker: str
    prefill_worker: str | None
    reason: str
    ttft_prefill_pred: float | None = None
    ttft_decode_pred: float | None = None
    chunk_schedule: tuple[int, ...] = ()


class NoWorkers(Exception):
    """No live worker can take this request; the message says which kind is missing."""


class NoKvRoom(NoWorkers):
    """Decode workers are live but none has KV room for this request now (it may wait)."""


class Policy(Protocol):
    name: str

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision: ...


def least_loaded_decode(view: ClusterView, req: RequestSpec) -> DecodeView:
    """The decode worker with the most free KV among those with room; ties by batch, then id."""
    fits = [d for d in view.decode if d.kv_free_tokens >= req.prompt_tokens + req.max_tokens]
    if not fits:
        if not view.decode:
            raise NoWorkers("no live decode worker")
        raise NoKvRoom("no decode worker has KV room for this request")
    return min(fits, key=lambda d: (d.batch + d.pending + d.deflections, d.kv_tokens, d.worker_id))


def least_loaded_prefill(view: ClusterView) -> PrefillView:
    if not view.prefill:
        raise NoWorkers("no live prefill worker")
    return min(view.prefill, key=lambda p: (p.queued_tokens, p.queued_requests, p.worker_id))


def ttft_prefill_path(p: PrefillView, req: RequestSpec, *, transfer: bool, prefix_aware: bool) -> float:
    """Equation 1 (+ the KV transfer when enabled): W_q + Exec (+ T_xfer)."""
    tokens = req.prompt_tokens - (req.cached_tokens if prefix_aware else 0)
    chunk = p.token_budget
    t = p.model.queue_wait(p.queued_tokens, chunk) + p.model.prefill_exec(tokens, chunk)
    if transfer:
        t += p.model.xfer_time(req.prompt_tokens)
    return t
