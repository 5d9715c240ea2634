"""One codec, built once: a msgpack encoder and one typed decoder per inbox.

No pickle anywhere. A payload that does not decode raises `DecodeError`; callers log and drop it.
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec

from common import messages as m

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_SEQ = struct.Struct(">Q")

DecodeError = msgspec.DecodeError


def encode(msg: m.Msg) -> bytes:
    return _encoder.encode(msg)


class Decoder(Generic[T]):
    """Typed decoder for one inbox union."""

    def __init__(self, type_: Any) -> None:
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(type_)

    def decode(self, payload: bytes | memoryview) -> T:
        result: T = self._dec.decode(payload)
        return result


router_inbox: Decoder[m.RouterInbox] = Decoder(m.RouterInbox)
heartbeat_inbox: Decoder[m.HeartbeatInbox] = Decoder(m.HeartbeatInbox)
prefill_inbox: Decoder[m.PrefillInbox] = Decoder(m.PrefillInbox)
decode_inbox: Decoder[m.DecodeInbox] = Decoder(m.DecodeInbox)
telemetry_inbox: Decoder[m.TelemetryInbox] = Decoder(m.TelemetryInbox)


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    value: int = _SEQ.unpack(frame)[0]
    return value
