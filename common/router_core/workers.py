"""The router's table of live workers: latest heartbeat + the ledger of work dispatched since.
It reads no clock: the router passes `now` (its monotonic clock) to what depends on time.

Heartbeats are timed on the router's own monotonic clock. A worker's view for the policy is its
last heartbeat plus every dispatch the worker had not yet acknowledged in it (heartbeats carry
the highest dispatch number the worker has seen), so back-to-back decisions between two
heartbeats do not herd onto the same "idle" worker. The ledger can be switched off to measure
what it buys (the paper's stale-view behaviour). With several routers, each ledger holds only
its own dispatches; a decode heartbeat lists every deflection the worker is prefilling and who
sent it, and the view adds the other routers' ones to this router's exact record.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common import messages as m
from common.engines.replay import Tail
from common.engines.step_error import bias_factor
from common.perf_model import PerfModel
from common.policy.base import ClusterView, Decision, DecodeView, PrefillView
from common.policy.schedule import reserved_step_cost


@dataclass(slots=True)
class LedgerEntry:
    request_id: str
    prompt_tokens: int
    reserve_tokens: int
    deflect: bool
    at: float = 0.0  # router clock (monotonic) when dispatched: when it joins the worker's queue
    retain: bool = False  # route "retain": a prefill worker decodes it itself, after its prefill


@dataclass(slots=True, eq=False)
class WorkerEntry:
    worker_id: str
    role: m.Role
    incarnation: str
    identity: bytes
    hello: m.Hello
    model: PerfModel                     # what the policy predicts it with: base_model x bias
    base_model: PerfModel                # its own coefficients (hello, heartbeats), else the router's profile
    joined: float
    last_seen: float
    hb: m.PrefillHeartbeat | m.DecodeHeartbeat | None = None
    dispatch_no: int = 0
    ledger: dict[int, LedgerEntry] = field(default_factory=dict)
    deflecting: dict[str, float] = field(default_factory=dict)  # request -> reserved step cost (s)
    deflect_info: dict[str, tuple[int, float]] = field(default_factory=dict)  # request -> (largest chunk,
    # predicted end of its prefill on the router clock)
    hb_at: float = 0.0                   # router clock when the last heartbeat came
    steady_at: float = 0.0               # its heartbeats are judged for unacknowledged work from then on
    # (membership.py, `on_heartbeat`: not the backlog read after a silence)
    backlog: tuple[tuple[int, int], ...] | None = None  # the last prefill heartbeat's, as a tuple
    drain: Tail | None = None            # the last prefill heartbeat's drain, on the router clock
    holding: set[str] = field(default_factory=set)             # requests this worker is working on
    draining: bool = False
    heartbeats: int = 0
    margin_max: float = 1.0              # the largest step margin its heartbeats said since it registered
    bias: float = 1.0                    # the measured step bias `model` is scaled by (step_error.bias_factor)
    coeffs: m.Coeffs | None = None       # the coefficients base_model was built from (heartbeats resend them)
    # a send to it failed (unroutable, or its queue full): out of every view and expired at once,
    # whatever it still sends (heartbeats, tokens), until it says Hello again
    unreachable: bool = False
    key: str | None = None               # under CURVE: the key it registered with (z85), the only one it may use
    # the policy's view of it, kept until something it is built from changes (`touch`): the
    # policy keeps per-view work by identity, so an unchanged worker must keep its view object
    _view: PrefillView | DecodeView | None = None
    _view_key: tuple[bool, str] = (False, "")
    _dirty: set[WorkerEntry] | None = None  # its table's set of entries touched since the last view

    def touch(self) -> None:
        """Its heartbeat, ledger, deflections, model or routability (draining, unreachable)
        changed: the next view is built afresh, and the table's next view takes it."""
        self._view = None
        if self._dirty is not None:
            self._dirty.add(self)

    def view(self, use_ledger: bool, me: str) -> PrefillView | DecodeView:
        if self._view is None or self._view_key != (use_ledger, me):
            self._view = self.prefill_view(use_ledger) if self.role == "prefill" else self.decode_view(use_ledger, me)
            self._view_key = (use_ledger, me)
        return self._view

    def next_dispatch(self, entry: LedgerEntry) -> int:
        self.dispatch_no += 1
        self.ledger[self.dispatch_no] = entry
        self.touch()
        return self.dispatch_no

    def acknowledge(self, last_dispatch: int, missed: list[int] | tuple[int, ...] = ()) -> list[LedgerEntry]:
        """Drop the dispatches a heartbeat acknowledges (numbers up to `last_dispatch`, but for
        those it says it `missed`: membership.py, `lost_dispatches`); returns them, in dispatch order."""
        if not self.ledger:
            return []
        skip = set(missed) if missed else ()  # (up to MISSED_MAX numbers: a set, not a list scan per entry)
        done = [self.ledger.pop(k) for k in [k for k in self.ledger if k <= last_dispatch and k not in skip]]
        if done:
            self.touch()
        return done

    def add_deflection(self, request_id: str, reserved_s: float, largest_chunk: int, end: float) -> None:
        """A deflection this router sent it: its reserved step cost, largest chunk and predicted
        end of prefill (router clock), until its first token (`end_deflection`)."""
        self.deflecting[request_id] = reserved_s
        self.deflect_info[request_id] = (largest_chunk, end)
        self.touch()

    def end_deflection(self, request_id: str) -> bool:
        """Its prefill is over (or the request ended): True if it was deflecting here."""
        self.deflect_info.pop(request_id, None)
        was = self.deflecting.pop(request_id, None) is not None
        if was:
            self.touch()
        return was

    def prefill_view(self, use_ledger: bool) -> PrefillView:
        hb = self.hb
        queued = hb.queued_tokens if isinstance(hb, m.PrefillHeartbeat) else 0
        reqs = hb.queued_requests if isinstance(hb, m.PrefillHeartbeat) else 0
        ledger: tuple[tuple[int, float], ...] = ()
        if use_ledger:
            for e in self.ledger.values():
                queued += e.prompt_tokens
                reqs += 1
            ledger = tuple((e.prompt_tokens, e.at) for e in self.ledger.values())
        # the third path (route "retain"): the requests it decodes itself, and those sent to it to
        # decode since its heartbeat (each at its prompt's context, its KV kept)
        kept = [e for e in self.ledger.values() if e.retain] if use_ledger else []
        kv_more = sum(e.reserve_tokens for e in kept)
        if not isinstance(hb, m.PrefillHeartbeat):  # none yet: idle since it registered
            return PrefillView(worker_id=self.worker_id, queued_tokens=queued, queued_requests=reqs,
                               token_budget=self.hello.token_budget, model=self.model, backlog=(),
                               busy_until=self.joined, ledger=ledger, decodes=len(kept),
                               decode_kv_tokens=sum(e.prompt_tokens for e in kept),
                               kv_free_tokens=max(0, self.hello.kv_capacity_tokens - kv_more))
        return PrefillView(worker_id=self.worker_id, queued_tokens=queued, queued_requests=reqs,
                           token_budget=self.hello.token_budget, model=self.model,
                           backlog=self.backlog, busy_until=self.hb_at + hb.busy_s, drain=self.drain,
                           ledger=ledger, max_batch=hb.max_batch, decodes=hb.decodes + len(kept),
                           decode_kv_tokens=hb.decode_kv_tokens + sum(e.prompt_tokens for e in kept),
                           strictest_tbt_slo=hb.strictest_tbt_slo, kv_free_tokens=max(0, hb.kv_free_tokens - kv_more),
                           step_margin=hb.step_margin / self.bias)

    def decode_view(self, use_ledger: bool, me: str = "") -> DecodeView:
        hb = self.hb
        h = self.hello
        busy_until = step_s = 0.0
        margin = 1.0
        if isinstance(hb, m.DecodeHeartbeat):
            # the margin is measured against the unscaled model: what is left of it beside the bias
            busy_until, step_s, margin = self.hb_at + hb.busy_s, hb.step_ms_p50 / 1000.0, hb.step_margin / self.bias
            batch, kv, free = hb.batch, hb.kv_tokens, hb.kv_free_tokens
            resident, defl = hb.resident_prefill_tokens, hb.deflections
            slo, pending = hb.strictest_tbt_slo, hb.waiting_kv
        else:
            batch, kv, free, resident, defl, slo, pending = 0, 0, h.kv_capacity_tokens, 0, 0, None, 0
        reserved = 0.0
        reserved_tokens = 0
        inflight: tuple[tuple[float, float, int], ...] = ()
        if use_ledger:
            for e in self.ledger.values():
                free -= e.reserve_tokens
                if e.deflect:
                    resident += e.prompt_tokens
                else:
                    pending += 1
            defl = len(self.deflecting)  # exact: the router sees every deflection start and end
            reserved = sum(self.deflecting.values(), 0.0)
            reserved_tokens = sum(t for t, _ in self.deflect_info.values())
            inflight = tuple((end, self.deflecting.get(rid, 0.0), k) for rid, (k, end) in self.deflect_info.items())
            if isinstance(hb, m.DecodeHeartbeat):
                for held in hb.held:
                    if held.router != me:  # another router's deflection (as of its heartbeat)
                        defl += 1
                        reserved += held.reserved_s
                        reserved_tokens += held.largest_chunk
        return DecodeView(worker_id=self.worker_id, batch=batch, kv_tokens=kv, kv_free_tokens=max(free, 0),
                          kv_capacity_tokens=h.kv_capacity_tokens, resident_prefill_tokens=resident,
                          deflections=defl, strictest_tbt_slo=slo, token_budget=h.token_budget, model=self.model,
                          reserved_step_s=reserved, pending=pending, reserved_tokens=reserved_tokens,
                          busy_until=busy_until, inflight=inflight, step_s=step_s, step_margin=margin)


# the relay: how long a dispatch takes to be acknowledged in the worker's heartbeat (router clock),
# over this many of the latest dispatches; with router replicas, about how long it takes to show in
# another replica's view (the worker heartbeats every replica alike, at once when it takes work)
RELAY_SAMPLES = 64


class WorkerTable:
    def __init__(self, default_model: PerfModel, *, per_worker_models: bool = True, bias_correction: bool = True,
                 me: str = "") -> None:
        self.me = me  # this router's incarnation: deflections heartbeats list under another are the other routers'
        self.workers: dict[str, WorkerEntry] = {}
        self.former: set[str] = set()  # ids of workers that left or were lost: their late messages are routine
        self.default_model = default_model
        self.per_worker_models = per_worker_models
        self.bias_correction = bias_correction
        # the last full view (`view` with nothing excluded), kept and patched where workers were
        # touched: a heartbeat costs its own worker's view, not the whole fleet's
        self._cv: ClusterView | None = None
        self._cv_ledger = False
        self._at: dict[str, tuple[bool, int]] = {}  # worker id -> (decode?, position) in `_cv`
        self._dirty: set[WorkerEntry] = set()
        self.relays: deque[float] = deque(maxlen=RELAY_SAMPLES)  # seconds, dispatch to acknowledgement
        self._relay_p90: float | None = None  # cached `relay_p90` (None: samples came since)
        self.relays_seen = 0  # relays measured so far, all told

    def relay_p90(self) -> float:
        """The 90th percentile of the latest dispatches' relay (`relays`: dispatch to the heartbeat
        that acknowledged it, on this router's clock); 0.0 before any."""
        if self._relay_p90 is None:
            xs = sorted(self.relays)
            self._relay_p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else 0.0
        return self._relay_p90

    def register(self, hello: m.Hello, identity: bytes, now: float) -> tuple[WorkerEntry, WorkerEntry | None]:
        """Add or refresh a worker, `now` on the router's monotonic clock. Returns (entry, replaced
        entry of an older incarnation)."""
        old = self.workers.get(hello.worker_id)
        if old is not None and old.incarnation == hello.incarnation and old.role == hello.role:
            old.last_seen = now
            old.hello = hello
            old.identity = identity
            old.unreachable = False
            old.touch()
            return old, None
        self._cv = None  # a new worker: the next view is rebuilt
        model = PerfModel.from_coeffs(hello.coeffs) if (hello.coeffs and self.per_worker_models) else self.default_model
        entry = WorkerEntry(worker_id=hello.worker_id, role=hello.role, incarnation=hello.incarnation,
                            identity=identity, hello=hello, model=model, base_model=model, joined=now,
                            last_seen=now, coeffs=hello.coeffs if model is not self.default_model else None,
                            _dirty=self._dirty)
        # its dispatch numbers go on above any it has seen (Hello.last_dispatch: from a router that
        # restarted since; a role flip's old entry: its links keep the highest number), so a number
        # it reports never covers work of ours still on its way (heartbeat acks, ends_unheard)
        entry.dispatch_no = max(hello.last_dispatch,
                                old.dispatch_no if old is not None and old.incarnation == hello.incarnation else 0)
        self.workers[hello.worker_id] = entry
        return entry, old

    def heartbeat(self, hb: m.PrefillHeartbeat | m.DecodeHeartbeat, now: float) -> WorkerEntry | None:
        e = self.workers.get(hb.worker_id)
        if e is None or e.incarnation != hb.incarnation:
            return None
        if e.hb is not None and hb.seq <= e.hb.seq:
            return e  # reordered or duplicate: keep the newer one
        e.hb = hb
        e.heartbeats += 1
        e.last_seen = e.hb_at = now
        if hb.step_margin > e.margin_max:
            e.margin_max = hb.step_margin
        # workers send their coefficients in every heartbeat: a new model object only when they change
        refit = hb.coeffs is not None and self.per_worker_models and hb.coeffs != e.coeffs
        if refit:
            e.coeffs = hb.coeffs
            e.base_model = PerfModel.from_coeffs(hb.coeffs)  # type: ignore[arg-type]
        bias = bias_factor(hb.step_bias) if self.bias_correction else 1.0
        if refit or bias != e.bias:  # a new object only when it changes: the policy caches by identity
            e.bias = bias
            e.model = e.base_model.scaled(bias) if bias != 1.0 else e.base_model
        if isinstance(hb, m.PrefillHeartbeat):
            # kept per heartbeat (not per view) so that the policy's replay cache sees the same objects;
            # the worker replayed its queue with its own model: stretched by its measured bias
            e.backlog = tuple(hb.backlog) if hb.backlog is not None else None
            d, b = hb.drain, e.bias
            e.drain = None if d is None else Tail(e.hb_at + d.start_s * b, tuple(d.chunks), d.used,
                                                  e.hb_at + d.end_s * b)
        e.draining = e.draining or hb.draining
        acked = e.acknowledge(hb.last_dispatch, hb.missed)
        if acked:  # the relay of each: dispatch to this acknowledgement
            self.relays.extend(now - le.at for le in acked)
            self.relays_seen += len(acked)
            self._relay_p90 = None
        e.touch()
        return e

    def remove(self, worker_id: str) -> WorkerEntry | None:
        self.former.add(worker_id)
        self._cv = None
        return self.workers.pop(worker_id, None)

    def expired(self, timeout_s: float, now: float) -> list[WorkerEntry]:
        return [e for e in self.workers.values() if e.unreachable or now - e.last_seen > timeout_s]

    def view(self, *, use_ledger: bool, exclude: frozenset[str] = frozenset()) -> ClusterView:
        """Every routable worker's view, in registration order; an unchanged worker's is the same
        object as last time. Without `exclude`, only the workers touched since the last call are
        looked at (their views replaced in place), unless one joined or left the routable set."""
        if exclude:
            return self._build(use_ledger, exclude)
        cv = self._cv
        if cv is None or self._cv_ledger != use_ledger:
            return self._rebuild(use_ledger)
        if not self._dirty:
            return cv
        pre: list[PrefillView] | None = None
        dec: list[DecodeView] | None = None
        for e in self._dirty:
            at = self._at.get(e.worker_id)
            routable = not (e.draining or e.unreachable) and self.workers.get(e.worker_id) is e
            if routable != (at is not None):
                return self._rebuild(use_ledger)  # it became (un)routable: positions move
            if at is None:
                continue
            v = e.view(use_ledger, self.me)
            if at[0]:
                if dec is None:
                    dec = list(cv.decode)
                dec[at[1]] = v  # type: ignore[assignment]
            else:
                if pre is None:
                    pre = list(cv.prefill)
                pre[at[1]] = v  # type: ignore[assignment]
        self._dirty.clear()
        cv = self._cv = ClusterView(prefill=cv.prefill if pre is None else tuple(pre),
                                    decode=cv.decode if dec is None else tuple(dec))
        return cv

    def _rebuild(self, use_ledger: bool) -> ClusterView:
        cv = self._cv = self._build(use_ledger, frozenset())
        self._cv_ledger = use_ledger
        self._dirty.clear()
        self._at = {v.worker_id: (False, i) for i, v in enumerate(cv.prefill)}
        self._at.update((v.worker_id, (True, i)) for i, v in enumerate(cv.decode))
        return cv

    def _build(self, use_ledger: bool, exclude: frozenset[str]) -> ClusterView:
        p: list[PrefillView] = []
        d: list[DecodeView] = []
        for e in self.workers.values():
            if e.draining or e.unreachable or e.worker_id in exclude:
                continue
            v = e.view(use_ledger, self.me)
            if isinstance(v, PrefillView):
                p.append(v)
            else:
                d.append(v)
        return ClusterView(prefill=tuple(p), decode=tuple(d))

    def record_dispatch(self, d: Decision, request_id: str, prompt_tokens: int, reserve_tokens: int,
                        now: float) -> tuple[int, int]:
        """What a dispatch leaves in the table (dispatch.py): the ledger entries of the worker(s)
        chosen (what the policy will see of them until their heartbeats acknowledge the work) and, for a deflection, its
        record on the decode worker (reserved step cost, largest chunk, predicted end of its
        prefill; `WorkerEntry.end_deflection` at its first token). `prompt_tokens` is the prompt
        as sent, `reserve_tokens` the KV it may grow to. Returns the dispatch numbers the work
        messages carry: (decode worker's, prefill worker's or 0)."""
        dw = self.workers[d.decode_worker]
        work = prompt_tokens - d.cached_tokens  # what the prefilling worker computes, as the index knows
        if d.route == "retain":  # the prefill worker prefills it and then decodes it: one entry, with KV kept
            return 0, dw.next_dispatch(LedgerEntry(request_id, work, reserve_tokens, deflect=False, at=now,
                                                   retain=True))
        if d.route == "deflect":
            no = dw.next_dispatch(LedgerEntry(request_id, work, reserve_tokens, deflect=True, at=now))
            dw.add_deflection(request_id,
                              reserved_step_cost(dw.model, d.chunk_schedule, dw.hello.token_budget, d.cached_tokens),
                              max(d.chunk_schedule, default=0), now + (d.ttft_decode_pred or 0.0))
            return no, 0
        assert d.prefill_worker is not None
        pno = self.workers[d.prefill_worker].next_dispatch(LedgerEntry(request_id, work, 0, deflect=False, at=now))
        return dw.next_dispatch(LedgerEntry(request_id, prompt_tokens, reserve_tokens, deflect=False, at=now)), pno

    def count(self, role: m.Role) -> int:
        return sum(1 for e in self.workers.values() if e.role == role and not e.draining and not e.unreachable)
