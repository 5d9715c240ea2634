"""The router core: every rule of the router, with no socket and no clock.

It owns the requests in flight and their lifecycle, the worker table with its ledgers, the
prefix index, the wait queue (waiting.py), parking and migration (migrate.py), membership
(membership.py), dispatch (dispatch.py) and the trust rules (trust.py). Its entry points take
the time (`now`, the caller's monotonic clock in seconds):

- `submit(prompt_ids, sampling, now, ...)`: admit a request (or raise the error the client gets);
- `on_message(identity, msg, now)`: a decoded message from a worker on the work socket;
- `tick(now)`: liveness, parked and waiting requests, deadlines (every heartbeat interval);
- `telemetry(now)`: worker states and counters to the monitor (once a second);
- `abort` / `stop_early` / `fail`: the HTTP layer or the shell ends a request;
- `prepare(now)`: let the policy prepare the current view ahead of the next decision.

What it sends goes through the `Outbox` it is given, what it counts through `Metrics`, and what
the shell must do (a request ended, views changed, a worker joined) through `Hooks`
(ports.py). services/router/service.py is the shell around it: sockets, HTTP, loops, clock,
signals. Tests drive it with a list for an outbox and explicit times (tests/router_fakes.py).
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from typing import Any

import structlog

from common import messages as m
from common.config import RouterConfig, parse_list
from common.errors import ConfigError, NoWorkerYet, Overloaded, ProtocolError, RequestError, Unavailable
from common.logging import Throttle
from common.perf_model import Profile, load_profile
from common.policy import (
    ConditionalConfig,
    Hold,
    KairosConfig,
    KvAwareConfig,
    NoDecodeRoom,
    NoKvRoom,
    NoWorkers,
    Policy,
    make_policy,
)
from common.router_core.admission import Admission, shortage
from common.router_core.delivery import CAP as DELIVERY_CAP
from common.router_core.delivery import DeliveryAllowance
from common.router_core.dispatch import Dispatcher
from common.router_core.inbound import Inbound
from common.router_core.membership import Membership
from common.router_core.migrate import Migration
from common.router_core.planner import Flip, RolePlanner, leader, measure
from common.router_core.ports import NULL_METRICS, Hooks, Log, Metrics, Outbox
from common.router_core.prefix import RouterPrefix
from common.router_core.requests import Event, Request
from common.router_core.trust import Gate, kv_limit, serving_limit
from common.router_core.waiting import Waiting
from common.router_core.workers import WorkerEntry, WorkerTable

NO_HOOKS = Hooks()
DELIVERY_LOG_S = 10.0  # at most one delivery_allowance line per this many seconds
# the workers hear of the allowance (PlanBudget) when it moved by this much since they last did: a
# quarter of a millisecond is the measured part's resolution (delivery.BIN_S)
DELIVERY_TELL_S = 0.00025
DROP_LOG_S = 10.0  # at most one log line per this many seconds per kind of dropped frame
# KV handshake messages whose relay to one worker failed, kept for its next Hello (at most)
RELAYS_HELD_MAX = 1024
# the codes of a request refused for overload after it waited (waiting.py: its budget ran out)
OVERLOAD_CODES = frozenset({"prefill_busy", "decode_busy", "kv_full"})
RELAY_LOG_S = 10.0  # with router replicas, a replica_relay line at most this often (when dispatches were acknowledged)


def build_policy(cfg: RouterConfig, profile: Profile) -> Policy:
    """The routing policy the settings name, with their knobs (ConfigError if they do not fit)."""
    try:
        kcfg = KairosConfig(candidates=parse_list(cfg.candidates), alpha=cfg.alpha, beta=cfg.beta,
                            transfer_term=cfg.transfer_term, max_deflections=cfg.max_deflections,
                            per_worker_models=cfg.per_worker_models, prefix_aware=cfg.prefix_aware,
                            predictor=cfg.predictor, budget_fit=cfg.budget_fit,  # type: ignore[arg-type]
                            share_expect=cfg.share_expect, late_binding=cfg.late_binding,
                            late_depth=cfg.late_depth, late_order=cfg.late_order,  # type: ignore[arg-type]
                            decode_room=cfg.decode_room, decode_beta=cfg.decode_beta, retain=cfg.retain,
                            retain_chunk=cfg.retain_chunk, retain_max=cfg.retain_max)
        ccfg = ConditionalConfig(eff_isl_threshold=cfg.eff_isl_threshold,
                                 eff_isl_ratio_threshold=cfg.eff_isl_ratio_threshold,
                                 prefill_busy_threshold=cfg.prefill_busy_threshold,
                                 decode_busy_threshold=cfg.decode_busy_threshold)
        return make_policy(cfg.policy, kairos=kcfg, conditional=ccfg, default_model=profile.model,
                           kv_aware=KvAwareConfig(overlap_weight=cfg.overlap_weight))
    except ValueError as e:
        raise ConfigError(str(e)) from e


class RouterCore:
    """See the module docstring."""

    def __init__(self, cfg: RouterConfig, outbox: Outbox, *, metrics: Metrics = NULL_METRICS,
                 hooks: Hooks = NO_HOOKS, incarnation: str | None = None, wall_offset: float = 0.0,
                 opened_at: float = 0.0, policy: Policy | None = None, profile: Profile | None = None,
                 log: Log | None = None) -> None:
        """`policy` and `profile`: the policy object and profile to run (the simulator's); by
        default those the settings name. `log`: see ports.py."""
        if cfg.replicas < 1 or not cfg.replica_stagger_ms >= 0:
            raise ConfigError(f"replicas must be 1 or more and replica_stagger_ms 0 or more (got replicas="
                              f"{cfg.replicas}, replica_stagger_ms={cfg.replica_stagger_ms})")
        self.cfg = cfg
        self.outbox, self.metrics, self.hooks = outbox, metrics, hooks
        self.log = log if log is not None else structlog.get_logger()
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.wall_offset = wall_offset  # wall-clock time = now + wall_offset
        self.opened_at = opened_at      # when the bus opened (a restarted router expects returning workers)
        self.key_ids: dict[str, str | None] = {}  # under CURVE: allowed worker key -> the worker id it is bound to
        self.profile = profile if profile is not None else load_profile(cfg.profile)
        self.policy = policy if policy is not None else build_policy(cfg, self.profile)
        self.table = WorkerTable(self.profile.model, per_worker_models=cfg.per_worker_models,
                                 bias_correction=cfg.bias_correction, me=self.incarnation)
        self.prefix = RouterPrefix(enabled=cfg.prefix_cache, max_blocks=cfg.prefix_index_blocks)
        try:  # the TBT budget less what delivery adds (delivery.py); the HTTP layer feeds the measured part
            self.delivery = DeliveryAllowance(cfg.tbt_delivery_allowance_ms / 1000.0,
                                              measured=cfg.tbt_delivery_measured)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.delivery_logged = -1.0  # the allowance (ms) the last delivery_allowance line said
        self.delivery_logged_at = -DELIVERY_LOG_S  # ... and when
        self.delivery_told = self.delivery.raw_s  # the allowance the workers last heard (PlanBudget)
        self.relay_logged_at = 0.0  # when the last replica_relay line was written (`log_relay`)
        self.relay_seen = 0  # how many relays the table had measured then
        self.requests: dict[str, Request] = {}
        self.unsent: dict[str, tuple[int, str]] = {}  # request id -> (attempt, worker) whose work send failed
        # worker -> the KV handshake messages (KvWant, KvTarget) whose relay to it failed: sent again
        # when it says Hello again (membership.py, `resend_relays`)
        self.relays_unsent: dict[str, list[m.KvWant | m.KvTarget]] = {}
        self.audit_at = 0.0  # when `tick` next checks that every request in flight has an owner
        self.counts: Counter[str] = Counter()
        self.dropped = Throttle(DROP_LOG_S)  # a line per kind of dropped frame per DROP_LOG_S at most
        self.liveness_s = cfg.liveness * cfg.heartbeat_interval
        self.gate = Gate(self.counts, metrics, log=self.log)
        self.dispatcher = Dispatcher(cfg, self.policy, self.table, self.prefix, self, outbox=outbox, metrics=metrics,
                                     hooks=hooks, wall_offset=wall_offset, log=self.log)
        self.dispatch = self.dispatcher.dispatch
        self.routes, self.reasons = self.dispatcher.routes, self.dispatcher.reasons
        # requests that ended, by the route that served them last ("none": never placed). `routes`
        # counts decisions: a request decided again (late binding holds it first, a decode worker
        # turns its deflection away, its worker is lost) counts there once per decision
        self.ended: Counter[str] = Counter()
        # the wait queue: requests waiting for KV room on a decode worker, or held by late binding
        self.waiting = Waiting(cfg, self.policy, self.table, self.counts, self, wall_offset)
        # what `tell_queue` last told the decode workers: the first waiting request (late, arrival), how many
        # wait and their prompt tokens, the first one's prompt tokens
        self.queue_told: tuple[bool, float, int, int, int] = (False, 0.0, 0, 0, 0)
        self.kv_waiting = self.waiting.queue
        self.hb_retry_at = -1e9  # when a heartbeat last decided the waiting requests again (`retry_waiting`)
        # mid-stream migration and parking: `parked`, requests that lost their worker with none left to go to
        self.migration = Migration(cfg, self.counts, self, metrics=metrics, log=self.log)
        self.parked = self.migration.parked
        self.membership = Membership(
            cfg=cfg, incarnation=self.incarnation, core=self, table=self.table, prefix=self.prefix, gate=self.gate,
            counts=self.counts, dropped=self.dropped, outbox=outbox, metrics=metrics, hooks=hooks,
            wall_offset=wall_offset, log=self.log)
        self.admission = Admission(cfg, self.table, self.requests)
        self.waiting.room_short = self.admission.room_short
        self.inbound = Inbound(self)
        # the role planner (common/router_core/planner.py): set by a shell that runs it, on the router
        # that leads (`planner.leader`); it ticks with `plan_roles`
        self.planner: RolePlanner | None = None
        self.plan_at = 0.0        # when `tick` next ticks the planner
        self.flip_at = 0.0        # when the flip under way was decided (it is abandoned after planner_flip_timeout_s)

    # ------------------------------------------------------------------ admission
    def submit(self, prompt_ids: list[int], sampling: m.Sampling, now: float, *, ttft_slo: float | None = None,
               tbt_slo: float | None = None, request_id: str | None = None, cached_tokens: int = 0,
               rid: str | None = None, block_hashes: tuple[int, list[int]] | None = None,
               client: str = "", traceparent: str = "", tracestate: str = "") -> Request:
        """Admit a request: dispatched now, or waiting in the queue. Raises Overloaded (HTTP 429:
        `max_in_flight` reached, the client's share reached, or a wait predicted past its budget;
        admission.py), Unavailable (no room and the queue is full), NoWorkerYet or RequestError
        (what no worker can serve). `rid`: its bus key (default: random); `block_hashes`: (block
        size, the prompt's block hashes) when the caller has them (the simulator's traces), else
        computed from the prompt; `client`: who sent it (its API key, else its address; "": no
        share applies); `traceparent`, `tracestate`: the trace context its work messages carry
        (common/tracing.py)."""
        if len(self.requests) >= self.cfg.max_in_flight:
            self.counts["rejected"] += 1
            self.metrics.observe_rejected("overloaded")
            raise Overloaded(f"{len(self.requests)} requests in flight (limit {self.cfg.max_in_flight})")
        if client:
            full = self.admission.client_full(client)
            if full is not None:
                self.counts["rejected_client_share"] += 1
                self.metrics.observe_rejected("client_share")
                raise Overloaded(full, code="client_share")
        self.check_limits(prompt_ids, sampling)
        # The bus key of a request: 96 random bits, so no peer can guess another's (about 0.6 us;
        # a counter is 0.3 us). The client's own id is kept as a label only.
        if rid is None:
            rid = os.urandom(12).hex()
        req = Request(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                      ttft_slo=ttft_slo or self.cfg.ttft_slo, tbt_slo=tbt_slo or self.cfg.tbt_slo,
                      arrival=now, deadline=now + self.cfg.request_timeout, cached_tokens=cached_tokens,
                      client_request_id=request_id or "", hash_memo=dict([block_hashes]) if block_hashes else {},
                      client=client, traceparent=traceparent, tracestate=tracestate)
        waiting = self.kv_waiting
        waiting.drop_done()
        try:
            head = self.waiting.blocker() if waiting else None
            if head is not None:
                # FIFO: nobody overtakes; it waits for what the first in line waits for (decode step
                # time with the decode guard, else KV), and its 429 names that, not always KV
                if head.short == "decode_busy":
                    raise NoDecodeRoom(f"requests ahead of it are waiting for decode step room ({head.wait_reason})")
                raise NoKvRoom(f"requests ahead of it are waiting for KV room ({head.wait_reason})")
            self.dispatch(req, now)
        except NoKvRoom as e:
            if not isinstance(e, Hold):
                self.admission.room_short(now)
            self.shed(req, e, now)
            if waiting.full() or self.cfg.kv_wait_timeout <= 0:
                self.counts["unavailable"] += 1
                self.metrics.observe_rejected("queue_full")
                raise Unavailable(f"cannot serve now: {e}, and {len(waiting)} requests already wait "
                                  f"for it (limit {self.cfg.kv_wait_max})", retry_after_s=1.0) from e
            self.waiting.enqueue(req, e, now, self.admission.wait_until(req))
            pred = self.admission.predicted
            self.log.info("request_waiting", request_id=rid, held=req.held, reason=str(e),
                          predicted_ttft_s=round(pred.ttft_s, 3) if pred is not None else None,
                          wait_until_s=round(req.kv_wait_until - now, 3))
        except NoWorkers as e:
            raise NoWorkerYet(f"cannot serve now: {e}", retry_after_s=1.0) from e
        self.requests[rid] = req
        if waiting:
            self.tell_queue(now)
        self.admission.started(req)
        self.metrics.set_in_flight(len(self.requests))
        self.counts["accepted"] += 1
        return req

    def shed(self, req: Request, e: NoKvRoom, now: float) -> None:
        """A new request that cannot be placed now: refuse it (Overloaded, HTTP 429) if its
        predicted time to first token is past its budget (admission.py), else return (it waits).
        With router replicas, the requests the others' queues hold (as the decode workers echo
        them) wait before it too."""
        over = self.admission.over_budget(req, e, self.kv_waiting, others=self.waiting.others_waiting(now))
        if over is None:
            return
        s, budget, retry = over
        self.counts["shed"] += 1
        self.metrics.observe_rejected(s.code)
        held = self.dropped.admit(("shed", s.code))  # one line per DROP_LOG_S per shortage, not one per refusal
        if held is not None:
            self.log.warning("overload_shed", code=s.code, predicted_ttft_s=round(s.ttft_s, 3), budget_s=budget,
                             retry_after_s=retry, why=s.why, suppressed_since_last=held)
        raise Overloaded(f"overloaded: predicted time to first token {s.ttft_s:.1f} s is over its budget of "
                         f"{budget:g} s ({'queue_budget' if self.cfg.queue_budget > 0 else 'its TTFT SLO'}): "
                         f"{s.why}; retry after {retry:g} s"
                         + (", or add prefill workers" if s.code == "prefill_busy" else ", or add decode workers"),
                         retry_after_s=retry, code=s.code) from e

    def check_limits(self, prompt_ids: list[int], sampling: m.Sampling) -> None:
        """HTTP 400 now for what no live worker can ever serve (retrying would not help)."""
        limit = serving_limit(self.table)
        if limit and len(prompt_ids) >= limit:
            self.counts["rejected_too_long"] += 1
            self.metrics.observe_rejected("too_long")
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the workers' max_model_len is {limit} "
                               f"(prompt plus at least one output token): shorten the prompt", param="prompt",
                               code="context_length_exceeded")
        kv = kv_limit(self.table)
        need = len(prompt_ids) + sampling.max_tokens
        if kv and need > kv:
            self.counts["rejected_too_long"] += 1
            self.metrics.observe_rejected("too_long")
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({sampling.max_tokens}) needs "
                               f"{need} tokens of KV cache; the largest decode worker holds {kv}: shorten the prompt "
                               "or lower max_tokens", param="max_tokens", code="context_length_exceeded")

    def prepare(self, now: float) -> None:
        """Let the policy prepare the current view (`Policy.prepare`), so that the next decision
        does only its own part; the shell calls it when its loop is free after `views_changed`."""
        policy = self.policy
        if policy.prepares:  # else no view is built for it
            policy.prepare(self.table.view(use_ledger=self.cfg.ledger), now, self.delivery.plan_slo(self.cfg.tbt_slo))

    def retry_waiting(self, now: float, heartbeat: bool = False) -> None:
        """Room may have opened for the waiting requests: decide them again, now or when the
        `room` hook says (the simulator's timing). `heartbeat`: a worker's heartbeat may show it,
        which every router replica hears at once: this replica's turn among them (waiting.py,
        `replica_turn`) may come later, through the `retry_later` hook; and a heartbeat retries at
        most once per `heartbeat_retry_ms`, the heartbeats between folded into the next retry
        (through the same hook; without it, at once)."""
        if self.hooks.room is not None:
            self.hooks.room(now)
            return
        delay = self.waiting.turn_delay(now) if heartbeat else 0.0
        if heartbeat and delay <= 0.0:  # at most one heartbeat's retry per heartbeat_retry_ms
            delay = self.hb_retry_at + self.cfg.heartbeat_retry_ms / 1000.0 - now
        if delay > 0.0 and self.hooks.retry_later is not None:
            self.hooks.retry_later(delay)
        else:
            self.retry_now(now, turn=heartbeat)

    def retry_now(self, now: float, turn: bool = False) -> None:
        """Decide the waiting requests again now (and tell the decode workers if the first changed);
        `turn`: at this replica's turn at room a heartbeat showed (`Waiting.retry`), which is the
        heartbeats' retry `heartbeat_retry_ms` counts from."""
        if turn:
            self.hb_retry_at = now
        self.waiting.retry(now, turn)
        self.tell_queue(now)

    def tell_queue(self, now: float) -> None:
        """With router replicas (`replicas` > 1): tell every decode worker when the request this
        router's wait queue would decide first changed (`Waiting.first`), or how many wait (and
        their prompt tokens); their heartbeats echo it to the other replicas, which take their
        turns at the room a heartbeat shows by the first (waiting.py, `replica_turn`) and count
        the rest before a new request of theirs when admission predicts its wait (admission.py),
        as one router's queue would have them before it."""
        if self.cfg.replicas <= 1:
            return
        late, at, tokens = self.waiting.first(now)
        waiting = self.kv_waiting
        live = [r for r in waiting if not r.done]
        told = (late, at, len(live), sum(len(r.prompt_token_ids) for r in live), tokens)
        if told == self.queue_told:
            return
        self.queue_told = told
        msg = m.QueueHead(router_incarnation=self.incarnation, late=late, oldest_at=at,
                          waiting=told[2], waiting_tokens=told[3], first_tokens=tokens)
        for w in self.table.workers.values():
            if w.role == "decode" and not w.unreachable:
                self.outbox.send(w.identity, msg)  # a worker that misses it hears the next change

    def send(self, w: WorkerEntry, msg: m.Msg) -> bool:
        """To a registered worker; False (and the worker marked unreachable) if it failed."""
        if self.outbox.send(w.identity, msg):
            return True
        # unroutable (gone, or reconnected under its id while the old connection lingered) or
        # its queue is full: nothing was queued. The next tick declares it lost, whatever it
        # still sends, and re-dispatches what it held; its next heartbeat then asks it to
        # register again. Work that was not sent is re-placed at the next tick whatever
        # happens meanwhile: the worker may register again (same incarnation) before that
        # tick, which clears `unreachable`, and would then hold a request it never received.
        rid = getattr(msg, "request_id", None)
        self.log.warning("send_to_worker_failed", worker=w.worker_id, message=type(msg).__name__,
                         **({"request_id": rid, "attempt": getattr(msg, "attempt", 0)} if rid else {}))
        w.unreachable = True
        w.touch()
        if isinstance(msg, (m.DecodeWork, m.PrefillWork)):
            self.unsent[msg.request_id] = (msg.attempt, w.worker_id)
        elif isinstance(msg, (m.KvWant, m.KvTarget)):
            held = self.relays_unsent.setdefault(w.worker_id, [])
            if len(held) < RELAYS_HELD_MAX:
                held.append(msg)
        return False

    def replace_unsent(self, now: float) -> None:
        """Re-place every request whose work could not be sent (`send`), unless something else
        already did (a later attempt: its worker was declared lost) or it ended."""
        unsent, self.unsent = self.unsent, {}
        for rid, (attempt, wid) in unsent.items():
            req = self.requests.get(rid)
            if req is None or req.done or req.attempt != attempt:
                continue
            self.counts["unsent_replaced"] += 1
            self.redispatch(req, f"its work could not be sent to worker {wid}", wid, now, never_ran=True)

    def owned(self, req: Request) -> bool:
        """Whether someone is responsible for this in-flight request: the decode worker it was
        sent to (holding it), the wait queue or the parked requests."""
        if req.kv_wait_until > 0.0 or req.request_id in self.parked:
            return True
        w = self.table.workers.get(req.decode_worker) if req.decode_worker else None
        return w is not None and req.request_id in w.holding

    # ------------------------------------------------------------------ request end states
    def release(self, req: Request) -> None:
        for wid in (req.prefill_worker, req.decode_worker):
            w = self.table.workers.get(wid) if wid else None
            if w is not None:
                w.holding.discard(req.request_id)
                w.end_deflection(req.request_id)

    def _end(self, req: Request, outcome: str, counter: str, now: float, *, cancel: bool) -> bool:
        """The bookkeeping every end of a request shares; False if it had already ended."""
        if req.done:
            return False
        req.done = True
        req.outcome = outcome
        if cancel:
            self.cancel_on_workers(req, outcome)
        self.release(req)
        self.requests.pop(req.request_id, None)
        self.admission.ended(req)
        self.counts[counter] += 1
        if self.kv_waiting and req.kv_wait_until == 0.0:
            self.retry_waiting(now)  # its KV may have freed (seen for sure at the next heartbeat)
        return True

    def finish(self, req: Request, finish_reason: str, now: float) -> None:
        if self._end(req, "ok", "completed", now, cancel=False):
            req.events.put_nowait(Event(finish_reason=finish_reason))
            self._done(req, finish_reason, now)

    def _log_failure(self, req: Request, message: str, code: str) -> None:
        """Every failure is in the log, whatever --log-requests says: an operator tracing a client's
        error finds why here (the client got the same message). Refusals for overload (a wait past
        its budget: what was short, as at the door's 429) come in storms: at most one line per
        code every DROP_LOG_S, with how many were left out."""
        held: int | None = 0
        if code in OVERLOAD_CODES:
            held = self.dropped.admit(("request_failed", code))
            if held is None:
                return
        self.log.warning("request_failed", request_id=req.request_id, client_request_id=req.client_request_id or None,
                         code=code, reason=message, attempt=req.attempt, sent_tokens=req.n_out,
                         decode_worker=req.decode_worker, prefill_worker=req.prefill_worker,
                         **({"suppressed_since_last": held} if held else {}))

    def fail(self, req: Request, message: str, code: str, now: float) -> None:
        if self._end(req, code, "failed", now, cancel=True):
            self._log_failure(req, message, code)
            req.events.put_nowait(Event(error=message, error_code=code))
            self._done(req, None, now)

    def stop_early(self, req: Request, now: float) -> None:
        """The HTTP layer found a stop string: the request is complete; stop its work."""
        if self._end(req, "ok", "completed", now, cancel=True):
            self._done(req, "stop", now)

    def abort(self, req: Request, now: float, reason: str = "client_disconnected") -> None:
        """The client went away: stop the work on the workers."""
        if self._end(req, reason, "aborted", now, cancel=True):
            self._done(req, "abort", now)

    def cancel_on_workers(self, req: Request, reason: str) -> None:
        for wid in {req.prefill_worker, req.decode_worker}:
            w = self.table.workers.get(wid) if wid else None
            if w is not None:
                self.send(w, m.Cancel(request_id=req.request_id, attempt=req.attempt, reason=reason))

    def _done(self, req: Request, finished_reason: str | None, now: float) -> None:
        rec = req.record(now, self.wall_offset)
        self.ended[rec.route or "none"] += 1
        self.outbox.publish(rec)
        self.metrics.observe_request(rec, req.gaps)
        self.metrics.set_in_flight(len(self.requests))
        self.hooks.request_done(req, finished_reason, rec)

    def redispatch(self, req: Request, why: str, bad_worker: str | None, now: float, *,
                   never_ran: bool = False) -> None:
        """Retry a request no token of which reached the client; else resume it from the last token
        the client has (`never_ran`: this attempt's work never reached a worker, so it is not
        counted against max_migrations)."""
        if req.done:
            return
        if req.streamed:
            self.migration.resume(req, why, bad_worker, now, counted=not never_ran)  # or a clear failure
            return
        if req.attempt + 1 >= self.cfg.max_attempts:
            self.fail(req, f"gave up after {req.attempt + 1} attempts (last: {why})", "retries_exhausted", now)
            return
        self.next_attempt(req, "redispatched", bad_worker)
        self.counts["redispatched"] += 1
        self.metrics.observe_redispatch()
        placed = self.dispatch_again(req, now)
        self.log.warning("request_redispatched", request_id=req.request_id, attempt=req.attempt, why=why,
                         bad_worker=bad_worker, decode_worker=req.decode_worker if placed else None,
                         prefill_worker=req.prefill_worker if placed else None,
                         **({} if placed else {"waiting": req.wait_reason or "parked"}))

    def next_attempt(self, req: Request, reason: str, bad_worker: str | None) -> None:
        """What every new attempt of a request starts with (a re-dispatch, a migration): its work
        stopped where it ran (Cancel with `reason`), its reservations there released, the worker it
        failed on avoided, its attempt number raised (later messages of the old attempt are dropped)."""
        self.cancel_on_workers(req, reason)
        self.release(req)
        if bad_worker:
            req.exclude.add(bad_worker)
        req.attempt += 1
        req.dispatched.clear()

    def dispatch_again(self, req: Request, now: float) -> bool:
        """Dispatch a request's next attempt (a re-dispatch, a migration): away from the workers it
        failed on if another can take it, else anywhere. False if it cannot be placed now; then
        `unplaced` has put it where it waits."""
        try:
            try:
                self.dispatch(req, now)
            except NoWorkers:
                req.exclude.clear()
                self.dispatch(req, now)
        except NoWorkers as e:
            self.unplaced(req, e, now)
            return False
        return True

    def unplaced(self, req: Request, e: NoWorkers, now: float) -> None:
        """The one rule for an accepted request that cannot be placed now, whatever brought it here
        (a lost worker, streaming or not; a worker's failure; a rejected deflection; a retry of the
        wait queue). The policy says why, by the exception's type:
          - `NoKvRoom` (no decode worker has room) or its kind `Hold` (late binding holds it): it
            waits in the wait queue, first in line (it came before the requests waiting there),
            decided again whenever room may have opened, up to `kv_wait_timeout`;
          - `NoWorkers` (no live worker can take it at all): it is parked (migrate.py) until a
            worker (re)registers, up to `park_timeout`.
        A request arriving with no worker registered is the shell's to hold (`Router.admit`)."""
        if isinstance(e, NoKvRoom):
            req.held, req.wait_reason, req.short = isinstance(e, Hold), str(e), shortage(e)
            req.kv_wait_until, req.wait_budget = now + self.cfg.kv_wait_timeout, 0.0  # admitted: no budget bound
            self.kv_waiting.appendleft(req)
            self.counts["kv_waited"] += 1
            self.tell_queue(now)
        else:
            self.migration.park(req, str(e), now)

    # ------------------------------------------------------------------ messages and time
    def on_message(self, identity: bytes, msg: m.RouterInbox, now: float) -> None:
        """A decoded message from the work socket, from the peer with this bus identity. One bad
        message never takes the router down: what it concerns fails, the rest goes on."""
        try:
            self.inbound.handle(identity, msg, now)
        except ProtocolError as e:
            self.log.warning("protocol_error", error=str(e))
        except Exception as e:
            self.inbound.handler_error(identity, msg, e, now)
        p = self.planner
        if p is not None and isinstance(msg, m.Hello) and msg.worker_id in self.table.workers:
            flip = p.pending
            p.rejoined(msg.worker_id, msg.role, now)  # a flipped worker back under its new role
            if flip is not None and p.pending is None:
                self.metrics.observe_role_flip_done(flip.to, now - self.flip_at)
                self.outbox.publish(m.RoleFlip(worker_id=flip.worker_id, frm=_other(flip.to), to=flip.to,
                                               reason=flip.reason, phase="done", evidence=flip.evidence,
                                               took_s=now - self.flip_at, at=now + self.wall_offset))

    def plan_roles(self, now: float) -> Flip | None:
        """The role planner's tick (every `planner.cfg.interval_s`, on the router that leads): it
        measures this router's view of the load and may move one worker to the other role, which
        it tells the worker (SetRole; the worker drains, then says Hello under its new role)."""
        p = self.planner
        if p is None or p.pending is not None:
            return None
        p.tbt_budget = self.delivery.plan_slo(self.cfg.tbt_slo)  # the step room it judges: what steps are planned to
        flip = p.observe(measure(self.table, self.kv_waiting), now)
        if flip is None:
            return None
        self.counts["role_flips"] += 1
        self.flip_at = now
        frm = self.table.workers[flip.worker_id].role
        self.metrics.observe_role_flip(frm, flip.to, flip.reason)
        self.outbox.publish(m.RoleFlip(worker_id=flip.worker_id, frm=frm, to=flip.to, reason=flip.reason,
                                       phase="started", evidence=flip.evidence, at=now + self.wall_offset))
        self.send(self.table.workers[flip.worker_id],
                  m.SetRole(role=flip.to, reason=flip.reason, router_incarnation=self.incarnation))
        return flip

    def routers_alive(self) -> set[str]:
        """This router and every router its live workers' heartbeats say they are registered with."""
        alive = {self.incarnation}
        for w in self.table.workers.values():
            if not w.unreachable and w.hb is not None:
                alive.update(w.hb.routers)
        return alive

    def tick_planner(self, now: float) -> Flip | None:
        """The role planner's turn on the live router's tick: every `interval_s`, on the router
        that leads (`planner.leader` of `routers_alive`), `plan_roles`; a flip whose worker is not
        back under its new role within planner_flip_timeout_s is abandoned (logged) so the
        planner goes on (the worker died, or its engine cannot change role)."""
        p = self.planner
        if p is None or not p.cfg.enabled or now < self.plan_at:
            return None
        self.plan_at = now + p.cfg.interval_s
        flip = p.pending
        if flip is not None:
            if now - self.flip_at > self.cfg.planner_flip_timeout_s:
                w = self.table.workers.get(flip.worker_id)
                role = w.role if w is not None else _other(flip.to)
                self.log.warning("role_flip_abandoned", worker=flip.worker_id, to=flip.to, reason=flip.reason,
                                 waited_s=round(now - self.flip_at, 1), role=role,
                                 registered=w is not None,
                                 fix="see the worker's log (role_change_refused: its engine cannot change role; "
                                     "or it died); pin it (planner_pin) to keep the planner off it")
                self.metrics.observe_role_flip_done("abandoned", now - self.flip_at)
                self.outbox.publish(m.RoleFlip(worker_id=flip.worker_id, frm=_other(flip.to), to=flip.to,
                                               reason=flip.reason, phase="abandoned", evidence=flip.evidence,
                                               took_s=now - self.flip_at, at=now + self.wall_offset))
                p.flip_done(flip.worker_id, role, now)
            return None
        if leader(self.routers_alive()) != self.incarnation:
            return None  # another router decides
        return self.plan_roles(now)

    def drop_frame(self, source: str, event: str, **fields: object) -> None:
        """A frame from the bus that cannot be used (`source`: its metric label): counted in
        kairos_bad_frames_total, and logged at most once per DROP_LOG_S per source and kind, with
        how many were dropped since the last line (a flood of junk must not drown the log)."""
        self.counts["bad_frames"] += 1
        self.metrics.observe_bad_frame(source)
        held = self.dropped.admit((source, event))
        if held is not None:
            self.log.warning(event, **fields, suppressed_since_last=held)

    def tick(self, now: float) -> None:
        """Liveness (silent workers removed, what they held re-dispatched), parked requests
        retried, waiting requests past their wait timeout and requests past their deadline failed."""
        self.membership.expire(now)
        if self.unsent:
            self.replace_unsent(now)
        self.migration.retry_parked(now)
        if self.kv_waiting:
            self.waiting.expire(now)
        self.tell_queue(now)
        for req in [r for r in self.requests.values() if now > r.deadline]:
            self.fail(req, f"deadline of {self.cfg.request_timeout:.0f}s exceeded", "deadline_exceeded", now)
        if self.planner is not None:
            self.tick_planner(now)
        if self.cfg.replicas > 1 and now - self.relay_logged_at >= RELAY_LOG_S:
            self.log_relay(now)
        if now >= self.audit_at:  # once per liveness window: a safety net, not a hot path
            self.audit_at = now + self.liveness_s
            self.audit(now)

    def log_relay(self, now: float) -> None:
        """With router replicas: the relay, how long this replica's dispatches took to be
        acknowledged in the workers' heartbeats (the latest RELAY_SAMPLES; about how long one
        replica's dispatch takes to show in the others' views), and the spacing of the replicas'
        turns it sets (waiting.py, `turn_spacing`). Only when dispatches were acknowledged since."""
        t = self.table
        self.relay_logged_at = now
        if t.relays_seen == self.relay_seen:
            return
        self.relay_seen = t.relays_seen
        xs = sorted(t.relays)
        self.log.info("replica_relay", p50_ms=round(1000 * xs[len(xs) // 2], 2), p90_ms=round(1000 * t.relay_p90(), 2),
                      max_ms=round(1000 * xs[-1], 2), samples=len(xs),
                      turn_spacing_ms=round(1000 * self.waiting.turn_spacing(), 2))

    def audit(self, now: float) -> None:
        """Every request in flight must have an owner: a worker holding it, the wait queue or the
        parked requests. One without is a bug: said loudly (`request_orphaned`), and placed again."""
        held: set[str] = set().union(*(w.holding for w in self.table.workers.values()))
        parked = self.parked
        orphans = [r for rid, r in self.requests.items()
                   if rid not in held and r.kv_wait_until == 0.0 and rid not in parked]
        for req in orphans:
            if req.done or self.owned(req):
                continue
            self.counts["orphaned"] += 1
            self.log.error("request_orphaned", request_id=req.request_id, attempt=req.attempt,
                           decode_worker=req.decode_worker, prefill_worker=req.prefill_worker)
            self.redispatch(req, "no worker, queue or park held it", None, now)

    def telemetry(self, now: float, loop_lag_ms: float = 0.0) -> None:
        d, slo = self.delivery, self.cfg.tbt_slo
        allowance = d.total_s(slo)
        self.membership.telemetry(now, loop_lag_ms, round(allowance * 1000.0, 2))
        self.tell_allowance()
        self.metrics.set_delivery_allowance(allowance)
        ms = round(allowance * 1000.0, 1)
        # a line when it moved by a millisecond or more, at most every DELIVERY_LOG_S (the gauge follows it)
        if abs(ms - self.delivery_logged) >= 1.0 and now - self.delivery_logged_at >= DELIVERY_LOG_S:
            self.delivery_logged, self.delivery_logged_at = ms, now
            say = self.log.warning if d.capped(slo) else self.log.info
            say("delivery_allowance", allowance_ms=ms, configured_ms=round(d.configured_s * 1000.0, 1),
                measured_ms=round(d.measured_s * 1000.0, 1), samples=d.samples, stalls=d.stalls,
                plan_tbt_ms=round(d.plan_slo(slo) * 1000.0, 1), tbt_slo_ms=round(slo * 1000.0, 1), capped=d.capped(slo))

    def tell_allowance(self) -> None:
        """When the delivery allowance moved: tell every worker (PlanBudget), so the requests it
        runs for this router are planned from now on as a new dispatch would be. A request keeps
        the budget of its dispatch otherwise, and in a burst after a quiet spell most of them are
        dispatched while the measured part is still rising (delivery.py). A worker that misses it
        hears the next move; what it is sent later carries the allowance in force."""
        a = self.delivery.raw_s
        if abs(a - self.delivery_told) < DELIVERY_TELL_S:
            return
        self.delivery_told = a
        msg = m.PlanBudget(router_incarnation=self.incarnation, allowance_s=a, cap=DELIVERY_CAP)
        for w in self.table.workers.values():
            if not w.unreachable and w.hello.plan_budget:
                self.outbox.send(w.identity, msg)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "router": self.incarnation,
            "in_flight": len(self.requests),
            "kv_waiting": len(self.kv_waiting),
            "held": sum(r.held for r in self.kv_waiting),  # of which held by late binding
            "counts": dict(self.counts),
            "routes": dict(self.routes),
            "ended": dict(self.ended),
            "reasons": {f"{r}:{why}": n for (r, why), n in self.reasons.items()},
            # step_margin: the measured / predicted step time its last heartbeat said it plans with (the
            # quantile a decode worker holds its chunks to; 1: none measured), step_margin_max the largest
            # since it registered; bias: what the router scales its model by (step_error.bias_factor)
            "workers": {w.worker_id: {"role": w.role, "engine": w.hello.engine, "draining": w.draining,
                                      "holding": len(w.holding),
                                      "step_margin": w.hb.step_margin if w.hb is not None else 1.0,
                                      "step_margin_max": w.margin_max, "bias": w.bias}
                        for w in self.table.workers.values()},
            "prefix": self.prefix.stats(),
            # what the decode guard leaves of the TBT SLO for delivery now (delivery.py): steps are planned to the rest
            "delivery_allowance_ms": round(self.delivery.total_s(self.cfg.tbt_slo) * 1000.0, 2),
            **({"planner": self.planner_stats()} if self.planner is not None else {}),
        }

    def planner_stats(self) -> dict[str, Any]:
        p = self.planner
        assert p is not None
        f = p.pending
        return {"enabled": p.cfg.enabled, "leads": leader(self.routers_alive()) == self.incarnation,
                "flips": dict(p.flips), "pending": None if f is None else
                {"worker": f.worker_id, "to": f.to, "reason": f.reason}}


def _other(role: m.Role) -> m.Role:
    return "prefill" if role == "decode" else "decode"
