"""The wait queue of requests that could not be placed yet, as the router core runs it
(common/router_core/waiting.py; the simulator runs that core too, sim/router.py).

Two kinds of request wait in it, in arrival order: one that found no decode worker with KV room
(`held` False), and one the policy holds back (Kairos's late binding, `held` True: the prefill
queues are deep and no decode worker can prefill it in place now). A request waiting for KV room
blocks the queue: a new arrival queues behind it (FIFO, nobody overtakes). Held requests do not
block it. When room may have opened, `retry` decides again the first `scan` waiting requests (with
the caller's `late`, the first `scan` that can still meet their SLO, wherever they stand: `head`), in
the order the caller gives (the policy's `retry_order`), going past held ones and stopping at the
first that still finds no room. The queue holds at most `limit` requests; what happens to one that
waits too long is the owner's (the router fails it, the simulator rejects it).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

SCAN = 64  # waiting requests one retry decides again at most


class Waiter(Protocol):
    held: bool  # held by the policy (late binding), not waiting for KV room
    done: bool  # ended while waiting (aborted, failed)


W = TypeVar("W", bound=Waiter)


class Outcome(enum.Enum):
    """What deciding one waiting request again came to (`WaitQueue.retry`'s `place`)."""

    PLACED = "placed"    # dispatched: out of the queue
    HELD = "held"        # held again: stays, and the retry goes on past it
    NO_ROOM = "no_room"  # still no KV room: stays, and the retry stops (nobody overtakes it)
    GONE = "gone"        # ended meanwhile (aborted, failed): out of the queue
    REMOVED = "removed"  # `place` took it out of the queue itself: the retry goes on


class WaitQueue(deque[W]):
    """A FIFO deque of waiting requests with the rules above."""

    def __init__(self, limit: int, scan: int = SCAN) -> None:
        super().__init__()
        self.limit = limit
        self.scan = scan

    def drop_done(self) -> None:
        """Take off the head the requests that ended while waiting (aborted, failed)."""
        while self and self[0].done:
            self.popleft()

    def full(self) -> bool:
        """A new request that cannot be placed must be refused: `limit` already wait."""
        return len(self) >= self.limit

    def head(self, late: Callable[[W], bool] | None = None) -> list[W]:
        """The waiting requests a retry decides again, in queue order: the first `scan`; with
        `late` (a request that can no longer meet its TTFT SLO, which the caller's order tries
        last), the first `scan` that are not late wherever they stand in the queue, then as many
        late ones, from the head, as leave `scan` in all. Under a sustained overload more than
        `scan` requests can wait past their SLO at the head of the queue: a head of the first
        `scan` alone would then hold only those, the retry would place them first, and every
        request behind them would miss its SLO too, however soon the room came."""
        if late is None:
            return list(itertools.islice(self, self.scan))
        early: list[tuple[int, W]] = []
        overdue: list[tuple[int, W]] = []
        for i, r in enumerate(self):
            if not late(r):
                early.append((i, r))
                if len(early) == self.scan:
                    break
            elif len(overdue) < self.scan:
                overdue.append((i, r))
        picked = early + overdue[:self.scan - len(early)]
        picked.sort(key=lambda x: x[0])
        return [r for _, r in picked]

    def retry(self, order: Callable[[list[W]], Iterable[int]], place: Callable[[W], Outcome],
              late: Callable[[W], bool] | None = None) -> None:
        """Decide the waiting requests `head(late)` again: `order(head)` gives the indices into
        `head` (the requests in queue order) to try, in that order; `place(request)` tries one."""
        head = self.head(late)
        if not head:
            return
        for i in order(head):
            req = head[i]
            got = place(req)
            if got is Outcome.PLACED or got is Outcome.GONE:
                self.remove(req)
            elif got is Outcome.NO_ROOM:
                return
