"""One in-flight request at the router: its state, its timing, and the events for its client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec.structs import replace as msgspec_replace

from common import messages as m
from common.policy.base import Decision
from common.router_core.prefix import Seen


@dataclass(slots=True)
class Event:
    """What the HTTP layer reads: new token ids, or the end (finish_reason), or an error."""

    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: list[m.TokenLogprobs] | None = None
    prompt_logprobs: list[m.TokenLogprobs | None] | None = None
    error: str | None = None
    error_code: str = ""
    text: str | None = None  # the text token_ids add, from the decode worker (TokenItem.text); None: decode them


class Events:
    """The events of one request, for its one HTTP task: put from the router's callbacks, taken
    all at once by the task. Cheaper than asyncio.Queue (no getter deque, no loop lookup per
    put), which matters at one put per streamed token. Unbounded like the Queue it replaces:
    a request holds at most its max_tokens tokens plus one end event.

    `sink`: set by a consumer that can take an event at once, synchronously (the HTTP layer's
    plain streams write a token chunk straight to the client's socket). It is offered an event
    only while the consumer waits in `take` with nothing queued, so events stay in order; it
    returns False to have the event queued as usual (an end, an error, a socket that is busy).
    `tokens`: the same consumer's way for new tokens alone (no logprobs, no end: `put_tokens`),
    offered their ids and text without an Event made for them (one per streamed token otherwise)."""

    __slots__ = ("_items", "_waiter", "sink", "tokens")

    def __init__(self) -> None:
        self._items: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[Event], bool] | None = None
        self.tokens: Callable[[list[int], str | None], bool] | None = None

    def put_nowait(self, ev: Event) -> None:
        sink = self.sink
        if sink is not None and self._waiter is not None and not self._items and sink(ev):
            return
        self._queue(ev)

    def put_tokens(self, ids: list[int], text: str | None) -> None:
        """New tokens and their text (None: not given), nothing else: `put_nowait(Event(token_ids=ids,
        text=text))`, offered to `tokens` first, under the same rule as `sink`."""
        take = self.tokens
        if take is not None and self._waiter is not None and not self._items and take(ids, text):
            return
        self._queue(Event(token_ids=ids, text=text))

    def _queue(self, ev: Event) -> None:
        self._items.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def pending(self) -> list[Event]:
        """The events not taken yet (not removed)."""
        return self._items

    async def take(self) -> list[Event]:
        """Every event so far, waiting for at least one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def hand_back(self, ev: Event) -> None:
        """The sink returns what it had taken and not yet delivered, just before it refuses an
        event: queued first (the refused event follows it), neither offered again nor waking the
        consumer (the refused event does)."""
        self._items.append(ev)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: m.Sampling
    ttft_slo: float
    tbt_slo: float
    arrival: float
    deadline: float
    cached_tokens: int = 0
    client_request_id: str = ""  # the client's x-request-id: a label only, never a bus key
    attempt: int = 0
    decision: Decision | None = None
    decided_at: float = 0.0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_done: bool = False
    first_token_at: float | None = None
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    step_s: float = -1.0   # the step time the worker reported for its last tokens (< 0: an attempt's first token)
    written_at: float = 0.0  # when the HTTP layer last wrote its tokens (the delivery allowance's measure)
    write_gap_max: float = 0.0  # ... and its largest gap between two such writes (request_done write_gap_max_s)
    n_out: int = 0
    out_ids: list[int] = field(default_factory=list)  # every token id sent to the client, in order
    resume_from: int = 0   # tokens already sent when this attempt was dispatched (a migrated request)
    migrations: int = 0    # times resumed on another decode worker after streaming (common.router_core.migrate)
    parked_until: float = 0.0  # parked (no worker could take it) until then (common.router_core.migrate)
    done: bool = False
    outcome: str = ""
    kv_fallback: bool = False
    kv_fallback_attempt: int = -1  # the attempt whose fallback was counted (a batch sent again counts once)
    kv_error: str = ""
    prefill: m.PrefillDone | None = None
    exclude: set[str] = field(default_factory=set)
    dispatched: dict[str, int] = field(default_factory=dict)  # worker -> dispatch number of this attempt's work there
    rejected_by: set[str] = field(default_factory=set)  # decode workers whose admission turned its deflection away
    events: Events = field(default_factory=Events)
    kv_wait_until: float = 0.0  # > 0: waiting in the router's queue for KV room until then
    held: bool = False          # ... because the policy held it (late binding), not for KV room
    wait_reason: str = ""       # why it waits, the policy's words
    short: str = ""             # ... and what is short: prefill_busy, decode_busy or kv_full (admission.shortage)
    wait_budget: float = 0.0    # > 0: its wait is bounded by its admission budget (seconds from arrival), not
    # kv_wait_timeout (admission.py's bounded wait)
    client: str = ""            # who sent it (API key, else address): its share of max_in_flight (admission.py)
    engine_cached: int | None = None   # prompt tokens the engine found cached (TokenItem.cached_tokens)
    engine_created: int | None = None  # ... and added to its cache (TokenItem.cache_created_tokens)
    # the work prompt's hashes per block size (given at submit, or computed at its first lookup),
    # kept: a held request is decided again at every freed slot and heartbeat, and hashing a long
    # prompt each time took a third of the router's CPU in a burst; `hash_memo_from` is the
    # resume_from they are for
    hash_memo: dict[int, list[int]] = field(default_factory=dict)
    hash_memo_from: int = 0
    prefix_seen: Seen = field(default_factory=Seen)  # ... and its last prefix lookup (RouterPrefix.lookup)
    traceparent: str = ""  # W3C trace context the workers' spans hang under (common/tracing.py; "": untraced)
    tracestate: str = ""
    span: object = None    # the router shell's span for it, when tracing
    decision_us: float = 0.0  # the last decision's CPU time
    indexed: dict[str, tuple[int, list[int]]] | None = None  # per worker: (its heartbeat seq, prefix blocks) that
    # the last dispatch added to the index (RouterPrefix.undo)

    @property
    def streamed(self) -> bool:
        return self.n_out > 0

    def work(self) -> tuple[list[int], m.Sampling]:
        """The prompt and sampling this attempt is dispatched with: the client's, or, for a request
        resumed after a migration, its prompt plus the tokens already sent and the tokens left. The
        engine counts `min_tokens` from the attempt's own first token, so a resumed attempt asks for
        those left; and no `prompt_logprobs`: the client had the prompt's with its first token (the
        resumed prompt's would run past the prompt and replace them)."""
        if not self.resume_from:
            return self.prompt_token_ids, self.sampling
        s = self.sampling
        return (self.prompt_token_ids + self.out_ids[:self.resume_from],
                msgspec_replace(s, max_tokens=s.max_tokens - self.resume_from,
                                min_tokens=max(0, s.min_tokens - self.resume_from), prompt_logprobs=None))

    def record(self, now: float, wall_offset: float = 0.0) -> m.RequestRecord:
        """Its record at its end, `now` (the router's monotonic clock; wall time = now + wall_offset)."""
        d = self.decision
        gaps = sorted(self.gaps)

        def pct(q: float) -> float | None:
            return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else None

        return m.RequestRecord(
            request_id=self.request_id, route=d.route if d else None, reason=d.reason if d else "",
            prefill_worker=self.prefill_worker, decode_worker=self.decode_worker,
            prompt_tokens=len(self.prompt_token_ids), output_tokens=self.n_out,
            ttft_s=(self.first_token_at - self.arrival) if self.first_token_at else None,
            ttft_pred_s=(d.ttft_decode_pred if d.route == "deflect" else d.ttft_prefill_pred) if d else None,
            tbt_p50_s=pct(0.5), tbt_p99_s=pct(0.99), tbt_max_s=gaps[-1] if gaps else None,
            e2e_s=now - self.arrival, outcome=self.outcome, attempts=self.attempt + 1,
            kv_fallback=self.kv_fallback, migrations=self.migrations, at=now + wall_offset, tbt_gaps_s=self.gaps[:4096],
            kv_bytes=self.prefill.kv.nbytes if self.prefill else 0,
            kv_transfer_s=self.prefill.kv.transfer_s if self.prefill else None, kv_error=self.kv_error,
            prefill_queue_s=self.prefill.queue_s if self.prefill else None,
            prefill_s=self.prefill.prefill_s if self.prefill else None, ttft_slo_s=self.ttft_slo,
            tbt_slo_s=self.tbt_slo, client_request_id=self.client_request_id)
