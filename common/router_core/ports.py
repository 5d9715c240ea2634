"""What the router core is given to act on the world: it opens no socket and reads no clock.

- `Outbox`: messages to one worker (by its bus identity) and to the monitor. The live router's
  shell encodes them onto its ZeroMQ sockets (services/router/service.py); a test passes a list
  that collects them (tests/router_fakes.py).
- `Metrics`: the counters and histograms the core feeds. The live router passes
  services/router/metrics.py, whose functions have these names; `NULL_METRICS` counts nothing.
- `Hooks`: what the shell does when the core says so: a request ended (the client's last event
  is already queued; the shell writes its metrics and log line), the views changed (the shell
  prepares the policy's view when its loop is free), a worker registered (requests waiting for a
  worker wake up); and two the simulator uses to run the core on its own clock: when room may
  have opened for waiting requests, and before the core reads the worker table.
- `Log`: the structlog logger the core's parts log through (`NULL_LOG` drops every line).

Time comes in with every call (`now`, the shell's monotonic clock in seconds); wall-clock
stamps on records are `now + wall_offset`, the offset the shell measured once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common import messages as m

if TYPE_CHECKING:
    from common.router_core.requests import Request


class Outbox(Protocol):
    def send(self, identity: bytes, msg: m.Msg) -> bool:
        """Queue `msg` for the peer with this bus identity; False if it could not be queued
        (unroutable, or its queue is full)."""
        ...

    def publish(self, msg: m.Msg) -> None:
        """Send `msg` to the monitor (telemetry)."""
        ...


class Metrics(Protocol):
    def observe_decision(self, rec: m.DecisionRecord) -> None: ...
    def observe_migration(self, outcome: str) -> None: ...
    def observe_request(self, rec: m.RequestRecord, gaps: Sequence[float] = ...) -> None: ...
    def observe_prefill_done(self, p: m.PrefillDone) -> None: ...
    def observe_rejected(self, reason: str) -> None: ...
    def observe_redispatch(self) -> None: ...
    def observe_deflect_rejected(self) -> None: ...
    def observe_kv_fallback(self) -> None: ...
    def observe_worker_lost(self, role: str) -> None: ...
    def observe_bad_frame(self, socket: str) -> None: ...
    def observe_dropped(self, reason: str) -> None: ...
    def observe_refused(self, reason: str) -> None: ...
    def observe_departed(self, role: str) -> None: ...
    def set_in_flight(self, n: int) -> None: ...
    def set_workers(self, prefill: int, decode: int) -> None: ...
    def set_delivery_allowance(self, seconds: float) -> None: ...
    def observe_role_flip(self, frm: str, to: str, reason: str) -> None: ...
    def observe_role_flip_done(self, outcome: str, seconds: float) -> None: ...
    def set_worker_roles(self, roles: dict[str, str]) -> None: ...


class _NullMetrics:
    """Counts nothing (tests, the simulator)."""

    def __getattr__(self, name: str) -> object:
        if name.startswith(("observe_", "set_")):
            return _nothing
        raise AttributeError(name)


def _nothing(*args: object, **kwargs: object) -> None:
    return None


NULL_METRICS: Metrics = _NullMetrics()  # type: ignore[assignment]


def _no_done(req: Request, finished_reason: str | None, rec: m.RequestRecord) -> None:
    return None


def _no_event() -> None:
    return None


# What the core logs through: a structlog bound logger. The live router passes none and gets the
# process's (configured by common/logging.py); the simulator passes NULL_LOG, which drops every line.
Log = Any


class NullLog:
    """Drops every line (debug ... critical, exception)."""

    def __getattr__(self, name: str) -> object:
        return _nothing


NULL_LOG: Log = NullLog()


@dataclass(frozen=True, slots=True)
class Hooks:
    # a request ended: `finished_reason` "stop"/"length"/"abort" for one that completed or was
    # aborted, None for one that failed; `rec` is its record (already published to the monitor)
    request_done: Callable[[Request, str | None, m.RequestRecord], None] = _no_done
    views_changed: Callable[[], None] = _no_event  # a worker's view changed: prepare the policy's view soon
    worker_joined: Callable[[], None] = _no_event  # a worker registered (not draining)
    # room may have opened for the waiting requests (a heartbeat, a deflection's first token, a
    # request's end): None retries the wait queue at once; the simulator retries at the times its
    # own model of heartbeats gives (sim/router.py)
    room: Callable[[float], None] | None = None
    # with several router replicas, a heartbeat's room is taken in turns (waiting.py, `replica_turn`):
    # retry the wait queue after this many seconds (the shell's timer); None: at once, whatever the turn
    retry_later: Callable[[float], None] | None = None
    # the core is about to read the worker table to decide (the simulator delivers the heartbeats
    # due by then, which it makes lazily); None: nothing to do (the live router's table is current)
    before_view: Callable[[float], None] | None = None
