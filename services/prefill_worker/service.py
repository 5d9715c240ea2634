"""Prefill worker: prefills prompts, then hands the KV cache to the decode worker the router chose.

Inbox (DEALER from the router): PrefillWork, KvTarget, Cancel, Drain (+ Welcome, Reregister).
Outbox: PrefillDone / RequestFailed to the router; PrefillHeartbeat on the same connection.
KV transport "modeled": the transfer takes the profile's T_xfer(L) and moves no bytes (the
simulator's assumption); "nixl": the KV blocks are written into the decode worker's memory.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from common import codec, tracing
from common import messages as m
from common.engines.base import EngineRequest, Prefilled
from common.engines.replay import drain
from common.kv import (
    DEFAULT_INFLIGHT_TOKENS,
    KvError,
    KvSender,
    fill_pattern,
    layout_from_info,
    plan_layout,
    sender_from_config,
    transfer_key,
)
from common.perf_model import PerfModel
from common.worker import WorkerService


class PrefillWorker(WorkerService):
    role = "prefill"
    decoder = codec.prefill_inbox

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.work: dict[str, m.PrefillWork] = {}
        self._transfers: set[asyncio.Task[None]] = set()
        # per (request, attempt): a stale attempt's hand-off still waiting must not take a new one's target
        self.targets: dict[tuple[str, int], m.KvTarget] = {}
        # Pull mode (the decode side READs the KV, vLLM): request -> when we stop waiting for the
        # read. Kept until the router says the decode side has it (Cancel "kv_consumed"), so a
        # drain does not end while decode workers still read from this one.
        self.kv_out: dict[str, float] = {}
        self._target_arrived: dict[tuple[str, int], asyncio.Event] = {}
        self.tx: KvSender | None = None
        self.engine.on_prefilled = self._on_prefilled
        self.counters.update(prefilled=0, kv_transfers=0, kv_failures=0)

    def heartbeat(self) -> m.PrefillHeartbeat:
        load = self.engine.load()
        coeffs = self.coeffs()
        queue = None
        if load.backlog is not None and coeffs is not None:
            # the router's replay predictor starts from this worker's own replay of its queue
            t = drain(PerfModel.from_coeffs(coeffs), self.engine.token_budget, self.engine.max_batch,
                      load.busy_s, load.backlog)
            queue = m.QueueDrain(start_s=t.start, chunks=list(t.chunks), used=t.used, end_s=t.end)
        return m.PrefillHeartbeat(
            worker_id=self.worker_id, incarnation=self.incarnation, seq=self.hb_seq,
            queued_tokens=load.queued_tokens, queued_requests=load.queued_requests,
            token_budget=self.engine.token_budget, last_dispatch=self.last_dispatch,
            step_ms_p50=load.step_ms_p50, steps=load.steps, coeffs=coeffs, draining=self.draining,
            backlog=load.backlog, busy_s=load.busy_s, max_batch=self.engine.max_batch, drain=queue,
            step_bias=load.step_bias)

    async def setup(self) -> None:
        if self.cfg.kv_transport == "nixl" and not self.engine.moves_kv:
            self.tx = sender_from_config(self.cfg, name=self.worker_id)
            # staging for the block size decode workers with this configuration use, before
            # registering: made at the first push instead, it stalled this worker's loop past the
            # router's liveness window on a loaded host, and the router declared it dead
            model = self.engine.coeffs()
            layout = plan_layout(pool_bytes=self.cfg.kv_pool_mib << 20, block_tokens=self.cfg.kv_block_tokens,
                                 profile_bytes_per_token=model.kv_bytes_per_token if model else 1024,
                                 capacity_tokens=DEFAULT_INFLIGHT_TOKENS, bytes_per_token=self.cfg.kv_bytes_per_token)
            self.tx.prepare(layout.block_bytes)

    async def teardown(self) -> None:
        if self.tx is not None:
            self.tx.close()

    def held_requests(self) -> list[tuple[str, int]]:
        return [(rid, w.attempt) for rid, w in self.work.items()]

    def held_ids(self) -> list[str]:
        return [*self.work, *self.kv_out]  # KV kept for a pull too: freed if the router forgot it

    def drain_pending(self) -> bool:
        now = time.monotonic()
        for rid in [r for r, until in self.kv_out.items() if until <= now]:
            del self.kv_out[rid]
        if self.kv_out:
            self.log.debug("drain_waits_for_kv_reads", requests=len(self.kv_out))
        return bool(self.kv_out)

    def drop_request(self, request_id: str) -> None:
        self.kv_out.pop(request_id, None)
        w = self.work.pop(request_id, None)
        if w is not None:
            self._forget_target(request_id, w.attempt)
            self.engine.abort(request_id)
            self.beat_now()

    def extra_hello(self) -> dict[str, Any]:
        return {"kv_block_tokens": self.cfg.kv_block_tokens} if self.tx is not None else {}

    async def on_message(self, msg: Any) -> None:
        match msg:
            case m.PrefillWork():
                self._on_work(msg)
            case m.KvTarget():
                self._on_kv_target(msg)
            case m.Cancel():
                self.kv_out.pop(msg.request_id, None)  # "kv_consumed", or the request ended
                w = self.work.get(msg.request_id)
                if w is not None and (msg.attempt < 0 or msg.attempt == w.attempt):
                    self.work.pop(msg.request_id)
                    self._forget_target(msg.request_id, w.attempt)
                    self.engine.abort(msg.request_id)
                    self.log.info("request_cancelled", request_id=msg.request_id, reason=msg.reason)
            case m.Drain():
                self.log.info("drain_requested", reason=msg.reason)
                self.stop.set()
            case _:
                self.log.warning("unexpected_message", message=type(msg).__name__)

    def _on_work(self, w: m.PrefillWork) -> None:
        self.last_dispatch = max(self.last_dispatch, w.dispatch)
        if self.draining:
            self._refuse(w, "worker_draining")
            return
        old = self.work.get(w.request_id)
        if old is not None:  # a re-dispatch of something we still hold: drop the old attempt
            self.engine.abort(w.request_id)
        if why := self.too_long(len(w.prompt_token_ids)):
            self._refuse(w, why, invalid=True)
            return
        if not self.add_to_engine(EngineRequest(request_id=w.request_id, attempt=w.attempt,
                                                prompt_token_ids=w.prompt_token_ids, sampling=w.sampling,
                                                mode="prefill", cached_tokens=w.cached_tokens,
                                                trace_headers=tracing.headers(w.traceparent, w.tracestate))):
            return
        self.work[w.request_id] = w
        self.beat_now()

    def forget(self, request_id: str) -> None:
        w = self.work.pop(request_id, None)
        if w is not None:
            self._forget_target(request_id, w.attempt)

    def _refuse(self, w: m.PrefillWork, reason: str, *, invalid: bool = False) -> None:
        self.refuse(w.request_id, w.attempt, reason, invalid=invalid)

    def _on_kv_target(self, t: m.KvTarget) -> None:
        w = self.work.get(t.request_id)
        if w is None or w.attempt != t.attempt:
            return
        self.targets[(t.request_id, t.attempt)] = t
        self._target_arrived.setdefault((t.request_id, t.attempt), asyncio.Event()).set()

    def _forget_target(self, request_id: str, attempt: int) -> None:
        self.targets.pop((request_id, attempt), None)
        self._target_arrived.pop((request_id, attempt), None)

    async def _push_nixl(self, w: m.PrefillWork) -> tuple[int, str]:
        """WRITE the request's KV into the decode worker's reserved blocks. Returns (bytes, error)."""
        assert self.tx is not None
        ev = self._target_arrived.setdefault((w.request_id, w.attempt), asyncio.Event())
        self.send(m.KvWant(request_id=w.request_id, attempt=w.attempt, tokens=len(w.prompt_token_ids)))
        try:
            await asyncio.wait_for(ev.wait(), timeout=self.cfg.kv_timeout)
        except TimeoutError:
            return 0, "no KV target from the decode worker in time"
        t = self.targets.get((w.request_id, w.attempt))
        if t is None:
            return 0, "the request was cancelled while waiting for its KV target"
        if t.error:
            return 0, f"decode worker could not take the KV: {t.error}"
        if t.kv_agent is None:
            return 0, "decode worker sent no NIXL agent"
        tokens = len(w.prompt_token_ids)
        try:
            self.tx.add_peer(t.kv_agent)
            bpt = layout_from_info(t.kv_agent, self.cfg.kv_block_tokens).bytes_per_token
            key = transfer_key(w.request_id, w.attempt)
            if self.cfg.kv_fault_rate and random.random() < self.cfg.kv_fault_rate:
                self.log.warning("kv_fault_injected", request_id=w.request_id, decode_worker=t.decode_worker)
                r = await self.tx.push(t.agent_name, key, t.block_ids, fill_pattern("corrupt-" + w.request_id,
                                                                                    tokens, bpt),
                                       timeout=self.cfg.kv_timeout)
            else:
                r = await self.tx.push_pattern(t.agent_name, key, t.block_ids, request_id=w.request_id,
                                               tokens=tokens, bytes_per_token=bpt, timeout=self.cfg.kv_timeout)
        except KvError as e:
            self.log.warning("kv_push_failed", request_id=w.request_id, decode_worker=t.decode_worker,
                             reason=e.reason, error=str(e))
            return 0, f"kv_{e.reason}: {e}"
        return r.nbytes, ""

    def _on_prefilled(self, p: Prefilled) -> None:
        w = self.work.get(p.request_id)
        if w is None or w.attempt != p.attempt:
            return
        self.counters["prefilled"] += 1
        self.beat_now()
        task = asyncio.create_task(self._hand_off(w, p))
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _hand_off(self, w: m.PrefillWork, p: Prefilled) -> None:
        tokens = len(w.prompt_token_ids)
        t0 = time.monotonic()
        model = self.engine.coeffs()
        nbytes = tokens * (model.kv_bytes_per_token if model else 0)
        error = ""
        if self.tx is not None:
            modeled_nbytes = nbytes
            nbytes, error = await self._push_nixl(w)
            if model is not None and not error:  # real bytes moved; keep the profile's timing (GPU-like)
                rest = model.xfer_t0 + modeled_nbytes / model.xfer_bandwidth - (time.monotonic() - t0)
                if rest > 0:
                    await asyncio.sleep(rest)
        elif self.cfg.kv_transport == "modeled" and model is not None:
            await asyncio.sleep(model.xfer_t0 + nbytes / model.xfer_bandwidth)
        self._forget_target(w.request_id, w.attempt)
        if self.work.get(w.request_id) is not w:
            return  # cancelled or re-dispatched meanwhile
        self.work.pop(w.request_id, None)
        self.counters["kv_failures" if error else "kv_transfers"] += 1
        kv = m.KvHandle(transport=self.engine.name if self.engine.moves_kv else self.cfg.kv_transport,
                        source_worker=self.worker_id, tokens=tokens, nbytes=nbytes,
                        transfer_s=time.monotonic() - t0, params=p.kv_params)
        self.send(m.PrefillDone(request_id=w.request_id, attempt=w.attempt, worker_id=self.worker_id, kv=kv,
                                queue_s=p.queue_s, prefill_s=p.prefill_s, first_token_id=p.first_token_id,
                                kv_error=error, prompt_logprobs=p.prompt_logprobs))
        if self.tracing is not None and w.traceparent:
            self._trace(self.tracing, w, p, kv, error, t0)
        if p.kv_params and not error:  # pull mode: the decode side reads it from us, later
            self.kv_out[w.request_id] = time.monotonic() + self.cfg.kv_handoff_timeout
        self.log.debug("prefill_done", request_id=w.request_id, tokens=tokens, queue_s=round(p.queue_s, 4),
                       prefill_s=round(p.prefill_s, 4), decode_worker=w.decode_worker)

    def _trace(self, t: tracing.Tracing, w: m.PrefillWork, p: Prefilled, kv: m.KvHandle, error: str,
               t0: float) -> None:
        """The request's `prefill` and `kv_transfer` spans, under the router's span (common/tracing.py)."""
        handed = time.time() - (time.monotonic() - t0)  # wall time the hand-off began (the prefill's end)
        t.record(tracing.PREFILL, w.traceparent, handed - p.prefill_s, handed,
                 {"kairos.worker": self.worker_id, "kairos.prompt_tokens": len(w.prompt_token_ids),
                  "kairos.cached_tokens": w.cached_tokens, "kairos.worker_queue_s": p.queue_s,
                  "kairos.attempt": w.attempt}, w.tracestate)
        t.record(tracing.KV_TRANSFER, w.traceparent, handed, handed + kv.transfer_s,
                 {"kairos.worker": self.worker_id, "kairos.decode_worker": w.decode_worker,
                  "kairos.kv_transport": kv.transport, "kairos.kv_bytes": kv.nbytes, "kairos.kv_error": error},
                 w.tracestate)

