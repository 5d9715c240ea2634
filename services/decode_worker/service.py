"""Decode worker: decodes handed-off requests and prefills deflected ones in place.

Inbox (DEALER from the router): DecodeWork, KvReady, KvWant, Cancel, Drain (+ Welcome, Reregister).
Outbox: TokenBatch / RequestFailed / KvTarget to the router; DecodeHeartbeat (TBT slack) on the
work connection, every interval and at once when a request is admitted or finishes prefill.

The rules (admission of work, the KV kept for handoffs, the deflections held, the heartbeat,
cancellation) are `DecodeCore`'s (common/worker_core/decode.py), which the simulator runs too;
this is its shell: the engine, the NIXL receiver, the KV deadlines' loop and the clock.

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
from common.policy.admission import Accepted
from common.tokenizer import SimpleTokenizer, Tokenizer, make_tokenizer
from common.worker import WorkerService
from common.worker_core import DecodeCore, EngineInfo, Pending


class DecodeWorker(WorkerService):
    role = "decode"
    decoder = codec.decode_inbox
    core: DecodeCore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # traced requests (only with tracing on): id -> [its engine request, wall time started, of its first token]
        self._traced: dict[str, list[Any]] = {}
        self._model: tuple[m.Coeffs | None, PerfModel | None] = (None, None)
        self.rx: KvReceiver | None = None
        self._kv_tasks: set[asyncio.Task[None]] = set()
        self.engine.on_tokens = self._on_tokens
        self.engine.on_kv_fallback = self.core.engine_fell_back  # engines that load KV themselves call it (vllm)

    def make_core(self, info: EngineInfo) -> DecodeCore:
        return DecodeCore(self.worker_id, self.incarnation, info, self, model=self.cfg.served_model_name,
                          kv_transport=self.cfg.kv_transport, kv_handoff_timeout=self.cfg.kv_handoff_timeout,
                          deflect_admission=self.cfg.deflect_admission, log=self.log,
                          tokenizer=self._tokenizer())

    def _tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, to send text deltas with the tokens (the router then writes them
        without decoding): the simulated engine's word tokenizer, or the vLLM model's own; None (ids
        only, the router decodes) where it cannot be loaded here."""
        if self.cfg.engine == "sim":
            return SimpleTokenizer()
        try:
            return make_tokenizer(self.cfg.model) if self.cfg.model else None
        except Exception as e:  # ConfigError, or whatever transformers raises: the router decodes instead
            self.log.warning("worker_tokenizer_unavailable", model=self.cfg.model,
                             error=f"{type(e).__name__}: {e}"[:300],
                             effect="token ids only; the router decodes the text itself")
            return None

    # the core's ledgers, read by operators and tests
    @property
    def pending(self) -> dict[str, Pending]:
        return self.core.pending

    @property
    def active(self) -> dict[str, m.DecodeWork]:
        return self.core.active

    @property
    def accepted(self) -> dict[str, Accepted]:
        return self.core.accepted

    def heartbeat(self) -> m.DecodeHeartbeat:
        return self.core.heartbeat(self.engine.load(), coeffs=self.coeffs(), engine_waiting_kv=self.engine.waiting_kv())

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

    def release_kv(self, key: str) -> None:
        if self.rx is not None:
            self.rx.release(key)

    # -- the core's ports, with the spans of traced requests (common/tracing.py) -----------------
    def start(self, req: EngineRequest) -> bool:
        if not super().start(req):
            return False
        if self.tracing is not None and req.trace_headers:
            self._traced[req.request_id] = [req, time.time(), 0.0]
        return True

    def abort(self, request_id: str) -> None:
        self._traced.pop(request_id, None)
        super().abort(request_id)

    def _on_engine_failed(self, request_id: str, attempt: int, reason: str, retryable: bool = True) -> None:
        self._traced.pop(request_id, None)
        super()._on_engine_failed(request_id, attempt, reason, retryable)

    def _on_tokens(self, items: list[m.TokenItem], step_s: float) -> None:
        if self._traced and self.tracing is not None:
            self._trace(self.tracing, items)  # first: the core's ledgers still hold the finished requests
        self.core.on_tokens(items, step_s)

    def _trace(self, t: tracing.Tracing, items: list[m.TokenItem]) -> None:
        """Spans of traced requests, written at their first token (`prefill`, a deflected request's
        prefill in place) and at their end (`decode`); once per request, not per token."""
        now = time.time()
        for it in items:
            tr = self._traced.get(it.request_id)
            if tr is None:
                continue
            if it.finish_reason == "error":  # failed (engine_failed): no span of a completion
                del self._traced[it.request_id]
                continue
            req, started, first = tr
            headers = req.trace_headers
            tp, ts = headers["traceparent"], headers.get("tracestate", "")
            if not first:
                first = tr[2] = now
                if req.mode == "deflect":
                    w = self.core.active.get(it.request_id)
                    t.record(tracing.PREFILL, tp, started, now,
                             {"kairos.worker": self.worker_id, "kairos.prompt_tokens": len(req.prompt_token_ids),
                              "kairos.cached_tokens": req.cached_tokens, "kairos.attempt": req.attempt,
                              "kairos.in_place": True, "kairos.kv_fallback": w is not None and w.mode == "handoff",
                              "kairos.chunk_schedule": ",".join(map(str, req.chunk_schedule))}, ts)
            if it.finish_reason is not None:
                del self._traced[it.request_id]
                t.record(tracing.DECODE, tp, first if req.mode == "deflect" else started, now,
                         {"kairos.worker": self.worker_id, "kairos.attempt": req.attempt, "kairos.mode": req.mode,
                          "kairos.finish_reason": it.finish_reason}, ts)

    def step_model(self) -> PerfModel | None:
        """The step-time model it reports to the routers (the refit, else the engine's profile)."""
        c = self.coeffs()
        if c is not self._model[0]:
            self._model = (c, PerfModel.from_coeffs(c) if c is not None else None)
        return self._model[1]

    # -- inbox ---------------------------------------------------------------------------------
    def on_message(self, msg: Any) -> None:
        match msg:
            case m.DecodeWork():
                own = self.engine.prefix_cached(msg.prompt_token_ids) if msg.chunk_schedule else None
                self.core.on_work(msg, time.monotonic(), self.engine.load(), self.step_model(), own)
            case m.KvReady():
                self._on_kv_ready(msg)
            case m.KvWant():
                p = self.core.pending.get(msg.request_id)
                if p is not None and p.work.attempt == msg.attempt and self.rx is not None and not p.key:
                    self._reserve_kv(p)
            case m.Cancel():
                self.core.on_cancel(msg)
            case m.QueueHead():
                self.core.on_queue_head(msg)
            case m.Drain():
                self.log.info("drain_requested", reason=msg.reason)
                self.stop.set()
            case _:
                self.log.warning("unexpected_message", message=type(msg).__name__)

    def _reserve_kv(self, p: Pending) -> None:
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
        p = self.core.kv_arrived(r.request_id, r.attempt)
        if p is None:
            return
        if r.error or r.kv is None:
            self.core.release(p)
            self.core.fall_back(p.work, r.error or "no kv handle", self.step_model())
            return
        if p.key and self.rx is not None:
            task = asyncio.create_task(self._await_kv(p, r.kv))
            self._kv_tasks.add(task)
            task.add_done_callback(self._kv_tasks.discard)
            return
        self.core.admit(p.work, "handoff", (), self.step_model(), kv=r.kv)

    async def _await_kv(self, p: Pending, kv: m.KvHandle) -> None:
        """The prefill side says the WRITE is done: wait for its notification, verify, admit."""
        assert self.rx is not None and self.rx.layout is not None
        w = p.work
        active = self.core.active
        active[w.request_id] = w  # held (for drain and cancel) while we verify
        self.core.landing.add(w.request_id)  # (not yet a running decode: a role flip's drain waits for it)
        try:
            await self.rx.wait(p.key, self.cfg.kv_timeout, tokens=len(w.prompt_token_ids),
                               bytes_per_token=self.rx.layout.bytes_per_token)
        except KvError as e:
            if active.pop(w.request_id, None) is not None:
                self.core.fall_back(w, f"kv_{e.reason}: {e}", self.step_model())
            return
        finally:
            self.core.release(p)
            self.core.landing.discard(w.request_id)
        if active.pop(w.request_id, None) is not None:  # not cancelled meanwhile
            self.core.admit(w, "handoff", (), self.step_model(), kv=kv)

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            for p in self.core.expired(time.monotonic()):
                self.core.fall_back(p.work, "kv_timeout", self.step_model())
