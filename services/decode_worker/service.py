"""Decode worker: decodes handed-off requests and prefills deflected ones in place.

Inbox (DEALER from the router): DecodeWork, KvReady, Cancel, Drain (+ Welcome, Reregister).
Outbox: TokenBatch / RequestFailed / KvTarget to the router; DecodeHeartbeat (TBT slack) on the
heartbeat PUB, every interval and at once when a request is admitted or finishes prefill.

A handed-off request waits here for its KV (KvReady) with KV space reserved. If the transfer
failed or never arrives before the request's deadline, the worker prefills it in place instead
(the fallback): counted, logged with the reason, reported to the router in the next TokenBatch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common import codec
from common import messages as m
from common.engines.base import EngineRequest
from common.errors import Overloaded
from common.worker import WorkerService


class _Pending:
    __slots__ = ("deadline", "work")

    def __init__(self, work: m.DecodeWork, deadline: float) -> None:
        self.work = work
        self.deadline = deadline


class DecodeWorker(WorkerService):
    role = "decode"
    decoder = codec.decode_inbox

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, _Pending] = {}
        self.active: dict[str, m.DecodeWork] = {}
        self._fallbacks: list[str] = []
        self.engine.on_tokens = self._on_tokens
        self.counters.update(deflected=0, handoffs=0, kv_fallbacks=0, refused=0, finished=0)

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
            waiting_kv=len(self.pending), last_dispatch=self.last_dispatch, step_ms_p50=load.step_ms_p50,
            step_ms_max=load.step_ms_max,
            tbt_slack_ms=(slo * 1000.0 - load.step_ms_max) if slo is not None else None,
            steps=load.steps, coeffs=self.engine.coeffs(), draining=self.draining)

    def held_requests(self) -> list[tuple[str, int]]:
        return [(rid, w.attempt) for rid, w in self.active.items()] + [
            (rid, p.work.attempt) for rid, p in self.pending.items()]

    def extra_loops(self) -> list[tuple[str, Any]]:
        return [("kv-deadlines", self._deadline_loop())]

    # -- inbox ---------------------------------------------------------------------------------
    async def on_message(self, msg: Any) -> None:
        match msg:
            case m.DecodeWork():
                self._on_work(msg)
            case m.KvReady():
                self._on_kv_ready(msg)
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
        if w.mode == "handoff":
            self.pending[w.request_id] = _Pending(w, time.monotonic() + w.deadline_s)
            self.beat_now()
            return
        self._admit(w, "deflect", w.chunk_schedule)

    def _admit(self, w: m.DecodeWork, mode: str, schedule: tuple[int, ...], kv: m.KvHandle | None = None) -> None:
        try:
            self.engine.add(EngineRequest(request_id=w.request_id, attempt=w.attempt,
                                          prompt_token_ids=w.prompt_token_ids, sampling=w.sampling,
                                          mode="handoff" if mode == "handoff" else "deflect",
                                          tbt_slo=w.tbt_slo, chunk_schedule=schedule, kv=kv,
                                          cached_tokens=w.cached_tokens))
        except Overloaded as e:
            self._refuse(w, f"overloaded: {e}")
            return
        self.active[w.request_id] = w
        self.counters["handoffs" if mode == "handoff" else "deflected"] += 1
        self.beat_now()

    def _refuse(self, w: m.DecodeWork, reason: str) -> None:
        self.counters["refused"] += 1
        self.log.warning("work_refused", request_id=w.request_id, reason=reason)
        self.send(m.RequestFailed(request_id=w.request_id, attempt=w.attempt, worker_id=self.worker_id,
                                  reason=reason, retryable=True))

    def _on_kv_ready(self, r: m.KvReady) -> None:
        p = self.pending.get(r.request_id)
        if p is None or p.work.attempt != r.attempt:
            self.log.info("kv_ready_unknown", request_id=r.request_id, attempt=r.attempt)
            return
        del self.pending[r.request_id]
        if r.error or r.kv is None:
            self._fallback(p.work, r.error or "no kv handle")
            return
        self._admit(p.work, "handoff", (), kv=r.kv)

    def _fallback(self, w: m.DecodeWork, reason: str) -> None:
        """KV did not arrive: prefill in place (an explicit, counted deflection)."""
        self.counters["kv_fallbacks"] += 1
        self.log.warning("kv_fallback_prefill_in_place", request_id=w.request_id, reason=reason,
                         prompt_tokens=len(w.prompt_token_ids))
        self._fallbacks.append(w.request_id)
        self._admit(w, "deflect", ())

    def _on_cancel(self, c: m.Cancel) -> None:
        w = self.active.get(c.request_id) or (p.work if (p := self.pending.get(c.request_id)) else None)
        if w is None or (c.attempt >= 0 and c.attempt != w.attempt):
            return
        self._drop(c.request_id)
        self.log.info("request_cancelled", request_id=c.request_id, reason=c.reason)

    def _drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
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
                    self._fallback(p.work, "kv_timeout")

    # -- engine output -------------------------------------------------------------------------
    def _on_tokens(self, items: list[m.TokenItem], step_s: float) -> None:
        fb, self._fallbacks = self._fallbacks, []
        self.send(m.TokenBatch(worker_id=self.worker_id, items=items, step_s=step_s, kv_fallback=fb))
        changed = False
        for it in items:
            if it.finish_reason is not None:
                self.active.pop(it.request_id, None)
                self.counters["finished"] += 1
                changed = True
        if changed:
            self.beat_now()
