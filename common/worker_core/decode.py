"""The decode worker's rules: its heartbeat, its admission of work, its ledgers, cancellation.

Ledgers:
- `pending`: handed-off requests admitted and waiting for their KV (KvReady, or the simulator's
  transfer end), each with the KV room kept for it (prompt + max_tokens) and the time after which
  it is prefilled in place instead (the fallback; `kv_handoff_timeout` or its deadline, if sooner);
- `active`: requests in the engine (and a handoff whose KV is being verified, live);
- `accepted` / `held`: deflections admitted and not yet prefilled, the step time each may add
  (admission checks the next one against them) and as heartbeats list them, with who sent each.

Admission of a DecodeWork (`on_work`), in this order: a draining worker refuses it
("worker_draining"); a re-dispatch replaces whatever attempt it held; a request whose prompt +
max_tokens exceeds the free KV (the engine's free KV less what `pending` keeps) is refused
("kv_full: ...", retryable: the router places it elsewhere), never queued; a prompt the engine can
never take is refused as invalid; a handoff goes to `pending`; a deflection whose schedule was
planned after more or fewer cached prompt tokens than the worker's own prefix cache holds (the
router's figure is a hint; `own_cached`, when the engine can say) is planned again (`replan`: the
router's chunks, cut or continued with chunks of its largest size, to cover exactly what the
worker must compute, never one token per step once a short plan runs out); a deflection that
carries a step budget is checked against the live state (common/policy/admission.py: the running decodes, the
deflections accepted, the request's own TBT SLO) and rejected at once with code
"deflect_rejected" if it does not fit; the rest starts in the engine.

The heartbeat is composed here from the engine's load (`EngineLoad`) and these ledgers: the one
mapping from an engine's report of itself to what the routers see (they map it to the policy's
DecodeView in one place, common/router_core/workers.py).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common import messages as m
from common import tracing
from common.engines.base import EngineLoad, EngineRequest
from common.perf_model import PerfModel
from common.policy.admission import REJECTED_REASON, Accepted, accepted_entry, check_deflection
from common.tokenizer import TextStream, Tokenizer, fingerprint
from common.worker_core.base import EngineInfo, WorkerCore
from common.worker_core.ports import NULL_LOG, Log, WorkerPorts

Outcome = Literal["pending", "started", "refused", "rejected"]


class Pending:
    """A handed-off request waiting here for its KV."""

    __slots__ = ("deadline", "key", "work")

    def __init__(self, work: m.DecodeWork, deadline: float, key: str = "") -> None:
        self.work = work
        self.deadline = deadline
        self.key = key  # the NIXL transfer key when KV landing space is reserved for it (the shell's)


class DecodeCore(WorkerCore):
    role = "decode"

    def __init__(self, worker_id: str, incarnation: str, info: EngineInfo, ports: WorkerPorts, *, model: str,
                 kv_transport: str = "modeled", kv_handoff_timeout: float = 30.0, deflect_admission: bool = True,
                 list_held: bool = True, log: Log = NULL_LOG, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(worker_id, incarnation, info, ports, model=model, kv_transport=kv_transport, log=log)
        # the model's tokenizer, when this worker can decode its outputs: a request whose router asks
        # for text deltas with the same tokenizer (Sampling.text) gets them with its ids (TextStream)
        self.tokenizer = tokenizer
        self.text_fp = fingerprint(tokenizer) if tokenizer is not None else ""
        self.texts: dict[str, tuple[int, TextStream]] = {}  # request -> (attempt, its text so far)
        self.kv_handoff_timeout = kv_handoff_timeout
        self.deflect_admission = deflect_admission
        self.list_held = list_held  # its heartbeats list the deflections it holds
        self.pending: dict[str, Pending] = {}
        self.active: dict[str, m.DecodeWork] = {}
        self.accepted: dict[str, Accepted] = {}
        self.held: dict[str, m.HeldDeflection] = {}
        self.in_prefill: set[str] = set()  # deflections in `active` not yet past their first token
        self.landing: set[str] = set()  # handoffs in `active` whose KV the shell verifies (not in the engine yet)
        self.queues: dict[str, m.RouterQueue] = {}  # router -> its oldest waiting request (QueueHead), echoed
        self.fallbacks: list[tuple[str, str]] = []  # (request, why) prefilled in place since the last TokenBatch
        self.counters.update(deflected=0, handoffs=0, kv_fallbacks=0, finished=0, deflect_rejected=0, replanned=0)

    # -- KV and the heartbeat ------------------------------------------------------------------
    def reserved(self) -> int:
        """KV tokens kept for the handoffs whose KV has not landed (prompt + max_tokens each)."""
        return sum(len(p.work.prompt_token_ids) + p.work.sampling.max_tokens for p in self.pending.values())

    def kv_free(self, load: EngineLoad) -> int:
        """KV tokens free for new work: the engine's free KV less what `pending` keeps."""
        return load.kv_free_tokens - self.reserved()

    def heartbeat(self, load: EngineLoad, *, coeffs: m.Coeffs | None = None, engine_waiting_kv: int = 0,
                  last_dispatch: int | None = None) -> m.DecodeHeartbeat:
        """Its next heartbeat: the engine's load, the KV it keeps for pending handoffs, the
        deflections it holds. `engine_waiting_kv`: handoffs the engine itself waits on (vLLM loads
        KV itself)."""
        self.seq += 1
        slo = load.strictest_tbt_slo
        return m.DecodeHeartbeat(
            worker_id=self.worker_id, incarnation=self.incarnation, seq=self.seq, batch=load.batch,
            kv_tokens=load.kv_tokens, kv_free_tokens=max(0, self.kv_free(load)),
            kv_capacity_tokens=load.kv_capacity_tokens, resident_prefill_tokens=load.resident_prefill_tokens,
            deflections=load.deflections, strictest_tbt_slo=slo, token_budget=self.info.token_budget,
            waiting_kv=len(self.pending) + engine_waiting_kv,
            last_dispatch=self.last_dispatch if last_dispatch is None else last_dispatch,
            step_ms_p50=load.step_ms_p50, step_ms_max=load.step_ms_max,
            tbt_slack_ms=(slo * 1000.0 - load.step_ms_max) if slo is not None else None,
            steps=load.steps, coeffs=coeffs, draining=self.draining, busy_s=load.busy_s,
            held=list(self.held.values()) if self.list_held else [], step_margin=load.step_margin,
            step_bias=load.step_bias, queues=list(self.queues.values()),
            step_err_p50=load.step_err_p50, step_err_p90=load.step_err_p90)

    def on_queue_head(self, q: m.QueueHead) -> None:
        """A router replica's wait queue changed: the next heartbeat echoes it to every router;
        when the request it would decide first changed, soon (common/router_core/waiting.py,
        `replica_turn`); when only how many wait changed (what the others' admission counts,
        admission.py), with the next heartbeat that comes anyway."""
        old = self.queues.get(q.router_incarnation)
        self.queues[q.router_incarnation] = m.RouterQueue(q.router_incarnation, q.oldest_at, q.late, q.waiting,
                                                          q.waiting_tokens, q.first_tokens)
        if old is None or (old.oldest_at, old.late, old.first_tokens) != (q.oldest_at, q.late, q.first_tokens):
            self.ports.beat_now()

    def planned_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        return list(self.active.values())

    def held_requests(self) -> list[tuple[str, int]]:
        return [(rid, w.attempt) for rid, w in self.active.items()] + [
            (rid, p.work.attempt) for rid, p in self.pending.items()]

    # -- admission -----------------------------------------------------------------------------
    def on_work(self, w: m.DecodeWork, now: float, load: EngineLoad, model: PerfModel | None,
                own_cached: int | None = None) -> Outcome:
        """Admit, keep (a handoff: until its KV lands) or turn away a DecodeWork (see the module
        docstring). `model`: its step-time model (None: none known; deflections then go unchecked).
        `own_cached`: prompt tokens its own prefix cache holds (None: unknown; the router's plan stands)."""
        self.saw_dispatch(w.dispatch)
        if self.draining:
            self.refuse(w.request_id, w.attempt, "worker_draining")
            return "refused"
        self.drop(w.request_id)  # a re-dispatch replaces whatever attempt it held
        need = len(w.prompt_token_ids) + w.sampling.max_tokens
        if need > self.kv_free(load):
            self.refuse(w.request_id, w.attempt, f"kv_full: {need} tokens needed")
            return "refused"
        if why := self.too_long(len(w.prompt_token_ids)):
            self.refuse(w.request_id, w.attempt, why, invalid=True)
            return "refused"
        if w.mode == "handoff":
            self.pending[w.request_id] = Pending(w, now + min(w.deadline_s, self.kv_handoff_timeout))
            self.ports.beat_now(at_once=True)  # took work: the other replicas learn of it sooner (`admit`)
            return "pending"
        if own_cached is not None and w.chunk_schedule and own_cached != (planned := self.planned_cached(w)):
            work = len(w.prompt_token_ids) - own_cached
            w = msgspec.structs.replace(w, chunk_schedule=replan(
                w.chunk_schedule, work, self.fitting_chunk(w, load, model, min(work, CONTINUATION_CHUNK))))
            self.counters["replanned"] += 1
            self.log.info("deflection_replanned", request_id=w.request_id, planned_cached=planned,
                          own_cached=own_cached, chunk_schedule=list(w.chunk_schedule))
        if w.step_budget_s > 0 and self.deflect_admission and (why := self.check(w, load, model)):
            self.counters["deflect_rejected"] += 1
            self.log.info("deflection_rejected", request_id=w.request_id, attempt=w.attempt, reason=why,
                          chunk_schedule=list(w.chunk_schedule))
            self.fail(w.request_id, w.attempt, why, code=REJECTED_REASON)
            return "rejected"
        return "started" if self.admit(w, "deflect", w.chunk_schedule, model) else "refused"

    def fitting_chunk(self, w: m.DecodeWork, load: EngineLoad, model: PerfModel | None, most: int) -> int:
        """The largest prefill chunk (at most `most` and the engine's token budget) whose step beside
        the running decodes fits `w`'s step budget, judged at the prompt's full length (its last,
        dearest chunk); the token budget when there is no model or budget to judge by. A plan redone
        for a prefix the worker does not hold continues with chunks of at least this size, asked for
        up to CONTINUATION_CHUNK (a plan made for a one-token remainder would otherwise prefill one
        token per step)."""
        most = max(1, min(most, self.info.token_budget or most))
        planned = self.planned_model(w, model)
        if planned is None or w.step_budget_s <= 0:
            return most
        ctx = len(w.prompt_token_ids)
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if planned.step_time(load.batch, load.kv_tokens, [(mid, ctx)]) <= w.step_budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def planned_cached(w: m.DecodeWork) -> int:
        """The prompt tokens the router planned `w`'s chunks to follow (its prefix-cache figure for
        this worker): the prompt less what the schedule prefills. Without a schedule, the request's own."""
        if not w.chunk_schedule:
            return w.cached_tokens
        return max(0, len(w.prompt_token_ids) - sum(w.chunk_schedule))

    @staticmethod
    def planned_model(w: m.DecodeWork, model: PerfModel | None) -> PerfModel | None:
        """The model the router planned `w`'s chunks with: the worker's, times the bias it took for it."""
        if model is None or w.model_bias == 1.0:
            return model
        return model.scaled(w.model_bias)

    def check(self, w: m.DecodeWork, load: EngineLoad, model: PerfModel | None) -> str:
        """'' when deflection `w` fits the live state, else why not: its own TBT SLO, the running
        decodes, the deflections accepted and not yet prefilled (common/policy/admission.py)."""
        planned = self.planned_model(w, model)
        if planned is None:
            return ""  # no step-time model to check with: admit, as before admission existed
        return check_deflection(planned, batch=load.batch, kv_tokens=load.kv_tokens, schedule=w.chunk_schedule,
                                budget_s=w.step_budget_s, tbt_slo=w.tbt_slo, accepted=self.accepted.values(),
                                strictest_tbt_slo=load.strictest_tbt_slo, cached=self.planned_cached(w))

    def admit(self, w: m.DecodeWork, mode: Literal["deflect", "handoff"], schedule: tuple[int, ...],
              model: PerfModel | None, kv: m.KvHandle | None = None) -> bool:
        """Start `w` in the engine: a deflection (prefilled here by `schedule`), or a handoff whose
        KV has landed (`kv`). False when the engine would not take it (the shell said why)."""
        if not self.ports.start(EngineRequest(request_id=w.request_id, attempt=w.attempt,
                                              prompt_token_ids=w.prompt_token_ids, sampling=w.sampling, mode=mode,
                                              tbt_slo=self.tbt_budget(w), chunk_schedule=schedule, kv=kv,
                                              cached_tokens=w.cached_tokens, resume_tokens=w.resume_tokens,
                                              trace_headers=tracing.headers(w.traceparent, w.tracestate))):
            return False
        self.active[w.request_id] = w
        if mode == "deflect":
            self.in_prefill.add(w.request_id)
        if mode == "deflect" and w.step_budget_s > 0 and schedule:
            planned = self.planned_model(w, model)
            if planned is not None:
                a = self.accepted[w.request_id] = accepted_entry(planned, schedule, w.step_budget_s,
                                                                 self.info.token_budget, self.planned_cached(w))
                self.held[w.request_id] = m.HeldDeflection(router=self.ports.router_of(w.request_id),
                                                           reserved_s=a.reserved_s, largest_chunk=max(schedule))
        self.counters["handoffs" if mode == "handoff" else "deflected"] += 1
        self.log.debug("request_admitted", request_id=w.request_id, attempt=w.attempt, mode=mode,
                       prompt_tokens=len(w.prompt_token_ids), chunk_schedule=list(schedule))
        # a deflection taken: at once where this worker serves several router replicas. Each sees
        # the deflections another sent only in heartbeats (`held`, and the step time they add), so
        # until then it may deflect onto this worker as if they were not there, and be turned away
        # here ("deflect_rejected"); a handoff whose KV landed was taken earlier (`on_work`)
        self.ports.beat_now(at_once=mode == "deflect")
        return True

    # -- a handoff's KV --------------------------------------------------------------------------
    def kv_arrived(self, request_id: str, attempt: int) -> Pending | None:
        """Its KV arrived (or failed to): the pending handoff it was for, out of `pending` (None: none
        such, a stale attempt or one dropped meanwhile). The caller admits it (`admit`, mode
        handoff) or prefills it in place (`fall_back`)."""
        p = self.pending.get(request_id)
        if p is None or p.work.attempt != attempt:
            self.log.info("kv_ready_unknown", request_id=request_id, attempt=attempt)
            return None
        del self.pending[request_id]
        return p

    def expired(self, now: float) -> list[Pending]:
        """The handoffs whose KV did not arrive in time, out of `pending` (their KV room released):
        the caller prefills each in place (`fall_back`)."""
        late = [p for p in self.pending.values() if now >= p.deadline]
        for p in late:
            del self.pending[p.work.request_id]
            self.release(p)
        return late

    def release(self, p: Pending) -> None:
        """Free the KV landing space reserved for `p` (if any)."""
        if p.key:
            self.ports.release_kv(p.key)
            p.key = ""

    def fall_back(self, w: m.DecodeWork, reason: str, model: PerfModel | None) -> None:
        """Its KV did not arrive: prefill it in place (an explicit, counted deflection, reported to
        the router with the next TokenBatch)."""
        self.engine_fell_back(w.request_id, reason)
        self.admit(w, "deflect", (), model)

    def engine_fell_back(self, request_id: str, reason: str) -> None:
        """A request is prefilled in place because its KV did not arrive (counted, logged, reported)."""
        self.counters["kv_fallbacks"] += 1
        self.log.warning("kv_fallback_prefill_in_place", request_id=request_id, reason=reason)
        self.fallbacks.append((request_id, reason))

    # -- engine output, cancellation ---------------------------------------------------------------
    def prefilled(self, request_id: str) -> bool:
        """A deflection's prefill is over (its first token) or it left: it reserves nothing any
        more. True if it was one that did."""
        self.in_prefill.discard(request_id)
        self.held.pop(request_id, None)
        return self.accepted.pop(request_id, None) is not None

    def finished(self, request_id: str) -> None:
        """A request's last token."""
        self.active.pop(request_id, None)
        self.counters["finished"] += 1

    def on_tokens(self, items: list[m.TokenItem], step_s: float) -> None:
        """An engine step's tokens: to the router (with the handoffs prefilled in place since the
        last batch), and the ledgers kept; a heartbeat soon if they changed."""
        items = [it for it in items if it.finish_reason != "error"]  # already failed (engine_failed)
        fb, self.fallbacks = self.fallbacks, []
        if not items and not fb:
            return
        if self.text_fp:
            items = [self._with_text(it) for it in items]
        self.ports.send(m.TokenBatch(worker_id=self.worker_id, items=items, step_s=step_s,
                                     kv_fallback=[rid for rid, _ in fb], kv_fallback_reasons=[why for _, why in fb]))
        changed = False
        for it in items:
            self.in_prefill.discard(it.request_id)
            if self.accepted and self.prefilled(it.request_id):
                changed = True  # every router sees at once that it holds one deflection less
            if it.finish_reason is not None:
                self.finished(it.request_id)
                changed = True
                self.log.debug("request_finished", request_id=it.request_id, attempt=it.attempt,
                               finish_reason=it.finish_reason)
        if changed:
            self.ports.beat_now()

    def _with_text(self, it: m.TokenItem) -> m.TokenItem:
        """`it` with its text delta (`TokenItem.text`) when its router asked for it with this
        worker's tokenizer; a resumed request (its earlier output is in its prompt) gets none: its
        text depends on tokens this worker did not make."""
        rid = it.request_id
        entry = self.texts.get(rid)
        if entry is None or entry[0] != it.attempt:
            w = self.active.get(rid)
            if w is None or w.attempt != it.attempt or w.sampling.text != self.text_fp or w.resume_tokens \
                    or self.tokenizer is None:
                return it
            entry = self.texts[rid] = (it.attempt, TextStream(self.tokenizer,
                                                              skip_special_tokens=not w.sampling.text_keep_special))
        text = entry[1].push(it.token_ids)
        if it.finish_reason is not None:
            del self.texts[rid]
        return msgspec.structs.replace(it, text=text)

    # -- a role flip that keeps the running decodes ------------------------------------------------
    def running_decodes(self) -> list[tuple[str, int]]:
        """Its requests past their first token (handoffs, deflections prefilled): a flip to prefill
        keeps them as the prefill worker's own decodes (route "retain"); deflections still
        prefilling and handoffs waiting for their KV are what its drain waits for."""
        return [(rid, w.attempt) for rid, w in self.active.items()
                if rid not in self.in_prefill and rid not in self.landing]

    def kept_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        return [self.active[rid] for rid, _ in self.kept()]

    def adopt(self, old: WorkerCore) -> list[str]:
        """Take over the running decodes a prefill core of this engine kept across its flip to
        decode: they are this worker's handoffs from now on (the engine holds their KV)."""
        ids = []
        self.told.update(old.told)
        for pw in old.kept_work():
            if not isinstance(pw, m.PrefillWork):
                return super().adopt(old)
            rid = pw.request_id
            # no text deltas (`_with_text`): its earlier tokens went out as ids alone, the router decodes them all
            self.active[rid] = m.DecodeWork(request_id=rid, attempt=pw.attempt, dispatch=pw.dispatch, mode="handoff",
                                            prompt_token_ids=pw.prompt_token_ids,
                                            sampling=msgspec.structs.replace(pw.sampling, text=""),
                                            tbt_slo=pw.tbt_slo, allowance_s=pw.allowance_s,
                                            deadline_s=pw.deadline_s,
                                            prefill_worker=self.worker_id, cached_tokens=pw.cached_tokens,
                                            resume_tokens=pw.resume_tokens, traceparent=pw.traceparent,
                                            tracestate=pw.tracestate)
            ids.append(rid)
        self.counters["adopted"] = self.counters.get("adopted", 0) + len(ids)
        self.log.info("role_change_kept", role=self.role, frm=old.role, requests=len(ids))
        return ids

    def on_cancel(self, c: m.Cancel) -> bool:
        """The router cancels a request (attempt -1: whichever it holds). True if it held it."""
        w = self.active.get(c.request_id) or (p.work if (p := self.pending.get(c.request_id)) else None)
        if w is None or (c.attempt >= 0 and c.attempt != w.attempt):
            return False
        self.drop(c.request_id)
        self.log.info("request_cancelled", request_id=c.request_id, reason=c.reason)
        return True

    def forget(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
        self.landing.discard(request_id)
        self.prefilled(request_id)
        self.active.pop(request_id, None)
        self.pending.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
        self.landing.discard(request_id)
        self.prefilled(request_id)
        p = self.pending.pop(request_id, None)
        if p is not None:
            self.release(p)
        if self.active.pop(request_id, None) is not None:
            self.ports.abort(request_id)
            self.ports.beat_now()


# The least chunk a plan redone for a prefix the worker does not hold continues with (when its step
# beside the running decodes fits the budget): the third path's shipped `retain_chunk`, measured safe
# beside decodes on the A100 under step noise. Continuing with the worker's own fitted chunk instead
# (up to 512 tokens) cost `chat-sessions-a100` 3.5 points of TBT in `python -m sim.regress`: the
# router's plan leaves margins (other deflections' chunks, slow periods) the fit does not see.
CONTINUATION_CHUNK = 64


def replan(schedule: tuple[int, ...], work: int, size: int = 0) -> tuple[int, ...]:
    """A chunk schedule covering exactly `work` prompt tokens: `schedule`'s chunks in order, cut
    where they reach it or continued with chunks of `size` or its largest chunk, whichever is
    larger (full-size chunks, not the one-token steps an engine falls back to once a plan runs out)."""
    out: list[int] = []
    left = work
    for chi in schedule:
        if left <= 0:
            break
        out.append(min(chi, left))
        left -= out[-1]
    size = max(size, *schedule) if schedule else size
    while left > 0 and size > 0:
        out.append(min(size, left))
        left -= out[-1]
    return tuple(out)
