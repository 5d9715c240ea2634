"""Fuzzing as tests (hypothesis): what a client or a peer sends never crashes the router.

- HTTP bodies: JSON objects over the real fields of the completion and chat bodies, with values
  of every JSON kind (nested, huge, negative, empty), and raw bytes: decoding and planning a
  request either succeeds or raises RequestError (a 400 naming the field); anything else would
  be a 500.
- Bus messages: msgpack maps tagged as every message type, with each field given values of the
  wrong kind, and raw bytes, through every inbox's decoder: a message decodes, or DecodeError
  (the receiver counts and drops it).

Derandomized and bounded (a few hundred examples each, seconds in all), so CI sees the same
inputs every run; run with `--hypothesis-seed=random` style settings locally to explore more.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import codec
from common import messages as m
from common.config import RouterConfig
from common.errors import RequestError
from common.tokenizer import SimpleTokenizer
from services.router import openai_schema as schema

FUZZ = settings(max_examples=300, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
                    st.sampled_from(["", "auto", "none", "required", "json_object", "user", "assistant", "tool"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)

COMPLETION_FIELDS = sorted(schema.CompletionBody.__struct_fields__)
CHAT_FIELDS = sorted(schema.ChatBody.__struct_fields__)
TOK = SimpleTokenizer()
CFG = RouterConfig()


def _plan(raw: bytes, chat: bool) -> None:
    try:
        schema.plan(schema.decode(raw, chat=chat), CFG, TOK)
    except RequestError:
        pass  # a 400 naming the field: fine


message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]),
                                 "content": values})


@FUZZ
@given(st.dictionaries(st.sampled_from(COMPLETION_FIELDS), values, max_size=6), st.text(max_size=30))
def test_completion_bodies_plan_or_get_a_400(body: dict[str, Any], prompt: str) -> None:
    body.setdefault("prompt", prompt)
    _plan(json.dumps(body).encode(), chat=False)


@FUZZ
@given(st.dictionaries(st.sampled_from(CHAT_FIELDS), values, max_size=6), st.lists(message, max_size=3))
def test_chat_bodies_plan_or_get_a_400(body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    body.setdefault("messages", messages)
    _plan(json.dumps(body).encode(), chat=True)


@FUZZ
@given(st.binary(max_size=200), st.booleans())
def test_raw_bytes_as_a_body_get_a_400(raw: bytes, chat: bool) -> None:
    _plan(raw, chat=chat)


def _members(union: Any) -> list[type[msgspec.Struct]]:
    return [t for t in typing.get_args(union) if isinstance(t, type) and issubclass(t, msgspec.Struct)]


INBOXES = [(codec.router_inbox, m.RouterInbox), (codec.prefill_inbox, m.PrefillInbox),
           (codec.decode_inbox, m.DecodeInbox), (codec.telemetry_inbox, m.TelemetryInbox)]


@st.composite
def tagged(draw: st.DrawFn) -> tuple[int, bytes]:
    i = draw(st.integers(0, len(INBOXES) - 1))
    kind = draw(st.sampled_from(_members(INBOXES[i][1])))
    fields = list(kind.__struct_fields__)
    msg: dict[str, Any] = {"type": kind.__name__}
    for f in draw(st.lists(st.sampled_from(fields), max_size=len(fields), unique=True)) if fields else []:
        msg[f] = draw(values)
    return i, msgspec.msgpack.encode(msg)


@FUZZ
@given(tagged())
def test_bus_messages_decode_or_are_dropped(case: tuple[int, bytes]) -> None:
    i, payload = case
    try:
        INBOXES[i][0].decode(payload)
    except codec.DecodeError:
        pass  # counted and dropped by the receiver


@FUZZ
@given(st.binary(max_size=300))
def test_raw_bytes_on_the_bus_are_dropped(payload: bytes) -> None:
    for dec, _ in INBOXES:
        try:
            dec.decode(payload)
        except codec.DecodeError:
            pass
