"""Decode side: a NIXL agent exposing a registered pool of KV blocks that prefill workers WRITE into.

    rx = KvReceiver("decode-0", num_blocks=4096, block_bytes=16384)
    async with rx:                                  # starts the notification poller
        hello = Hello(..., kv_agent=rx.agent_info())
        ids = rx.reserve(key, nbytes)               # KvNoSpace when full; send KvTarget(block_ids=ids)
        try:
            view = await rx.wait(key, timeout, tokens=n, bytes_per_token=bpt)   # KvTimeout / KvCorrupt
        finally:
            rx.release(key)

The poller drives UCX progress (the progress thread is off): it reads notifications every
`poll_s` while transfers are expected and every `idle_poll_s` otherwise, never blocking the
event loop. A reservation whose bytes never arrived is *quarantined* on release for
`quarantine_s`, so that a late WRITE from a slow or frozen sender cannot land in blocks already
handed to another request; a late notification for it frees the blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

import common.kv._nixl as _nixl
from common import logging as klog
from common.kv.blocks import BlockAllocator, is_contiguous
from common.kv.errors import KvBadDescriptor, KvCorrupt, KvError, KvNoSpace, KvTimeout, KvUnavailable
from common.kv.layout import KvLayout
from common.kv.pattern import verify_pattern
from common.messages import KvAgentInfo

NOTIF_PREFIX = b"kv1 "  # notification = b"kv1 <nbytes> <key>" (see sender.notification)


def parse_notification(msg: bytes) -> tuple[int, str] | None:
    """(nbytes, key) of a KV notification, None for anything else."""
    if not msg.startswith(NOTIF_PREFIX):
        return None
    try:
        size, key = msg[len(NOTIF_PREFIX):].split(b" ", 1)
        return int(size), key.decode()
    except ValueError:  # also UnicodeDecodeError
        return None


@dataclass
class _Reservation:
    blocks: list[int]
    nbytes: int
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    source: str = ""
    outcome: KvError | None = None  # a failure to raise from wait(): bad size, released, closed


class KvReceiver:
    """A registered host-memory pool of `num_blocks` x `block_bytes` plus reservations by key.

    A key names one transfer; use one per attempt (e.g. f"{request_id}:{attempt}") so that a late
    notification of an abandoned attempt never matches a new one.
    """

    def __init__(self, name: str, *, num_blocks: int, block_bytes: int, poll_s: float = 0.0002,
                 idle_poll_s: float = 0.01, quarantine_s: float = 11.0, layout: KvLayout | None = None) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise KvBadDescriptor(f"KV pool needs num_blocks >= 1 and block_bytes >= 1, got {num_blocks}, "
                                  f"{block_bytes}")
        self.name = name
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.layout = layout
        self.poll_s = poll_s
        self.idle_poll_s = idle_poll_s
        self.quarantine_s = quarantine_s
        self._log = klog.get().bind(kv_agent=name)
        self._agent: Any = _nixl.make_agent(name)
        # Touch every page now: the first WRITE would otherwise fault the pool in on the sender's clock.
        self._pool: npt.NDArray[np.uint8] = np.empty(num_blocks * block_bytes, np.uint8)
        self._pool.fill(0)
        self._addr = int(self._pool.ctypes.data)
        try:
            self._reg = self._agent.register_memory([(self._addr, self._pool.nbytes, 0, "")], "DRAM")
        except Exception as e:
            raise _nixl.translate(e, f"registering {self._pool.nbytes} bytes") from e
        self._blocks = BlockAllocator(num_blocks)
        self._res: dict[str, _Reservation] = {}
        self._quarantine: dict[str, tuple[list[int], float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()

    # ----------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the notification poller (a task on the running loop)."""
        if self._closed:
            raise RuntimeError("KvReceiver is closed")
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name=f"kv-poll-{self.name}")

    async def close(self) -> None:
        """Stop polling, fail pending waits, deregister the pool and drop the agent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for key, res in self._res.items():
            if not res.arrived.is_set():
                res.outcome = KvUnavailable(f"{key}: receiver {self.name!r} closed while waiting")
                res.arrived.set()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            self._log.warning("kv_deregister_failed", error=str(e))
        self._agent = None

    async def __aenter__(self) -> KvReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def agent_info(self) -> KvAgentInfo:
        """What a sender needs (put it in Hello.kv_agent): agent metadata plus the pool's geometry."""
        return KvAgentInfo(agent_name=self.name, metadata=bytes(self._agent.get_agent_metadata()),
                           region_addr=self._addr, region_bytes=self._pool.nbytes, block_bytes=self.block_bytes,
                           num_blocks=self.num_blocks)

    # ----------------------------------------------------------------------- reservations

    def reserve(self, key: str, nbytes: int, *, block_ids: list[int] | None = None) -> list[int]:
        """Block ids for `nbytes` of KV under `key`; KvNoSpace when the pool cannot hold them now.

        The allocator picks contiguous blocks when it can (zero-copy `view`); `block_ids` asks
        for exactly those blocks, in that order (KvNoSpace if any is taken).
        """
        self._check_open()
        if nbytes <= 0:
            raise KvBadDescriptor(f"{key}: cannot reserve {nbytes} bytes")
        if key in self._res:
            raise KvBadDescriptor(f"{key}: already reserved")
        need = -(-nbytes // self.block_bytes)
        if need > self.num_blocks:
            self._failures[KvNoSpace.reason] += 1
            raise KvNoSpace(f"out of KV space: {key} needs {need} blocks of {self.block_bytes} bytes, the whole "
                            f"pool has {self.num_blocks}")
        self._sweep_quarantine(time.monotonic())
        if key in self._quarantine:
            # A key reused while its old blocks wait out a possible late WRITE: keep those blocks
            # quarantined under an anonymous name so the old notification cannot free the new ones.
            self._quarantine[f"{key}\x00{id(self._quarantine[key])}"] = self._quarantine.pop(key)
            self._counts["reused_keys"] += 1
        if block_ids is not None:
            if len(block_ids) != need or len(set(block_ids)) != need or \
                    any(not 0 <= b < self.num_blocks for b in block_ids):
                raise KvBadDescriptor(f"{key}: {nbytes} bytes need {need} distinct block ids in "
                                      f"[0, {self.num_blocks}), got {len(block_ids)}")
            ids: list[int] | None = list(block_ids) if self._blocks.take(list(block_ids)) else None
        else:
            ids = self._blocks.alloc(need)
        if ids is None:
            self._failures[KvNoSpace.reason] += 1
            raise KvNoSpace(f"out of KV space: {key} needs {need} blocks, {self._blocks.free_count} free of "
                            f"{self.num_blocks} ({self.quarantined_blocks} quarantined)")
        self._res[key] = _Reservation(blocks=ids, nbytes=nbytes)
        self._counts["reserved"] += 1
        return ids

    async def wait(self, key: str, timeout: float, *, tokens: int | None = None, bytes_per_token: int | None = None,
                   request_id: str | None = None) -> npt.NDArray[np.uint8]:
        """Wait (at most `timeout` s) for the WRITE notification of `key`; return its bytes (read-only).

        With `tokens` and `bytes_per_token`, also verify the bytes against
        fill_pattern(request_id, tokens, bytes_per_token); request_id defaults to request_of(key).
        Raises KvTimeout (nothing arrived), KvCorrupt (wrong size or content). The view stays valid
        until release(key); copy it to keep it longer. Always call release(key) afterwards.
        """
        self._check_open()
        res = self._res.get(key)
        if res is None:
            raise KvBadDescriptor(f"{key}: not reserved")
        if self._task is None or self._task.done():
            raise RuntimeError("KvReceiver poller is not running (`async with receiver` or `await receiver.start()`)")
        if not res.arrived.is_set():
            try:
                await asyncio.wait_for(res.arrived.wait(), timeout)
            except TimeoutError:
                self._failures[KvTimeout.reason] += 1
                raise KvTimeout(f"{key}: no KV notification within {timeout:.3f}s ({res.nbytes} bytes in "
                                f"{len(res.blocks)} blocks expected)") from None
        if res.outcome is not None:
            if isinstance(res.outcome, KvCorrupt):
                self._failures[KvCorrupt.reason] += 1
            raise res.outcome
        data = self.view(key)
        if tokens is not None:
            if bytes_per_token is None:
                raise TypeError("verification needs bytes_per_token with tokens")
            try:
                verify_pattern(data, request_id or request_of(key), tokens, bytes_per_token)
            except KvCorrupt:
                self._failures[KvCorrupt.reason] += 1
                raise
            self._counts["verified"] += 1
        return data

    def view(self, key: str) -> npt.NDArray[np.uint8]:
        """The reserved bytes of `key` (zero-copy when its blocks are contiguous), read-only."""
        res = self._res.get(key)
        if res is None:
            raise KvBadDescriptor(f"{key}: not reserved")
        if is_contiguous(res.blocks):
            start = res.blocks[0] * self.block_bytes
            out = self._pool[start:start + res.nbytes]
        else:
            out = self._pool.reshape(self.num_blocks, self.block_bytes)[res.blocks].reshape(-1)[:res.nbytes]
        out.flags.writeable = False
        return out

    def release(self, key: str) -> None:
        """Give `key`'s blocks back (quarantined first if its bytes never arrived). Idempotent."""
        res = self._res.pop(key, None)
        if res is None:
            return
        self._counts["released"] += 1
        if res.arrived.is_set() or self._closed:  # the WRITE is complete: nothing more will land
            self._blocks.free(res.blocks)
            return
        res.outcome = KvBadDescriptor(f"{key}: released while waiting for its KV")
        res.arrived.set()  # wake a waiter: this transfer is abandoned
        if self.quarantine_s <= 0:
            self._blocks.free(res.blocks)
        else:
            self._quarantine[key] = (res.blocks, time.monotonic() + self.quarantine_s)

    # ----------------------------------------------------------------------- counters

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(b) for b, _ in self._quarantine.values())

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and gauges for export: reserved/arrived/verified/released, bytes, failures by reason."""
        return {
            "reserved": self._counts["reserved"], "arrived": self._counts["arrived"],
            "verified": self._counts["verified"], "released": self._counts["released"],
            "bytes": self._counts["bytes"], "late_notifs": self._counts["late_notifs"],
            "foreign_notifs": self._counts["foreign_notifs"], "reused_keys": self._counts["reused_keys"],
            "failures": dict(self._failures),
            "free_blocks": self._blocks.free_count, "quarantined_blocks": self.quarantined_blocks,
            "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
            "pending": sum(1 for r in self._res.values() if not r.arrived.is_set()),
        }

    # ----------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KvReceiver is closed")

    async def _poll(self) -> None:
        while True:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:
                self._failures[_nixl.translate(e, "polling notifications").reason] += 1
                self._log.warning("kv_poll_failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(self.idle_poll_s)
                continue
            for source, msgs in notifs.items():
                for msg in msgs:
                    self._on_notification(str(source), bytes(msg))
            if self._quarantine:
                self._sweep_quarantine(time.monotonic())
            expecting = any(not r.arrived.is_set() for r in self._res.values())  # O(pending): small
            await asyncio.sleep(self.poll_s if expecting else self.idle_poll_s)

    def _on_notification(self, source: str, msg: bytes) -> None:
        parsed = parse_notification(msg)
        if parsed is None:
            self._counts["foreign_notifs"] += 1
            return
        nbytes, key = parsed
        res = self._res.get(key)
        if res is None or res.arrived.is_set():
            self._counts["late_notifs"] += 1
            late = self._quarantine.pop(key, None)
            if late is not None:  # the abandoned WRITE has landed; nothing more will touch these blocks
                self._blocks.free(late[0])
            self._log.info("kv_late_notification", key=key, source=source, freed=late is not None)
            return
        if nbytes != res.nbytes:
            res.outcome = KvCorrupt(f"{key}: {source} wrote {nbytes} bytes, {res.nbytes} were reserved")
        res.source = source
        res.arrived.set()
        self._counts["arrived"] += 1
        self._counts["bytes"] += nbytes

    def _sweep_quarantine(self, now: float) -> None:
        for key in [k for k, (_, until) in self._quarantine.items() if until <= now]:
            self._blocks.free(self._quarantine.pop(key)[0])


def transfer_key(request_id: str, attempt: int) -> str:
    """The key of one transfer attempt: reserve, push and wait all use it."""
    return f"{request_id}:{attempt}"


def request_of(key: str) -> str:
    """The request id in a transfer key made by transfer_key (a key without ":<int>" is the id)."""
    head, sep, tail = key.rpartition(":")
    return head if sep and tail.isdigit() else key


__all__ = ["KvReceiver", "parse_notification", "request_of", "transfer_key"]
