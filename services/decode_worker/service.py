"""Decode worker: decodes handed-off requests and prefills deflected ones in place.

Inbox (DEALER from the router): DecodeWork, KvReady, Cancel, Drain (+ Welcome, Reregister).
Outbox: TokenBatch / RequestFailed / KvTarget to the router; DecodeHeartbeat (TBT slack) on the
work connection, every interval and at once when a request is admitted or finishes prefill.

A deflection that carries a step budget is admitted only if its chunk schedule fits the live
state (the running decodes and every deflection accepted and not yet prefilled, from any
router; common/policy/admission.py), else refused at once with code "deflect_rejected" (the
router then decides again without this worker): with several routers none of them sees all
the deflections, this worker does. Heartbeats list the deflections held and who sent each.

A handed-off request waits here for its KV (KvReady) with KV space reserved. If the transfer
failed or never arrives within `kv_handoff_timeout` (or the request's deadline, if sooner), the
worker prefills it in place instead (the fallback): counted, logged with the reason, reported to
the router in the next TokenBatch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from msgspec.structs import replace as msgspec_replace

from common import codec, tracing
from common import messages as m
from common.engines.base import EngineRequest
from common.kv import KvError, KvReceiver, receiver_from_config, transfer_key
from common.perf_model import PerfModel
from common.policy.admission import REJECTED_REASON, Accepted, accepted_entry, check_deflection
from common.worker import WorkerService


class _Pending:
    __slots__ = ("deadline", "key", "work")

    def __init__(self, work: m.DecodeWork, deadline: float, key: str = "") -> None:
        self.work = work
        self.deadline = deadline
        self.key = key  # the NIXL transfer key when KV space is reserved for it


class DecodeWorker(WorkerService):
    role = "decode"
    decoder = codec.decode_inbox

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, _Pending] = {}
        self.active: dict[str, m.DecodeWork] = {}
        # traced requests (only with tracing on): id -> [the work, wall time admitted, of its first token]
        self._traced: dict[str, list[Any]] = {}
        self._fallbacks: list[str] = []
        self._fallback_reasons: list[str] = []
        self.accepted: dict[str, Accepted] = {}  # deflections admitted and not yet prefilled
        self.held: dict[str, m.HeldDeflection] = {}  # the same, as heartbeats list them
        self._model: tuple[m.Coeffs | None, PerfModel | None] = (None, None)
        self.rx: KvReceiver | None = None
        self._kv_tasks: set[asyncio.Task[None]] = set()
        self.engine.on_tokens = self._on_tokens
        self.engine.on_kv_fallback = self._on_engine_kv_fallback  # engines that load KV themselves call it (vllm)
        self.counters.update(deflected=0, handoffs=0, kv_fallbacks=0, finished=0, deflect_rejected=0)

    # -- heartbeats --------------------------------------------------------------------------
    def _reserved(self) -> int:
        return sum(len(p.work.prompt_token_ids) + p.work.sampling.max_tokens for p in self.pending.values())

    def heartbeat(self) -> m.DecodeHeartbeat:
        load = self.engine.load()
        slo = load.strictest_tbt_slo
        return m.DecodeHeartbeat(
            worker_id=self.worker_id, incarnation=self.incarnation, seq=self.hb_seq, batch=load.batch,
            kv_tokens=load.kv_tokens, kv_free_tokens=max(0, load.kv_free_tokens - self._reserved()),
            kv_capacity_tokens=load.kv_capacity_tokens, resident_prefill_tokens=load.resident_prefill_tokens,
            deflections=load.deflections, strictest_tbt_slo=slo, token_budget=self.engine.token_budget,
            waiting_kv=len(self.pending) + self.engine.waiting_kv(),
            last_dispatch=self.last_dispatch, step_ms_p50=load.step_ms_p50,
            step_ms_max=load.step_ms_max,
            tbt_slack_ms=(slo * 1000.0 - load.step_ms_max) if slo is not None else None,
            steps=load.steps, coeffs=self.coeffs(), draining=self.draining, busy_s=load.busy_s,
            held=list(self.held.values()), step_margin=load.step_margin, step_bias=load.step_bias)

    def held_requests(self) -> list[tuple[str, int]]:
        return [(rid, w.attempt) for rid, w in self.active.items()] + [
            (rid, p.work.attempt) for rid, p in self.pending.items()]

    def extra_loops(self) -> list[tuple[str, Any]]:
        return [("kv-deadlines", self._deadline_loop())]

    async def setup(self) -> None:
        if self.cfg.kv_transport == "nixl" and not self.engine.moves_kv:
            model = self.engine.coeffs()
            self.rx = receiver_from_config(self.cfg, name=self.worker_id,
                                           profile_bytes_per_token=model.kv_bytes_per_token if model else 1024)
            await self.rx.start()

    async def teardown(self) -> None:
        if self.rx is not None:
            await self.rx.close()

    def extra_hello(self) -> dict[str, Any]:
        if self.rx is None:
            return {}
        return {"kv_agent": self.rx.agent_info(), "kv_block_tokens": self.cfg.kv_block_tokens}

    def drop_request(self, request_id: str) -> None:
        self._drop(request_id)

    # -- inbox ---------------------------------------------------------------------------------
    async def on_message(self, msg: Any) -> None:
        match msg:
            case m.DecodeWork():
                self._on_work(msg)
            case m.KvReady():
                self._on_kv_ready(msg)
            case m.KvWant():
                p = self.pending.get(msg.request_id)
                if p is not None and p.work.attempt == msg.attempt and self.rx is not None and not p.key:
                    self._reserve_kv(p)
            case m.Cancel():
                self._on_cancel(msg)
            case m.Drain():
                self.log.info("drain_requested", reason=msg.reason)
                self.stop.set()
            case _:
                self.log.warning("unexpected_message", message=type(msg).__name__)

    def _on_work(self, w: m.DecodeWork) -> None:
        self.last_dispatch = max(self.last_dispatch, w.dispatch)
        if self.draining:
            self._refuse(w, "worker_draining")
            return
        self._drop(w.request_id)  # a re-dispatch replaces whatever attempt we held
        need = len(w.prompt_token_ids) + w.sampling.max_tokens
        if not self.engine.can_admit(len(w.prompt_token_ids) + self._reserved(), w.sampling.max_tokens):
            self._refuse(w, f"kv_full: {need} tokens needed")
            return
        if why := self.too_long(len(w.prompt_token_ids)):
            self._refuse(w, why, invalid=True)
            return
        if w.mode == "handoff":
            wait = min(w.deadline_s, self.cfg.kv_handoff_timeout)
            self.pending[w.request_id] = _Pending(w, time.monotonic() + wait)
            self.beat_now()
            return
        if w.step_budget_s > 0 and self.cfg.deflect_admission and (why := self._check_deflection(w)):
            self.counters["deflect_rejected"] += 1
            self.log.info("deflection_rejected", request_id=w.request_id, attempt=w.attempt, reason=why,
                          chunk_schedule=list(w.chunk_schedule))
            self.send(m.RequestFailed(request_id=w.request_id, attempt=w.attempt, worker_id=self.worker_id,
                                      reason=why, retryable=True, code=REJECTED_REASON))
            return
        self._admit(w, "deflect", w.chunk_schedule)

    def _step_model(self) -> PerfModel | None:
        c = self.coeffs()
        if c is not self._model[0]:
            self._model = (c, PerfModel.from_coeffs(c) if c is not None else None)
        return self._model[1]

    def _planned_model(self, w: m.DecodeWork) -> PerfModel | None:
        """The model the router planned `w`'s chunks with: ours, times the bias it took for us."""
        model = self._step_model()
        if model is None or w.model_bias == 1.0:
            return model
        return model.scaled(w.model_bias)

    def _check_deflection(self, w: m.DecodeWork) -> str:
        """'' when the deflection fits this worker's live state, else why not."""
        model = self._planned_model(w)
        if model is None:
            return ""  # no step-time model to check with: admit, as before admission existed
        load = self.engine.load()
        return check_deflection(model, batch=load.batch, kv_tokens=load.kv_tokens, schedule=w.chunk_schedule,
                                budget_s=w.step_budget_s, tbt_slo=w.tbt_slo, accepted=self.accepted.values(),
                                strictest_tbt_slo=load.strictest_tbt_slo, cached=w.cached_tokens)

    def _admit(self, w: m.DecodeWork, mode: str, schedule: tuple[int, ...], kv: m.KvHandle | None = None) -> None:
        if not self.add_to_engine(EngineRequest(request_id=w.request_id, attempt=w.attempt,
                                                prompt_token_ids=w.prompt_token_ids, sampling=w.sampling,
                                                mode="handoff" if mode == "handoff" else "deflect",
                                                tbt_slo=w.tbt_slo, chunk_schedule=schedule, kv=kv,
                                                cached_tokens=w.cached_tokens, resume_tokens=w.resume_tokens,
                                                trace_headers=tracing.headers(w.traceparent, w.tracestate))):
            return
        self.active[w.request_id] = w
        if self.tracing is not None and w.traceparent:
            self._traced[w.request_id] = [w, time.time(), 0.0, mode]
        if mode == "deflect" and w.step_budget_s > 0 and schedule:
            model = self._planned_model(w)
            if model is not None:
                a = self.accepted[w.request_id] = accepted_entry(model, schedule, w.step_budget_s,
                                                                 self.engine.token_budget, w.cached_tokens)
                self.held[w.request_id] = m.HeldDeflection(router=self.router_of(w.request_id),
                                                           reserved_s=a.reserved_s, largest_chunk=max(schedule))
        self.counters["handoffs" if mode == "handoff" else "deflected"] += 1
        self.log.debug("request_admitted", request_id=w.request_id, attempt=w.attempt, mode=mode,
                       prompt_tokens=len(w.prompt_token_ids), chunk_schedule=list(schedule))
        self.beat_now()

    def _refuse(self, w: m.DecodeWork, reason: str, *, invalid: bool = False) -> None:
        self.refuse(w.request_id, w.attempt, reason, invalid=invalid)

    def _reserve_kv(self, p: _Pending) -> None:
        """NIXL: reserve landing blocks and tell the prefill worker (via the router) where to write.
        Done when the prefill side asks (KvWant), so blocks are held only for the transfer."""
        assert self.rx is not None and self.rx.layout is not None
        w = p.work
        key = transfer_key(w.request_id, w.attempt)
        target = m.KvTarget(request_id=w.request_id, attempt=w.attempt, decode_worker=self.worker_id,
                            agent_name=self.rx.name, kv_agent=self.rx.agent_info())
        try:
            ids = self.rx.reserve(key, self.rx.layout.nbytes(len(w.prompt_token_ids)))
        except KvError as e:
            self.log.warning("kv_reserve_failed", request_id=w.request_id, reason=e.reason, error=str(e))
            self.send(msgspec_replace(target, error=f"{e.reason}: {e}"))
            return
        p.key = key
        self.send(msgspec_replace(target, block_ids=ids))

    def _on_kv_ready(self, r: m.KvReady) -> None:
        p = self.pending.get(r.request_id)
        if p is None or p.work.attempt != r.attempt:
            self.log.info("kv_ready_unknown", request_id=r.request_id, attempt=r.attempt)
            return
        del self.pending[r.request_id]
        if r.error or r.kv is None:
            self._release_kv(p)
            self._fallback(p.work, r.error or "no kv handle")
            return
        if p.key and self.rx is not None:
            task = asyncio.create_task(self._await_kv(p, r.kv))
            self._kv_tasks.add(task)
            task.add_done_callback(self._kv_tasks.discard)
            return
        self._admit(p.work, "handoff", (), kv=r.kv)

    async def _await_kv(self, p: _Pending, kv: m.KvHandle) -> None:
        """The prefill side says the WRITE is done: wait for its notification, verify, admit."""
        assert self.rx is not None and self.rx.layout is not None
        w = p.work
        self.active[w.request_id] = w  # held (for drain and cancel) while we verify
        try:
            await self.rx.wait(p.key, self.cfg.kv_timeout, tokens=len(w.prompt_token_ids),
                               bytes_per_token=self.rx.layout.bytes_per_token)
        except KvError as e:
            if self.active.pop(w.request_id, None) is not None:
                self._fallback(w, f"kv_{e.reason}: {e}")
            return
        finally:
            self._release_kv(p)
        if self.active.pop(w.request_id, None) is not None:  # not cancelled meanwhile
            self._admit(w, "handoff", (), kv=kv)

    def _release_kv(self, p: _Pending) -> None:
        if p.key and self.rx is not None:
            self.rx.release(p.key)
            p.key = ""

    def _fallback(self, w: m.DecodeWork, reason: str) -> None:
        """KV did not arrive: prefill in place (an explicit, counted deflection)."""
        self.counters["kv_fallbacks"] += 1
        self.log.warning("kv_fallback_prefill_in_place", request_id=w.request_id, reason=reason,
                         prompt_tokens=len(w.prompt_token_ids))
        self._fallbacks.append(w.request_id)
        self._fallback_reasons.append(reason)
        self._admit(w, "deflect", ())

    def _on_engine_kv_fallback(self, request_id: str, reason: str) -> None:
        self.counters["kv_fallbacks"] += 1
        self.log.warning("kv_fallback_prefill_in_place", request_id=request_id, reason=reason)
        self._fallbacks.append(request_id)
        self._fallback_reasons.append(reason)

    def _prefilled(self, request_id: str) -> None:
        """A deflection's prefill is over (or it left): it reserves nothing any more."""
        self.accepted.pop(request_id, None)
        self.held.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._traced.pop(request_id, None)
        self._prefilled(request_id)
        self.active.pop(request_id, None)
        self.pending.pop(request_id, None)

    def _on_cancel(self, c: m.Cancel) -> None:
        w = self.active.get(c.request_id) or (p.work if (p := self.pending.get(c.request_id)) else None)
        if w is None or (c.attempt >= 0 and c.attempt != w.attempt):
            return
        self._drop(c.request_id)
        self.log.info("request_cancelled", request_id=c.request_id, reason=c.reason)

    def _drop(self, request_id: str) -> None:
        self._traced.pop(request_id, None)
        self._prefilled(request_id)
        p = self.pending.pop(request_id, None)
        if p is not None:
            self._release_kv(p)
        if self.active.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.beat_now()

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for rid, p in list(self.pending.items()):
                if now >= p.deadline:
                    del self.pending[rid]
                    self._release_kv(p)
                    self._fallback(p.work, "kv_timeout")

    # -- engine output -------------------------------------------------------------------------
    def _on_tokens(self, items: list[m.TokenItem], step_s: float) -> None:
        items = [it for it in items if it.finish_reason != "error"]
        fb, self._fallbacks = self._fallbacks, []
        why, self._fallback_reasons = self._fallback_reasons, []
        if not items and not fb:
            return
        self.send(m.TokenBatch(worker_id=self.worker_id, items=items, step_s=step_s, kv_fallback=fb,
                               kv_fallback_reasons=why))
        if self._traced and self.tracing is not None:
            self._trace(self.tracing, items)
        changed = False
        for it in items:
            if self.accepted and it.request_id in self.accepted:
                self._prefilled(it.request_id)  # its first token: its prefill is over
                changed = True  # every router sees at once that it holds one deflection less
            if it.finish_reason == "error":
                continue  # on_failed already reported it (RequestFailed): not a completion
            if it.finish_reason is not None:
                self.active.pop(it.request_id, None)
                self.counters["finished"] += 1
                changed = True
                self.log.debug("request_finished", request_id=it.request_id, attempt=it.attempt,
                               finish_reason=it.finish_reason)
        if changed:
            self.beat_now()

    def _trace(self, t: tracing.Tracing, items: list[m.TokenItem]) -> None:
        """Spans of traced requests (common/tracing.py), written at their first token (`prefill`, a
        deflected request's prefill in place) and at their end (`decode`); once per request, not per token."""
        now = time.time()
        for it in items:
            tr = self._traced.get(it.request_id)
            if tr is None:
                continue
            w, admitted, first, mode = tr
            if not first:
                first = tr[2] = now
                if mode == "deflect":
                    t.record(tracing.PREFILL, w.traceparent, admitted, now,
                             {"kairos.worker": self.worker_id, "kairos.prompt_tokens": len(w.prompt_token_ids),
                              "kairos.cached_tokens": w.cached_tokens, "kairos.attempt": w.attempt,
                              "kairos.in_place": True, "kairos.kv_fallback": w.mode == "handoff",
                              "kairos.chunk_schedule": ",".join(map(str, w.chunk_schedule))}, w.tracestate)
            if it.finish_reason is not None:
                del self._traced[it.request_id]
                t.record(tracing.DECODE, w.traceparent, first if mode == "deflect" else admitted, now,
                         {"kairos.worker": self.worker_id, "kairos.attempt": w.attempt, "kairos.mode": mode,
                          "kairos.finish_reason": it.finish_reason}, w.tracestate)
