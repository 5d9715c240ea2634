"""Who gets in: the router's admission rules, with no socket and no clock.

A request the cluster cannot start in time is refused at the door (HTTP 429 with `Retry-After`,
before any byte of a stream), not queued until a fixed timeout:

- **Predicted wait.** A request that cannot be placed now (Kairos's late binding holds it, or no
  decode worker has room) would wait in the router's queue. Before it is queued, its time to first
  token is predicted from the router's own models, and over the budget (`queue_budget`, else the
  request's TTFT SLO) it is refused with `Overloaded`, whose `code` names what is short and whose
  `retry_after_s` is the predicted time for the backlog to drain to where a new request fits:
  - held (`Hold`: the prefill queues are deep and no decode worker can prefill it in place): the
    prefill pool must first work through the tokens it holds (its views, ledger included) and the
    tokens of the requests waiting before it (with router replicas, those waiting at the other
    replicas too, as the decode workers' heartbeats echo their queues: one router's queue would
    hold them before it), then its own prompt, at the pool's rate (each
    prefill worker's token budget per step time at a full budget, from its performance model),
    half a prefill step (it starts at a step boundary), then the decode step that gives its first
    token (on a busy decode worker, after half of the one in flight); code `prefill_busy`;
  - no decode room (`NoKvRoom`: KV; `NoDecodeRoom`: decode step time, the decode guard): room
    frees as the requests holding it end; with k requests already waiting before it (k = 0 for
    the first to wait), it waits for the (k+1)-th of them to reach its max_tokens (at its decode
    worker's recent step time; one dispatched but without its first token yet first takes its
    lead), then its own lead to a first token; with more waiting before it than requests holding
    room, each round of rooms past those costs one request's service time (its lead and max_tokens
    steps); code `kv_full` or `decode_busy`. With no request of this router holding decode room
    (another router's fill the pool) nothing predicts it: it waits. The lead (dispatch to first
    token: prefill queue, prefill, KV transfer, first decode step) is the one measured on recent
    requests (`lead_s`), and at least the models' prefill alone and first decode step.
- **Bounded wait.** A request admitted to wait (its prediction within the budget, or none) waits
  at most until its budget from arrival less its lead (`kv_wait_timeout` when that is sooner):
  placed later, it would miss the time to first token it was admitted for, so it fails then with a
  429 and what was short (`prefill_busy`, `decode_busy`, `kv_full`; Retry-After) instead of being
  served past its budget (waiting.py). Only `kv_wait_timeout` ends a wait with no budget
  (`queue_budget` -1) or one for other reasons (its worker lost): a retryable 503
  (`prefill_wait_timeout`, `decode_wait_timeout`, `kv_wait_timeout`: what was short).
- **Client shares.** One client (its API key, else its address; the HTTP shell names it) holds at
  most `client_share` x `max_in_flight` requests in flight, so one client or one batched request
  cannot take every slot; code `client_share`.

The rules take the time and the worker table; `RouterCore.submit` applies them, the simulator runs
them with the core, and the HTTP shell only maps `Overloaded` to 429.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from common.config import RouterConfig
from common.policy import Hold, NoDecodeRoom, NoKvRoom
from common.router_core.requests import Request
from common.router_core.workers import WorkerTable

LEAD_WEIGHT = 0.2  # weight of each served request's lead in the measured one (a moving average)
ROOM_MARGIN = 0.1  # a wait for decode room is admitted when predicted within (1 - this) x its budget
ROOM_SHORT_S = 2.0  # after a decision found no decode room, held requests count it for this long


def shortage(e: NoKvRoom) -> str:
    """What is short when the policy cannot place a request now: `prefill_busy` (late binding
    holds it: the prefill queues are deep and no decode worker can prefill it in place),
    `decode_busy` (every decode worker's decode step would pass the TBT SLO) or `kv_full`."""
    if isinstance(e, Hold):
        return "prefill_busy"
    return "decode_busy" if isinstance(e, NoDecodeRoom) else "kv_full"


def budget(cfg: RouterConfig, req: Request) -> float | None:
    """The longest time to first token `req` is admitted, and waits, for: `queue_budget`, else
    (0) its TTFT SLO; None (-1): no limit."""
    b = cfg.queue_budget
    if b < 0:
        return None
    return b if b > 0 else req.ttft_slo


@dataclass(frozen=True, slots=True)
class Shortage:
    """A prediction for a request that cannot be placed now: its time to first token from now
    (`ttft_s`), what is short (`code`) and why, in words an operator can act on (`why`)."""

    ttft_s: float
    code: str
    why: str


class Admission:
    """The admission rules (see the module docstring). It reads the worker table and the wait
    queue it is given, and the requests in flight; it owns the per-client counts."""

    def __init__(self, cfg: RouterConfig, table: WorkerTable, requests: dict[str, Request]) -> None:
        self.cfg, self.table, self.requests = cfg, table, requests
        self.clients: Counter[str] = Counter()  # requests in flight per client
        self.lead_s = 0.0  # measured dispatch -> first token of recent requests (moving average; 0: none yet)
        self.room_short_until = 0.0  # till then, decode room counts for held requests too (`room_short`)
        self.predicted: Shortage | None = None  # the last prediction `over_budget` made (for the log)
        self.client_limit = max(1, int(cfg.client_share * cfg.max_in_flight)) if 0 < cfg.client_share < 1 else 0

    # ------------------------------------------------------------------ per-client shares
    def client_full(self, client: str) -> str | None:
        """Why `client` may not start another request now (None: it may)."""
        if not client or not self.client_limit:
            return None
        n = self.clients[client]
        if n < self.client_limit:
            return None
        return (f"this client ({client}) has {n} requests in flight, its share of the router "
                f"(client_share {self.cfg.client_share:g} x max_in_flight {self.cfg.max_in_flight}); "
                "wait for some to finish")

    def started(self, req: Request) -> None:
        if req.client:
            self.clients[req.client] += 1

    def ended(self, req: Request) -> None:
        """`req` left the router. Served, its lead (its last dispatch to its first token) joins the
        measured one."""
        if req.outcome == "ok" and req.first_token_at is not None and req.decided_at > 0:
            lead = req.first_token_at - req.decided_at
            if lead >= 0:  # (< 0: re-dispatched after its first token)
                self.lead_s = lead if self.lead_s <= 0 else self.lead_s + LEAD_WEIGHT * (lead - self.lead_s)
        c = req.client
        if c:
            n = self.clients[c] - 1
            if n > 0:
                self.clients[c] = n
            else:
                del self.clients[c]

    # ------------------------------------------------------------------ predicted wait
    def budget(self, req: Request) -> float | None:
        """The longest predicted time to first token `req` is admitted with (None: no limit)."""
        return budget(self.cfg, req)

    def prefill_rate(self) -> float:
        """Tokens per second the prefill pool works through at full token budgets (0: no worker)."""
        rate = 0.0
        for p in self.table.view(use_ledger=self.cfg.ledger).prefill:
            step = p.model.prefill_exec(p.token_budget, p.token_budget)
            if step > 0:
                rate += p.token_budget / step
        return rate

    def alone_s(self, tokens: int) -> float:
        """The prompt's prefill time on the fastest prefill worker, idle (0 when none is live)."""
        times = [p.model.prefill_exec(tokens, p.token_budget)
                 for p in self.table.view(use_ledger=self.cfg.ledger).prefill]
        return min(times, default=0.0)

    def first_step(self, tokens: int) -> float:
        """The decode step that brings a prompt's first token after its prefill: the quickest of the
        decode workers' next steps with it added, and on a busy worker half a step of waiting
        for the one in flight, at the pace its steps have run lately (as Kairos's replay predictor
        times the disaggregated path's first token); 0 when no decode worker is live."""
        best = math.inf
        for d in self.table.view(use_ledger=self.cfg.ledger).decode:
            step = d.model.step_time(d.batch + 1, d.kv_tokens + tokens)
            if d.batch + d.deflections + d.pending:
                step = 1.5 * max(step, d.step_s)
            best = min(best, step)
        return best if best < math.inf else 0.0

    def lead(self, tokens: int) -> float:
        """A prompt's time from its dispatch to its first token: the measured lead of recent requests
        (`lead_s`), at least its prefill alone and the first decode step (the models')."""
        return max(self.lead_s, self.alone_s(tokens) + self.first_step(tokens))

    def wait_until(self, req: Request) -> float | None:
        """The latest time `req` can leave the wait queue and still meet its budget (None: no budget)."""
        b = self.budget(req)
        if b is None:
            return None
        return req.arrival + max(0.0, b - self.lead(len(req.prompt_token_ids)))

    def room_short(self, now: float) -> None:
        """A decision found no decode worker with room (KV or decode step) at `now`: for a while
        (`ROOM_SHORT_S`), requests that late binding holds wait for decode room too."""
        self.room_short_until = now + ROOM_SHORT_S

    def predict(self, req: Request, e: NoKvRoom, ahead: Iterable[Request],
                others: tuple[int, int] = (0, 0)) -> Shortage | None:
        """`req`'s predicted time to first token if it waits (`e`: why it cannot be placed now;
        `ahead`: the requests already waiting; `others`: how many wait at the other router
        replicas and their prompt tokens), or None where nothing predicts it. A held one is
        predicted from the prefill pool and, while decode room is short too (a decision found none
        lately: `room_short`), from decode room, whichever is later. The others' requests count
        for the prefill pool only: decode room is predicted from when this router's own requests
        end, and it does not see the others' end."""
        ahead = [r for r in ahead if not r.done]
        if isinstance(e, Hold):
            held = self.predict_prefill(req, ahead, others)
            if req.arrival >= self.room_short_until:
                return held
            room = self.predict_room(req, NoDecodeRoom(str(e)), ahead)
            if held is None or (room is not None and room.ttft_s > held.ttft_s):
                return room
            return held
        return self.predict_room(req, e, ahead)

    def predict_prefill(self, req: Request, waiting: list[Request],
                        others: tuple[int, int] = (0, 0)) -> Shortage | None:
        """Held (late binding): the prefill pool's backlog, and the prompts waiting before it (here,
        and `others`: at the other router replicas, how many and their tokens)."""
        tokens = len(req.prompt_token_ids)
        rate = self.prefill_rate()
        if rate <= 0:
            return None
        view = self.table.view(use_ledger=self.cfg.ledger)
        queued = sum(p.queued_tokens for p in view.prefill)
        n_others, t_others = others
        before = sum(len(r.prompt_token_ids) for r in waiting) + t_others
        # a prompt placed on a busy prefill worker starts at its next step: half a step later on average
        half_step = 0.5 * min(p.model.prefill_exec(p.token_budget, p.token_budget) for p in view.prefill)
        ttft = (queued + before + tokens) / rate + half_step + self.first_step(tokens)
        at_others = f", {n_others} of them at other router replicas" if n_others else ""
        return Shortage(ttft, "prefill_busy",
                        f"the prefill workers hold {queued} prompt tokens and {len(waiting) + n_others} requests "
                        f"({before} tokens{at_others}) wait before it, at {rate:.0f} tokens/s")

    def predict_room(self, req: Request, e: NoKvRoom, waiting: list[Request]) -> Shortage | None:
        """No decode room (KV, or decode step time): when the requests holding room end."""
        tokens = len(req.prompt_token_ids)
        # decode room frees as the requests decoding end: the (k+1)-th to end makes room for it,
        # k the requests waiting before it (the held ones too: each needs a decode worker once a
        # prefill queue frees), the first to wait too (k = 0: the soonest end). A remaining time
        # counts max_tokens while some requests stop earlier: the prediction errs long, and a
        # request it lets wait is still bounded by its budget (waiting.py), so under a decode-pool
        # overload none is served past it (issue 48: with the first waiter unpredicted, some
        # waited for decode room and were served at 18 s)
        k = len(waiting)
        ends = self.decode_ends(req.arrival)
        if not ends:
            return None
        # more waiting before it than requests decoding: past those, each room that frees is taken by
        # one of the requests waiting before it, which then decodes in its turn (one service time a
        # round, at this request's length), so a queue that outgrows the decode pool is refused too
        rounds, j = divmod(k, len(ends))
        # each room that frees is seen at its decode worker's next heartbeat: up to one interval later
        wait = heapq.nsmallest(j + 1, ends)[-1] + rounds * self.service_s(req) \
            + (k + 1) * self.cfg.heartbeat_interval
        ttft = wait + self.lead(tokens)
        code = shortage(e)
        return Shortage(ttft, code,
                        f"no decode worker has {'KV' if code == 'kv_full' else 'decode step'} room for it "
                        f"({e}); {k} requests wait for room before it, {len(ends)} decode now, and room "
                        f"for it is predicted in {wait:.1f} s")

    def service_s(self, req: Request) -> float:
        """How long a request like `req` holds its decode room: its lead to a first token, then
        max_tokens decode steps at the quickest decode worker's recent pace (else its model's)."""
        tokens = len(req.prompt_token_ids)
        steps = [d.step_s if d.step_s > 0 else d.model.step_time(max(1, d.batch), d.kv_tokens + tokens)
                 for d in self.table.view(use_ledger=self.cfg.ledger).decode]
        return self.lead(tokens) + max(1, req.sampling.max_tokens) * min(steps, default=0.0)

    def decode_ends(self, now: float) -> list[float]:
        """Seconds from `now` until each request holding decode room reaches its max_tokens, at its
        decode worker's recent step time (else its model's): one decoding, from the tokens it has
        left; one dispatched that has not started decoding (its prefill, its KV transfer), after
        what is left of its lead, from all of them. A request waiting in the queue holds none."""
        steps: dict[str, float] = {}
        for d in self.table.view(use_ledger=self.cfg.ledger).decode:
            steps[d.worker_id] = d.step_s if d.step_s > 0 else d.model.step_time(max(1, d.batch), d.kv_tokens)
        out = []
        for r in self.requests.values():
            w = r.decode_worker
            if w is None or r.done or w not in steps or r.kv_wait_until > 0:
                continue
            left = max(0, r.sampling.max_tokens - r.n_out) * steps[w]
            if r.n_out == r.resume_from and not r.prefill_done:  # on its way: its lead first
                left += max(0.0, self.lead(len(r.prompt_token_ids)) - (now - r.decided_at))
            out.append(left)
        return out

    def over_budget(self, req: Request, e: NoKvRoom, ahead: Iterable[Request], *,
                    others: tuple[int, int] = (0, 0)) -> tuple[Shortage, float, float] | None:
        """(the shortage, the budget, Retry-After in seconds) when `req` is predicted to wait past
        its budget, else None (`predict`: `others`, what waits at the other router replicas).
        Retry-After is how long the backlog takes to drain to where a request like it fits (at
        least 1 s)."""
        budget = self.budget(req)
        self.predicted = None
        if budget is None:
            return None
        s = self.predicted = self.predict(req, e, ahead, others)
        if s is None:
            return None
        # decode room frees in steps (a request's end, seen at a heartbeat), so a wait predicted
        # just inside the budget is as likely to end just past it: it keeps a margin
        limit = budget * (1.0 - ROOM_MARGIN) if s.code != "prefill_busy" else budget
        if s.ttft_s <= limit:
            return None
        return s, budget, max(1.0, math.ceil(s.ttft_s - limit))
