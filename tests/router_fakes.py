"""Driving the router core (common/router_core/core.py) in tests: no socket, no clock.

`FakeOutbox` collects what the core sends to each worker (by worker id) and publishes to the
monitor; a peer in `unreachable` refuses messages, as an unroutable ZeroMQ peer does. Time is a
number the test moves (`Clock`)."""

from __future__ import annotations

from typing import Any

from common import config
from common import messages as m
from common.router_core.core import RouterCore


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, m.Msg]] = []
        self.published: list[m.Msg] = []
        self.unreachable: set[str] = set()

    def send(self, identity: bytes, msg: m.Msg) -> bool:
        peer = identity.decode()
        if peer in self.unreachable:
            return False
        self.sent.append((peer, msg))
        return True

    def publish(self, msg: m.Msg) -> None:
        self.published.append(msg)

    def take(self) -> list[tuple[str, m.Msg]]:
        """What was sent since the last call."""
        out, self.sent = self.sent, []
        return out


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def make_core(policy: str = "deflect-all", outbox: FakeOutbox | None = None, *, opened_at: float = 0.0,
              **overrides: Any) -> tuple[RouterCore, FakeOutbox]:
    """A router core with the fast profile and the given settings, and its outbox."""
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": policy, "profile": "fast", **overrides})
    box = outbox if outbox is not None else FakeOutbox()
    return RouterCore(cfg, box, opened_at=opened_at), box


def hello(worker_id: str, role: m.Role, *, incarnation: str = "", kv_capacity_tokens: int = 100_000,
          token_budget: int = 2048, **fields: Any) -> m.Hello:
    return m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=worker_id, role=role,
                   incarnation=incarnation or f"inc-{worker_id}", engine="sim", model="kairos-sim",
                   token_budget=token_budget, kv_capacity_tokens=kv_capacity_tokens, max_batch=64, **fields)
