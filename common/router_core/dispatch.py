"""Deciding and sending one request: the policy's decision and the bookkeeping that follows it.

`Dispatcher.dispatch(req, now)` builds the request's view of the cluster (the worker table's
views with the router's ledger, minus the workers it must avoid), asks the policy, records the
work in the ledger of the worker(s) chosen, sends DecodeWork (and PrefillWork on the
disaggregated path; route "retain": one PrefillWork with `retain`, the prefill worker decodes it
itself), publishes the DecisionRecord and counts it. It raises the policy's
`NoWorkers` / `NoKvRoom` / `Hold` when the request cannot be placed now; what to do then is the
caller's (common/router_core/core.py, waiting.py, migrate.py).

The policy's decision is timed with the process's performance counter: that is a measurement of
the router's own cost, not its clock; the rules read only `now`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Protocol

import msgspec
import structlog

from common import messages as m
from common.config import RouterConfig
from common.policy import Policy, RequestSpec
from common.policy.admission import decide_without
from common.router_core.delivery import DeliveryAllowance
from common.router_core.ports import Hooks, Log, Metrics, Outbox
from common.router_core.prefix import RouterPrefix, Seen
from common.router_core.requests import Request
from common.router_core.trust import too_small
from common.router_core.workers import WorkerEntry, WorkerTable


class Sender(Protocol):
    """What dispatch asks of the rest of the router core (core.py's RouterCore is one)."""

    delivery: DeliveryAllowance  # the TBT budget less delivery: what work is planned to (delivery.py)

    def send(self, w: WorkerEntry, msg: m.Msg) -> bool:
        """To a registered worker (marked unreachable, and the work placed again, if it fails)."""


class Dispatcher:
    """Decides and sends (see the module docstring). It reads the worker table and the prefix
    index and writes their ledgers; it sends through `core` (`Sender`), publishes through the
    outbox, and tells the shell through `hooks` (`before_view`, `views_changed`)."""

    def __init__(self, cfg: RouterConfig, policy: Policy, table: WorkerTable, prefix: RouterPrefix, core: Sender, *,
                 outbox: Outbox, metrics: Metrics, hooks: Hooks, wall_offset: float = 0.0,
                 log: Log | None = None) -> None:
        self.cfg, self.policy, self.table, self.prefix = cfg, policy, table, prefix
        self.outbox, self.metrics, self.core, self.hooks = outbox, metrics, core, hooks
        self.wall_offset = wall_offset
        self.log = log if log is not None else structlog.get_logger()
        # the "decision" line is debug-level: off, its ten fields are not even built (about 4 µs a
        # request: a dropped structlog call still evaluates its arguments and binds the logger)
        self._log_decisions = cfg.log_level.lower() == "debug"
        self.routes: Counter[str] = Counter()
        self.reasons: Counter[tuple[str, str]] = Counter()

    def dispatch(self, req: Request, now: float, *, rejected: bool = False) -> None:
        """Decide and send. `rejected`: decode workers (`req.rejected_by`) turned its deflection
        away, so decide again with those closed to deflections (common/policy/admission.py),
        or, with no prefill worker live, deflect again without the admission check."""
        before_view = self.hooks.before_view
        if before_view is not None:
            before_view(now)  # (not timed: the simulator's engines, not the router's work)
        t0 = time.perf_counter()
        prompt, sampling = req.work()  # a migrated request: its prompt + the tokens sent, and the rest
        small = too_small(self.table, len(prompt))
        exclude = frozenset(req.exclude) | small if req.exclude else small
        view = self.table.view(use_ledger=self.cfg.ledger, exclude=exclude)
        if req.hash_memo_from != req.resume_from:  # migrated since: another prompt
            req.hash_memo, req.hash_memo_from, req.prefix_seen = {}, req.resume_from, Seen()
        cached, hashes = self.prefix.lookup(prompt, req.hash_memo, req.prefix_seen)
        tbt = self.core.delivery.plan_slo(req.tbt_slo)  # what its steps are planned to (delivery.py)
        allowance = req.tbt_slo - tbt  # ... and what was taken off for that (a PlanBudget moves it later)
        spec = RequestSpec(request_id=req.request_id, prompt_tokens=len(prompt),
                           max_tokens=sampling.max_tokens, ttft_slo=req.ttft_slo, tbt_slo=tbt,
                           cached_tokens=req.cached_tokens, cached=cached)
        if not rejected:
            decision = self.policy.decide(spec, view, now)
        elif view.prefill:
            decision = decide_without(self.policy, spec, view, now, frozenset(req.rejected_by))
        else:
            decision = msgspec.structs.replace(self.policy.decide(spec, view, now), step_budget_s=0.0)
        decision_us = (time.perf_counter() - t0) * 1e6
        req.decision = decision
        req.decided_at = now
        req.decision_us = decision_us
        req.decode_worker = decision.decode_worker
        req.prefill_worker = decision.prefill_worker
        req.prefill_done = decision.route == "deflect"
        remaining = max(0.1, req.deadline - now)
        dw = self.table.workers[decision.decode_worker]
        tokens = len(prompt)
        reserve = tokens + sampling.max_tokens
        if self.prefix.enabled:
            # (route "retain": one worker is both)
            req.indexed = self.prefix.dispatched([w for w in dict.fromkeys((decision.decode_worker,
                                                                             decision.prefill_worker)) if w],
                                                 hashes, tokens, decision.cached_tokens)
        no, pno = self.table.record_dispatch(decision, req.request_id, tokens, reserve, now)
        req.dispatched[decision.decode_worker] = pno if decision.route == "retain" else no
        if decision.prefill_worker and decision.route != "retain":
            req.dispatched[decision.prefill_worker] = pno
        if decision.route == "retain":  # the prefill worker keeps it and decodes it itself: no KV moves
            dw.holding.add(req.request_id)
            self.core.send(dw, m.PrefillWork(request_id=req.request_id, attempt=req.attempt, dispatch=pno,
                                             prompt_token_ids=prompt, sampling=sampling, decode_worker=dw.worker_id,
                                             deadline_s=remaining, cached_tokens=req.cached_tokens, retain=True,
                                             tbt_slo=tbt, allowance_s=allowance, resume_tokens=req.resume_from,
                                             traceparent=req.traceparent, tracestate=req.tracestate))
        elif decision.route == "deflect":
            dw.holding.add(req.request_id)
            self.core.send(dw, m.DecodeWork(request_id=req.request_id, attempt=req.attempt, dispatch=no, mode="deflect",
                                        prompt_token_ids=prompt, sampling=sampling,
                                        tbt_slo=tbt, allowance_s=allowance, deadline_s=remaining,
                                        chunk_schedule=decision.chunk_schedule, cached_tokens=req.cached_tokens,
                                        resume_tokens=req.resume_from, step_budget_s=decision.step_budget_s,
                                        model_bias=dw.bias, traceparent=req.traceparent,
                                        tracestate=req.tracestate))
        else:
            assert decision.prefill_worker is not None
            pw = self.table.workers[decision.prefill_worker]
            pw.holding.add(req.request_id)
            dw.holding.add(req.request_id)
            self.core.send(dw, m.DecodeWork(request_id=req.request_id, attempt=req.attempt, dispatch=no, mode="handoff",
                                        prompt_token_ids=prompt, sampling=sampling,
                                        tbt_slo=tbt, allowance_s=allowance, deadline_s=remaining,
                                        prefill_worker=pw.worker_id, cached_tokens=req.cached_tokens,
                                        resume_tokens=req.resume_from, traceparent=req.traceparent,
                                        tracestate=req.tracestate))
            self.core.send(pw, m.PrefillWork(request_id=req.request_id, attempt=req.attempt, dispatch=pno,
                                         prompt_token_ids=prompt, sampling=sampling,
                                         decode_worker=dw.worker_id, deadline_s=remaining,
                                         cached_tokens=req.cached_tokens, traceparent=req.traceparent,
                                         tracestate=req.tracestate))
        self.routes[decision.route] += 1
        self.reasons[(decision.route, decision.reason)] += 1
        rec = m.DecisionRecord(request_id=req.request_id, policy=self.policy.name, route=decision.route,
                               prefill_worker=decision.prefill_worker, decode_worker=decision.decode_worker,
                               reason=decision.reason, prompt_tokens=tokens,
                               ttft_prefill_pred=decision.ttft_prefill_pred,
                               ttft_decode_pred=decision.ttft_decode_pred, chunk_schedule=decision.chunk_schedule,
                               decision_us=decision_us, at=now + self.wall_offset, attempt=req.attempt,
                               client_request_id=req.client_request_id)
        self.outbox.publish(rec)
        self.metrics.observe_decision(rec)
        if self._log_decisions:
            self.log.debug("decision", request_id=req.request_id, route=decision.route, reason=decision.reason,
                           decode_worker=decision.decode_worker, prefill_worker=decision.prefill_worker,
                           ttft_p=decision.ttft_prefill_pred, ttft_d=decision.ttft_decode_pred,
                           schedule=list(decision.chunk_schedule), decision_us=round(decision_us, 1),
                           attempt=req.attempt)
        self.hooks.views_changed()
