"""The router's wait queue: requests that find no decode worker with KV room, and, with Kairos's
late binding, requests the policy holds (`Hold`: the prefill queues are deep and no decode
worker can prefill it in place now).

A request waiting for KV room blocks the queue (FIFO: nobody overtakes it). Held requests do
not: a new arrival is still decided at once. The queue is decided again when room may have
opened (any worker's heartbeat, a deflection's first token, a request's end): the first
`SCAN` waiting requests (under Kairos's wait order, the first `SCAN` whose TTFT SLO is not over yet, wherever they
stand: `Waiting.head`), in the policy's `wait_order` (`Policy.wait_order`; Kairos late binding: first those that can
still meet their TTFT SLO, `latest_start`, the shortest prefill first among them: `Waiting._order`), past the held
ones, up to the first that still waits for KV room. Every waiting request is bounded by `kv_wait_timeout` (then
HTTP 503, the code naming what was short: `prefill_wait_timeout` for a held one, `decode_wait_timeout`,
`kv_wait_timeout`;
`worker_lost_midstream` for one that had streamed tokens before it lost its worker). A new request
predicted to wait past its budget is not queued at all (admission.py: HTTP 429).
A waiting request that no live worker could take at all any more is parked instead
(`RouterCore.unplaced`, the one rule for requests that cannot be placed). With several router
replicas, a retry that a worker's heartbeat starts waits for this replica's turn among them
(`replica_turn`: in one router's retry order), so that each decides after the others'
dispatches show; each replica tells the decode workers the request it would decide first
(`QueueHead`), and their heartbeats echo every replica's. In its turn a replica places its own
requests only up to the first another replica waits with (one router's queue would decide that
one next; at least one, so that a stale echo slows a replica, never stops it): the first replica
in turn does not take the whole room for requests the others' come before. "First" is in the
policy's wait order, by size too where the order is (`turn_key`; QueueHead.first_tokens). Out of turn (room only
this replica hears of at once: its own deflection's first token, its own request's end) it places
none past that request: the room is the others' too, and the worker's next heartbeat shows it to
every replica, which then take their turns at it (one router would give it to its first request
in order, wherever it waits). The queue and its
retry are common/wait_queue.py's; what is the router's here is how a request is tried and
failed. The simulator runs this class as part of the core (sim/router.py), on its own timing of
retries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container
from typing import Protocol

from common import messages as m
from common.config import RouterConfig
from common.policy import Hold, NoDecodeRoom, NoKvRoom, NoWorkers, Policy
from common.policy.kairos import latest_start
from common.router_core.admission import budget, shortage
from common.router_core.requests import Request
from common.router_core.workers import WorkerTable
from common.wait_queue import Outcome, WaitQueue

TURN_MAX_S = 0.05  # the replicas' turns at most this far apart, whatever the relay (`Waiting.turn_spacing`)


TurnKey = tuple[bool, int, float]  # a replica's first waiting request: (late, size if the order is by size, arrival)


def prefill_tokens(r: Request, prefill: Container[str]) -> int:
    """The prompt tokens a prefill worker has to compute for `r`: its prompt less the longest
    prefix one of the `prefill` workers holds, as the router's last prefix lookup for it found
    (`Request.prefix_seen`: a hint, the worker's own cache decides). A session's later turn
    carries its whole conversation but prefills only what is new; ordering the wait queue by raw
    prompt length put it behind shorter prompts that cost more."""
    n = len(r.prompt_token_ids)
    best = max((t for w, t in r.prefix_seen.cached if w in prefill), default=0)
    return n - min(n, best)


def turn_key(late: bool, tokens: int, at: float, by_size: bool) -> TurnKey:
    """Where one router's wait order would put a request: those that can still make their TTFT
    SLO first (`late` False), among them the shortest prefill (`prefill_tokens`) first when the
    order is by size (Kairos's "short"), then by arrival; the late ones by arrival."""
    return late, tokens if by_size and not late else 0, at


def replica_turn(mine: tuple[bool, int, float, str], others: dict[str, TurnKey]) -> int:
    """This replica's turn (0: first) at the room a worker's heartbeat may show, among the replicas
    that have requests waiting. `mine`: the `turn_key` of the request its retry would decide first
    (`Waiting.first`) and this replica's incarnation; `others`: the other replicas' first requests'
    keys as the decode workers' heartbeats echo them (`DecodeHeartbeat.queues`; arrival 0.0: none
    waits there). The replica whose first request one router's queue would decide first goes first
    (ties by incarnation), so the room goes as one router's wait order would give it.

    Every replica hears a heartbeat at once; deciding together, each blind to what the others send
    until the workers' next heartbeats show it, they would place up to as many times what the room
    holds as there are replicas: a late-binding depth filled several times over, one decode
    worker's slack booked by several deflections (its admission then turns all but one away to the
    prefill queues), and the room taken by whoever decides first rather than by how long the
    requests have waited. Taking turns `replica_stagger_ms` apart, each decides after the ones
    before it have dispatched and the workers' heartbeats have said so."""
    return sum(1 for r, key in others.items() if key[2] > 0.0 and (*key, r) < mine)


class Placer(Protocol):
    """What the wait queue asks of the rest of the router core (core.py's RouterCore is one)."""

    def dispatch(self, req: Request, now: float, *, rejected: bool = False) -> None:
        """Decide and send at `now`; raises the policy's NoKvRoom/Hold/NoWorkers when it cannot."""

    def fail(self, req: Request, message: str, code: str, now: float) -> None:
        """End a request with an error."""

    def unplaced(self, req: Request, e: NoWorkers, now: float) -> None:
        """Put a request no live worker can take where it waits (parked)."""


class Waiting:
    """The router's wait queue with its rules. It owns the queue (`queue`) and reaches the rest of
    the router only through what it is given: the settings, the policy (its declared wait order,
    `Policy.retry_order`) and the worker table (read only), the router's counters, and `core`, the
    three things it asks of the core (`Placer`)."""

    def __init__(self, cfg: RouterConfig, policy: Policy, table: WorkerTable, counts: Counter[str],
                 core: Placer, wall_offset: float = 0.0,
                 room_short: Callable[[float], None] = lambda now: None) -> None:
        self.cfg, self.policy, self.table, self.counts = cfg, policy, table, counts
        self.wall_offset = wall_offset  # wall-clock time = the router's clock + wall_offset
        self.core = core
        self.room_short = room_short  # told when a retry finds no decode room (Admission.room_short)
        self.queue: WaitQueue[Request] = WaitQueue(cfg.kv_wait_max)

    def prefill_ids(self) -> frozenset[str]:
        """The prefill workers' ids (whose caches `prefill_tokens` counts)."""
        return frozenset(wid for wid, w in self.table.workers.items() if w.role == "prefill")

    def alone_s(self, tokens: int) -> float:
        """The prompt's prefill time on the fastest idle prefill worker (0 when none is live)."""
        times = [w.model.prefill_exec(tokens, w.hello.token_budget) for w in self.table.workers.values()
                 if w.role == "prefill"]
        return min(times, default=0.0)

    def late(self, now: float) -> Callable[[Request], bool] | None:
        """Under the policy's wait order (late binding), whether a waiting request can no longer
        meet its TTFT SLO whatever it were sent to (its SLO is over), which the order tries last
        (`WaitQueue.head` looks past them); None (no order but FIFO): every one counts."""
        if not self.policy.orders_waiting():
            return None
        return lambda r: r.arrival + r.ttft_slo <= now

    def head(self, now: float) -> list[Request]:
        """The waiting requests a retry now would decide again (`WaitQueue.head`)."""
        return self.queue.head(self.late(now))

    def first(self, now: float) -> tuple[bool, float, int]:
        """The request a retry now would decide first: (whether it can no longer meet its TTFT
        SLO, its arrival on the wall clock, the tokens its prefill computes: `prefill_tokens`); (False,
        0.0, 0) when none waits."""
        head = [r for r in self.head(now) if not r.done]
        if not head:
            return False, 0.0, 0
        sizes = self._sizes(head)
        latest = self._latest(head, sizes)
        i = next(iter(self._order(latest, sizes, now)))
        r = head[i]
        return self.policy.orders_waiting() and latest[i] <= now, r.arrival + self.wall_offset, sizes[i]

    def _sizes(self, head: list[Request]) -> list[int]:
        """Each one's `prefill_tokens` (what its prefill computes), the size the order goes by."""
        pf = self.prefill_ids()
        return [prefill_tokens(r, pf) for r in head]

    def _order(self, latest: list[float], sizes: list[int], now: float) -> list[int]:
        """The policy's order for the head (`wait_order`, told each one's `_sizes`), with router
        replicas too: their turns at room go by each replica's first request in this order
        (`replica_turn`, `turn_key`: its size too when the order is by size)."""
        return self.policy.wait_order(latest, sizes, now)

    def _latest(self, head: list[Request], sizes: list[int]) -> list[float]:
        """Each one's `latest_start` (late binding's retry order), else 0.0 (no order but FIFO)."""
        if not self.policy.orders_waiting():
            return [0.0] * len(head)
        return [latest_start(r.arrival, r.ttft_slo, self.alone_s(n)) for r, n in zip(head, sizes, strict=True)]

    def _queues(self, now: float) -> list[m.RouterQueue]:
        """The other replicas' wait queues, as the decode workers' heartbeats last echoed them
        (`DecodeHeartbeat.queues`; the newest heartbeat's word for each). One whose first request
        arrived more than `kv_wait_timeout` ago cannot be waiting any more (its replica failed it or
        is gone, and a decode worker echoes a gone replica's last word for ever): left out."""
        me = self.table.me
        oldest = now + self.wall_offset - self.cfg.kv_wait_timeout
        others: dict[str, tuple[float, m.RouterQueue]] = {}  # router -> (heartbeat time, its queue)
        for w in self.table.workers.values():
            hb = w.hb
            if isinstance(hb, m.DecodeHeartbeat) and hb.queues:
                for q in hb.queues:
                    if q.router != me and (q.router not in others or w.hb_at >= others[q.router][0]):
                        others[q.router] = (w.hb_at, q)
        return [q for _, q in others.values() if q.oldest_at >= oldest]

    def _others(self, now: float) -> dict[str, TurnKey]:
        """The other replicas' first waiting requests' `turn_key`s (`_queues`; arrival 0.0: none waits there)."""
        by_size = self.policy.orders_by_size()
        return {q.router: turn_key(q.late, q.first_tokens, q.oldest_at, by_size) for q in self._queues(now)}

    def others_waiting(self, now: float) -> tuple[int, int]:
        """How many requests wait at the other replicas, and their prompt tokens (`_queues`): one
        router's queue would hold them too, before a request arriving now; (0, 0) with one router."""
        if self.cfg.replicas <= 1:
            return 0, 0
        qs = [q for q in self._queues(now) if q.oldest_at > 0.0]
        return sum(q.waiting for q in qs), sum(q.waiting_tokens for q in qs)

    def turn_delay(self, now: float) -> float:
        """Seconds until this replica's turn at room a heartbeat may show (`replica_turn`); 0 with
        one router, or when nothing waits here."""
        cfg = self.cfg
        if cfg.replicas <= 1 or cfg.replica_stagger_ms <= 0.0:
            return 0.0
        late, at, tokens = self.first(now)
        if at == 0.0:
            return 0.0
        turn = replica_turn((*turn_key(late, tokens, at, self.policy.orders_by_size()), self.table.me),
                            self._others(now))
        return turn * self.turn_spacing() if turn else 0.0

    def turn_spacing(self) -> float:
        """Seconds between the replicas' turns: `replica_stagger_ms`, or the relay this replica
        measures if longer (`WorkerTable.relay_p90`: its dispatches' acknowledgement by the workers'
        heartbeats, which reach every replica alike), at most TURN_MAX_S. A turn closer to the one
        before it than the relay decides blind to that one's dispatches: on the shared 2-core host
        the relay's P90 was 4-11 ms live, where 3 ms were assumed (docs/results/router-replicas.md)."""
        stagger = self.cfg.replica_stagger_ms / 1000.0
        return max(stagger, min(TURN_MAX_S, self.table.relay_p90()))

    def blocker(self) -> Request | None:
        """The first request waiting for decode room (KV or decode step time; not a held one), which a
        new request must queue behind; None when none waits for room."""
        return next((r for r in self.queue if not r.held and not r.done), None)

    def enqueue(self, req: Request, e: NoKvRoom, now: float, until: float | None = None) -> None:
        """A new request waits (admission let it): until room opens, at most `kv_wait_timeout`, and
        at most `until` (admission's `wait_until`: placed later, it would miss the time to first
        token it was admitted for; it fails then, retryable, instead)."""
        req.held = isinstance(e, Hold)
        req.wait_reason, req.short = str(e), shortage(e)
        req.kv_wait_until = now + self.cfg.kv_wait_timeout
        b = budget(self.cfg, req)
        if until is not None and b is not None and until < req.kv_wait_until:
            req.kv_wait_until, req.wait_budget = max(now, until), b
        self.queue.append(req)
        self.counts["late_held" if req.held else "kv_waited"] += 1
        if isinstance(e, NoDecodeRoom):  # of those waiting for room: the decode step, not the KV
            self.counts["decode_room_waited"] += 1

    def retry(self, now: float, turn: bool = False) -> None:
        """Decide the waiting requests again (see the module docstring). `turn`: at this replica's
        turn at room a worker's heartbeat showed every replica (`replica_turn`); else at room only
        this replica heard of (its own deflection's first token or request's end), where, with
        replicas, it places none that another replica's first waiting request comes before."""
        q = self.queue
        q.drop_done()
        if not q:
            return
        policy = self.policy
        # with replicas: the first request another replica waits with, in one router's retry order
        # (as the decode workers' heartbeats echo it); in its turn this replica places its own only
        # up to it, and at least one (so that a stale echo slows it, never stops it); out of turn,
        # none past it (the room shows to every replica at the worker's next heartbeat: theirs too)
        cfg = self.cfg
        bound: tuple[bool, int, float, str] | None = None
        by_size = policy.orders_by_size()
        if cfg.replicas > 1 and cfg.replica_stagger_ms > 0.0:
            heads = [(*key, r) for r, key in self._others(now).items() if key[2] > 0.0]
            bound = min(heads, default=None)
        me = self.table.me
        placed = 0
        latest: dict[str, float] = {}

        def order(head: list[Request]) -> list[int]:
            sizes = self._sizes(head)
            ls = self._latest(head, sizes)
            for r, t in zip(head, ls, strict=True):
                latest[r.request_id] = t
            return self._order(ls, sizes, now)

        def place(req: Request) -> Outcome:
            nonlocal placed
            if req.done:
                return Outcome.GONE
            if bound is not None and (placed or not turn):
                key = (*turn_key(policy.orders_waiting() and latest.get(req.request_id, 0.0) <= now,
                                 len(req.prompt_token_ids), req.arrival + self.wall_offset, by_size), me)
                if key > bound:  # another replica's first request comes before it: that one's turn first
                    return Outcome.NO_ROOM
            try:
                self.core.dispatch(req, now)
            except Hold as e:
                req.held, req.wait_reason, req.short = True, str(e), shortage(e)
                return Outcome.HELD
            except NoKvRoom as e:
                req.held, req.wait_reason, req.short = False, str(e), shortage(e)
                self.room_short(now)
                return Outcome.NO_ROOM
            except NoWorkers as e:  # no worker left that could take it: parked (RouterCore.unplaced)
                q.remove(req)
                self.core.unplaced(req, e, now)
                return Outcome.REMOVED
            req.kv_wait_until, req.wait_budget = 0.0, 0.0
            req.held = False
            placed += 1
            return Outcome.PLACED

        q.retry(order, place, self.late(now))

    def expire(self, now: float) -> None:
        """Fail the waiting requests past their wait timeout, each with what it waited for."""
        q = self.queue
        # anywhere in the queue, not only at its head: a request put back first in line
        # (`RouterCore.unplaced`) waits longer than those behind it
        gone: list[Request] = []
        keep: list[Request] = []
        for r in q:
            (gone if r.done or now >= r.kv_wait_until else keep).append(r)
        if not gone:
            return
        q.clear()
        q.extend(keep)
        for req in gone:
            if req.done:
                continue
            if req.wait_budget > 0:  # its budget ran out (admission.py's bounded wait): a refusal, HTTP 429
                self.counts["budget_wait_timeouts"] += 1
                which = "queue_budget" if self.cfg.queue_budget > 0 else "its TTFT SLO"
                self.core.fail(req, f"overloaded: no worker could start it in time for its budget of "
                                    f"{req.wait_budget:g} s ({which}, from arrival: placed later, its first token "
                                    f"would come past it); {req.wait_reason}; retry later, or add "
                                    + ("prefill workers" if req.short == "prefill_busy" else "decode workers"),
                               req.short, now)
                continue
            self.counts["kv_wait_timeouts"] += 1
            t = self.cfg.kv_wait_timeout
            if req.streamed:  # it lost its decode worker mid-stream and found no room to resume on
                self.core.fail(req, f"worker failed after streaming {req.n_out} tokens; no decode worker had KV room "
                                    f"to resume it on within {t:g} s (kv_wait_timeout); the output is incomplete",
                               "worker_lost_midstream", now)
            elif req.held:  # what was short is prefill (the queues stayed deep), not KV
                self.core.fail(req, f"no worker could take it within {t:g} s (kv_wait_timeout): the prefill workers' "
                                    f"queues stayed full and no decode worker could prefill it in place (late binding "
                                    f"held it: {req.wait_reason}); retry later, or add prefill or decode workers",
                               "prefill_wait_timeout", now)
            elif req.short == "decode_busy":
                self.core.fail(req, f"no decode worker had decode step room for it within {t:g} s (kv_wait_timeout: "
                                    f"{req.wait_reason}); retry later, or add decode workers",
                               "decode_wait_timeout", now)
            else:
                self.core.fail(req, f"no decode worker had room for it within {t:g} s (kv_wait_timeout: "
                                    f"{req.wait_reason}); retry later, or add decode workers", "kv_wait_timeout", now)
