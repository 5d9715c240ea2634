"""The prefill worker's rules: its heartbeat, its admission of work, its ledgers, cancellation.

Ledgers: `work`, the requests it prefills or hands off now; `targets`, the KV target each
hand-off waits for (per request and attempt: a stale attempt's hand-off must not take a new
one's); `kv_out`, requests whose KV a decode worker reads from here later (pull mode), kept
until the router says it was read (Cancel "kv_consumed") or their time is up: a drain waits
for them.

The heartbeat is composed here from the engine's load and its own replay of its queue with its
step-time model (common/engines/replay.py): the router's replay predictor starts from it. It
also carries what the third path needs (route "retain"): the requests it decodes itself, their
KV, the strictest TBT SLO among them, its KV free and its measured step margin.

Route "retain" (a PrefillWork with `retain`): the worker keeps the request after its prefill
and decodes it itself (no KV moves, no PrefillDone): its KV (prompt + max_tokens) must fit now
or the work is refused ("kv_full: ...", retryable, as a decode worker refuses it); its tokens go
to the router in TokenBatches as a decode worker's do (`on_tokens`), with cancellation and
max_tokens as there. `decoding` lists them until their last token.
"""

from __future__ import annotations

from common import messages as m
from common import tracing
from common.engines.base import EngineLoad, EngineRequest, Prefilled
from common.engines.replay import drain
from common.perf_model import PerfModel
from common.worker_core.base import EngineInfo, WorkerCore
from common.worker_core.ports import NULL_LOG, Log, WorkerPorts


class PrefillCore(WorkerCore):
    role = "prefill"

    def __init__(self, worker_id: str, incarnation: str, info: EngineInfo, ports: WorkerPorts, *, model: str,
                 kv_transport: str = "modeled", log: Log = NULL_LOG, can_retain: bool = True) -> None:
        super().__init__(worker_id, incarnation, info, ports, model=model, kv_transport=kv_transport, log=log)
        self.can_retain = can_retain  # its engine can decode (route "retain"); else it says no KV is free for it
        self.work: dict[str, m.PrefillWork] = {}
        self.targets: dict[tuple[str, int], m.KvTarget] = {}
        self.kv_out: dict[str, float] = {}  # request -> when it stops waiting for the decode side's read
        self.decoding: set[str] = set()  # retained requests (route "retain") it decodes now
        self.streaming: set[str] = set()  # ... of which, those past their first token
        self.counters.update(prefilled=0, kv_transfers=0, kv_failures=0, retained=0, finished=0)

    def heartbeat(self, load: EngineLoad, model: PerfModel | None, *, coeffs: m.Coeffs | None = None,
                  last_dispatch: int | None = None) -> m.PrefillHeartbeat:
        """Its next heartbeat: its queue, as the engine reports it, and its own replay of that queue
        with `model` (None: no model, no replay)."""
        self.seq += 1
        queue = None
        if load.backlog is not None and model is not None:
            t = drain(model, self.info.token_budget, self.info.max_batch, load.busy_s, load.backlog)
            queue = m.QueueDrain(start_s=t.start, chunks=list(t.chunks), used=t.used, end_s=t.end)
        return m.PrefillHeartbeat(
            worker_id=self.worker_id, incarnation=self.incarnation, seq=self.seq,
            queued_tokens=load.queued_tokens, queued_requests=load.queued_requests,
            token_budget=self.info.token_budget,
            last_dispatch=self.last_dispatch if last_dispatch is None else last_dispatch,
            step_ms_p50=load.step_ms_p50, steps=load.steps, coeffs=coeffs, draining=self.draining,
            backlog=load.backlog, busy_s=load.busy_s, max_batch=self.info.max_batch, drain=queue,
            step_bias=load.step_bias, step_err_p50=load.step_err_p50, step_err_p90=load.step_err_p90,
            decodes=load.batch, decode_kv_tokens=load.kv_tokens,
            strictest_tbt_slo=load.strictest_tbt_slo,
            kv_free_tokens=max(0, load.kv_free_tokens) if self.can_retain else 0,
            step_margin=load.step_margin)

    def planned_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        return [self.work[rid] for rid in self.decoding if rid in self.work]

    def held_requests(self) -> list[tuple[str, int]]:
        return [(rid, w.attempt) for rid, w in self.work.items()]

    def held_ids(self) -> list[str]:
        return [*self.work, *self.kv_out]  # KV kept for a pull too: freed if the router forgot it

    def drain_pending(self, now: float) -> bool:
        """Whether decode workers may still read KV from here (pull mode), as of `now`."""
        for rid in [r for r, until in self.kv_out.items() if until <= now]:
            del self.kv_out[rid]
        return bool(self.kv_out)

    # -- admission, cancellation -----------------------------------------------------------------
    def on_work(self, w: m.PrefillWork, load: EngineLoad | None = None) -> bool:
        """Queue a PrefillWork in the engine, or turn it away (draining; a prompt the engine can
        never take; a retained request whose KV does not fit `load`'s free KV). A re-dispatch
        replaces the attempt it held. True when queued."""
        self.saw_dispatch(w.dispatch)
        if self.draining:
            self.refuse(w.request_id, w.attempt, "worker_draining")
            return False
        old = self.work.get(w.request_id)
        if old is not None:  # a re-dispatch of something it still holds: the old attempt stops
            self.ports.abort(w.request_id)
            self.decoding.discard(w.request_id)
            self.streaming.discard(w.request_id)
        if why := self.too_long(len(w.prompt_token_ids)):
            self.refuse(w.request_id, w.attempt, why, invalid=True)
            return False
        if w.retain and not self.can_retain:
            self.refuse(w.request_id, w.attempt, "retain_unsupported: this engine does not decode on a prefill worker")
            return False
        if w.retain and load is not None and (need := len(w.prompt_token_ids) + w.sampling.max_tokens) > \
                load.kv_free_tokens:
            self.refuse(w.request_id, w.attempt, f"kv_full: {need} tokens needed")
            return False
        if not self.ports.start(EngineRequest(request_id=w.request_id, attempt=w.attempt,
                                              prompt_token_ids=w.prompt_token_ids, sampling=w.sampling,
                                              mode="retain" if w.retain else "prefill", tbt_slo=self.tbt_budget(w),
                                              cached_tokens=w.cached_tokens,
                                              resume_tokens=w.resume_tokens if w.retain else 0,
                                              trace_headers=tracing.headers(w.traceparent, w.tracestate))):
            return False
        self.work[w.request_id] = w
        if w.retain:
            self.decoding.add(w.request_id)
            self.counters["retained"] += 1
        # at once: router replicas see a prefill queue only through its heartbeats (each one's
        # ledger holds only its own dispatches), so each learns of another's sooner
        self.ports.beat_now(at_once=True)
        return True

    def on_cancel(self, c: m.Cancel) -> bool:
        """The router cancels a request, or says its KV was read ("kv_consumed"). True if it held it."""
        self.kv_out.pop(c.request_id, None)
        w = self.work.get(c.request_id)
        if w is None or (c.attempt >= 0 and c.attempt != w.attempt):
            return False
        del self.work[c.request_id]
        self.decoding.discard(c.request_id)
        self.streaming.discard(c.request_id)
        self.forget_target(c.request_id, w.attempt)
        self.ports.abort(c.request_id)
        self.log.info("request_cancelled", request_id=c.request_id, reason=c.reason)
        return True

    def drop(self, request_id: str) -> None:
        self.kv_out.pop(request_id, None)
        self.decoding.discard(request_id)
        self.streaming.discard(request_id)
        w = self.work.pop(request_id, None)
        if w is not None:
            self.forget_target(request_id, w.attempt)
            self.ports.abort(request_id)
            self.ports.beat_now()

    def forget(self, request_id: str) -> None:
        self.decoding.discard(request_id)
        self.streaming.discard(request_id)
        w = self.work.pop(request_id, None)
        if w is not None:
            self.forget_target(request_id, w.attempt)

    # -- the hand-off ----------------------------------------------------------------------------
    def on_target(self, t: m.KvTarget) -> bool:
        """Where the decode worker wants this request's KV; True if it is for an attempt held here."""
        w = self.work.get(t.request_id)
        if w is None or w.attempt != t.attempt:
            return False
        self.targets[(t.request_id, t.attempt)] = t
        return True

    def forget_target(self, request_id: str, attempt: int) -> None:
        self.targets.pop((request_id, attempt), None)

    def on_prefilled(self, p: Prefilled) -> m.PrefillWork | None:
        """The engine prefilled a request: the work to hand off (None: not held here, a stale attempt)."""
        w = self.work.get(p.request_id)
        if w is None or w.attempt != p.attempt:
            return None
        self.counters["prefilled"] += 1
        self.ports.beat_now()
        return w

    def handed_off(self, w: m.PrefillWork, p: Prefilled, kv: m.KvHandle, error: str, now: float,
                   kv_hold_s: float) -> bool:
        """Its KV moved (or failed to: `error`): tell the router (PrefillDone). False when the
        request was cancelled or re-dispatched meanwhile (nothing is sent). A pulled KV (the engine's
        `kv_params`) is kept `kv_hold_s` for the decode side to read."""
        self.forget_target(w.request_id, w.attempt)
        if self.work.get(w.request_id) is not w:
            return False
        del self.work[w.request_id]
        self.counters["kv_failures" if error else "kv_transfers"] += 1
        self.ports.send(m.PrefillDone(request_id=w.request_id, attempt=w.attempt, worker_id=self.worker_id, kv=kv,
                                      queue_s=p.queue_s, prefill_s=p.prefill_s, first_token_id=p.first_token_id,
                                      kv_error=error, prompt_logprobs=p.prompt_logprobs))
        if p.kv_params and not error:  # pull mode: the decode side reads it from here, later
            self.kv_out[w.request_id] = now + kv_hold_s
        return True

    # -- the third path: requests it decodes itself (route "retain") -------------------------------
    def on_tokens(self, items: list[m.TokenItem], step_s: float) -> None:
        """An engine step's tokens of retained requests: to the router, as a decode worker sends
        them (TokenBatch); a request's last token ends it here (a heartbeat soon)."""
        items = [it for it in items if it.finish_reason != "error"]  # already failed (engine_failed)
        if not items:
            return
        self.ports.send(m.TokenBatch(worker_id=self.worker_id, items=items, step_s=step_s))
        changed = False
        for it in items:
            self.first_token(it.request_id)
            if it.finish_reason is not None:
                self.finished(it.request_id)
                changed = True
        if changed:
            self.ports.beat_now()

    def first_token(self, request_id: str) -> None:
        """A retained request's prefill is over: it streams (a flip to decode keeps it, `kept`)."""
        if request_id in self.decoding:
            self.streaming.add(request_id)

    def finished(self, request_id: str) -> None:
        """A retained request's last token."""
        if request_id in self.decoding:
            self.decoding.discard(request_id)
            self.streaming.discard(request_id)
            self.work.pop(request_id, None)
            self.counters["finished"] += 1

    # -- a role flip that keeps the running decodes ------------------------------------------------
    def running_decodes(self) -> list[tuple[str, int]]:
        """The retained requests past their first token: a flip to decode keeps them as the decode
        worker's own (its queued and running prefills, hand-offs included, are what the drain waits for)."""
        return [(rid, self.work[rid].attempt) for rid in self.streaming if rid in self.work]

    def kept_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        return [self.work[rid] for rid, _ in self.kept()]

    def adopt(self, old: WorkerCore) -> list[str]:
        """Take over the running decodes a decode core of this engine kept across its flip to
        prefill: they are requests this worker decodes itself (route "retain") from now on."""
        kept = old.kept_work()  # (its engine steps them on: it kept them, `can_retain` or not)
        ids = []
        self.told.update(old.told)
        for dw in kept:
            if not isinstance(dw, m.DecodeWork):
                return super().adopt(old)
            rid = dw.request_id
            self.work[rid] = m.PrefillWork(request_id=rid, attempt=dw.attempt, dispatch=dw.dispatch,
                                           prompt_token_ids=dw.prompt_token_ids, sampling=dw.sampling,
                                           decode_worker=self.worker_id, deadline_s=dw.deadline_s,
                                           cached_tokens=dw.cached_tokens, retain=True, tbt_slo=dw.tbt_slo,
                                           allowance_s=dw.allowance_s,
                                           resume_tokens=dw.resume_tokens, traceparent=dw.traceparent,
                                           tracestate=dw.tracestate)
            self.decoding.add(rid)
            self.streaming.add(rid)
            ids.append(rid)
        self.counters["adopted"] = self.counters.get("adopted", 0) + len(ids)
        self.log.info("role_change_kept", role=self.role, frm=old.role, requests=len(ids))
        return ids
