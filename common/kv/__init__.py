"""Real KV bytes over NIXL for the simulated engine (kv_transport="nixl").

Imports without NIXL installed; only creating a KvSender/KvReceiver (or check_transport("nixl"))
needs it, and then fails with KvUnavailable / ConfigError naming the install recipe.

The flow (the router only relays the small control messages)::

    decode worker                              router          prefill worker
    rx = receiver_from_config(cfg, ...)                         tx = sender_from_config(cfg, ...)
    Hello(kv_agent=rx.agent_info())  ─────────▶  relays info ─▶ tx.add_peer(info)
    DecodeWork(mode="handoff") ◀──────────────  dispatch  ───▶ PrefillWork
    ids = rx.reserve(key, layout.nbytes(L))
    KvTarget(block_ids=ids, agent_name=rx.name) ─────────────▶ (prefill completes)
                                                                payload = fill_pattern(request_id, L, bpt)
    view = await rx.wait(key, timeout,      ◀── NIXL WRITE ──── await tx.push(agent_name, key, ids, payload,
                         tokens=L, bytes_per_token=bpt)             timeout=cfg.kv_timeout)
                                                                (push_pattern: the same, no temporary array)
    rx.release(key); admit the request          KvReady ◀───── PrefillDone(kv=KvHandle(..., transfer_s=...))

`key` names one transfer attempt: transfer_key(request_id, attempt) == f"{request_id}:{attempt}".

Decode worker (receiver)::

    rx = receiver_from_config(cfg, name=worker_id, profile_bytes_per_token=profile.model.kv_bytes_per_token)
    async with rx:                                  # notification poller runs while open
        hello = Hello(..., kv_transport="nixl", kv_agent=rx.agent_info())
        key = transfer_key(work.request_id, work.attempt)
        try:
            ids = rx.reserve(key, rx.layout.nbytes(len(work.prompt_token_ids)))
        except KvNoSpace as e:
            ...                                     # send KvTarget(error=e.reason); prefill in place
        send(KvTarget(request_id=..., attempt=..., decode_worker=worker_id, agent_name=rx.name, block_ids=ids))
        try:
            await rx.wait(key, cfg.kv_timeout, tokens=L, bytes_per_token=rx.layout.bytes_per_token)
        except KvTransferError as e:                # KvTimeout, KvCorrupt: fall back to prefill in place
            fallback(reason=e.reason)
        finally:
            rx.release(key)                         # the sim never reads KV again: free at admission
        export(rx.stats)

Prefill worker (sender)::

    tx = sender_from_config(cfg, name=worker_id)
    tx.add_peer(info)                               # every time the router relays a decode worker's info
    bpt = layout_from_info(tx.peer_info(target.agent_name), cfg.kv_block_tokens).bytes_per_token
    try:                                            # fill_pattern(request_id, L, bpt), written into staging:
        r = await tx.push_pattern(target.agent_name, transfer_key(request_id, attempt), target.block_ids,
                                  request_id=request_id, tokens=L, bytes_per_token=bpt, timeout=cfg.kv_timeout)
        kv = KvHandle(transport="nixl", source_worker=worker_id, tokens=L, nbytes=r.nbytes,
                      transfer_s=r.transfer_s)
    except KvTransferError as e:
        ...                                         # PrefillDone / KvReady with error=e.reason
    tx.close()                                      # at shutdown

Failure outcomes (every wait is bounded):

    fault                                   sender (push)                 receiver (reserve / wait)
    receiver killed mid-transfer            KvPeerLost in ms; peer lost   (dead)
    receiver frozen (SIGSTOP)               KvTimeout at `timeout`; peer  (frozen)
                                            torn down, re-added next push
    receiver restarted, same name           KvPeerLost until add_peer(new (new process: fresh pool)
                                            info); then pushes succeed
    sender dies before the notification     (dead)                        KvTimeout at `timeout`; blocks
                                                                          quarantined on release
    bad block ids / sizes / addresses       KvBadDescriptor, nothing sent KvBadDescriptor (bad reserve)
    bytes differ from the pattern           -                             KvCorrupt
    pool full                               KvNoSpace (staging full)      KvNoSpace ("out of KV space")
    peer never added                        KvUnknownPeer                 -

All are KvTransferError subclasses with a `reason` ("peer_lost", "timeout", ...); both sides
count them in `stats["failures"]`. Byte scaling (bytes per token vs the profile's): layout.py.
"""

from __future__ import annotations

import common.kv._nixl as _nixl
from common import logging as klog
from common.config import WorkerConfig
from common.errors import ConfigError
from common.kv.errors import (
    REASONS,
    KvBadDescriptor,
    KvCorrupt,
    KvError,
    KvNixlError,
    KvNoSpace,
    KvPeerLost,
    KvTimeout,
    KvUnavailable,
    KvUnknownPeer,
    reason_of,
)
from common.kv.layout import DEFAULT_INFLIGHT_TOKENS, KvLayout, layout_from_info, plan_layout
from common.kv.pattern import fill_pattern, verify_pattern
from common.kv.receiver import KvReceiver, request_of, transfer_key
from common.kv.sender import KvSender, PushResult

TRANSPORTS = ("modeled", "nixl")


def nixl_available() -> bool:
    """True when NIXL imports in this environment."""
    return _nixl.available()


def check_transport(kv_transport: str) -> None:
    """Validate a worker's kv_transport at startup: ConfigError if unknown, or "nixl" without NIXL."""
    if kv_transport not in TRANSPORTS:
        raise ConfigError(f"unknown kv_transport {kv_transport!r}: use one of {', '.join(TRANSPORTS)}")
    if kv_transport == "nixl":
        try:
            _nixl.api()
        except KvUnavailable as e:
            raise ConfigError(str(e)) from e


def receiver_from_config(cfg: WorkerConfig, *, name: str, profile_bytes_per_token: int,
                         capacity_tokens: int = DEFAULT_INFLIGHT_TOKENS) -> KvReceiver:
    """The decode worker's receiver: pool of kv_pool_mib, layout by plan_layout (logged as kv_layout)."""
    check_transport("nixl")
    layout = plan_layout(pool_bytes=cfg.kv_pool_mib << 20, block_tokens=cfg.kv_block_tokens,
                         profile_bytes_per_token=profile_bytes_per_token, capacity_tokens=capacity_tokens,
                         bytes_per_token=cfg.kv_bytes_per_token)
    klog.get().info("kv_layout", bytes_per_token=layout.bytes_per_token,
                    profile_bytes_per_token=profile_bytes_per_token, scale=round(layout.scale, 6),
                    scaled=layout.bytes_per_token != profile_bytes_per_token, block_tokens=layout.block_tokens,
                    block_bytes=layout.block_bytes, num_blocks=layout.num_blocks,
                    capacity_tokens=layout.capacity_tokens, pool_bytes=layout.pool_bytes)
    return KvReceiver(name, num_blocks=layout.num_blocks, block_bytes=layout.block_bytes,
                      quarantine_s=cfg.kv_timeout + 1.0, layout=layout)


def sender_from_config(cfg: WorkerConfig, *, name: str) -> KvSender:
    """The prefill worker's sender, with kv_pool_mib of staging per peer block size."""
    check_transport("nixl")
    return KvSender(name, staging_bytes=cfg.kv_pool_mib << 20)


__all__ = [
    "DEFAULT_INFLIGHT_TOKENS", "REASONS", "TRANSPORTS",
    "KvBadDescriptor", "KvCorrupt", "KvError", "KvLayout", "KvNixlError", "KvNoSpace", "KvPeerLost",
    "KvReceiver", "KvSender", "KvTimeout", "KvUnavailable", "KvUnknownPeer", "PushResult",
    "check_transport", "fill_pattern", "layout_from_info", "nixl_available", "plan_layout", "reason_of",
    "receiver_from_config", "request_of", "sender_from_config", "transfer_key", "verify_pattern",
]
