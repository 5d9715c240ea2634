"""Typed outcomes of a KV transfer. Every failure is one of these; `reason` is its counter key.

KvTransferError (common.errors)    a KV transfer failed: fall back to prefill in place
├── KvUnavailable    reason "unavailable"     nixl is not installed / cannot start an agent
├── KvNoSpace        reason "no_space"        the receiver's block pool (or the sender's staging) is full
├── KvTimeout        reason "timeout"         a deadline passed (sender: transfer never completed;
│                                             receiver: no notification arrived)
├── KvPeerLost       reason "peer_lost"       the peer disconnected or was replaced mid-transfer
├── KvUnknownPeer    reason "unknown_peer"    push to a peer that was never added (or was removed)
├── KvBadDescriptor  reason "bad_descriptor"  block ids, sizes, addresses or metadata are invalid
├── KvCorrupt        reason "corrupt"         the bytes arrived but do not match the expected pattern
└── KvNixlError      reason "nixl_error"      any other NIXL/UCX failure (backend error, cancelled, ...)

`str(error)` is a human sentence; `error.reason` is the stable snake_case key services put in
`RequestFailed.reason` / `KvTarget.error` / `KvReady.error` and use as a metric label.
"""

from __future__ import annotations

from common.errors import KvTransferError


class KvError(KvTransferError):
    """Base of the typed KV outcomes; `reason` names the failure for counters and messages."""

    reason = "kv_error"


class KvUnavailable(KvError):
    reason = "unavailable"


class KvNoSpace(KvError):
    reason = "no_space"


class KvTimeout(KvError):
    reason = "timeout"


class KvPeerLost(KvError):
    reason = "peer_lost"


class KvUnknownPeer(KvError):
    reason = "unknown_peer"


class KvBadDescriptor(KvError):
    reason = "bad_descriptor"


class KvCorrupt(KvError):
    reason = "corrupt"


class KvNixlError(KvError):
    reason = "nixl_error"


REASONS: tuple[str, ...] = tuple(c.reason for c in (KvUnavailable, KvNoSpace, KvTimeout, KvPeerLost,
                                                    KvUnknownPeer, KvBadDescriptor, KvCorrupt, KvNixlError))


def reason_of(exc: BaseException) -> str:
    """The counter key of any exception raised by this package ("nixl_error" for an unmapped one)."""
    return exc.reason if isinstance(exc, KvError) else "nixl_error"
