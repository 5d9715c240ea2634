"""Which waiting request the router core tries first when room opens under an overload
(common/router_core/waiting.py, common/wait_queue.py; the simulator runs the same core). Fake
clock, no sockets: a `Waiting` over a stub worker table and a placer that has room for a given
number of requests.

Issue 44, shift-code under 10 % step noise (tune slice): past the decode pool's capacity, two
rules turned a deficit of a few per cent into every request missing its TTFT SLO: the retry
decided only the first SCAN requests, all of them already past their SLO, and a held request's
latest start left out the prefill queue it would join."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

from common import config
from common import messages as m
from common.perf_model import load_profile
from common.policy import Hold, NoDecodeRoom, NoWorkers, Policy
from common.policy.kairos import KairosConfig, retry_order
from common.router_core.requests import Request
from common.router_core.waiting import Waiting
from common.router_core.workers import WorkerTable
from common.wait_queue import SCAN, Outcome, WaitQueue

SLO = 2.0
BUDGET = 2048


class SlackOrder:
    """Kairos's wait order (late binding on, `late_order` "slack"): the policy side `Waiting` asks."""

    cfg = KairosConfig(late_binding=True, late_order="slack")

    def orders_waiting(self) -> bool:
        return True

    def retry_order(self, latest: list[float], now: float) -> list[int]:
        return retry_order(self.cfg, latest, now)

    def wait_order(self, latest: list[float], sizes: list[int], now: float) -> list[int]:
        return retry_order(self.cfg, latest, now, sizes)

    def orders_by_size(self) -> bool:
        return self.cfg.late_order == "short"


class ShortOrder(SlackOrder):
    """... with `late_order` "short" (Kairos's default)."""

    cfg = KairosConfig(late_binding=True)


@dataclass
class Entry:
    """What `Waiting` reads of a worker table entry."""

    worker_id: str
    role: str
    model: Any
    hello: Any
    hb: Any = None
    draining: bool = False
    hb_at: float = 0.0


@dataclass
class Table:
    workers: dict[str, Entry] = field(default_factory=dict)
    me: str = "router-0"

    def relay_p90(self) -> float:
        return 0.0


class Placer:
    """Room for `room` requests; then every request waits for decode room (or stays held)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.placed: list[str] = []

    def dispatch(self, req: Request, now: float, *, rejected: bool = False) -> None:
        if self.room <= 0:
            raise Hold("prefill queues deep") if req.held else NoDecodeRoom("no decode room")
        self.room -= 1
        self.placed.append(req.request_id)

    def fail(self, req: Request, message: str, code: str, now: float) -> None:
        raise AssertionError(f"{req.request_id} failed: {message}")

    def unplaced(self, req: Request, e: NoWorkers, now: float) -> None:
        raise AssertionError(f"{req.request_id} unplaced")


def prefill_worker(queued_tokens: int) -> Entry:
    model = load_profile("fast").model
    hb = m.PrefillHeartbeat(worker_id="p0", incarnation="i", seq=1, queued_tokens=queued_tokens,
                            queued_requests=1 if queued_tokens else 0, token_budget=BUDGET)
    return Entry("p0", "prefill", model, m.Hello(protocol=m.PROTOCOL_VERSION, worker_id="p0", role="prefill",
                                                 incarnation="i", engine="sim", model="kairos-sim",
                                                 token_budget=BUDGET, kv_capacity_tokens=100_000, max_batch=64),
                 hb)


def waiting(room: int, queued_tokens: int = 0, order: type[SlackOrder] = SlackOrder,
            replicas: int = 1) -> tuple[Waiting, Placer]:
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "kairos", "profile": "fast",
                                                               "replicas": replicas, "replica_stagger_ms": 3.0})
    placer = Placer(room)
    table = Table({"p0": prefill_worker(queued_tokens)})
    return Waiting(cfg, cast(Policy, order()), cast(WorkerTable, table), Counter(), placer), placer


def request(rid: str, arrival: float, *, prompt: int = 64, held: bool = False) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1] * prompt, sampling=m.Sampling(max_tokens=16),
                   ttft_slo=SLO, tbt_slo=0.1, arrival=arrival, deadline=arrival + 600.0, held=held,
                   kv_wait_until=arrival + 600.0)


def test_the_retry_looks_past_more_than_scan_requests_whose_slo_is_over() -> None:
    # a sustained overload: SCAN + 6 requests at the head waited past their TTFT SLO; one that
    # arrived just now can still make it. Room opens for one: it goes to the one that can make it
    # (the late ones are tried after it), not to the oldest late one, which would make it late too
    w, placer = waiting(room=1)
    now = 100.0
    late = [request(f"late{i}", arrival=90.0 + i * 0.01) for i in range(SCAN + 6)]
    fresh = request("fresh", arrival=now - 0.2)
    w.queue.extend([*late, fresh])
    assert w.first(now) == (False, fresh.arrival, 64)  # what a replica's turn is decided by, too
    w.retry(now)
    assert placer.placed == ["fresh"]
    assert len(w.queue) == SCAN + 6 and fresh not in w.queue
    # room for more: the late ones then go, oldest first
    placer.room = 2
    w.retry(now)
    assert placer.placed == ["fresh", "late0", "late1"]


def test_a_free_slot_goes_to_the_shortest_prompt_that_can_still_make_it() -> None:
    # Kairos's default order ("short"): room for one goes to the shortest of the requests that can
    # still meet their TTFT SLO, not to the oldest; one past its SLO comes after them, whatever its size
    w, placer = waiting(room=1, order=ShortOrder)
    now = 100.0
    late = request("late", arrival=90.0, prompt=16)
    old = request("old", arrival=now - 0.5, prompt=3000)
    short = request("short", arrival=now - 0.2, prompt=200)
    mid = request("mid", arrival=now - 0.1, prompt=900)
    w.queue.extend([late, old, short, mid])
    assert w.first(now) == (False, short.arrival, 200)
    w.retry(now)
    assert placer.placed == ["short"]
    placer.room = 3
    w.retry(now)
    assert placer.placed == ["short", "mid", "old", "late"]
    # a router replica orders its own queue the same way (its turns at room go by arrival)
    w, placer = waiting(room=1, order=ShortOrder, replicas=4)
    w.queue.extend([request("old", arrival=now - 0.5, prompt=3000), request("short", arrival=now - 0.2, prompt=200)])
    w.retry(now)
    assert placer.placed == ["short"]
    # "slack": the oldest that can still make it first
    w, placer = waiting(room=1)
    w.queue.extend([request("late", arrival=90.0, prompt=16), request("old", arrival=now - 0.5, prompt=3000),
                    request("short", arrival=now - 0.2, prompt=200)])
    w.retry(now)
    assert placer.placed == ["old"]


def test_a_session_turn_is_ordered_by_what_its_prefill_computes_not_by_its_whole_conversation() -> None:
    # "short" gives a free prefill slot to the prompt that takes the least of it. A session's next
    # turn carries the whole conversation (6,000 tokens) but the prefill worker holds 5,800 of them
    # (the router's last prefix lookup for it, Request.prefix_seen): its prefill is 200 tokens, less
    # than a fresh 900-token prompt's. Raw prompt length put it last (agent sessions at 1P2D, H100:
    # both-SLO 85-96 % before, 91-99 % after on six draws; docs/results/decode-bottleneck.md)
    from common.router_core.prefix import Seen

    w, placer = waiting(room=1, order=ShortOrder)
    now = 100.0
    fresh = request("fresh", arrival=now - 0.5, prompt=900)
    turn = request("turn", arrival=now - 0.2, prompt=6000)
    turn.prefix_seen = Seen()
    turn.prefix_seen.cached = (("p0", 5800),)
    w.queue.extend([fresh, turn])
    assert w.first(now) == (False, turn.arrival, 200)
    w.retry(now)
    assert placer.placed == ["turn"]
    # held by a decode worker only (the KV a hand-off left there): a prefill worker computes it all
    w, placer = waiting(room=1, order=ShortOrder)
    turn.prefix_seen.cached = (("d0", 5800),)
    w.queue.extend([request("fresh", arrival=now - 0.5, prompt=900), turn])
    assert w.first(now) == (False, now - 0.5, 900)
    w.retry(now)
    assert placer.placed == ["fresh"]


@dataclass(eq=False)
class R:
    name: str
    late: bool = False
    held: bool = False
    done: bool = False


def test_the_head_without_late_ones_is_the_first_scan_in_queue_order() -> None:
    q: WaitQueue[R] = WaitQueue(1000, scan=3)
    rs = [R("a", late=True), R("b"), R("c", late=True), R("d"), R("e"), R("f")]
    q.extend(rs)
    assert [r.name for r in q.head()] == ["a", "b", "c"]  # no predicate: as before
    assert [r.name for r in q.head(lambda r: r.late)] == ["b", "d", "e"]  # the first 3 not late
    q2: WaitQueue[R] = WaitQueue(1000, scan=4)
    q2.extend(rs[:4])
    assert [r.name for r in q2.head(lambda r: r.late)] == ["a", "b", "c", "d"]  # room left: late ones too

    def place(r: R) -> Outcome:
        return Outcome.PLACED if r.name == "d" else Outcome.NO_ROOM

    q.retry(lambda head: [1, 0, 2], place, lambda r: r.late)  # tries d first
    assert [r.name for r in q] == ["a", "b", "c", "e", "f"]



def test_a_replica_waits_its_turn_behind_another_replicas_shorter_request() -> None:
    """Router replicas take turns at room by each one's first request in one router's order
    (`replica_turn`, `turn_key`). In Kairos's "short" order that compares sizes: another replica's
    first request, younger but shorter (both can still make their SLO), comes first, so this
    replica waits its turn and, out of turn, places nothing; by arrival ("slack") it would go
    first. (Before 2026-12-07 the turns went by arrival in either order: on the code slice four
    replicas' P95 TTFT was 1.18x one router's; since, 1.08x: router-replicas.md.)"""
    now = 100.0

    def at(order: type[SlackOrder]) -> tuple[float, list[str]]:
        w, placer = waiting(room=1, order=order, replicas=2)
        table = cast(Table, w.table)
        table.me = "rb"
        other = m.RouterQueue(router="ra", oldest_at=now - 0.2, late=False, waiting=1, first_tokens=200)
        table.workers["d0"] = Entry("d0", "decode", None, None, m.DecodeHeartbeat(
            worker_id="d0", incarnation="i", seq=1, batch=0, kv_tokens=0, kv_free_tokens=10_000,
            kv_capacity_tokens=10_000, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
            token_budget=BUDGET, queues=[other]), hb_at=now)
        w.queue.append(request("mine", arrival=now - 0.5, prompt=3000))
        assert w.first(now) == (False, now - 0.5, 3000)
        delay = w.turn_delay(now)
        w.retry(now)  # out of turn
        return delay, placer.placed

    assert at(ShortOrder) == (0.003, [])
    assert at(SlackOrder) == (0.0, ["mine"])
