"""TTFT on the disaggregated path: replay the prefill worker's known queue.

The paper's Equation 1 prices the queue as (sum/chi) steps at the context sum/2, which is far off
once the queue holds many requests (each is chunked from its own first token, not from the
middle of the pile). The replay instead runs the prefill worker's scheduling rule forward on what
the router knows of its queue: FIFO, at most `max_batch` requests in the batch, each step filling
`token_budget` tokens in order (the rule of `Batcher._plan_prefill`), every step timed by
`PerfModel.step_time`. A request that arrives at `t` joins the first step that starts after `t`
(an idle worker starts one for it at `t`). The new request's prefill then ends when its last
chunk's step does; with a fresh view and no step noise this is exact (tests/test_predict.py).

What the replay needs of a worker (PrefillView): `backlog`, the (prompt tokens, tokens done)
of every request it holds, FIFO, as they will be when its step in flight ends at `busy_until`;
and `ledger`, the (prompt tokens, dispatch time) of the requests the router sent it since.

Cost: a replay walks one step per `token_budget` queued tokens. `ReplayCache` keeps, per worker,
the replay of its last view and extends it when the view only gained ledger entries (one per
request the router sends it), so a decision costs one short extension per prefill worker and a
full replay only after a heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.perf_model import PerfModel


class Tail:
    """Where a replayed queue ends: its last step (start, chunks, tokens used) and the time it
    ends. A request appended to the queue can only share that last step, then runs alone: every
    earlier step that starts after it joins either used the whole budget or had `max_batch`
    requests ahead of it."""

    __slots__ = ("chunks", "end", "start", "used")

    def __init__(self, start: float, chunks: list[tuple[int, int]], used: int, end: float) -> None:
        self.start = start
        self.chunks = chunks
        self.used = used
        self.end = end


def replay(model: PerfModel, budget: int, max_batch: int, start: float,
           items: Sequence[tuple[int, int, float]]) -> Tail:
    """Replay a FIFO queue of (prompt tokens, tokens done, join time) from `start` (the end of
    the step in flight; joins in non-decreasing order after the backlog's -inf)."""
    t = start
    active: list[list[int]] = []  # [remaining, done]
    i, n = 0, len(items)
    last = Tail(start, [], 0, start)
    cap = max_batch if max_batch > 0 else 1 << 30
    while i < n or active:
        while i < n and items[i][2] < t:
            p, done, _ = items[i]
            if p > done:
                active.append([p - done, done])
            i += 1
        if not active:
            # idle until the next arrival, which starts a step for itself alone
            p, done, join = items[i]
            t = max(t, join)
            i += 1
            if p > done:
                active.append([p - done, done])
            if not active:
                continue
        left = budget
        chunks: list[tuple[int, int]] = []
        for a in active[:cap]:
            if left <= 0:
                break
            chi = a[0] if a[0] < left else left
            chunks.append((chi, a[1]))
            a[0] -= chi
            a[1] += chi
            left -= chi
        end = t + model.step_time(0, 0, chunks)
        last = Tail(t, chunks, budget - left, end)
        active = [a for a in active if a[0] > 0]
        t = end
    return last


def alone(model: PerfModel, budget: int, tokens: int, done: int = 0) -> float:
    """Prefill time of a prompt alone on the worker from `done` tokens: steps of `budget` tokens."""
    t = 0.0
    while done < tokens:
        chi = min(budget, tokens - done)
        t += model.step_time(0, 0, ((chi, done),))
        done += chi
    return t


def shares(budget: int, max_batch: int, tail: Tail, join: float) -> bool:
    """Does a request joining at `join` get a chunk in the queue's last step?"""
    return (join < tail.start and tail.used < budget and bool(tail.chunks)
            and (max_batch <= 0 or len(tail.chunks) < max_batch))


def extend(model: PerfModel, budget: int, max_batch: int, tail: Tail, tokens: int, join: float) -> Tail:
    """The replay of the queue plus one more request of `tokens` joining at `join` (>= every
    earlier join): it shares the last step's spare budget if that step starts after it joins
    and has room in the batch, then runs alone. The result's `end` is when its prefill completes."""
    if tokens <= 0:
        return tail
    if shares(budget, max_batch, tail, join):
        chi = min(budget - tail.used, tokens)
        chunks = [*tail.chunks, (chi, 0)]
        end = tail.start + model.step_time(0, 0, chunks)
        if chi >= tokens:
            return Tail(tail.start, chunks, tail.used + chi, end)
        done = chi
        t = end
    else:
        done = 0
        t = tail.end if tail.end > join else join
    start = t
    chunks = []
    while done < tokens:
        chi = min(budget, tokens - done)
        chunks = [(chi, done)]
        start = t
        t += model.step_time(0, 0, chunks)
        done += chi
    return Tail(start, chunks, chunks[0][0], t)


class _Entry:
    __slots__ = ("backlog", "busy_until", "ledger", "model", "tail")

    def __init__(self, backlog: tuple[tuple[int, int], ...], busy_until: float, ledger: tuple[tuple[int, float], ...],
                 model: PerfModel, tail: Tail) -> None:
        self.backlog = backlog
        self.busy_until = busy_until
        self.ledger = ledger
        self.model = model
        self.tail = tail


class ReplayCache:
    """Per prefill worker, the replay of its latest view (see the module docstring)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, _Entry] = {}

    def tail(self, worker_id: str, model: PerfModel, budget: int, max_batch: int,
             backlog: tuple[tuple[int, int], ...], busy_until: float, ledger: tuple[tuple[int, float], ...]) -> Tail:
        e = self._by_worker.get(worker_id)
        if e is not None and e.backlog is backlog and e.busy_until == busy_until and e.model is model:
            k = len(e.ledger)
            if k == len(ledger) and e.ledger == ledger:
                return e.tail
            if k < len(ledger) and ledger[:k] == e.ledger:
                tail = e.tail
                for tokens, join in ledger[k:]:
                    tail = extend(model, budget, max_batch, tail, tokens, join)
                e.ledger, e.tail = ledger, tail
                return tail
        items: list[tuple[int, int, float]] = [(p, d, -1.0e300) for p, d in backlog]
        items.extend((tokens, 0, join) for tokens, join in ledger)
        tail = replay(model, budget, max_batch, busy_until, items)
        if len(self._by_worker) > 4096:
            self._by_worker.clear()
        self._by_worker[worker_id] = _Entry(backlog, busy_until, ledger, model, tail)
        return tail
