"""The router core's wait queue (common/wait_queue.py; the simulator runs the same core): FIFO, held
requests passed over, the retry stopping at the first still without room, the scan and the limit."""

from __future__ import annotations

from dataclasses import dataclass

from common.wait_queue import Outcome, WaitQueue


@dataclass(eq=False)
class R:
    name: str
    held: bool = False
    done: bool = False


def queue(*names: str, limit: int = 100, scan: int = 64) -> tuple[WaitQueue[R], dict[str, R]]:
    q: WaitQueue[R] = WaitQueue(limit, scan)
    rs = {n: R(n) for n in names}
    q.extend(rs.values())
    return q, rs


def run(q: WaitQueue[R], outcomes: dict[str, Outcome], order: list[int] | None = None) -> list[str]:
    tried: list[str] = []

    def place(r: R) -> Outcome:
        tried.append(r.name)
        got = outcomes.get(r.name, Outcome.PLACED)
        r.held = got is Outcome.HELD
        return got

    q.retry(lambda head: order if order is not None else range(len(head)), place)
    return tried


def test_placed_leave_and_the_first_without_room_stops_the_retry() -> None:
    q, _ = queue("a", "b", "c", "d")
    assert run(q, {"b": Outcome.NO_ROOM}) == ["a", "b"]
    assert [r.name for r in q] == ["b", "c", "d"]  # nobody overtook b


def test_held_ones_are_passed_over_and_stay_in_place() -> None:
    q, _ = queue("a", "b", "c")
    assert run(q, {"a": Outcome.HELD, "c": Outcome.HELD}) == ["a", "b", "c"]
    assert [r.name for r in q] == ["a", "c"]
    assert all(r.held for r in q)


def test_gone_leave_and_removed_are_not_removed_twice() -> None:
    q, _ = queue("a", "b", "c")

    def place(r: R) -> Outcome:
        if r.name == "b":
            q.remove(r)  # the owner took it out itself (the router, failing it)
            return Outcome.REMOVED
        return Outcome.GONE if r.name == "a" else Outcome.NO_ROOM

    q.retry(lambda head: range(len(head)), place)
    assert [r.name for r in q] == ["c"]


def test_the_order_is_the_callers_and_only_the_first_scan_are_tried() -> None:
    q, _ = queue("a", "b", "c", "d", "e", scan=3)
    seen: list[list[str]] = []

    def order(head: list[R]) -> list[int]:
        seen.append([r.name for r in head])
        return [2, 0, 1]

    tried: list[str] = []

    def place(r: R) -> Outcome:
        tried.append(r.name)
        return Outcome.HELD

    q.retry(order, place)
    assert seen == [["a", "b", "c"]] and tried == ["c", "a", "b"]
    assert len(q) == 5


def test_full_at_the_limit_and_an_empty_queue_tries_nothing() -> None:
    q, _ = queue("a", "b", limit=2)
    assert q.full()
    q.popleft()
    assert not q.full()
    empty: WaitQueue[R] = WaitQueue(4)
    assert run(empty, {}) == []


def test_requests_that_ended_while_waiting_leave_the_head() -> None:
    q, rs = queue("a", "b", "c")
    rs["a"].done = rs["c"].done = True
    q.drop_done()
    assert [r.name for r in q] == ["b", "c"]  # only the head: c leaves when it reaches it
