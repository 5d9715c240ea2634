"""Replay a prefill worker's queue through its batching rule: when would a new request's
prefill end? (The replay TTFT predictor of the Kairos policy; the worker reports its own.)

The paper's Equation 1 prices the queue as (sum/chi) steps at the context sum/2, which is far off
once the queue holds many requests (each is chunked from its own first token, not from the
middle of the pile). The replay instead runs the prefill worker's scheduling rule forward on what
the router knows of its queue: FIFO, at most `max_batch` requests in the batch, each step filling
`token_budget` tokens in order (the rule of `Batcher._plan_prefill`), every step timed by
`PerfModel.step_time`. A request that arrives at `t` joins the first step that starts after `t`
(an idle worker starts one for it at `t`). The new request's prefill then ends when its last
chunk's step does; with a fresh view and no step noise this is exact (tests/test_predict.py).
`Batcher._plan_prefill` and `replay` must stay in step.

What the replay needs of a worker (PrefillView): `backlog`, the (prompt tokens, tokens done)
of every request it holds, FIFO, as they will be when its step in flight ends at `busy_until`;
and `ledger`, the (prompt tokens, dispatch time) of the requests the router sent it since.

Cost: a replay walks one step per `token_budget` queued tokens. The worker replays its backlog
once per heartbeat (`drain`); the router only extends that by its ledger and by the new request
(`extend`: the steps of one request), see common/policy/predict.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from common.perf_model import PerfModel


class Tail(msgspec.Struct, frozen=True, array_like=True):
    """Where a replayed queue ends: its last step (start, chunks, tokens used) and the time it
    ends. A request appended to the queue can only share that last step, then runs alone: every
    earlier step that starts after it joins either used the whole budget or had `max_batch`
    requests ahead of it."""

    start: float
    chunks: tuple[tuple[int, int], ...]
    used: int
    end: float


def replay(model: PerfModel, budget: int, max_batch: int, start: float,
           items: Sequence[tuple[int, int, float]]) -> Tail:
    """Replay a FIFO queue of (prompt tokens, tokens done, join time) from `start` (the end of
    the step in flight; joins in non-decreasing order after the backlog's -inf).

    Budget is handed out in FIFO order, so requests complete in order: the active ones are
    always items[head:joined], and a step's chunks are a run from the head."""
    step_time = model.step_time
    rem = [p - d for p, d, _ in items]
    done = [d for _, d, _ in items]
    n = len(items)
    cap = max_batch if max_batch > 0 else n + 1
    t = start
    head = joined = 0
    last_start: float = start
    last_chunks: list[tuple[int, int]] = []
    last_used = 0
    while True:
        while head < joined and rem[head] <= 0:
            head += 1
        while joined < n and items[joined][2] < t:
            joined += 1
        while head < joined and rem[head] <= 0:
            head += 1
        if head >= joined:
            while joined < n and rem[joined] <= 0:
                joined += 1
            head = joined
            if joined >= n:
                break
            # idle until the next arrival, which starts a step for itself alone
            join = items[joined][2]
            if join > t:
                t = join
            joined += 1
        left = budget
        chunks = []
        i = head
        stop = min(joined, head + cap)
        while i < stop and left > 0:
            r = rem[i]
            if r > 0:
                chi = r if r < left else left
                chunks.append((chi, done[i]))
                rem[i] = r - chi
                done[i] += chi
                left -= chi
            i += 1
        last_start, last_chunks, last_used = t, chunks, budget - left
        t += step_time(0, 0, chunks)
    return Tail(last_start, tuple(last_chunks), last_used, t)


def drain(model: PerfModel, budget: int, max_batch: int, busy_until: float,
          backlog: Sequence[tuple[int, int]]) -> Tail:
    """The replay of a worker's own backlog ((prompt tokens, tokens done), FIFO) from the end
    of its step in flight: what a prefill worker reports in its heartbeat (`PrefillView.drain`)."""
    return replay(model, budget, max_batch, busy_until, [(p, d, -1.0e300) for p, d in backlog])


def alone(model: PerfModel, budget: int, tokens: int, done: int = 0) -> float:
    """Prefill time of a prompt alone on the worker from `done` tokens: steps of `budget` tokens
    (each `model.step_time(0, 0, ((chi, done),))`, written out: the router runs this per request)."""
    return _alone_after(model, budget, 0.0, tokens, done)[3]


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
        shared = (*tail.chunks, (chi, 0))
        end = tail.start + model.step_time(0, 0, shared)
        if chi >= tokens:
            return Tail(tail.start, shared, tail.used + chi, end)
        start, chi, done, end = _alone_after(model, budget, end, tokens, chi)
    else:
        start, chi, done, end = _alone_after(model, budget, tail.end if tail.end > join else join, tokens, 0)
    return Tail(start, ((chi, done),), chi, end)


def extend_end(model: PerfModel, budget: int, tail: Tail, tokens: int) -> float:
    """`extend(...).end` for a request of `tokens` > 0 that `shares` the queue's last step,
    without building the Tail."""
    tot, attn = last_step_sums(tail)
    return extend_end_after(model, budget, tail, tot, attn, tokens)


def last_step_sums(tail: Tail) -> tuple[int, float]:
    """The tokens of the queue's last step and its attention sum, as `PerfModel.step_time`
    accumulates them (kept per worker by the router's policy, for `extend_end_after`)."""
    tot = 0
    attn = 0.0
    for chi, k in tail.chunks:
        tot += chi
        attn += chi * (k + chi / 2.0)
    return tot, attn


def extend_end_after(model: PerfModel, budget: int, tail: Tail, tot: int, attn: float, tokens: int) -> float:
    """`extend_end` given `last_step_sums(tail)`: the shared step is `model.step_time(0, 0,
    (*tail.chunks, (chi, 0)))` written out from those sums, bit for bit the same (the router
    runs this per prefill worker and request; tests/test_decision_order.py)."""
    chi = budget - tail.used
    if chi > tokens:
        chi = tokens
    total = tot + chi
    over = total - model.knee
    gemm = model.a3 * total + (model.a7 * over if over > 0 else 0.0) + model.a5 * total * total
    end = tail.start + (((model.a0 + model.a6) + gemm) + model.a4 * (attn + chi * (0 + chi / 2.0)))
    return end if chi >= tokens else _alone_after(model, budget, end, tokens, chi)[3]


def _alone_after(model: PerfModel, budget: int, t: float, tokens: int, done: int) -> tuple[float, int, int, float]:
    """A prompt's steps alone from `t`, `done` of its `tokens` prefilled: its last step's (start,
    chunk, tokens before it) and end (`t` itself when nothing is left). Each step is
    `model.step_time(0, 0, ((chi, done),))` written out, bit for bit the same
    (tests/test_decision_order.py)."""
    fixed, a3, a4, a5, a7, knee = model.a0 + model.a6, model.a3, model.a4, model.a5, model.a7, model.knee
    start, chi, before = t, 0, done
    while done < tokens:
        chi = min(budget, tokens - done)
        over = chi - knee
        start, before = t, done
        t += (fixed + (a3 * chi + (a7 * over if over > 0 else 0.0) + a5 * chi * chi)) + a4 * (chi * (done + chi / 2.0))
        done += chi
    return start, chi, before, t
