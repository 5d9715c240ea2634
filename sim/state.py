"""The simulator's state of each request and worker (sim/core.py runs the events on them):
what a request went through, each worker's engine (the real batching class) and step in flight,
and each router's ledger of what it dispatched to a worker since that worker's last heartbeat."""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from common.engines.batcher import Batcher, Seq, StepPlan
from common.engines.step_error import StepErrorEstimator
from common.perf_model import PerfModel
from common.policy.admission import Accepted


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    arrival: float
    prompt: int
    output: int
    route: str | None = None
    reason: str = ""
    decode_worker: str = ""
    router: int = 0               # which router replica it arrived at
    ttft_pred: float | None = None
    waited: float = -1.0          # arrival to leaving the router's KV wait queue (-1: never waited)
    held: bool = False            # waits because the policy held it (late binding), not for KV room
    was_held: bool = False
    latest: float = math.nan      # latest start to meet the TTFT SLO (late binding's retry order)
    rejected: bool = False
    prefill_started: float = -1.0
    prefilled: float = -1.0
    xfer: float = -1.0
    first: float = -1.0
    last: float = -1.0
    done: float = -1.0
    ntok: int = 0
    hashes: list[int] | None = None  # the prompt's block hashes (from the trace's hash_ids)
    cached: int = 0                  # prompt tokens its prefill skipped (prefix-cache hit)
    gaps: array = field(default_factory=lambda: array("d"))  # type: ignore[type-arg]


class PrefillLedger:
    """One router's ledger of a prefill worker: what it dispatched there since the last heartbeat."""

    __slots__ = ("q", "reqs", "tokens")

    def __init__(self) -> None:
        self.tokens = self.reqs = 0
        self.q: list[tuple[int, float]] = []  # (prompt tokens, dispatch time) since the heartbeat


class DecodeLedger:
    """One router's ledger of a decode worker, and its exact record of the deflections it sent."""

    __slots__ = ("deflecting", "kv", "pending", "res")

    def __init__(self) -> None:
        self.res = self.kv = self.pending = 0
        self.deflecting: dict[str, tuple[float, int, float]] = {}  # deflection -> (step cost s, largest chunk,
        # predicted end)


class Worker:
    __slots__ = ("batcher", "beat_at", "bias", "busy", "busy_s", "estimator", "hb", "model", "next_hb", "phase",
                 "plan", "retry_at", "until", "view_model", "views", "wid")

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float, routers: int) -> None:
        self.wid = wid
        self.batcher = batcher
        self.model = model
        self.busy = False
        self.busy_s = 0.0
        self.phase = phase
        self.next_hb = phase
        self.hb: tuple[Any, ...] = ()
        self.views: list[Any] = [None] * routers  # each router's view of it (None: to rebuild)
        self.plan: StepPlan | None = None  # the step in flight
        self.until = 0.0  # when it ends, as the worker's model predicts (without the noise)
        self.retry_at = -1.0  # the heartbeat at which a retry of the wait queue is already due
        self.beat_at = -1.0   # a prompt heartbeat due then (-1: none)
        self.estimator: StepErrorEstimator | None = None  # its measured step error (None: not measured)
        self.bias = 1.0              # the bias its last heartbeat reported, as routers take it (bias_factor)
        self.view_model = model      # what routers predict it with: model x bias


class PrefillWorker(Worker):
    __slots__ = ("led", "queued_reqs", "queued_tokens")

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float, routers: int) -> None:
        super().__init__(wid, batcher, model, phase, routers)
        self.queued_tokens = 0
        self.queued_reqs = 0
        self.led = [PrefillLedger() for _ in range(routers)]


class DecodeWorker(Worker):
    __slots__ = ("accepted", "accepted_from", "admit_wait", "led", "step_s", "waiting_kv", "waiting_kv_tokens")

    def __init__(self, wid: str, batcher: Batcher, model: PerfModel, phase: float, routers: int) -> None:
        super().__init__(wid, batcher, model, phase, routers)
        self.waiting_kv = 0
        self.waiting_kv_tokens = 0
        self.admit_wait: deque[Seq] = deque()
        self.led = [DecodeLedger() for _ in range(routers)]
        self.accepted: dict[str, Accepted] = {}  # worker side: deflections admitted, not yet prefilled
        self.accepted_from: dict[str, tuple[int, int]] = {}  # ... their router and largest chunk (heartbeats)
        self.step_s = 0.0  # recent step time (moving average), as heartbeats report it


class Level:
    """A queue's length over time: its maximum and its time-weighted mean."""

    __slots__ = ("area", "max", "n", "t")

    def __init__(self) -> None:
        self.n = self.max = 0
        self.area = self.t = 0.0

    def add(self, now: float, delta: int) -> None:
        self.area += self.n * (now - self.t)
        self.t = now
        self.n += delta
        if self.n > self.max:
            self.max = self.n

    def report(self, end: float) -> dict[str, float]:
        area = self.area + self.n * (end - self.t)
        return {"max": self.max, "mean": area / end if end > 0 else 0.0}
