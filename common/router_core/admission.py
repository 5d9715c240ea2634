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
    tokens of the requests waiting before it, then its own prompt, at the pool's rate (each
    prefill worker's token budget per step time at a full budget, from its performance model),
    half a prefill step (it starts at a step boundary), then the decode step that gives its first
    token (on a busy decode worker, after half of the one in flight); code `prefill_busy`;
  - no decode room (`NoKvRoom`: KV; `NoDecodeRoom`: decode step time): room frees as the
    requests decoding end; with k requests already waiting for room before it, it waits for the
    (k+1)-th of them to reach its max_tokens (at its decode worker's recent step time), then its
    own prefill and first decode step; with more waiting before it than requests decoding, each
    round of rooms past those costs one request's service time (its prefill and max_tokens
    steps); the first to wait is not predicted (it waits, bounded by `kv_wait_timeout`); code
    `kv_full` or `decode_busy`.
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


def shortage(e: NoKvRoom) -> str:
    """What is short when the policy cannot place a request now: `prefill_busy` (late binding
    holds it: the prefill queues are deep and no decode worker can prefill it in place),
    `decode_busy` (every decode worker's decode step would pass the TBT SLO) or `kv_full`."""
    if isinstance(e, Hold):
        return "prefill_busy"
    return "decode_busy" if isinstance(e, NoDecodeRoom) else "kv_full"


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
        """`req` left the router."""
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
        b = self.cfg.queue_budget
        if b < 0:
            return None
        return b if b > 0 else req.ttft_slo

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

    def predict(self, req: Request, e: NoKvRoom, ahead: Iterable[Request]) -> Shortage | None:
        """`req`'s predicted time to first token if it waits (`e`: why it cannot be placed now;
        `ahead`: the requests already waiting), or None where nothing predicts it."""
        tokens = len(req.prompt_token_ids)
        if isinstance(e, Hold):
            rate = self.prefill_rate()
            if rate <= 0:
                return None
            view = self.table.view(use_ledger=self.cfg.ledger)
            queued = sum(p.queued_tokens for p in view.prefill)
            waiting = [r for r in ahead if not r.done]
            before = sum(len(r.prompt_token_ids) for r in waiting)
            # a prompt placed on a busy prefill worker starts at its next step: half a step later on average
            half_step = 0.5 * min(p.model.prefill_exec(p.token_budget, p.token_budget) for p in view.prefill)
            ttft = (queued + before + tokens) / rate + half_step + self.first_step(tokens)
            return Shortage(ttft, "prefill_busy",
                            f"the prefill workers hold {queued} prompt tokens and {len(waiting)} requests "
                            f"({before} tokens) wait before it, at {rate:.0f} tokens/s")
        # decode room frees as the requests decoding end: the (k+1)-th to end makes room for it,
        # k the requests waiting for room before it. The first to wait is not predicted (it waits,
        # bounded by kv_wait_timeout): a remaining time counts max_tokens, while most requests
        # stop earlier, so the prediction serves to refuse a queue that grows, not the first.
        k = sum(1 for r in ahead if not r.done and not r.held)
        if k == 0:
            return None
        ends = self.decode_ends()
        if not ends:
            return None
        # more waiting before it than requests decoding: past those, each room that frees is taken by
        # one of the requests waiting before it, which then decodes in its turn (one service time a
        # round, at this request's length), so a queue that outgrows the decode pool is refused too
        rounds, j = divmod(k, len(ends))
        wait = heapq.nsmallest(j + 1, ends)[-1] + rounds * self.service_s(req)
        ttft = wait + self.alone_s(tokens) + self.first_step(tokens)
        code = shortage(e)
        return Shortage(ttft, code,
                        f"no decode worker has {'KV' if code == 'kv_full' else 'decode step'} room for it "
                        f"({e}); {k} requests wait for room before it, {len(ends)} decode now, and room "
                        f"for it is predicted in {wait:.1f} s")

    def service_s(self, req: Request) -> float:
        """How long a request like `req` holds its decode room: its prefill alone, then max_tokens
        decode steps at the quickest decode worker's recent pace (else its model's)."""
        tokens = len(req.prompt_token_ids)
        steps = [d.step_s if d.step_s > 0 else d.model.step_time(max(1, d.batch), d.kv_tokens + tokens)
                 for d in self.table.view(use_ledger=self.cfg.ledger).decode]
        return self.alone_s(tokens) + max(1, req.sampling.max_tokens) * min(steps, default=0.0)

    def decode_ends(self) -> list[float]:
        """Seconds until each request decoding now reaches its max_tokens, at its decode worker's
        recent step time (else its model's)."""
        steps: dict[str, float] = {}
        for d in self.table.view(use_ledger=self.cfg.ledger).decode:
            steps[d.worker_id] = d.step_s if d.step_s > 0 else d.model.step_time(max(1, d.batch), d.kv_tokens)
        out = []
        for r in self.requests.values():
            w = r.decode_worker
            if w is not None and r.prefill_done and not r.done and w in steps:
                out.append(max(0, r.sampling.max_tokens - r.n_out) * steps[w])
        return out

    def over_budget(self, req: Request, e: NoKvRoom, ahead: Iterable[Request]) \
            -> tuple[Shortage, float, float] | None:
        """(the shortage, the budget, Retry-After in seconds) when `req` is predicted to wait past
        its budget, else None. Retry-After is how long the backlog takes to drain to where a
        request like it fits (at least 1 s)."""
        budget = self.budget(req)
        if budget is None:
            return None
        s = self.predict(req, e, ahead)
        if s is None or s.ttft_s <= budget:
            return None
        return s, budget, max(1.0, math.ceil(s.ttft_s - budget))
