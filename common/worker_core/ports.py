"""What a worker core is given to act on the world: it opens no socket, reads no clock and
touches no engine itself.

`WorkerPorts` is implemented by each shell: the live services (common/worker.py and
services/*_worker/service.py: ZeroMQ to the router, the engine, the asyncio loop) and the
simulator's workers (sim/state.py: the simulated engine's `Batcher`, messages handed straight
to the simulated routers); a test passes a fake that records what the core did
(tests/test_worker_core.py).

Time comes in with the calls that need it (`now`, the shell's monotonic clock in seconds) and
so does the engine's load (`EngineLoad`, the engine's own report of itself).
"""

from __future__ import annotations

from typing import Protocol

from common import messages as m
from common.engines.base import EngineRequest


class WorkerPorts(Protocol):
    def send(self, msg: m.Msg) -> None:
        """To the router that sent the request the message is about (every router for one about none)."""
        ...

    def start(self, req: EngineRequest) -> bool:
        """Hand a request to the engine. False when the engine would not take it; the shell has
        then told the router why (RequestFailed) and the core keeps nothing of it."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request in the engine and free what it holds there (its KV included)."""
        ...

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        """Plan a running request's steps to `tbt_slo` from now on where that is less than its
        budget now (PlanBudget). False when the engine does not hold it or its budget is that or
        less already."""
        ...

    def beat_now(self, at_once: bool = False) -> None:
        """The worker's state changed: heartbeat soon (live: within 2 ms, changes coalesced).
        `at_once`: without the coalescing delay where the worker serves several router replicas
        (a prefill or decode worker that took work: until its heartbeat, each of the other
        replicas sees its queue, room and held deflections without that work and may place onto
        it as if it were not there); with one router, as `beat_now()`: that router's own
        ledger already counts what it sent."""
        ...

    def router_of(self, request_id: str) -> str:
        """The incarnation of the router that sent this request (heartbeats' held lists name it)."""
        ...

    def release_kv(self, key: str) -> None:
        """Free the KV landing space reserved under this transfer key (NIXL; nothing elsewhere)."""
        ...


class Log(Protocol):
    """The structlog logger the core logs through (`NULL_LOG` drops every line)."""

    def debug(self, event: str, **fields: object) -> object: ...
    def info(self, event: str, **fields: object) -> object: ...
    def warning(self, event: str, **fields: object) -> object: ...
    def error(self, event: str, **fields: object) -> object: ...


class _NullLog:
    def debug(self, event: str, **fields: object) -> None:
        return None

    info = warning = error = debug


NULL_LOG: Log = _NullLog()
