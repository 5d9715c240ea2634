"""The router: front door and decision maker.

Binds the bus (workers connect to it), keeps the worker table from heartbeats, runs the policy
per request, sends work down the disaggregated path (PrefillWork + DecodeWork(handoff), then
KvReady when the prefill side is done) or the deflected path (DecodeWork(deflect) with the chunk
schedule), relays tokens to the HTTP layer, and publishes every decision and outcome to the
monitor. Reliability: a worker silent for liveness x interval is removed (services.router.membership,
with Hello, Goodbye and heartbeats); its requests are re-dispatched if no token reached the
client yet, else resumed on another decode worker (services.router.migrate). Every request has a
deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from typing import Any

import msgspec
import structlog

from common import codec
from common import messages as m
from common.config import RouterConfig, parse_list
from common.errors import ConfigError, NoWorkerYet, Overloaded, ProtocolError, RequestError, Unavailable
from common.logging import Throttle
from common.perf_model import load_profile
from common.policy import (
    ConditionalConfig,
    Hold,
    KairosConfig,
    KvAwareConfig,
    NoKvRoom,
    NoWorkers,
    RequestSpec,
    make_policy,
)
from common.policy.admission import REJECTED_REASON, decide_without
from common.policy.schedule import reserved_step_cost
from common.sockets import Inbox, RouterBus, fingerprint, send_nowait
from common.tokenizer import make_tokenizer
from services.router import metrics, vllm_metrics
from services.router.membership import Membership
from services.router.migrate import Migration
from services.router.openai_tools import ToolCalling
from services.router.prefix import RouterPrefix
from services.router.requests import Event, Request
from services.router.trust import Gate, kv_limit, serving_limit, too_small
from services.router.waiting import Waiting
from services.router.workers import LedgerEntry, WorkerEntry, WorkerTable

log = structlog.get_logger()


DROP_LOG_S = 10.0  # at most one log line per this many seconds per kind of dropped frame


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        # the request_done line: at info level when asked (--log-requests), else at debug level
        # (written only under --log-level debug; its fields are not even computed otherwise)
        self._request_line = "info" if cfg.log_requests else "debug" if cfg.log_level.lower() == "debug" else ""
        self.incarnation = uuid.uuid4().hex[:12]
        self.profile = load_profile(cfg.profile)
        try:
            kcfg = KairosConfig(candidates=parse_list(cfg.candidates), alpha=cfg.alpha, beta=cfg.beta,
                                transfer_term=cfg.transfer_term, max_deflections=cfg.max_deflections,
                                per_worker_models=cfg.per_worker_models, prefix_aware=cfg.prefix_aware,
                                predictor=cfg.predictor, budget_fit=cfg.budget_fit,  # type: ignore[arg-type]
                                share_expect=cfg.share_expect, late_binding=cfg.late_binding,
                                late_depth=cfg.late_depth, late_order=cfg.late_order)  # type: ignore[arg-type]
            ccfg = ConditionalConfig(eff_isl_threshold=cfg.eff_isl_threshold,
                                     eff_isl_ratio_threshold=cfg.eff_isl_ratio_threshold,
                                     prefill_busy_threshold=cfg.prefill_busy_threshold,
                                     decode_busy_threshold=cfg.decode_busy_threshold)
            self.policy = make_policy(cfg.policy, kairos=kcfg, conditional=ccfg,
                                      default_model=self.profile.model,
                                      kv_aware=KvAwareConfig(overlap_weight=cfg.overlap_weight))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.tokenizer = make_tokenizer(cfg.tokenizer)
        self.tool_calling: ToolCalling | None = None
        if cfg.tool_call_parser:
            self.tool_calling = ToolCalling(cfg.tool_call_parser, cfg.enable_auto_tool_choice, cfg.tokenizer,
                                            cfg.served_model_name)
        self.table = WorkerTable(self.profile.model, per_worker_models=cfg.per_worker_models,
                                 bias_correction=cfg.bias_correction, me=self.incarnation)
        self.prefix = RouterPrefix(enabled=cfg.prefix_cache, max_blocks=cfg.prefix_index_blocks)
        self.requests: dict[str, Request] = {}
        # the policy's view work, done when views change rather than in the next decision (`prepare_soon`)
        self._prepare = getattr(self.policy, "prepare", None)
        self._prepare_queued = False
        self._prepared_at = -1.0  # monotonic time of the last `prepare`
        self.counts: Counter[str] = Counter()
        # the wait queue (services/router/waiting.py): requests waiting for KV room on a decode
        # worker, or held by late binding; `kv_waiting` is its FIFO
        self.waiting = Waiting(cfg, self.policy, self.table, self.counts, dispatch=lambda req: self._dispatch(req),
                               fail=lambda req, message, code: self._fail(req, message, code=code))
        self.kv_waiting = self.waiting.queue
        # mid-stream migration and parking (services/router/migrate.py); `parked`: requests that
        # lost their worker with none left to go to
        self.migration = Migration(cfg, self.counts, dispatch=lambda req: self._dispatch(req),
                                   finish=lambda req, reason: self._finish(req, reason),
                                   fail=lambda req, message, code: self._fail(req, message, code=code),
                                   cancel_on_workers=lambda req, why: self._cancel_on_workers(req, why),
                                   release=lambda req: self._release(req))
        self.parked = self.migration.parked
        self._dropped = Throttle(DROP_LOG_S)  # a line per kind of dropped frame per DROP_LOG_S at most
        self.routes: Counter[str] = Counter()
        self.reasons: Counter[tuple[str, str]] = Counter()
        self.bus: RouterBus | None = None
        self.stop = asyncio.Event()
        self.accepting = True
        self.leaving = False  # after SIGTERM: /ready says 503, each response closes its connection (see __main__)
        self.liveness_s = cfg.liveness * cfg.heartbeat_interval
        self._inbox: Inbox | None = None
        self._opened_at = time.monotonic()
        self.gate = Gate(self.counts)
        # Hello, Goodbye, heartbeats, liveness and telemetry (services/router/membership.py)
        self.membership = Membership(
            cfg=cfg, incarnation=self.incarnation, table=self.table, prefix=self.prefix, gate=self.gate,
            counts=self.counts, requests=self.requests, waiting=self.waiting, migration=self.migration,
            dropped=self._dropped, send=lambda w, msg: self._send(w, msg), work_send=lambda f: self._work_send(f),
            publish=lambda msg: self._publish(msg), fail=lambda req, message, code: self._fail(req, message, code=code),
            redispatch=lambda req, why, bad: self._redispatch(req, why, bad),
            retry_waiting=lambda: self._retry_kv_waiting(), prepare_soon=lambda: self.prepare_soon(),
            drop_frame=lambda *a, **kw: self.drop_frame(*a, **kw), liveness_s=self.liveness_s)
        vllm_metrics.attach(self)  # vLLM's gauges on /metrics read this router

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        self.bus = RouterBus(self.cfg, on_key_refused=self._on_key_refused)
        self._opened_at = time.monotonic()
        log.info("router_bus_bound", work=self.cfg.work_port, telemetry=self.cfg.telemetry_port,
                 policy=self.policy.name, incarnation=self.incarnation, curve=bool(self.cfg.curve_keys_dir),
                 worker_keys=len(self.bus.key_ids))
        if not self.cfg.curve_keys_dir:
            log.warning("bus_insecure", detail="CURVE is off: anyone who reaches the work port can register as a "
                        "worker and serve clients' prompts, and anyone who reaches the telemetry port reads it; "
                        "set KAIROS_CURVE_KEYS_DIR (kairos keys DIR) on every service")
        shared = sorted(fingerprint(k) for k, wid in self.bus.key_ids.items() if wid is None)
        if shared:
            log.warning("shared_worker_key", keys=shared, detail="these allowed worker keys are bound to no "
                        "worker id: a holder of one may register as any worker; make one key per worker with "
                        "`kairos keys DIR --add --workers ID,...` and delete the shared one from allowed/worker/")

    def _on_key_refused(self, domain: str, key: str, address: str) -> None:
        """The bus refused a CURVE key at the handshake (unknown, or another role's)."""
        self.counts["keys_refused"] += 1
        metrics.observe_dropped(f"{domain}_key_refused")
        held = self._dropped.admit(("key_refused", domain, key))
        if held is not None:
            log.warning("bus_key_refused", socket=domain, key=fingerprint(key), address=address,
                        detail=f"a CURVE key not in allowed/{domain}/ tried to connect", suppressed_since_last=held)

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()
            self.bus = None

    def loops(self) -> list[tuple[str, Any]]:
        return [("work", self._work_loop()), ("liveness", self.membership.liveness_loop()),
                ("telemetry", self.membership.telemetry_loop())]

    async def drain(self, timeout: float) -> None:
        """Stop intake, then wait for in-flight requests to finish (bounded)."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self.requests.values()):
            self._fail(req, "router shutting down", code="router_shutdown")

    # ------------------------------------------------------------------ admission and dispatch
    def submit(self, prompt_ids: list[int], sampling: m.Sampling, *, ttft_slo: float | None = None,
               tbt_slo: float | None = None, request_id: str | None = None, cached_tokens: int = 0) -> Request:
        if not self.accepting:
            metrics.observe_rejected("shutting_down")
            raise Unavailable("router is shutting down", retry_after_s=2.0)
        if len(self.requests) >= self.cfg.max_in_flight:
            self.counts["rejected"] += 1
            metrics.observe_rejected("overloaded")
            raise Overloaded(f"{len(self.requests)} requests in flight (limit {self.cfg.max_in_flight})")
        self._check_limits(prompt_ids, sampling)
        # The bus key of a request: 96 random bits, so no peer can guess another's (about 0.6 us;
        # a counter is 0.3 us). The client's own id is kept as a label only.
        rid = os.urandom(12).hex()
        now = time.monotonic()
        req = Request(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                      ttft_slo=ttft_slo or self.cfg.ttft_slo, tbt_slo=tbt_slo or self.cfg.tbt_slo,
                      arrival=now, deadline=now + self.cfg.request_timeout, cached_tokens=cached_tokens,
                      client_request_id=request_id or "")
        while self.kv_waiting and self.kv_waiting[0].done:  # aborted while waiting
            self.kv_waiting.popleft()
        try:
            if self.kv_waiting and self.waiting.blocked():
                raise NoKvRoom("requests ahead of it are waiting for KV room")  # FIFO: nobody overtakes
            self._dispatch(req)
        except NoKvRoom as e:
            if self.kv_waiting.full() or self.cfg.kv_wait_timeout <= 0:
                self.counts["unavailable"] += 1
                metrics.observe_rejected("no_kv_room")
                raise Unavailable(f"cannot serve now: {e}, and {len(self.kv_waiting)} requests already wait "
                                  f"for it (limit {self.cfg.kv_wait_max})", retry_after_s=1.0) from e
            self.waiting.enqueue(req, e, now)
        except NoWorkers as e:
            raise NoWorkerYet(f"cannot serve now: {e}", retry_after_s=1.0) from e
        self.requests[rid] = req
        metrics.set_in_flight(len(self.requests))
        self.counts["accepted"] += 1
        return req

    async def admit(self, prompt_ids: list[int], sampling: m.Sampling, *, ttft_slo: float | None = None,
                    tbt_slo: float | None = None, request_id: str | None = None, cached_tokens: int = 0) -> Request:
        """`submit`, but when no worker can take the request yet (the router just restarted and the
        workers are re-registering, or they are all restarting), hold it up to `worker_wait`
        seconds for one to register instead of answering 503 at once."""
        deadline = time.monotonic() + self.cfg.worker_wait
        held = False
        while True:
            try:
                req = self.submit(prompt_ids, sampling, ttft_slo=ttft_slo, tbt_slo=tbt_slo, request_id=request_id,
                                  cached_tokens=cached_tokens)
            except NoWorkerYet:
                left = deadline - time.monotonic()
                if left <= 0 or not self.accepting:
                    self.counts["unavailable"] += 1
                    metrics.observe_rejected("no_worker")
                    if held:
                        metrics.observe_held("timeout")
                    raise
                held = True
                joined = self.membership.workers_joined
                try:
                    await asyncio.wait_for(joined.wait(), timeout=left)
                except TimeoutError:
                    pass
                continue
            if held:
                metrics.observe_held("served")
            return req

    def _check_limits(self, prompt_ids: list[int], sampling: m.Sampling) -> None:
        """HTTP 400 now for what no live worker can ever serve (retrying would not help)."""
        limit = serving_limit(self.table)
        if limit and len(prompt_ids) >= limit:
            self.counts["rejected_too_long"] += 1
            metrics.observe_rejected("too_long")
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the workers' max_model_len is {limit} "
                               f"(prompt plus at least one output token): shorten the prompt", param="prompt",
                               code="context_length_exceeded")
        kv = kv_limit(self.table)
        need = len(prompt_ids) + sampling.max_tokens
        if kv and need > kv:
            self.counts["rejected_too_long"] += 1
            metrics.observe_rejected("too_long")
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({sampling.max_tokens}) needs "
                               f"{need} tokens of KV cache; the largest decode worker holds {kv}: shorten the prompt "
                               "or lower max_tokens", param="max_tokens", code="context_length_exceeded")

    def prepare_soon(self) -> None:
        """A worker's view changed (a heartbeat, a dispatch): have the policy prepare the new
        view once the loop is free (`Kairos.prepare`), so that the next request's decision does
        only its own part. Coalesced, and at most once per `prepare_interval_ms`: a large fleet's
        heartbeats arrive spread out (2,560 a second from 256 workers), and preparing after each
        one costs the whole fleet's views each time; a decision that comes first does the work
        for what changed since itself."""
        if self._prepare is None or self._prepare_queued:
            return
        self._prepare_queued = True
        wait = self._prepared_at + self.cfg.prepare_interval_ms / 1000.0 - time.monotonic()
        loop = asyncio.get_running_loop()
        if wait > 0:
            loop.call_later(wait, self._prepare_now)
        else:
            loop.call_soon(self._prepare_now)

    def _prepare_now(self) -> None:
        self._prepare_queued = False
        if self._prepare is not None:
            now = self._prepared_at = time.monotonic()
            self._prepare(self.table.view(use_ledger=self.cfg.ledger), now, self.cfg.tbt_slo)

    def _retry_kv_waiting(self) -> None:
        """Decide the waiting requests again (services/router/waiting.py): called on heartbeats,
        a deflection's first token and a request's end, i.e. when room may have opened."""
        self.waiting.retry()

    def _dispatch(self, req: Request, *, rejected: bool = False) -> None:
        """Decide and send. `rejected`: decode workers (`req.rejected_by`) turned its deflection
        away, so decide again with those closed to deflections (common/policy/admission.py),
        or, with no prefill worker live, deflect again without the admission check."""
        t0 = time.perf_counter()
        prompt, sampling = req.work()  # a migrated request: its prompt + the tokens sent, and the rest
        exclude = frozenset(req.exclude) | too_small(self.table, len(prompt))
        view = self.table.view(use_ledger=self.cfg.ledger, exclude=exclude)
        cached, hashes = self.prefix.lookup(prompt)
        spec = RequestSpec(request_id=req.request_id, prompt_tokens=len(prompt),
                           max_tokens=sampling.max_tokens, ttft_slo=req.ttft_slo, tbt_slo=req.tbt_slo,
                           cached_tokens=req.cached_tokens, cached=cached)
        if not rejected:
            decision = self.policy.decide(spec, view, time.monotonic())
        elif view.prefill:
            decision = decide_without(self.policy, spec, view, time.monotonic(), frozenset(req.rejected_by))
        else:
            decision = msgspec.structs.replace(self.policy.decide(spec, view, time.monotonic()), step_budget_s=0.0)
        decision_us = (time.perf_counter() - t0) * 1e6
        req.decision = decision
        req.decided_at = time.monotonic()
        req.decode_worker = decision.decode_worker
        req.prefill_worker = decision.prefill_worker
        req.prefill_done = decision.route == "deflect"
        remaining = max(0.1, req.deadline - time.monotonic())
        dw = self.table.workers[decision.decode_worker]
        tokens = len(prompt)
        reserve = tokens + sampling.max_tokens
        work = tokens - decision.cached_tokens  # what the prefilling worker computes, as the index knows
        if self.prefix.enabled:
            self.prefix.dispatched([w for w in (decision.decode_worker, decision.prefill_worker) if w], hashes,
                                   tokens, decision.cached_tokens)
        if decision.route == "deflect":
            no = dw.next_dispatch(LedgerEntry(req.request_id, work, reserve, deflect=True))
            dw.add_deflection(req.request_id,
                              reserved_step_cost(dw.model, decision.chunk_schedule, dw.hello.token_budget,
                                                 decision.cached_tokens),
                              max(decision.chunk_schedule, default=0),
                              time.monotonic() + (decision.ttft_decode_pred or 0.0))
            dw.holding.add(req.request_id)
            self._send(dw, m.DecodeWork(request_id=req.request_id, attempt=req.attempt, dispatch=no, mode="deflect",
                                        prompt_token_ids=prompt, sampling=sampling,
                                        tbt_slo=req.tbt_slo, deadline_s=remaining,
                                        chunk_schedule=decision.chunk_schedule, cached_tokens=req.cached_tokens,
                                        resume_tokens=req.resume_from, step_budget_s=decision.step_budget_s,
                                        model_bias=dw.bias))
        else:
            assert decision.prefill_worker is not None
            pw = self.table.workers[decision.prefill_worker]
            pno = pw.next_dispatch(LedgerEntry(req.request_id, work, 0, deflect=False, at=time.monotonic()))
            dno = dw.next_dispatch(LedgerEntry(req.request_id, tokens, reserve, deflect=False))
            pw.holding.add(req.request_id)
            dw.holding.add(req.request_id)
            self._send(dw, m.DecodeWork(request_id=req.request_id, attempt=req.attempt, dispatch=dno, mode="handoff",
                                        prompt_token_ids=prompt, sampling=sampling,
                                        tbt_slo=req.tbt_slo, deadline_s=remaining,
                                        prefill_worker=pw.worker_id, cached_tokens=req.cached_tokens,
                                        resume_tokens=req.resume_from))
            self._send(pw, m.PrefillWork(request_id=req.request_id, attempt=req.attempt, dispatch=pno,
                                         prompt_token_ids=prompt, sampling=sampling,
                                         decode_worker=dw.worker_id, deadline_s=remaining,
                                         cached_tokens=req.cached_tokens))
        self.routes[decision.route] += 1
        self.reasons[(decision.route, decision.reason)] += 1
        rec = m.DecisionRecord(request_id=req.request_id, policy=self.policy.name, route=decision.route,
                               prefill_worker=decision.prefill_worker, decode_worker=decision.decode_worker,
                               reason=decision.reason, prompt_tokens=tokens,
                               ttft_prefill_pred=decision.ttft_prefill_pred,
                               ttft_decode_pred=decision.ttft_decode_pred, chunk_schedule=decision.chunk_schedule,
                               decision_us=decision_us, at=time.time(), attempt=req.attempt,
                               client_request_id=req.client_request_id)
        self._publish(rec)
        metrics.observe_decision(rec)
        log.debug("decision", request_id=req.request_id, route=decision.route, reason=decision.reason,
                  decode_worker=decision.decode_worker, prefill_worker=decision.prefill_worker,
                  ttft_p=decision.ttft_prefill_pred, ttft_d=decision.ttft_decode_pred,
                  schedule=list(decision.chunk_schedule), decision_us=round(decision_us, 1), attempt=req.attempt)
        self.prepare_soon()

    def _send(self, w: WorkerEntry, msg: m.Msg) -> None:
        assert self.bus is not None
        if not self._work_send([w.identity, codec.encode(msg)]):
            # unroutable (gone, or reconnected under its id while the old connection lingered) or
            # its queue is full: nothing was queued. The liveness loop declares it lost at its next
            # tick, whatever it still sends, and re-dispatches what it held; its next heartbeat
            # then asks it to register again.
            log.warning("send_to_worker_failed", worker=w.worker_id, message=type(msg).__name__)
            w.unreachable = True
            w.touch()

    def _publish(self, msg: m.Msg) -> None:
        if self.bus is not None:
            self.bus.publish(codec.encode(msg))

    # ------------------------------------------------------------------ request end states
    def _release(self, req: Request) -> None:
        for wid in (req.prefill_worker, req.decode_worker):
            w = self.table.workers.get(wid) if wid else None
            if w is not None:
                w.holding.discard(req.request_id)
                w.end_deflection(req.request_id)

    def _end(self, req: Request, outcome: str, counter: str, *, cancel: bool) -> bool:
        """The bookkeeping every end of a request shares; False if it had already ended."""
        if req.done:
            return False
        req.done = True
        req.outcome = outcome
        if cancel:
            self._cancel_on_workers(req, outcome)
        self._release(req)
        self.requests.pop(req.request_id, None)
        self.counts[counter] += 1
        if self.kv_waiting and req.kv_wait_until == 0.0:
            self._retry_kv_waiting()  # its KV may have freed (seen for sure at the next heartbeat)
        return True

    def _finish(self, req: Request, finish_reason: str) -> None:
        if self._end(req, "ok", "completed", cancel=False):
            req.events.put_nowait(Event(finish_reason=finish_reason))
            self._log_done(req, finish_reason)

    def _fail(self, req: Request, message: str, *, code: str) -> None:
        if self._end(req, code, "failed", cancel=True):
            req.events.put_nowait(Event(error=message, error_code=code))
            self._log_done(req)

    def stop_early(self, req: Request) -> None:
        """The HTTP layer found a stop string: the request is complete; stop its work."""
        if self._end(req, "ok", "completed", cancel=True):
            self._log_done(req, "stop")

    def abort(self, req: Request, reason: str = "client_disconnected") -> None:
        """The client went away: stop the work on the workers."""
        if self._end(req, reason, "aborted", cancel=True):
            self._log_done(req, "abort")

    def _cancel_on_workers(self, req: Request, reason: str) -> None:
        for wid in {req.prefill_worker, req.decode_worker}:
            w = self.table.workers.get(wid) if wid else None
            if w is not None:
                self._send(w, m.Cancel(request_id=req.request_id, attempt=req.attempt, reason=reason))

    def _log_done(self, req: Request, finished_reason: str | None = None) -> None:
        rec = req.record()
        self._publish(rec)
        metrics.observe_request(rec, req.gaps)
        vllm_metrics.observe_finished(self.cfg.served_model_name, req, finished_reason)
        metrics.set_in_flight(len(self.requests))
        if not self._request_line:
            return
        write = log.info if self._request_line == "info" else log.debug
        write("request_done", request_id=req.request_id, client_request_id=req.client_request_id or None,
              route=rec.route, reason=rec.reason,
              prefill_worker=rec.prefill_worker, decode_worker=rec.decode_worker,
              prompt_tokens=rec.prompt_tokens, output_tokens=rec.output_tokens,
              ttft_s=round(rec.ttft_s, 4) if rec.ttft_s is not None else None,
              ttft_pred_s=round(rec.ttft_pred_s, 4) if rec.ttft_pred_s is not None else None,
              tbt_p50_s=rec.tbt_p50_s and round(rec.tbt_p50_s, 4),
              tbt_p99_s=rec.tbt_p99_s and round(rec.tbt_p99_s, 4), e2e_s=round(rec.e2e_s, 4),
              outcome=rec.outcome, attempts=rec.attempts, migrations=rec.migrations, kv_fallback=rec.kv_fallback)

    def _redispatch(self, req: Request, why: str, bad_worker: str | None) -> None:
        """Retry a request no token of which reached the client; else fail it clearly."""
        if req.done:
            return
        if req.streamed:
            self.migration.resume(req, why, bad_worker)  # on another decode worker, or a clear failure
            return
        if req.attempt + 1 >= self.cfg.max_attempts:
            self._fail(req, f"gave up after {req.attempt + 1} attempts (last: {why})", code="retries_exhausted")
            return
        self._cancel_on_workers(req, "redispatched")
        self._release(req)
        if bad_worker:
            req.exclude.add(bad_worker)
        req.attempt += 1
        self.counts["redispatched"] += 1
        metrics.observe_redispatch()
        log.warning("request_redispatched", request_id=req.request_id, attempt=req.attempt, why=why,
                    bad_worker=bad_worker)
        try:
            self._dispatch(req)
        except NoWorkers:
            req.exclude.clear()
            try:
                self._dispatch(req)
            except NoKvRoom as e:
                # e.g. a decode worker refused it for KV room the views did not show: wait for room, first in line
                req.held, req.wait_reason = isinstance(e, Hold), str(e)
                req.kv_wait_until = time.monotonic() + self.cfg.kv_wait_timeout
                self.kv_waiting.appendleft(req)
                self.counts["kv_waited"] += 1
            except NoWorkers as e:
                self.migration.park(req, str(e))  # until a worker (re)registers, or a clear failure

    # ------------------------------------------------------------------ inbox: work socket
    def _work_send(self, frames: list[bytes]) -> bool:
        if self._inbox is not None:
            return self._inbox.send(frames)
        assert self.bus is not None
        return send_nowait(self.bus.work, frames)  # before the loops start

    async def _work_loop(self) -> None:
        assert self.bus is not None
        self._inbox = Inbox(self.bus.work, self._on_work_frames, keyed=bool(self.cfg.curve_keys_dir))
        try:
            await self._inbox.failed  # the reader callback does the work; this ends only on a bug
        finally:
            self._inbox.close()
            self._inbox = None

    def drop_frame(self, source: str, event: str, **fields: object) -> None:
        """A frame from the bus that cannot be used (`source`: its metric label): counted in
        kairos_bad_frames_total, and logged at most once per DROP_LOG_S per source and kind, with
        how many were dropped since the last line (a flood of junk must not drown the log)."""
        self.counts["bad_frames"] += 1
        metrics.observe_bad_frame(source)
        held = self._dropped.admit((source, event))
        if held is not None:
            log.warning(event, **fields, suppressed_since_last=held)

    def _on_work_frames(self, frames: list[bytes], key: str | None = None) -> None:
        """A message from the work socket; `key`: the sender's CURVE public key (None without CURVE)."""
        if len(frames) != 2:
            self.drop_frame("work", "bad_frame_dropped", socket="work", frames=len(frames))
            return
        identity, payload = frames
        try:
            msg = codec.router_inbox.decode(payload)
        except codec.DecodeError as e:
            self.drop_frame("work", "bad_frame_dropped", socket="work", error=str(e)[:200], bytes=len(payload))
            return
        self.gate.key = key
        if key is not None and not self._key_may_speak(identity, key, msg):
            return
        try:
            self._on_work_message(identity, msg)
        except ProtocolError as e:
            log.warning("protocol_error", error=str(e))
        except Exception as e:  # one bad message must not take the router down
            self._on_handler_error(identity, msg, e)

    def _key_may_speak(self, identity: bytes, key: str, msg: m.RouterInbox) -> bool:
        """Under CURVE: a Hello only under the id its key is bound to (or any, for a shared key);
        any other message only under the key its connection registered with."""
        assert self.bus is not None
        if isinstance(msg, m.Hello):
            bound = self.bus.key_ids.get(key)
            if bound is not None and bound != msg.worker_id:
                self.membership.refuse(identity, msg, f"key: the key this worker connected with ({fingerprint(key)}) "
                                  f"is bound to worker {bound!r}, not {msg.worker_id!r}: give each worker its own key "
                                  "(kairos keys) or set KAIROS_CURVE_KEY_NAME")
                return False
            return True
        w = self.table.workers.get(identity.decode(errors="replace"))
        if w is not None and w.key is not None and w.key != key:
            self.gate.drop(identity, "message_from_another_key", msg)
            return False
        return True

    def _on_work_message(self, identity: bytes, msg: m.RouterInbox) -> None:
        if isinstance(msg, m.Hello):
            self.membership.on_hello(identity, msg)
            return
        if isinstance(msg, (m.PrefillHeartbeat, m.DecodeHeartbeat)):
            self.membership.on_heartbeat(identity, msg)
            return
        w = self._trusted_sender(identity, msg)
        if w is None:
            return
        match msg:
            case m.TokenBatch():
                self._on_tokens(msg, w)
            case m.PrefillDone():
                self._on_prefill_done(msg, w)
            case m.RequestFailed():
                self._on_failed(msg, w)
            case m.KvTarget():
                self._relay(msg, w, to="prefill")
            case m.KvWant():
                self._relay(msg, w, to="decode")
            case m.Goodbye():
                self.membership.on_goodbye(msg, w)
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} on the work socket")

    def _returning(self, worker_id: str) -> bool:
        """Whether a message from an unregistered `worker_id` is an ordinary recovery, not a stray
        peer: a worker this router saw leave or lose (its last messages, before it says Hello again),
        any worker in this router's first two liveness windows (a restarted router: the workers'
        in-flight messages), or, under CURVE, one whose key is bound to that very id."""
        if worker_id in self.table.former or time.monotonic() - self._opened_at < 2 * self.liveness_s:
            return True
        key = self.gate.key
        return key is not None and self.bus is not None and self.bus.key_ids.get(key) == worker_id

    # -- trust: who may send what (every message but Hello comes from a registered worker, bound to
    # the ZeroMQ identity it registered with, and concerns only requests assigned to it)
    def _trusted_sender(self, identity: bytes, msg: m.Msg) -> WorkerEntry | None:
        wid = identity.decode(errors="replace")
        w = self.table.workers.get(wid)
        if w is None or w.identity != identity:
            self.gate.drop(identity, "unregistered_peer", msg, routine=self._returning(wid))
            return None
        claimed = getattr(msg, "worker_id", None)
        if claimed is not None and claimed != w.worker_id:
            self.gate.drop(identity, "worker_id_mismatch", msg)
            return None
        return w

    def _assigned(self, w: WorkerEntry, req: Request, msg: m.Msg, *, role: m.Role | None = None) -> bool:
        """Whether `req` is assigned to `w` (in `role`, if given); if not, drop `msg`, counted."""
        if role != "decode" and req.prefill_worker == w.worker_id:
            return True
        if role != "prefill" and req.decode_worker == w.worker_id:
            return True
        self.gate.drop(w.identity, "not_assigned", msg, req.request_id)
        return False

    def _on_handler_error(self, identity: bytes, msg: m.Msg, e: Exception) -> None:
        """A message we failed to handle (a bug, or input we did not foresee): fail the one request
        it concerns, if it is that sender's, and keep serving."""
        self.counts["handler_errors"] += 1
        metrics.observe_bad_frame("work_handler")
        rid = getattr(msg, "request_id", None)
        log.error("message_handler_failed", message=type(msg).__name__, request_id=rid,
                  peer=identity.decode(errors="replace")[:64], error=f"{type(e).__name__}: {e}"[:300],
                  exc_info=True)
        req = self.requests.get(rid) if isinstance(rid, str) else None
        w = self.table.workers.get(identity.decode(errors="replace"))
        if req is not None and w is not None and w.identity == identity and \
                w.worker_id in (req.prefill_worker, req.decode_worker):
            try:
                self._fail(req, f"internal error handling {type(msg).__name__} from {w.worker_id}",
                           code="internal_error")
            except Exception as e2:  # already failing: log, never take the router down
                log.error("fail_after_handler_error_failed", request_id=rid, error=f"{type(e2).__name__}: {e2}"[:300])

    def _on_tokens(self, b: m.TokenBatch, w: WorkerEntry) -> None:
        now = time.monotonic()
        reqs = self.requests
        w.last_seen = now
        for i, rid in enumerate(b.kv_fallback):
            r = reqs.get(rid)
            if r is not None and self._assigned(w, r, b, role="decode"):
                r.kv_fallback = True
                if i < len(b.kv_fallback_reasons):
                    r.kv_error = r.kv_error or b.kv_fallback_reasons[i]
                self.counts["kv_fallbacks"] += 1
                metrics.observe_kv_fallback()
        wid = w.worker_id
        freed = False  # a deflection slot: held requests (late binding) may fit now
        for it in b.items:
            req = reqs.get(it.request_id)
            if req is not None and req.decode_worker != wid:  # not (or no longer) this worker's
                self.gate.drop(w.identity, "not_assigned", b, it.request_id)
                if it.finish_reason is None:  # e.g. it woke up after the request moved on: stop it there
                    self._send(w, m.Cancel(request_id=it.request_id, attempt=it.attempt, reason="not_assigned"))
                continue
            if req is None or req.attempt != it.attempt or req.done:
                if it.finish_reason is None:  # a stale attempt still running there
                    self._send(w, m.Cancel(request_id=it.request_id, attempt=it.attempt, reason="stale_attempt"))
                continue
            if req.n_out == req.resume_from:  # this attempt's first token: its prefill is over, its KV read
                if w.end_deflection(req.request_id):
                    freed = True
                self._kv_consumed(req)
            if req.first_token_at is None:
                req.first_token_at = now
            else:
                req.gaps.append(now - req.last_token_at)
            req.last_token_at = now
            if it.cached_tokens is not None and req.engine_cached is None:
                req.engine_cached, req.engine_created = it.cached_tokens, it.cache_created_tokens
            req.n_out += len(it.token_ids)
            req.out_ids += it.token_ids
            req.events.put_nowait(Event(token_ids=it.token_ids, logprobs=it.logprobs,
                                        prompt_logprobs=it.prompt_logprobs))
            if it.finish_reason is not None:
                self._finish(req, it.finish_reason)
        if freed and self.kv_waiting:
            self._retry_kv_waiting()

    def _on_prefill_done(self, p: m.PrefillDone, pw: WorkerEntry) -> None:
        req = self.requests.get(p.request_id)
        if req is not None and not self._assigned(pw, req, p, role="prefill"):
            return
        metrics.observe_prefill_done(p)
        pw.holding.discard(p.request_id)
        pw.last_seen = time.monotonic()
        if req is None or req.attempt != p.attempt or req.done:
            return
        req.prefill_done = True
        req.prefill = p
        if p.prompt_logprobs:
            req.events.put_nowait(Event(prompt_logprobs=p.prompt_logprobs))
        if p.kv_error:
            req.kv_error = p.kv_error
        dw = self.table.workers.get(req.decode_worker or "")
        if dw is None:
            self._redispatch(req, "decode worker gone before the KV handoff", req.decode_worker)
            return
        if p.kv_error:
            self.counts["kv_failures"] += 1
            log.warning("kv_transfer_failed", request_id=req.request_id, prefill_worker=p.worker_id,
                        decode_worker=dw.worker_id, reason=p.kv_error)
        self._send(dw, m.KvReady(request_id=req.request_id, attempt=req.attempt, kv=p.kv, error=p.kv_error))

    def _relay(self, msg: m.KvWant | m.KvTarget, sender: WorkerEntry, to: m.Role) -> None:
        """Pass a KV handshake message to the request's other worker (current attempt only)."""
        req = self.requests.get(msg.request_id)
        if req is None or req.attempt != msg.attempt:
            return
        if not self._assigned(sender, req, msg, role="decode" if to == "prefill" else "prefill"):
            return
        wid = req.decode_worker if to == "decode" else req.prefill_worker
        w = self.table.workers.get(wid) if wid else None
        if w is not None:
            self._send(w, msg)

    def _on_failed(self, f: m.RequestFailed, w: WorkerEntry) -> None:
        req = self.requests.get(f.request_id)
        if req is None or req.attempt != f.attempt or req.done:
            return
        if not self._assigned(w, req, f):
            return
        if f.code == REJECTED_REASON and req.decision is not None and req.decision.route == "deflect":
            self._deflect_rejected(req, f)
            return
        log.warning("worker_reported_failure", request_id=f.request_id, worker=f.worker_id, reason=f.reason,
                    retryable=f.retryable)
        if f.retryable:
            self._redispatch(req, f.reason, f.worker_id)
        elif f.code == "invalid_request":  # the request is at fault: no worker would take it
            self._fail(req, f.reason, code="invalid_request")
        else:
            self._fail(req, f"worker {f.worker_id}: {f.reason}", code="worker_error")

    def _deflect_rejected(self, req: Request, f: m.RequestFailed) -> None:
        """The decode worker's admission said no (another router's deflections, or decodes that
        landed since its heartbeat, left no room): another decode worker's deflection or the
        disaggregated path, same attempt."""
        req.rejected_by.add(f.worker_id)
        self.counts["deflect_rejected"] += 1
        metrics.observe_deflect_rejected()
        log.info("deflection_rejected", request_id=req.request_id, decode_worker=f.worker_id, reason=f.reason)
        self._release(req)
        try:
            self._dispatch(req, rejected=True)
        except NoKvRoom:
            req.kv_wait_until = time.monotonic() + self.cfg.kv_wait_timeout
            self.kv_waiting.appendleft(req)
            self.counts["kv_waited"] += 1
        except NoWorkers as e:
            self.migration.park(req, str(e))

    def _kv_consumed(self, req: Request) -> None:
        """A handed-off request's first token: the decode side has the KV (or gave up on it), so a
        prefill worker holding it for a pull may let it go (and finish its drain)."""
        p = req.prefill
        if p is not None and p.kv.params and req.prefill_worker:
            pw = self.table.workers.get(req.prefill_worker)
            if pw is not None:
                self._send(pw, m.Cancel(request_id=req.request_id, attempt=req.attempt, reason="kv_consumed"))

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
            "reasons": {f"{r}:{why}": n for (r, why), n in self.reasons.items()},
            "workers": {w.worker_id: {"role": w.role, "engine": w.hello.engine, "draining": w.draining,
                                      "holding": len(w.holding)} for w in self.table.workers.values()},
            "prefix": self.prefix.stats(),
        }
