"""A worker's side of the prefix index: what its engine's prefix cache stored and evicted,
netted and bounded for the heartbeats (messages.PrefixSummary). Shared by both roles and any
engine that implements `Engine.take_prefix_events`."""

from __future__ import annotations

from common import messages as m
from common.engines.base import Engine

BACKLOG_LIMIT = 16 * m.MAX_PREFIX_EVENTS  # changes held back before the router is told to forget us


class PrefixReporter:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_tokens = 0
        self._pending: dict[int, bool] = {}  # block -> stored (True) or removed (False); last change wins
        self._cleared = False

    def summary(self) -> m.PrefixSummary | None:
        """The next heartbeat's summary; None when the engine keeps no prefix cache or nothing changed."""
        ev = self.engine.take_prefix_events()
        pending = self._pending
        if ev is not None:
            if ev.cleared or (self.block_tokens and ev.block_tokens != self.block_tokens):
                pending.clear()
                self._cleared = True
            self.block_tokens = ev.block_tokens
            for h in ev.removed:
                pending[h] = False
            for h in ev.stored:
                pending[h] = True
            if len(pending) > BACKLOG_LIMIT:  # the router falls too far behind: start over
                pending.clear()
                self._cleared = True
        if not self.block_tokens or (not pending and not self._cleared):
            return None
        stored: list[int] = []
        removed: list[int] = []
        for h, s in pending.items():
            (stored if s else removed).append(h)
            if len(stored) + len(removed) >= m.MAX_PREFIX_EVENTS:
                break
        for h in stored:
            del pending[h]
        for h in removed:
            del pending[h]
        out = m.PrefixSummary(block_tokens=self.block_tokens, stored=stored, removed=removed, cleared=self._cleared)
        self._cleared = False
        return out
