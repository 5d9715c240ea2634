"""A plain stream's chunks from their templates (services/router/openai_serve.py `Plain`) are the
bytes the generic rendering writes, for every kind of request, whichever path each chunk takes.

Each case runs `serve.stream` over the same scripted token events (in-process: no socket, no
clock but a fixed `created`): without the templates (the reference), with them, and with them
written the direct way (a fake DirectWrite, also one whose socket refuses now and then): every byte the
same each way; and checks that the plain cases did use the templates and the
direct writes. The Events sink's ordering rule has its own test below.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from common import messages as m
from common.config import RouterConfig
from common.router_core.delivery import DeliveryAllowance
from common.router_core.requests import Event, Events, Request
from common.tokenizer import SimpleTokenizer, TextStream, fingerprint
from services.router import openai_schema as schema
from services.router import openai_serve as serve
from services.router.openai_render import Choice

TOK = SimpleTokenizer()
WORDS = TOK.encode("the model and the cache of a router")


class _Router:
    def __init__(self) -> None:
        self.cfg = RouterConfig()
        self.stopped: list[str] = []
        self.delivery = DeliveryAllowance()

    def stop_early(self, req: Request) -> None:
        self.stopped.append(req.request_id)


def _plan(body: dict[str, Any], chat: bool) -> schema.Plan:
    return schema.plan(schema.decode(json.dumps(body).encode(), chat=chat), RouterConfig(), TOK)


def _requests(p: schema.Plan) -> list[Request]:
    return [Request(request_id=f"r{i}", prompt_token_ids=p.prompts[i // p.n], sampling=s, ttft_slo=1.0, tbt_slo=1.0,
                    arrival=0.0, deadline=60.0)
            for i, s in enumerate([s for _ in p.prompts for s in p.samplings])]


class _Direct:
    """services/router/edge.py's DirectWrite without a socket: the bodies into `sent`; with
    `refuse`, every third `ready()` says no (a socket whose buffer is full: the event goes the
    `send` way)."""

    def __init__(self, sent: list[bytes], refuse: bool) -> None:
        self.sent, self.asked, self.written, self.refuse = sent, 0, 0, refuse

    def ready(self) -> bool:
        self.asked += 1
        return not self.refuse or self.asked % 3 != 0

    def open(self) -> bool:
        return True

    def write(self, body: bytes) -> None:
        self.written += 1
        self.sent.append(body)


async def _run(body: dict[str, Any], chat: bool, script: list[list[Event]], fast: bool,
               monkeypatch: pytest.MonkeyPatch, direct: bool = False, refuse: bool = False,
               tok: Any = TOK, worker_text: bool = False) -> tuple[list[bytes], int]:
    """The bodies `stream` sends for `script` (each batch put to every request, then the loop
    turns), and how many chunks the templates rendered (with `direct`: how many went straight
    to the fake socket). `worker_text`: each event carries the text a decode worker sends with
    its ids when the plan asks for it (Sampling.text: common/tokenizer.py TextStream), as
    common/worker_core/decode.py makes it."""
    monkeypatch.setattr(serve.time, "time", lambda: 1_700_000_000.0)
    p = schema.plan(schema.decode(json.dumps(body).encode(), chat=chat), RouterConfig(), tok)
    reqs = _requests(p)
    choices = [Choice(i, i // p.n, r, p, tok) for i, r in enumerate(reqs)]
    worker = [TextStream(tok, skip_special_tokens=not r.sampling.text_keep_special)
              if worker_text and r.sampling.text == fingerprint(tok) else None for r in reqs]
    sent: list[bytes] = []
    rendered = 0
    take = serve.Plain.take

    def counting(self: serve.Plain, c: Choice, evs: list[Event]) -> bytes | None:
        nonlocal rendered
        out = take(self, c, evs)
        rendered += out is not None
        return out

    monkeypatch.setattr(serve.Plain, "take", counting)

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            sent.append(msg["body"])

    async def produce() -> None:
        for batch in script:
            for r, w in zip(reqs, worker, strict=True):
                for ev in batch:
                    text = w.push(ev.token_ids) if w is not None and ev.token_ids is not None else None
                    if ev.token_ids is not None and ev.finish_reason is None and ev.error is None \
                            and ev.logprobs is None:  # as common/router_core/inbound.py puts tokens alone
                        r.events.put_tokens(list(ev.token_ids), text)
                        continue
                    r.events.put_nowait(Event(token_ids=list(ev.token_ids) if ev.token_ids else ev.token_ids,
                                              finish_reason=ev.finish_reason, logprobs=ev.logprobs,
                                              error=ev.error, error_code=ev.error_code, text=text))
            for _ in range(5):
                await asyncio.sleep(0)

    writer = _Direct(sent, refuse) if direct else None
    producer = asyncio.create_task(produce())
    await serve.stream(_Router(), send, p, choices, [], "fp-1", fast=fast, direct=writer)  # type: ignore[arg-type]
    await producer
    assert all(r.events.sink is None and r.events.tokens is None for r in reqs)
    return sent, writer.written if writer is not None else rendered


def _ev(ids: list[int], finish: str | None = None) -> Event:
    return Event(token_ids=ids, finish_reason=finish)


LENGTH = [[_ev(WORDS[:1])], [_ev(WORDS[1:2])], [_ev(WORDS[2:4])], [_ev(WORDS[4:5]), _ev(WORDS[5:6])],
          [_ev([]), _ev(WORDS[6:7])], [_ev(WORDS[7:8], "length")]]
STOP_TOKEN = [[_ev(WORDS[:1])], [_ev(WORDS[1:3])], [_ev([2], "stop")]]  # 2: the end-of-sequence token
ONE_BATCH = [[_ev(WORDS[:3]), _ev(WORDS[3:4], "length")]]
SPECIAL = [[_ev([0, 1])], [_ev(WORDS[:2])], [_ev([], "length")]]  # special tokens: text " " each
FAILED = [[_ev(WORDS[:2])], [Event(error="worker gone", error_code="unavailable")]]
LOGPROBS = [[Event(token_ids=WORDS[:1], logprobs=[m.TokenLogprobs([WORDS[0]], [-0.5], [1])])],
            [Event(token_ids=WORDS[1:2], logprobs=[m.TokenLogprobs([WORDS[1]], [-0.25], [1])], finish_reason="length")]]

PLAIN: list[tuple[str, bool, dict[str, Any], list[list[Event]]]] = [
    ("chat", True, {"messages": [{"role": "user", "content": "hi"}]}, LENGTH),
    ("completion", False, {"prompt": "hi"}, LENGTH),
    ("chat stop token", True, {"messages": [{"role": "user", "content": "hi"}]}, STOP_TOKEN),
    ("completion stop token", False, {"prompt": "hi"}, STOP_TOKEN),
    ("chat usage", True, {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     LENGTH),
    ("completion usage", False, {"prompt": "hi", "stream_options": {"include_usage": True}}, LENGTH),
    ("chat n=2", True, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, LENGTH),
    ("completion two prompts", False, {"prompt": ["hi", "the cache"]}, LENGTH),
    ("completion special tokens", False, {"prompt": "hi", "skip_special_tokens": False}, SPECIAL),
    ("chat error", True, {"messages": [{"role": "user", "content": "hi"}]}, FAILED),
    ("completion one batch", False, {"prompt": "hi"}, ONE_BATCH),
]
GENERIC: list[tuple[str, bool, dict[str, Any], list[list[Event]]]] = [
    ("completion stop string", False, {"prompt": "hi", "stop": ["and the"]}, LENGTH),
    ("chat logprobs", True, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, LOGPROBS),
    ("completion echo", False, {"prompt": "hi", "echo": True}, LENGTH),
    ("chat token ids", True, {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}, LENGTH),
    ("chat continuous usage", True, {"messages": [{"role": "user", "content": "hi"}],
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     LENGTH),
]
PLAIN_NAMES = {c[0] for c in PLAIN}


@pytest.mark.parametrize(("name", "chat", "body", "script"), PLAIN + GENERIC, ids=[c[0] for c in PLAIN + GENERIC])
async def test_templates_write_the_generic_bytes(name: str, chat: bool, body: dict[str, Any],
                                                 script: list[list[Event]], monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"model": RouterConfig().served_model_name, "max_tokens": 8, "stream": True, **body}
    want, none = await _run(body, chat, script, False, monkeypatch)
    got, rendered = await _run(body, chat, script, True, monkeypatch)
    assert none == 0
    assert got == want
    # written from the bus reader, the tokens of one turn of the loop in one chunk (tokens that
    # arrive with the end go with it): the same bytes
    got_direct, written = await _run(body, chat, script, True, monkeypatch, direct=True)
    assert got_direct == want
    plain_one = name in PLAIN_NAMES and "n=2" not in name and "prompts" not in name
    if plain_one and script is not ONE_BATCH:
        assert written > 0, "a plain stream of one choice should write its middle chunks directly"
    else:  # ONE_BATCH: its only tokens arrive with its end, and go with it
        assert written == 0
    # a socket that refuses now and then: the event it refused goes the generic way, with what
    # was taken before it in the same turn handed back: still the same bytes
    got_some, _ = await _run(body, chat, script, True, monkeypatch, direct=True, refuse=True)
    assert got_some == want
    assert want[-1].endswith(b"data: [DONE]\n\n")
    if name in PLAIN_NAMES and script is not ONE_BATCH:  # one batch: its only chunk is the last
        assert rendered > 0, "the plain stream's middle chunks should come from the templates"
    elif name not in PLAIN_NAMES:
        assert rendered == 0


def test_plain_is_only_the_plain_case() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert serve.plain(_plan(chat, True), [])
    for extra in ({"stop": ["x"]}, {"logprobs": True}, {"return_token_ids": True},
                  {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}):
        assert not serve.plain(_plan({**chat, **extra}, True), []), extra


async def test_the_sink_is_offered_an_event_only_while_the_consumer_waits_with_nothing_queued() -> None:
    """Events stay in order: an event the sink refuses is queued, and so is every event after it
    until the consumer has taken it; none is offered while the consumer is busy elsewhere."""
    events = Events()
    taken: list[Event] = []
    e1, e2, e3, e4 = (Event(token_ids=[i]) for i in range(4))
    events.sink = lambda ev: ev is not e3 and not taken.append(ev)
    events.put_nowait(e1)  # nobody waits: queued
    assert taken == [] and await events.take() == [e1]
    waiting = asyncio.create_task(events.take())
    await asyncio.sleep(0)
    events.put_nowait(e2)  # the consumer waits, nothing queued: the sink takes it
    assert taken == [e2] and not waiting.done()
    events.put_nowait(e3)  # refused: queued, the consumer woken
    events.put_nowait(e4)  # e3 not taken yet: queued behind it, not offered
    assert await waiting == [e3, e4] and taken == [e2]
    # tokens alone (Events.tokens, no Event made): the same rule
    got: list[list[int]] = []
    events.tokens = lambda ids, text: ids != [7] and not got.append(ids)
    events.put_tokens([5], "x")  # nobody waits: queued, as an Event
    assert got == [] and [(e.token_ids, e.text) for e in await events.take()] == [([5], "x")]
    waiting = asyncio.create_task(events.take())
    await asyncio.sleep(0)
    events.put_tokens([6], None)  # taken
    events.put_tokens([7], None)  # refused: queued, the consumer woken
    events.put_tokens([8], None)  # queued behind it
    assert [e.token_ids for e in await waiting] == [[7], [8]] and got == [[6]]


class ByteTokenizer:
    """A byte-level tokenizer in miniature (what Hugging Face's are, for decoding): one token per
    UTF-8 byte (ids 3..258), so a character may span tokens and a prefix's decode ends in U+FFFD;
    ids 0-2 special; and, as `clean_up_tokenization_spaces` does, " ." decodes as "." (the decode
    of a longer output is not always the shorter one's decode extended)."""

    vocab_size = 259
    eos_token_id = 2
    fingerprint = "bytes-test"
    additive = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytes(i - 3 for i in ids if i >= 3).decode(errors="replace").replace(" .", ".")
        return out if skip_special_tokens else "".join("<s>" for i in ids if i < 3) + out

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def render_chat(self, messages: list[dict[str, object]], **kw: Any) -> str:
        return "\n".join(f"{msg['role']}: {msg.get('content') or ''}" for msg in messages) + "\nassistant:"


BYTES = ByteTokenizer()
UTF = BYTES.encode("héllo wörld ✓ . ok 🙂 .")


def _byte_script() -> list[list[Event]]:
    """UTF's tokens one or a few at a time (characters split across events), then the end."""
    out: list[list[Event]] = []
    i = 0
    for k, step in enumerate([1, 2, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1, 1, 2, 1, 3, 1, 1, 1, 2, 1, 1, 1, 1]):
        if i >= len(UTF):
            break
        out.append([_ev(UTF[i:i + step])] if k % 5 else [_ev(UTF[i:i + 1]), _ev(UTF[i + 1:i + step])])
        i += step
    out.append([_ev(UTF[i:], "length")])
    return out


BYTE_CASES: list[tuple[str, bool, dict[str, Any]]] = [
    ("chat", True, {"messages": [{"role": "user", "content": "hi"}]}),
    ("completion", False, {"prompt": "hi"}),
    ("completion usage", False, {"prompt": "hi", "stream_options": {"include_usage": True}}),
    ("chat n=2", True, {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("completion special tokens", False, {"prompt": "hi", "skip_special_tokens": False}),
    ("completion stop string", False, {"prompt": "hi", "stop": ["ok"]}),
]


@pytest.mark.parametrize(("name", "chat", "body"), BYTE_CASES, ids=[c[0] for c in BYTE_CASES])
async def test_worker_text_writes_the_generic_bytes_for_a_byte_level_tokenizer(
        name: str, chat: bool, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer whose tokens do not decode one by one (Hugging Face's) takes the template path
    only with the decode worker's text deltas, and writes the bytes the router's own decoding
    writes, with characters split across tokens and a decode that rewrites what came before."""
    body = {"model": RouterConfig().served_model_name, "max_tokens": 64, "stream": True, **body}
    script = _byte_script()
    want, _ = await _run(body, chat, script, False, monkeypatch, tok=BYTES)
    assert "✓".encode() in b"".join(want)  # characters split across tokens, whole again
    # without the worker's text, a byte-level tokenizer stays on the generic path
    _, rendered = await _run(body, chat, script, True, monkeypatch, tok=BYTES)
    assert rendered == 0
    got, rendered = await _run(body, chat, script, True, monkeypatch, tok=BYTES, worker_text=True)
    assert got == want
    got_direct, written = await _run(body, chat, script, True, monkeypatch, direct=True, tok=BYTES, worker_text=True)
    assert got_direct == want
    got_some, _ = await _run(body, chat, script, True, monkeypatch, direct=True, refuse=True, tok=BYTES,
                             worker_text=True)
    assert got_some == want
    if "stop" in name:  # a stop string: the router must see the text itself, no deltas asked
        assert rendered == 0 and written == 0
    elif "n=2" in name:
        assert rendered > 0
    else:
        assert rendered > 0 and written > 0, "the worker's text should put a byte-level stream on the fast path"


@pytest.mark.parametrize(("name", "chat", "body", "script"), PLAIN + GENERIC, ids=[c[0] for c in PLAIN + GENERIC])
async def test_a_streams_last_chunk_goes_out_with_its_end(name: str, chat: bool, body: dict[str, Any],
                                                         script: list[list[Event]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The final chunk (the one with the finish reason), the usage chunk and `[DONE]` are one body:
    one write and one ASGI message at a stream's end, not two; the events are the same bytes."""
    body = {"model": RouterConfig().served_model_name, "max_tokens": 8, "stream": True, **body}
    sent, _ = await _run(body, chat, script, True, monkeypatch)
    events = [e for e in sent[-1].split(b"\n\n") if e]
    if "error" in name:
        assert events[-1] == b"data: [DONE]" and b"kairos_error" in events[0]
        return
    usage = "usage" in name  # include_usage: the usage chunk comes after the final one
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 2 + usage  # one final chunk: the last choice's (the others' went before)
    finish = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert any(c.get("finish_reason") for f in finish for c in f["choices"]), "the final chunk goes with [DONE]"
    if usage:
        assert finish[-1]["choices"] == [] and finish[-1]["usage"]["completion_tokens"] > 0
    assert not any(b"[DONE]" in b for b in sent[:-1])
