"""Prefill worker: prefills prompts, then hands the KV cache to the decode worker the router chose.

Inbox (DEALER from the router): PrefillWork, KvTarget, Cancel, Drain (+ Welcome, Reregister).
Outbox: PrefillDone / RequestFailed to the router; PrefillHeartbeat on the same connection.
KV transport "modeled": the transfer takes the profile's T_xfer(L) and moves no bytes (the
simulator's assumption); "nixl": the KV blocks are written into the decode worker's memory.

The rules (admission of work, what it holds, the heartbeat and its replay of the queue,
cancellation, the hand-off's report) are `PrefillCore`'s (common/worker_core/prefill.py), which
the simulator runs too; this is its shell: the engine, the NIXL sender, the transfers and the clock.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from common import codec, tracing
from common import messages as m
from common.engines.base import Prefilled
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
from common.worker_core import EngineInfo, PrefillCore


class PrefillWorker(WorkerService):
    role = "prefill"
    decoder = codec.prefill_inbox
    core: PrefillCore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._transfers: set[asyncio.Task[None]] = set()
        # per (request, attempt): its KvTarget arrived (the core keeps the target itself)
        self._target_arrived: dict[tuple[str, int], asyncio.Event] = {}
        self.tx: KvSender | None = None
        self.engine.on_prefilled = self._on_prefilled
        self.engine.on_tokens = self.core.on_tokens  # route "retain": the requests it decodes itself

    def make_core(self, info: EngineInfo) -> PrefillCore:
        return PrefillCore(self.worker_id, self.incarnation, info, self, model=self.cfg.served_model_name,
                           kv_transport=self.cfg.kv_transport, log=self.log, can_retain=self.engine.can_retain)

    # the core's ledgers, read by operators and tests
    @property
    def work(self) -> dict[str, m.PrefillWork]:
        return self.core.work

    @property
    def targets(self) -> dict[tuple[str, int], m.KvTarget]:
        return self.core.targets

    @property
    def kv_out(self) -> dict[str, float]:
        return self.core.kv_out

    def heartbeat(self) -> m.PrefillHeartbeat:
        coeffs = self.coeffs()  # the router's replay predictor starts from this worker's replay of its queue
        return self.core.heartbeat(self.engine.load(), PerfModel.from_coeffs(coeffs) if coeffs is not None else None,
                                   coeffs=coeffs)

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

    def drain_pending(self) -> bool:
        waiting = self.core.drain_pending(time.monotonic())
        if waiting:
            self.log.debug("drain_waits_for_kv_reads", requests=len(self.core.kv_out))
        return waiting

    def drop_request(self, request_id: str) -> None:
        w = self.core.work.get(request_id)
        self.core.drop(request_id)
        if w is not None:
            self._target_arrived.pop((request_id, w.attempt), None)

    def extra_hello(self) -> dict[str, Any]:
        return {"kv_block_tokens": self.cfg.kv_block_tokens} if self.tx is not None else {}

    def on_message(self, msg: Any) -> None:
        match msg:
            case m.PrefillWork():
                self.core.on_work(msg, self.engine.load() if msg.retain else None)
            case m.KvTarget():
                if self.core.on_target(msg):
                    self._target_arrived.setdefault((msg.request_id, msg.attempt), asyncio.Event()).set()
            case m.Cancel():
                w = self.core.work.get(msg.request_id)
                if self.core.on_cancel(msg) and w is not None:  # "kv_consumed", or the request ended
                    self._target_arrived.pop((msg.request_id, w.attempt), None)
            case m.Drain():
                self.log.info("drain_requested", reason=msg.reason)
                self.stop.set()
            case _:
                self.log.warning("unexpected_message", message=type(msg).__name__)

    async def push_nixl(self, w: m.PrefillWork) -> tuple[int, str]:
        """WRITE the request's KV into the decode worker's reserved blocks. Returns (bytes, error)."""
        assert self.tx is not None
        ev = self._target_arrived.setdefault((w.request_id, w.attempt), asyncio.Event())
        self.send(m.KvWant(request_id=w.request_id, attempt=w.attempt, tokens=len(w.prompt_token_ids)))
        try:
            await asyncio.wait_for(ev.wait(), timeout=self.cfg.kv_timeout)
        except TimeoutError:
            return 0, "no KV target from the decode worker in time"
        t = self.core.targets.get((w.request_id, w.attempt))
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
        w = self.core.on_prefilled(p)
        if w is None:
            return
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
            nbytes, error = await self.push_nixl(w)
            if model is not None and not error:  # real bytes moved; keep the profile's timing (GPU-like)
                rest = model.xfer_t0 + modeled_nbytes / model.xfer_bandwidth - (time.monotonic() - t0)
                if rest > 0:
                    await asyncio.sleep(rest)
        elif self.cfg.kv_transport == "modeled" and model is not None:
            await asyncio.sleep(model.xfer_t0 + nbytes / model.xfer_bandwidth)
        self._target_arrived.pop((w.request_id, w.attempt), None)
        now = time.monotonic()
        kv = m.KvHandle(transport=self.engine.name if self.engine.moves_kv else self.cfg.kv_transport,
                        source_worker=self.worker_id, tokens=tokens, nbytes=nbytes, transfer_s=now - t0,
                        params=p.kv_params)
        if not self.core.handed_off(w, p, kv, error, now, self.cfg.kv_handoff_timeout):
            return  # cancelled or re-dispatched meanwhile
        if self.tracing is not None and w.traceparent:
            self._trace(self.tracing, w, p, kv, error, t0)
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

