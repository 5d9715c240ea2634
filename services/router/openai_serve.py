"""Answering one completions or chat request: its choices' events to a JSON body or an SSE stream.

A request with several prompts, or n > 1, is several router requests (one per choice, each with
its own Sampling); their events are merged here, and the choice indexes are prompt x n + choice,
as in vLLM's server. A stop string found by a Choice ends its router request at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from functools import partial
from typing import Any, Protocol

import msgspec

from common.router_core.delivery import DeliveryAllowance
from common.router_core.requests import Event, Request
from services.router.errors import error_object
from services.router.openai_render import Choice, unary_choice, usage
from services.router.openai_schema import Plan
from services.router.openai_tools import ToolStream
from services.router.service import Router

Send = Callable[[dict[str, Any]], Awaitable[None]]
_json = msgspec.json.Encoder()
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def error_status(code: str) -> tuple[int, float | None]:
    """HTTP status and Retry-After (only where a retry can help) of a request that failed after
    admission."""
    if code == "invalid_request":  # a worker found the request itself at fault: retrying cannot help
        return 400, None
    if code == "deadline_exceeded":
        return 504, None
    if code in ("router_shutdown", "kv_wait_timeout", "prefill_wait_timeout", "decode_wait_timeout"):
        # another router, or room that frees, can take it
        return 503, 2.0
    if code in ("prefill_busy", "decode_busy", "kv_full"):
        # it waited at the router for room until its budget ran out (admission.py's bounded wait): overload
        return 429, 2.0
    if code in ("unavailable", "retries_exhausted"):
        return 503, None
    return 500, None


PLACED_POLL_S = 0.02  # how often a stream whose request waits at the router looks whether it left the queue


async def placed(choices: list[Choice]) -> tuple[int, dict[str, Any]] | None:
    """Before a stream's status line: while a request waits in the router's queue (no room yet,
    or late binding holds it), wait until it is placed or fails (bounded by its budget, else
    kv_wait_timeout); one that failed before any token gets its status (429 with Retry-After when
    its budget ran out) instead of a `200 OK` with an error inside (status, body as `unary`'s);
    None: stream it. A request that ended without an event (its client went away) waits no more."""
    while any(c.req.kv_wait_until > 0 and not c.req.done and not c.req.events.pending() for c in choices):
        await asyncio.sleep(PLACED_POLL_S)
    for c in choices:
        first = c.req.events.pending()
        if first and first[0].error is not None:
            status, retry_after = error_status(first[0].error_code)
            return status, {"message": first[0].error, "code": first[0].error_code, "retry_after": retry_after}
    return None


def feed(router: Router, c: Choice, events: list[Event]) -> None:
    c.push(events)
    if c.stop_early:
        c.stop_early = False
        router.stop_early(c.req)


async def unary(router: Router, p: Plan, choices: list[Choice], fingerprint: str | None = None) \
        -> tuple[int, dict[str, Any]]:
    for c in choices:
        while not c.done:
            feed(router, c, await c.req.events.take())
        if c.error is not None:
            status, retry_after = error_status(c.error.error_code)
            return status, {"message": c.error.error, "code": c.error.error_code, "retry_after": retry_after}
    req = choices[0].req
    d = req.decision
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if p.chat else "cmpl-") + (req.client_request_id or req.request_id),
        "object": "chat.completion" if p.chat else "text_completion", "created": int(time.time()),
        "model": p.model, "choices": [unary_choice(c) for c in choices], "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(p, choices, details=router.cfg.enable_prompt_tokens_details)}
    if p.chat:
        c0 = choices[0]
        body.update(prompt_logprobs=c0.prompt_logprobs_json() if c0.req.sampling.prompt_logprobs is not None else None,
                    prompt_token_ids=p.prompts[0] if p.return_token_ids else None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    body["kairos"] = {"route": d.route if d else None, "reason": d.reason if d else None,
                      "decode_worker": req.decode_worker, "prefill_worker": req.prefill_worker,
                      "ttft_s": (req.first_token_at - req.arrival) if req.first_token_at else None,
                      "attempts": req.attempt + 1, "kv_fallback": req.kv_fallback}
    return 200, body


class _Merge:
    """The next events of any of the choices (one task per choice when there are several)."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices = choices
        self.tasks: list[asyncio.Task[None]] = []
        if len(choices) > 1:  # one choice reads its events itself: no queue (asyncio.Queue(): 2-5 µs)
            self.q: asyncio.Queue[tuple[int, list[Event]]] = asyncio.Queue()
            self.tasks = [asyncio.create_task(self._pump(i, c)) for i, c in enumerate(choices)]

    async def _pump(self, i: int, c: Choice) -> None:
        while True:
            evs = await c.req.events.take()
            self.q.put_nowait((i, evs))
            if any(e.finish_reason is not None or e.error is not None for e in evs):
                return

    async def next(self) -> tuple[int, list[Event]]:
        if not self.tasks:
            return 0, await self.choices[0].req.events.take()
        return await self.q.get()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def _role_usage(p: Plan, c: Choice) -> dict[str, Any]:
    """continuous_usage_stats: the role chunk counts the prompt and no output yet (vLLM)."""
    if not p.continuous_usage:
        return {}
    pt = len(p.prompts[c.prompt_index])
    return {"usage": {"prompt_tokens": pt, "completion_tokens": 0, "total_tokens": pt}}


class DirectWrite(Protocol):
    """A connection's direct writes (services/router/edge.py's DirectWrite; tests pass a fake)."""

    def ready(self) -> bool: ...

    def open(self) -> bool: ...

    def write(self, body: bytes) -> None: ...


# the connection's DirectWrite (services/router/edge.py), set by the HTTP layer in the request's
# own task (each request runs in a task of its own: the value is that request's); None: none
DIRECT_WRITE: ContextVar[DirectWrite | None] = ContextVar("kairos_direct_write", default=None)

_MARK = "\ue000kairos-text\ue000"  # stands for a chunk's text while its template is made (never escaped)
_MARK_JSON = _json.encode(_MARK)


def plain(p: Plan, choices: list[Choice]) -> bool:
    """A stream whose middle chunks are text only (the common case): no stop strings, logprobs,
    tool calls, echo, per-chunk usage or token ids, and a tokenizer whose tokens decode one by one
    or text deltas asked of the decode worker (Sampling.text: it decodes, `Event.text`).
    Its chunks before the last are one template per choice with the new text's JSON string in it
    (`Plain`): no per-token objects, no dict to build and encode per chunk."""
    return (not p.stop and p.logprobs is None and p.tool_plan is None and not p.echo and not p.continuous_usage
            and not p.return_token_ids and all(c.additive or c.req.sampling.text for c in choices))


class Plain:
    """The bytes of a plain stream's middle chunk for one choice: `pre + JSON string + post`, cut
    from the generic chunk rendered with a marker for its text (so the bytes are the generic
    path's by construction; tests/test_stream_bytes.py checks them against it). Cut at its first
    use: a stream whose only event is its end (one output token) never pays for it."""

    __slots__ = ("make", "post", "pre")

    def __init__(self, make: Callable[[], bytes]) -> None:
        self.make: Callable[[], bytes] | None = make  # the generic chunk with the marker for its text
        self.pre = self.post = b""

    def take(self, c: Choice, evs: list[Event]) -> bytes | None:
        """The chunk for `evs` (tokens only), the choice's state moved on as `Choice.push` and
        `Choice.delta` would; None where the generic path must render them (an end, an error,
        logprobs, nothing to show, text that may end inside a character), the state untouched."""
        if len(evs) == 1:
            ev = evs[0]
            if ev.finish_reason is not None or ev.error is not None or ev.logprobs is not None \
                    or ev.prompt_logprobs is not None or not ev.token_ids:
                return None
            ids = ev.token_ids
            given = ev.text
        else:
            ids = []
            texts: list[str] | None = []
            for ev in evs:
                if ev.finish_reason is not None or ev.error is not None or ev.logprobs is not None \
                        or ev.prompt_logprobs is not None:
                    return None
                if ev.token_ids:
                    ids += ev.token_ids
                    if texts is not None:
                        if ev.text is None:
                            texts = None
                        else:
                            texts.append(ev.text)
            if not ids:
                return None
            given = "".join(texts) if texts is not None else None
        text = self.text_of(c, ids, given)
        return None if text is None else self.commit(c, ids, text)

    @staticmethod
    def text_of(c: Choice, ids: list[int], given: str | None = None) -> str | None:
        """The text `ids` add to the choice's, where it can go out as it is (None: the generic
        path must render it: the choice ended, text held back, nothing to show, a character
        that may not be complete). `given`: the decode worker's text of them (Event.text), the
        choice's own delta (common/tokenizer.py TextStream), so nothing is decoded here; without
        it only a tokenizer whose tokens decode one by one can go this way."""
        if c.done or c.sent != len(c.text):
            return None
        if given is not None:
            text = given
        elif c.additive:
            text = c._decode(ids)
        else:
            return None
        if not text or text[-1] == "\ufffd":
            return None
        return text

    def commit(self, c: Choice, ids: list[int], text: str) -> bytes:
        """The chunk of `ids` (decoding to `text`), the choice's state moved on as `Choice.push`
        and `Choice.delta` would."""
        c.ids += ids
        c.lps += [None] * len(ids)
        c.full += text
        c.text = c.full
        c.sent = len(c.full)
        c.lps_sent = len(c.ids)
        if self.make is not None:
            self.pre, _, self.post = self.make().partition(_MARK_JSON)
            self.make = None
        return self.pre + _json.encode(text) + self.post


class _Direct:
    """A single-choice plain stream's token chunks, written from the bus reader (the request's
    `Events.sink`) without waking its HTTP task: the tokens accepted during one turn of the event
    loop go out as one chunk (as the generic path joins the events it finds queued), written
    when the turn's other callbacks are done (`_flush_due`) or before the task writes anything
    itself (`flush`), so the order on the wire is the order of the events."""

    __slots__ = ("c", "delivery", "direct", "ids", "template", "texts")

    def __init__(self, template: Plain, c: Choice, direct: DirectWrite,
                 delivery: DeliveryAllowance | None = None) -> None:
        self.template, self.c, self.direct = template, c, direct
        self.delivery = delivery
        self.ids: list[int] = []
        self.texts: list[str] = []

    def offer(self, ev: Event) -> bool:
        """Events.sink: True when `ev` is taken (tokens only, the socket writable now). An event
        refused after others were taken in this turn has them handed back first, so the task
        renders them with it, as the queued path would (a stream's last tokens and its end, which
        arrive together, stay one chunk)."""
        if ev.finish_reason is not None or ev.error is not None or ev.logprobs is not None \
                or ev.prompt_logprobs is not None or not ev.token_ids:
            return self._refuse()
        return self.tokens(ev.token_ids, ev.text)

    def tokens(self, ids: list[int], text: str | None) -> bool:
        """Events.tokens: new tokens alone (`offer` without the Event), under the same rules."""
        if not ids or not self.direct.ready():
            return self._refuse()
        c = self.c
        if not self.ids and (c.done or c.sent != len(c.text)):
            return False
        if text is None:
            if not c.additive:
                return self._refuse()
            text = c._decode(ids)
        if not text or text[-1] == "\ufffd":
            return self._refuse()
        if not self.ids:
            loop = asyncio.get_running_loop()
            if _due_on[0] is not loop:  # no flush due on this loop yet (what a closed loop left is dropped)
                _due.clear()
                _due_on[0] = loop
                loop.call_soon(_flush_due)
            _due.append(self)
        self.ids += ids
        self.texts.append(text)
        return True

    def _refuse(self) -> bool:
        if self.ids:
            self.c.req.events.hand_back(Event(token_ids=self.ids, text="".join(self.texts)))
            self.ids, self.texts = [], []
        return False

    def flush(self) -> None:
        if not self.ids:
            return
        ids, text = self.ids, "".join(self.texts)
        self.ids, self.texts = [], []
        body = self.template.commit(self.c, ids, text)
        if self.direct.open():
            self.direct.write(body)
            if self.delivery is not None:
                wrote(self.delivery, self.c.req, time.monotonic())


def wrote(delivery: DeliveryAllowance, req: Request, now: float) -> None:
    """A stream's tokens were written to its socket at `now`: the gap since its last write less
    the step time the worker reported for them is one sample of the delivery allowance's measured
    part (common/router_core/delivery.py); none for an attempt's first token (`step_s` < 0) or a
    worker that reports no step time."""
    last, req.written_at = req.written_at, now
    if last > 0.0:
        gap = now - last
        if gap > req.write_gap_max:
            req.write_gap_max = gap
        if req.step_s > 0.0:
            delivery.observe(gap - req.step_s)


_due: list[_Direct] = []  # streams with tokens accepted in this turn of the loop
_due_on: list[asyncio.AbstractEventLoop | None] = [None]  # the loop their flush is scheduled on


def _flush_due() -> None:
    due = _due[:]
    _due.clear()
    _due_on[0] = None
    for d in due:
        d.flush()


async def stream(router: Router, send: Send, p: Plan, choices: list[Choice],
                 headers: list[tuple[bytes, bytes]], fingerprint: str | None = None, *,
                 fast: bool = True, direct: DirectWrite | None = None) -> None:
    """The SSE chunks, as vLLM's server writes them: chat opens with a role chunk per choice (with
    `prompt_token_ids` when return_token_ids is asked); a completion choice's first chunk carries
    its `prompt_token_ids` then; the final chunk of each choice (or the usage chunk, when usage is
    asked) carries the `system_fingerprint`. A plain stream's middle chunks come from a template
    (`Plain`; `fast=False`: every chunk the generic way, the reference the tests compare with);
    with one choice and `direct` (the connection's DirectWrite, services/router/edge.py; by
    default the one the HTTP layer put in `DIRECT_WRITE` for this request's task), each is
    written from the bus reader as its tokens arrive (the request's `Events.sink`), and this task
    wakes only for what needs it: the end, an error, a socket that must drain."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
    req = choices[0].req
    cid = ("chatcmpl-" if p.chat else "cmpl-") + (req.client_request_id or req.request_id)
    obj = "chat.completion.chunk" if p.chat else "text_completion"
    created = int(time.time())
    head = {"id": cid, "object": obj, "created": created, "model": p.model}

    def chunk(choice: dict[str, Any], c: Choice | None = None, **top: Any) -> bytes:
        body = {**head, "choices": [choice], **top}
        if c is not None and p.continuous_usage:
            pt = len(p.prompts[c.prompt_index])
            body["usage"] = {"prompt_tokens": pt, "completion_tokens": len(c.ids), "total_tokens": pt + len(c.ids)}
        return b"data: " + _json.encode(body) + b"\n\n"

    first: list[bytes] = []
    if p.chat:
        for c in choices:
            first.append(chunk({"index": c.index, "delta": {"role": p.role, "content": ""}, "logprobs": None,
                                "finish_reason": None},
                               prompt_token_ids=p.prompts[c.prompt_index] if p.return_token_ids else None,
                               prompt_text=None, **_role_usage(p, c)))
        if p.echo and p.echo_text:
            for c in choices:
                first.append(chunk({"index": c.index, "delta": {"content": p.echo_text}, "logprobs": None,
                                    "finish_reason": None}))
    if first:
        await send({"type": "http.response.body", "body": b"".join(first), "more_body": True})
    echoed = [False] * len(choices)
    ids_sent = [False] * len(choices)  # completions: the prompt's token ids went out (return_token_ids)
    offsets = [0] * len(choices)
    tool_streams = [ToolStream(p.tool_plan, p.prompts[c.prompt_index]) for c in choices] \
        if p.tool_plan is not None else []
    templates: list[Plain] = []
    if fast and plain(p, choices):
        if p.chat:
            templates = [Plain(partial(chunk, {"index": c.index, "delta": {"content": _MARK}, "logprobs": None,
                                               "finish_reason": None, "token_ids": None})) for c in choices]
        else:
            templates = [Plain(partial(chunk, {"index": c.index, "text": _MARK, "logprobs": None,
                                               "finish_reason": None, "stop_reason": None,
                                               "prompt_token_ids": None, "token_ids": None})) for c in choices]
    merge = _Merge(choices)
    events = choices[0].req.events
    last = b""  # the last choice's final chunk, written with the stream's end
    if direct is None:
        direct = DIRECT_WRITE.get()
    delivery = router.delivery if len(choices) == 1 else None  # one stream's writes: its gaps
    writer = _Direct(templates[0], choices[0], direct, delivery) if templates and direct is not None \
        and len(choices) == 1 else None
    if writer is not None:
        events.sink, events.tokens = writer.offer, writer.tokens
    try:
        while not all(c.done for c in choices):
            i, evs = await merge.next()
            c = choices[i]
            if writer is not None:
                writer.flush()  # what the bus reader took before these events goes first
            if templates:
                body = templates[i].take(c, evs)
                if body is not None:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    if delivery is not None:
                        wrote(delivery, req, time.monotonic())
                    continue
            feed(router, c, evs)
            if c.error is not None:
                status, _ = error_status(c.error.error_code)
                err = {**error_object(status, c.error.error or ""), "kairos_error": c.error.error_code}
                await send({"type": "http.response.body", "body": b"data: " + _json.encode(err) + b"\n\n"
                            b"data: [DONE]\n\n", "more_body": False})
                return
            start = c.lps_sent
            text, ids, lps = c.delta()
            strs = c.out_strs(start, lps) if p.logprobs is not None else []
            if not text and not ids and not c.done:
                continue
            fin = c.finish if c.done else None
            if p.chat:
                delta: dict[str, Any] | None = {"content": text} if text else {}  # held text: {} (vLLM)
                lp = c.chat_logprobs(ids, lps, strs) if p.logprobs is not None else None
                if tool_streams:  # vLLM's tool-call parser makes the delta (services/router/openai_tools.py)
                    delta = tool_streams[i].delta(text, ids, fin is not None)
                    fin = tool_streams[i].finish(fin)
                    if delta is None:
                        if fin is None and lp is None and not p.return_token_ids:
                            continue
                        delta = {}
                out: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": fin}
                if fin is not None:
                    out["stop_reason"] = c.stop_reason
                out["token_ids"] = ids if p.return_token_ids else None
            else:
                if p.echo and not echoed[i]:
                    echoed[i] = True
                    ptext, pids, plps, pstrs = c.echo_parts()
                    if p.max_tokens_zero:
                        text, ids, lps, strs = ptext, pids, plps, pstrs
                    else:
                        text, ids, lps, strs = ptext + text, pids + ids, plps + lps, pstrs + strs
                lp = None
                if p.logprobs is not None:
                    lp = c.completion_logprobs(ids, lps, strs, offsets[i])
                    if lp["tokens"]:
                        offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                prompt_ids = None
                if p.return_token_ids and not ids_sent[i]:
                    ids_sent[i] = True
                    prompt_ids = p.prompts[c.prompt_index]
                out = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": fin,
                       "stop_reason": c.stop_reason if fin is not None else None, "prompt_token_ids": prompt_ids,
                       "token_ids": ids if p.return_token_ids else None}
            top = {"system_fingerprint": fingerprint} if fin is not None and not p.include_usage else {}
            body = chunk(out, c, **top)
            if fin is not None and all(x.done for x in choices):
                last = body  # the stream's last chunk goes out with its end: one write, not two
                continue
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if delivery is not None and (text or ids):
                wrote(delivery, req, time.monotonic())
        tail = last
        if p.include_usage:
            u = usage(p, choices, details=router.cfg.enable_prompt_tokens_details, stream=True)
            u = {k: v for k, v in u.items() if v is not None}
            final = {**head, "choices": [], "usage": u, "system_fingerprint": fingerprint}
            tail += b"data: " + _json.encode({k: v for k, v in final.items() if v is not None}) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        if delivery is not None and last:
            wrote(delivery, req, time.monotonic())
    finally:
        events.sink = events.tokens = None
        if writer is not None:
            writer.ids, writer.texts = [], []  # ended (an error, the client gone): nothing more goes out
        merge.close()

