"""Snapshots in, a decision out: the types every routing policy shares.

A policy sees immutable views of the live workers (latest heartbeat plus the router's ledger
of work dispatched since) and the request; it returns a `Decision`. No sockets, no clock, no
global randomness: the live router and `kairos sim` call the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import msgspec

from common.engines.replay import Tail
from common.messages import Route
from common.perf_model import PerfModel


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_tokens: int
    max_tokens: int
    ttft_slo: float
    tbt_slo: float
    cached_tokens: int = 0  # prompt tokens cached wherever it goes (an engine's report)
    # per worker (prefill or decode): the prompt tokens its prefix cache holds, as the router's
    # prefix index knows them (common/policy/prefix_index.py); empty: none known
    cached: tuple[tuple[str, int], ...] = ()

    def cached_on(self, worker_id: str) -> int:
        """Prompt tokens a prefill on `worker_id` can skip (at most all but the last)."""
        n = self.cached_tokens
        for w, k in self.cached:
            if w == worker_id:
                n = max(n, k)
                break
        return min(n, self.prompt_tokens - 1) if n > 0 else 0


class PrefillView(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    queued_tokens: int
    queued_requests: int
    token_budget: int
    model: PerfModel
    # what the replay predictor needs (predict.py): each held request's (prompt tokens, tokens
    # done) in FIFO order as of `busy_until`, the end of the step in flight (policy clock); None
    # when the worker does not report it (the predictor then sees `queued_tokens` less the
    # ledger's as one request); and the requests dispatched since, (prompt tokens, dispatch time)
    backlog: tuple[tuple[int, int], ...] | None = None
    busy_until: float = 0.0
    drain: Tail | None = None  # the backlog's replay, when the worker computed it (it knows its queue)
    ledger: tuple[tuple[int, float], ...] = ()
    max_batch: int = 0  # 0: no cap
    # the third path (route "retain": it decodes requests itself after their prefill): the
    # requests it decodes (heartbeat + ledger), their KV tokens, the strictest TBT SLO among them
    # (None: none), its KV free for more, its measured step margin (as DecodeView's)
    decodes: int = 0
    decode_kv_tokens: int = 0
    strictest_tbt_slo: float | None = None
    kv_free_tokens: int = 0
    step_margin: float = 1.0


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
    reserved_tokens: int = 0      # tokens per step the deflections in flight may take (their largest chunks)
    busy_until: float = 0.0       # end of the step in flight (policy clock); <= now: unknown or idle
    inflight: tuple[tuple[float, float, int], ...] = ()  # deflections in flight: (predicted end,
    # reserved step s, largest chunk)
    step_s: float = 0.0           # its recent step time (0: unknown)
    step_margin: float = 1.0      # its measured step error (measured / predicted, 99th pct): chunks are
    # planned so that their steps, times this, fit the TBT SLO (common/engines/step_error.py)


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
    cached_tokens: int = 0  # prompt tokens the router expects the prefilling worker to hold
    step_budget_s: float = 0.0  # deflect: the step time every chunk was planned to fit (0: none planned)


class NoWorkers(Exception):
    """No live worker can take this request; the message says which kind is missing."""


class NoKvRoom(NoWorkers):
    """Decode workers are live but none has KV room for this request now (it may wait)."""


class NoDecodeRoom(NoKvRoom):
    """Decode workers have KV room, but a new decode on any of them would push its decode step
    past the TBT SLO (Kairos's `decode_room`): the request waits as for KV room."""


class Hold(NoKvRoom):
    """Late binding: every path is busy now (the prefill queues are deep and no decode worker can
    prefill it in place), so the request waits at the router, in arrival order, and is decided
    again when a worker frees room. Waiting is bounded as for KV room (the router's wait timeout)."""


class Policy(Protocol):
    """The whole interface a routing policy offers the router core (common/router_core/) and the
    simulator: they call these methods and nothing else, and probe for none of them. A policy
    subclasses this class to inherit the defaults and overrides what it does differently; the
    policies are built by name from the registry (registry.py).

    - `decide` (required): the decision for `req` on `view` at `now`, or one of the exceptions
      above (NoWorkers, NoKvRoom, NoDecodeRoom, Hold) saying why it cannot be placed now.
    - `prepare`: do ahead, when the router's loop is free after the views changed, the work of the
      next decision that depends only on the view (Kairos's replayed queues). The core calls it
      only when `prepares` is true, so a policy with nothing to prepare costs the core no view.
      Default: nothing.
    - `orders_waiting` / `retry_order` / `wait_order`: the order the router's wait queue decides its
      waiting requests again in (common/router_core/waiting.py). When `orders_waiting()` is true the
      core computes each waiting request's `latest_start` (kairos.py) and `wait_order` (given also
      each one's prompt tokens; by default it is `retry_order`) returns the indices to try in;
      default: arrival order (FIFO), with no `latest_start` computed.
    """

    name: str
    prepares: ClassVar[bool] = False  # whether `prepare` does anything

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision: ...

    def prepare(self, view: ClusterView, now: float, tbt_slo: float) -> None:
        """Nothing to prepare (see the class docstring)."""
        return None

    def orders_waiting(self) -> bool:
        """Whether `retry_order` needs the waiting requests' latest starts (default: no, FIFO)."""
        return False

    def retry_order(self, latest: Sequence[float], now: float) -> list[int]:
        """Indices into `latest` (the waiting requests' latest starts, in arrival order; zeros when
        `orders_waiting()` is false) in the order to decide them again: by default, arrival order."""
        return list(range(len(latest)))

    def orders_by_size(self) -> bool:
        """Whether `wait_order` puts a shorter prompt first among those that can still make their
        TTFT SLO (router replicas then compare their first requests' sizes too); default: no."""
        return False

    def wait_order(self, latest: Sequence[float], sizes: Sequence[int], now: float) -> list[int]:
        """`retry_order` told also each waiting request's prompt tokens (`sizes`, in the same
        order), which the router's wait queue calls; by default `retry_order`, sizes unused."""
        return self.retry_order(latest, now)


def least_loaded_decode(view: ClusterView, req: RequestSpec) -> DecodeView:
    """The decode worker with the most free KV among those with room; ties by batch, then id."""
    need = req.prompt_tokens + req.max_tokens
    best: DecodeView | None = None
    key: tuple[int, int, str] = (0, 0, "")
    for d in view.decode:
        if d.kv_free_tokens >= need:
            k = (d.batch + d.pending + d.deflections, d.kv_tokens, d.worker_id)
            if best is None or k < key:
                best, key = d, k
    if best is None:
        if not view.decode:
            raise NoWorkers("no live decode worker")
        raise NoKvRoom("no decode worker has KV room for this request")
    return best


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
