"""What the router core does with each message a worker sends on the work socket.

Hello, Goodbye and heartbeats go to membership (membership.py). Every other message must come
from a registered worker, over the bus connection it registered with, and may concern only
requests assigned to it (the trust rules, trust.py); then: tokens are relayed to the request's
client (and may end it), PrefillDone starts the KV hand-off on the decode worker, KvWant and
KvTarget are relayed between the two workers of a request, RequestFailed re-dispatches,
resumes or fails the request, and a decode worker's admission refusal sends the deflection
elsewhere.

`Inbound` uses only the core's public parts, named by `Core` below (core.py builds it with the
core, which is one).
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from common import messages as m
from common.config import RouterConfig
from common.errors import ProtocolError
from common.policy import NoWorkers
from common.policy.admission import REJECTED_REASON
from common.router_core.membership import Membership
from common.router_core.migrate import Migration
from common.router_core.ports import Log, Metrics
from common.router_core.prefix import RouterPrefix
from common.router_core.requests import Event, Request
from common.router_core.trust import Gate
from common.router_core.waiting import Waiting
from common.router_core.workers import WorkerEntry, WorkerTable


class Core(Protocol):
    """What of the router core (core.py) message handling uses."""

    cfg: RouterConfig
    table: WorkerTable
    requests: dict[str, Request]
    gate: Gate
    counts: Counter[str]
    metrics: Metrics
    membership: Membership
    migration: Migration
    prefix: RouterPrefix
    waiting: Waiting
    opened_at: float
    liveness_s: float
    key_ids: dict[str, str | None]
    log: Log

    def send(self, w: WorkerEntry, msg: m.Msg) -> bool: ...
    def dispatch(self, req: Request, now: float, *, rejected: bool = False) -> None: ...
    def finish(self, req: Request, finish_reason: str, now: float) -> None: ...
    def fail(self, req: Request, message: str, code: str, now: float) -> None: ...
    def release(self, req: Request) -> None: ...
    def redispatch(self, req: Request, why: str, bad_worker: str | None, now: float) -> None: ...
    def unplaced(self, req: Request, e: NoWorkers, now: float) -> None: ...
    def retry_waiting(self, now: float) -> None: ...


class Inbound:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.table, self.requests, self.gate = core.table, core.requests, core.gate
        self.counts, self.metrics, self.membership = core.counts, core.metrics, core.membership
        self.log = core.log

    def handle(self, identity: bytes, msg: m.RouterInbox, now: float) -> None:
        if isinstance(msg, m.Hello):
            self.membership.on_hello(identity, msg, now)
            return
        if isinstance(msg, (m.PrefillHeartbeat, m.DecodeHeartbeat)):
            self.membership.on_heartbeat(identity, msg, now)
            return
        w = self._trusted_sender(identity, msg, now)
        if w is None:
            return
        match msg:
            case m.TokenBatch():
                self._on_tokens(msg, w, now)
            case m.PrefillDone():
                self._on_prefill_done(msg, w, now)
            case m.RequestFailed():
                self._on_failed(msg, w, now)
            case m.KvTarget():
                self._relay(msg, w, to="prefill")
            case m.KvWant():
                self._relay(msg, w, to="decode")
            case m.Goodbye():
                self.membership.on_goodbye(msg, w, now)
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} on the work socket")

    def _returning(self, worker_id: str, now: float) -> bool:
        """Whether a message from an unregistered `worker_id` is an ordinary recovery, not a stray
        peer: a worker this router saw leave or lose (its last messages, before it says Hello again),
        any worker in this router's first two liveness windows (a restarted router: the workers'
        in-flight messages), or, under CURVE, one whose key is bound to that very id."""
        core = self.core
        if worker_id in self.table.former or now - core.opened_at < 2 * core.liveness_s:
            return True
        key = self.gate.key
        return key is not None and core.key_ids.get(key) == worker_id

    # -- trust: who may send what (every message but Hello comes from a registered worker, bound to
    # the ZeroMQ identity it registered with, and concerns only requests assigned to it)
    def _trusted_sender(self, identity: bytes, msg: m.Msg, now: float) -> WorkerEntry | None:
        wid = identity.decode(errors="replace")
        w = self.table.workers.get(wid)
        if w is None or w.identity != identity:
            self.gate.drop(identity, "unregistered_peer", msg, routine=self._returning(wid, now))
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

    def handler_error(self, identity: bytes, msg: m.Msg, e: Exception, now: float) -> None:
        """A message we failed to handle (a bug, or input we did not foresee): fail the one request
        it concerns, if it is that sender's, and keep serving."""
        self.counts["handler_errors"] += 1
        self.metrics.observe_bad_frame("work_handler")
        rid = getattr(msg, "request_id", None)
        self.log.error("message_handler_failed", message=type(msg).__name__, request_id=rid,
                  peer=identity.decode(errors="replace")[:64], error=f"{type(e).__name__}: {e}"[:300],
                  exc_info=True)
        req = self.requests.get(rid) if isinstance(rid, str) else None
        w = self.table.workers.get(identity.decode(errors="replace"))
        if req is not None and w is not None and w.identity == identity and \
                w.worker_id in (req.prefill_worker, req.decode_worker):
            try:
                self.core.fail(req, f"internal error handling {type(msg).__name__} from {w.worker_id}",
                               "internal_error", now)
            except Exception as e2:  # already failing: log, never take the router down
                self.log.error("fail_after_handler_error_failed", request_id=rid,
                               error=f"{type(e2).__name__}: {e2}"[:300])

    def _on_tokens(self, b: m.TokenBatch, w: WorkerEntry, now: float) -> None:
        reqs = self.requests
        w.last_seen = now
        for i, rid in enumerate(b.kv_fallback):
            r = reqs.get(rid)
            if r is not None and self._assigned(w, r, b, role="decode"):
                if r.kv_fallback_attempt == r.attempt:  # a batch sent again after a break (RouterLink.recent)
                    continue
                r.kv_fallback, r.kv_fallback_attempt = True, r.attempt
                if i < len(b.kv_fallback_reasons):
                    r.kv_error = r.kv_error or b.kv_fallback_reasons[i]
                self.counts["kv_fallbacks"] += 1
                self.metrics.observe_kv_fallback()
        wid = w.worker_id
        send = self.core.send
        freed = False  # a deflection slot: held requests (late binding) may fit now
        for it in b.items:
            req = reqs.get(it.request_id)
            if req is not None and req.decode_worker != wid:  # not (or no longer) this worker's
                self.gate.drop(w.identity, "not_assigned", b, it.request_id)
                if it.finish_reason is None:  # e.g. it woke up after the request moved on: stop it there
                    send(w, m.Cancel(request_id=it.request_id, attempt=it.attempt, reason="not_assigned"))
                continue
            if req is None or req.attempt != it.attempt or req.done:
                if it.finish_reason is None:  # a stale attempt still running there
                    send(w, m.Cancel(request_id=it.request_id, attempt=it.attempt, reason="stale_attempt"))
                continue
            if it.pos >= 0 and it.pos != req.n_out and self._out_of_order(req, it, w, now):
                continue
            if req.n_out == req.resume_from:  # this attempt's first token: its prefill is over, its KV read
                if w.end_deflection(req.request_id):
                    freed = True
                self._kv_consumed(req)
                req.step_s = -1.0  # no gap of the worker's to compare its delivery with (delivery.py)
            else:
                req.step_s = b.step_s
            if req.first_token_at is None:
                req.first_token_at = now
            else:
                req.gaps.append(now - req.last_token_at)
            req.last_token_at = now
            if it.cached_tokens is not None and req.engine_cached is None:
                req.engine_cached, req.engine_created = it.cached_tokens, it.cache_created_tokens
            req.n_out += len(it.token_ids)
            req.out_ids += it.token_ids
            if it.logprobs is None and it.prompt_logprobs is None:  # the common case: no Event made on the way
                req.events.put_tokens(it.token_ids, it.text)
            else:
                req.events.put_nowait(Event(token_ids=it.token_ids, logprobs=it.logprobs,
                                            prompt_logprobs=it.prompt_logprobs, text=it.text))
            if it.finish_reason is not None:
                self.core.finish(req, it.finish_reason, now)
        if freed and self.core.waiting.queue:
            self.core.retry_waiting(now)

    def _out_of_order(self, req: Request, it: m.TokenItem, w: WorkerEntry, now: float) -> bool:
        """A token item that does not continue the stream where the client is (`TokenItem.pos`
        against `Request.n_out`). True: it was dropped. Tokens already streamed (a repeat) are
        dropped; a hole (what the worker sent before this was lost on the way: a bus connection
        that broke, e.g. a router frozen past the ZeroMQ heartbeat timeout, drops what was in
        flight) resumes the request from the last token the client has, as a migration does, so
        the client never sees a stream with tokens missing."""
        if it.pos < req.n_out and it.pos + len(it.token_ids) <= req.n_out and it.finish_reason is None:
            self.counts["tokens_repeated"] += 1
            return True
        self.counts["token_gaps"] += 1
        self.log.warning("tokens_lost_in_transit", request_id=req.request_id, attempt=req.attempt,
                         worker=w.worker_id, expected_pos=req.n_out, got_pos=it.pos,
                         action="resume from the last token the client has")
        self.core.redispatch(req, f"the stream is at token {req.n_out} but {w.worker_id} sent token {it.pos}: "
                                  "tokens lost in transit (its bus connection broke?)", None, now)
        return True

    def _on_prefill_done(self, p: m.PrefillDone, pw: WorkerEntry, now: float) -> None:
        req = self.requests.get(p.request_id)
        if req is not None and not self._assigned(pw, req, p, role="prefill"):
            return
        if req is not None and req.prefill is not None and req.prefill.attempt == p.attempt and req.prefill_done:
            self.counts["prefill_done_repeated"] += 1  # sent again after a break (RouterLink.recent)
            return
        pw.last_seen = now
        if req is not None and req.attempt != p.attempt:  # an older attempt's (sent again after a break):
            return                                        # the current one may be held here
        self.metrics.observe_prefill_done(p)
        pw.holding.discard(p.request_id)
        if req is None or req.done:
            return
        req.prefill_done = True
        req.prefill = p
        if p.prompt_logprobs:
            req.events.put_nowait(Event(prompt_logprobs=p.prompt_logprobs))
        if p.kv_error:
            req.kv_error = p.kv_error
        dw = self.table.workers.get(req.decode_worker or "")
        if dw is None:
            self.core.redispatch(req, "decode worker gone before the KV handoff", req.decode_worker, now)
            return
        if p.kv_error:
            self.counts["kv_failures"] += 1
            self.log.warning("kv_transfer_failed", request_id=req.request_id, prefill_worker=p.worker_id,
                        decode_worker=dw.worker_id, reason=p.kv_error)
        self.core.send(dw, m.KvReady(request_id=req.request_id, attempt=req.attempt, kv=p.kv, error=p.kv_error))

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
            self.core.send(w, msg)

    def _on_failed(self, f: m.RequestFailed, w: WorkerEntry, now: float) -> None:
        req = self.requests.get(f.request_id)
        if req is None or req.attempt != f.attempt or req.done:
            return
        if not self._assigned(w, req, f):
            return
        if f.code == REJECTED_REASON and req.decision is not None and req.decision.route == "deflect":
            self._deflect_rejected(req, f, now)
            return
        self.log.warning("worker_reported_failure", request_id=f.request_id, worker=f.worker_id, reason=f.reason,
                    retryable=f.retryable)
        if f.retryable:
            self.core.redispatch(req, f.reason, f.worker_id, now)
        elif f.code == "invalid_request":  # the request is at fault: no worker would take it
            self.core.fail(req, f.reason, "invalid_request", now)
        else:
            self.core.fail(req, f"worker {f.worker_id}: {f.reason}", "worker_error", now)

    def _deflect_rejected(self, req: Request, f: m.RequestFailed, now: float) -> None:
        """The decode worker's admission said no (another router's deflections, or decodes that
        landed since its heartbeat, left no room): another decode worker's deflection or the
        disaggregated path, same attempt."""
        req.rejected_by.add(f.worker_id)
        if req.indexed:  # it will not cache the prompt: what the dispatch told the prefix index is not so
            self.core.prefix.undo(f.worker_id, req.indexed.pop(f.worker_id, (-1, [])))
        self.counts["deflect_rejected"] += 1
        self.metrics.observe_deflect_rejected()
        self.log.info("deflection_rejected", request_id=req.request_id, decode_worker=f.worker_id, reason=f.reason)
        self.core.release(req)
        try:
            self.core.dispatch(req, now, rejected=True)
        except NoWorkers as e:
            self.core.unplaced(req, e, now)

    def _kv_consumed(self, req: Request) -> None:
        """A handed-off request's first token: the decode side has the KV (or gave up on it), so a
        prefill worker holding it for a pull may let it go (and finish its drain)."""
        p = req.prefill
        if p is not None and p.kv.params and req.prefill_worker:
            pw = self.table.workers.get(req.prefill_worker)
            if pw is not None:
                self.core.send(pw, m.Cancel(request_id=req.request_id, attempt=req.attempt, reason="kv_consumed"))
