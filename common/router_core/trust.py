"""The router's trust rules for the bus: who may register, and who may send what.

Every message but Hello must come from a registered worker, over the ZeroMQ connection (routing
identity) it registered with, and may concern only requests the router assigned to that worker;
anything else is dropped, counted by reason (`kairos_router_dropped_messages`) and logged at
warning with the peer (at most once a second per peer and reason, so a flood cannot flood the
log). A worker whose engine, model or KV transport cannot work with the cluster's is refused at
registration with the reason, which the worker logs.
"""

from __future__ import annotations

from collections import Counter

import structlog

from common import messages as m
from common.logging import Throttle
from common.router_core.ports import NULL_METRICS, Log, Metrics
from common.router_core.workers import WorkerTable
from common.sockets import fingerprint

WARN_EVERY_S = 1.0


class Gate:
    """Counts and logs dropped messages."""

    def __init__(self, counts: Counter[str], metrics: Metrics = NULL_METRICS, log: Log | None = None) -> None:
        self.counts = counts
        self.metrics = metrics
        self.log = log if log is not None else structlog.get_logger()
        self.dropped: Counter[str] = Counter()
        self._warn = Throttle(WARN_EVERY_S)  # a line per peer and reason per second at most
        self.key: str | None = None  # the CURVE key of the message being handled (None without CURVE)

    def drop(self, peer: bytes, reason: str, msg: m.Msg, request_id: str = "", *, routine: bool = False) -> None:
        """Count and log a dropped message: at warning, or at info when `routine` (a worker's late
        messages while it recovers, which it re-sends or the router re-dispatches anyway)."""
        self.dropped[reason] += 1
        self.counts["dropped_messages"] += 1
        self.metrics.observe_dropped(reason)
        held = self._warn.admit((peer, reason))
        if held is None:
            return
        emit = self.log.info if routine else self.log.warning
        emit("message_dropped", routine=routine, reason=reason, peer=peer.decode(errors="replace")[:64],
             message=type(msg).__name__, request_id=request_id or getattr(msg, "request_id", None),
             suppressed_since_last=held, **({"key": fingerprint(self.key)} if self.key else {}))


def refusal(identity: bytes, h: m.Hello, table: WorkerTable, *, served_model: str) -> str:
    """Why `h` may not register (empty: it may). The cluster's engine and KV transport are those of
    the workers registered now (any, when there are none)."""
    if h.protocol != m.PROTOCOL_VERSION:
        return f"protocol: worker speaks protocol {h.protocol}, the router {m.PROTOCOL_VERSION}: run the same release"
    if identity != h.worker_id.encode():
        return "identity: the connection's identity is not the worker_id it registers (a forged Hello?)"
    if h.model != served_model:
        return (f"model: the worker serves {h.model!r}, the router serves {served_model!r}: set the same "
                "KAIROS_SERVED_MODEL_NAME on both")
    for w in table.workers.values():
        if w.worker_id == h.worker_id:
            continue  # a new incarnation replaces it
        other = w.hello
        if other.engine != h.engine:
            return (f"engine: the worker runs engine {h.engine!r}, the cluster's workers run {other.engine!r} "
                    f"(e.g. {w.worker_id}): one engine kind per cluster")
        if other.kv_transport != h.kv_transport:
            return (f"kv_transport: the worker moves KV by {h.kv_transport!r}, the cluster's workers by "
                    f"{other.kv_transport!r} (e.g. {w.worker_id}): set the same KAIROS_KV_TRANSPORT everywhere")
        if other.kv_block_tokens and h.kv_block_tokens and other.kv_block_tokens != h.kv_block_tokens:
            return (f"kv_block_tokens: the worker's KV blocks hold {h.kv_block_tokens} tokens, the cluster's "
                    f"{other.kv_block_tokens} (e.g. {w.worker_id}): set the same KAIROS_KV_BLOCK_TOKENS everywhere")
    return ""


def _decode_limit(table: WorkerTable, field: str) -> int:
    """The largest `Hello.<field>` over the live decode workers: 0 if none is registered or one
    reports none (0: no limit known), since then nothing can be judged."""
    best = 0
    for w in table.workers.values():
        if w.role != "decode" or w.draining:
            continue
        v = int(getattr(w.hello, field))
        if v <= 0:
            return 0
        best = max(best, v)
    return best


def serving_limit(table: WorkerTable) -> int:
    """The longest sequence (prompt + output) some live decode worker takes: 0 if one has no limit
    or none is registered (then nothing can be judged yet)."""
    return _decode_limit(table, "max_model_len")


_NONE: frozenset[str] = frozenset()


def too_small(table: WorkerTable, prompt_tokens: int) -> frozenset[str]:
    """Workers whose max_model_len leaves no room for this prompt plus one output token."""
    out = [w.worker_id for w in table.workers.values() if 0 < w.hello.max_model_len <= prompt_tokens]
    return frozenset(out) if out else _NONE  # none, as a rule: no set built per request


def kv_limit(table: WorkerTable) -> int:
    """The most KV (tokens) one live decode worker holds at all: 0 if none is registered or one
    reports no capacity (then nothing can be judged)."""
    return _decode_limit(table, "kv_capacity_tokens")
