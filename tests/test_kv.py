"""common.kv: real KV bytes over NIXL between processes on loopback, and every failure's outcome.

The receiver runs in a child process (common.kv.remote.RemoteReceiver), the sender in the test
process. Tests marked `nixl` skip only when NIXL cannot be imported; the pure parts (pattern,
layout, allocator, importing without NIXL) always run. Every child is killed in a finally.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from common.config import WorkerConfig
from common.errors import ConfigError, KvTransferError
from common.kv import (
    KvBadDescriptor,
    KvCorrupt,
    KvNoSpace,
    KvPeerLost,
    KvTimeout,
    KvUnknownPeer,
    check_transport,
    fill_pattern,
    layout_from_info,
    nixl_available,
    plan_layout,
    receiver_from_config,
    request_of,
    sender_from_config,
    transfer_key,
    verify_pattern,
)
from common.kv.blocks import BlockAllocator
from common.kv.receiver import parse_notification
from common.kv.sender import notification
from common.messages import KvAgentInfo

HAVE_NIXL = nixl_available()
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not importable in this environment "
                                "(pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1)")
TAG = f"{os.getpid()}"
BLOCK = 16 << 10
NBLOCKS = 64

# ---------------------------------------------------------------------------- pure parts


def test_pattern_round_trip_and_detects_every_kind_of_damage() -> None:
    data = fill_pattern("req-a", 300, 104)  # not a multiple of 8 bytes per token
    assert data.size == 300 * 104 and data.dtype == np.uint8
    verify_pattern(data, "req-a", 300, 104)
    verify_pattern(bytes(data), "req-a", 300, 104)
    assert np.array_equal(data, fill_pattern("req-a", 300, 104))  # deterministic
    flipped = data.copy()
    flipped[123 * 104 + 7] ^= 0x01
    with pytest.raises(KvCorrupt, match=r"token 123, offset 7"):
        verify_pattern(flipped, "req-a", 300, 104)
    with pytest.raises(KvCorrupt):
        verify_pattern(fill_pattern("req-b", 300, 104), "req-a", 300, 104)  # another request's KV
    swapped = data.reshape(30, -1)[[1, 0, *range(2, 30)]].reshape(-1)  # two blocks in each other's place
    with pytest.raises(KvCorrupt):
        verify_pattern(swapped, "req-a", 300, 104)
    with pytest.raises(KvCorrupt, match="expected 31200"):
        verify_pattern(data[:-1], "req-a", 300, 104)
    with pytest.raises(KvCorrupt):
        verify_pattern(np.zeros_like(data), "req-a", 300, 104)
    out = np.zeros(40000, np.uint8)
    view = fill_pattern("req-a", 300, 104, out=out)
    assert np.shares_memory(view, out) and np.array_equal(view, data) and not out[31200:].any()


def test_layout_scales_bytes_per_token_to_fit_the_pool() -> None:
    # DeepSeek-V2-Lite's 31,104 B/token in a 64 MiB pool holding 65,536 tokens in flight: 1 KiB/token.
    lay = plan_layout(pool_bytes=64 << 20, block_tokens=16, profile_bytes_per_token=31104)
    assert (lay.bytes_per_token, lay.block_bytes, lay.num_blocks) == (1024, 16384, 4096)
    assert lay.scale == pytest.approx(1024 / 31104) and lay.blocks_for(17) == 2 and lay.nbytes(3) == 3072
    small = plan_layout(pool_bytes=64 << 20, block_tokens=16, profile_bytes_per_token=100, capacity_tokens=1000)
    assert small.bytes_per_token == 96 and small.scale < 1  # rounded down to a multiple of 8
    fixed = plan_layout(pool_bytes=1 << 20, block_tokens=16, profile_bytes_per_token=31104, bytes_per_token=4096)
    assert (fixed.bytes_per_token, fixed.num_blocks) == (4096, 16)
    with pytest.raises(ConfigError):
        plan_layout(pool_bytes=1 << 10, block_tokens=16, profile_bytes_per_token=0, bytes_per_token=4096)
    info = KvAgentInfo(agent_name="d", metadata=b"x", region_addr=1, region_bytes=lay.pool_bytes,
                       block_bytes=lay.block_bytes, num_blocks=lay.num_blocks)
    assert layout_from_info(info, 16).bytes_per_token == 1024
    with pytest.raises(ConfigError):
        layout_from_info(info, 24)


def test_allocator_prefers_contiguous_runs_and_never_double_allocates() -> None:
    a = BlockAllocator(10)
    x = a.alloc(3)
    y = a.alloc(3)
    assert x == [0, 1, 2] and y == [3, 4, 5] and a.free_count == 4
    a.free(x)
    assert a.alloc(2) == [0, 1]  # best fit: the 3-run, not the 4-run
    assert a.alloc(5) == [2, 6, 7, 8, 9]  # no run of 5 left: scattered
    assert a.alloc(1) is None and a.free_count == 0
    with pytest.raises(ValueError, match="double free"):
        a.free([3, 3])
    a.free(y)
    with pytest.raises(ValueError, match="double free"):
        a.free(y)
    assert not a.take([2, 3]) and a.take([5, 3]) and a.free_count == 1


def test_notification_and_keys() -> None:
    key = transfer_key("chat-1:x", 2)
    assert key == "chat-1:x:2" and request_of(key) == "chat-1:x" and request_of("plain") == "plain"
    assert parse_notification(notification(key, 4096)) == (4096, key)
    assert parse_notification(b"something else") is None and parse_notification(b"kv1 nope") is None


def test_package_imports_without_nixl() -> None:
    """A lean install: common.kv imports, modeled works, nixl fails with the install hint."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13", "nixl_meta_utils"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        import common.kv as kv
        from common.errors import ConfigError
        assert not kv.nixl_available()
        kv.check_transport("modeled")
        try:
            kv.check_transport("nixl")
        except ConfigError as e:
            assert "nixl-cu13==1.5.1" in str(e), e
        else:
            raise SystemExit("check_transport('nixl') passed without NIXL")
        try:
            kv.KvSender("x")
        except kv.KvUnavailable as e:
            print("ok", e.reason)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok unavailable")
    with pytest.raises(ConfigError, match="unknown kv_transport"):
        check_transport("carrier-pigeon")


# ---------------------------------------------------------------------------- fixtures

if HAVE_NIXL:
    from common.kv import KvReceiver, KvSender
    from common.kv.remote import RemoteReceiver


def _spawn(name: str, nblocks: int = NBLOCKS, block: int = BLOCK) -> RemoteReceiver:
    return RemoteReceiver([(name, nblocks, block)], startup_timeout=60)


@pytest.fixture(scope="module")
def shared() -> Iterator[RemoteReceiver]:
    """One receiver child for the tests that leave it healthy."""
    if not HAVE_NIXL:
        pytest.skip("NIXL is not importable")
    peer = _spawn(f"kvt-shared-{TAG}")
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def fresh() -> Iterator[RemoteReceiver]:
    """A receiver child for a test that freezes or kills it."""
    peer = _spawn(f"kvt-fresh-{TAG}-{time.monotonic_ns()}")
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def tx() -> Iterator[KvSender]:
    sender = KvSender(f"kvt-tx-{TAG}-{time.monotonic_ns()}", staging_bytes=NBLOCKS * BLOCK)
    try:
        yield sender
    finally:
        sender.close()


def _name(peer: RemoteReceiver) -> str:
    return peer.pools[0][0]


async def _push_and_verify(tx: KvSender, peer: RemoteReceiver, key: str, tokens: int, bpt: int,
                           block_ids: list[int] | None = None) -> None:
    name = _name(peer)
    ids = peer.reserve(name, key, tokens * bpt, block_ids)
    try:
        result = await tx.push(name, key, ids, fill_pattern(request_of(key), tokens, bpt), timeout=10)
        assert result.nbytes == tokens * bpt and result.blocks == len(ids)
        reply = peer.wait(name, key, timeout=10, tokens=tokens, bytes_per_token=bpt)
        assert reply.nbytes == tokens * bpt
    finally:
        peer.release(name, key)


# ---------------------------------------------------------------------------- bytes intact


@needs_nixl
async def test_single_large_block_arrives_intact(tx: KvSender) -> None:
    with _spawn(f"kvt-big-{TAG}", nblocks=1, block=8 << 20) as big:
        tx.add_peer(big.info(_name(big)))
        await _push_and_verify(tx, big, transfer_key("req-big", 0), 8192, 1024)  # 8 MiB, one descriptor
        assert big.stats(_name(big))["verified"] == 1
    assert tx.stats["transfers"] == 1 and tx.stats["bytes"] == 8 << 20 and tx.stats["failures"] == {}


@needs_nixl
async def test_many_scattered_blocks_arrive_intact_concurrently(tx: KvSender, shared: RemoteReceiver) -> None:
    name = _name(shared)
    assert tx.add_peer(shared.info(name)) is True
    assert tx.add_peer(shared.info(name)) is False  # same info again: no-op
    perm = np.random.default_rng(7).permutation(NBLOCKS)[:40].tolist()
    # 633 tokens x 1 KiB = 39.6 blocks: a partial last block; scattered destinations in random order.
    await _push_and_verify(tx, shared, transfer_key("req-many", 0), 633, 1024, perm)
    await asyncio.gather(*(_push_and_verify(tx, shared, transfer_key(f"req-c{i}", 0), 100 + 37 * i, 640)
                           for i in range(3)))
    stats = shared.stats(name)
    assert stats["verified"] >= 4 and stats["free_blocks"] == NBLOCKS and stats["failures"] == {}
    assert tx.stats["transfers"] == 4 and tx.stats["failures"] == {}


# ---------------------------------------------------------------------------- failures


@needs_nixl
async def test_receiver_killed_mid_transfer_is_peer_lost(tx: KvSender, fresh: RemoteReceiver) -> None:
    name = _name(fresh)
    tx.add_peer(fresh.info(name))
    await _push_and_verify(tx, fresh, transfer_key("warm", 0), 64, 1024)
    ids = fresh.reserve(name, "doomed:0", NBLOCKS * BLOCK)
    fresh.freeze()  # hold the WRITE in flight, then kill the receiver under it
    push = asyncio.create_task(tx.push(name, "doomed:0", ids, fill_pattern("doomed", NBLOCKS, BLOCK), timeout=20))
    await asyncio.sleep(0.3)
    assert not push.done(), "the WRITE completed although the receiver was stopped"
    t0 = time.monotonic()
    fresh.kill()
    with pytest.raises(KvPeerLost):
        await push
    assert time.monotonic() - t0 < 5.0  # detected by UCX, not by the 20 s deadline
    t1 = time.monotonic()
    with pytest.raises(KvPeerLost, match="lost"):  # refused at once until add_peer brings new info
        await tx.push(name, "next:0", [0], b"x" * 10, timeout=20)
    assert time.monotonic() - t1 < 0.5
    assert tx.stats["failures"] == {"peer_lost": 2} and tx.stats["peers_lost"] == 1


@needs_nixl
async def test_receiver_frozen_sender_times_out_then_recovers(tx: KvSender, fresh: RemoteReceiver) -> None:
    name = _name(fresh)
    tx.add_peer(fresh.info(name))
    await _push_and_verify(tx, fresh, transfer_key("warm", 0), 64, 1024)
    ids = fresh.reserve(name, "stuck:0", 16 * BLOCK)
    fresh.freeze()
    try:
        t0 = time.monotonic()
        with pytest.raises(KvTimeout, match=r"not done within 0\.500s"):
            await tx.push(name, "stuck:0", ids, fill_pattern("stuck", 16, BLOCK), timeout=0.5)
        assert 0.5 <= time.monotonic() - t0 < 2.0
    finally:
        fresh.thaw()
    fresh.release(name, "stuck:0")
    assert tx.stats["failures"] == {"timeout": 1} and tx.stats["teardowns"] == 1
    await _push_and_verify(tx, fresh, transfer_key("after", 0), 100, 1024)  # re-added lazily, works again
    assert tx.stats["readds"] == 1 and tx.stats["transfers"] == 2


@needs_nixl
async def test_receiver_restarted_under_the_same_name(tx: KvSender) -> None:
    name = f"kvt-restart-{TAG}"
    first = _spawn(name)
    try:
        tx.add_peer(first.info(name))
        await _push_and_verify(tx, first, transfer_key("before", 0), 64, 1024)
        old_info = first.info(name)
    finally:
        first.kill()
        first.close()
    second = _spawn(name)
    try:
        new_info = second.info(name)
        assert new_info.metadata != old_info.metadata
        assert tx.add_peer(new_info) is True  # removes the old agent first, else NIXL refuses the name
        await _push_and_verify(tx, second, transfer_key("after", 0), 64, 1024)
    finally:
        second.close()
    assert tx.stats["peers_replaced"] == 1 and tx.stats["transfers"] == 2 and tx.stats["failures"] == {}


@needs_nixl
async def test_sender_never_sends_receiver_times_out(shared: RemoteReceiver) -> None:
    name = _name(shared)
    shared.reserve(name, "silent:0", 10 * BLOCK)
    t0 = time.monotonic()
    with pytest.raises(KvTimeout, match="no KV notification"):
        shared.wait(name, "silent:0", timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    shared.release(name, "silent:0")
    assert shared.stats(name)["failures"].get("timeout", 0) >= 1


@needs_nixl
async def test_bad_descriptors_are_refused_before_any_byte_moves(tx: KvSender, shared: RemoteReceiver) -> None:
    name = _name(shared)
    info = shared.info(name)
    with pytest.raises(KvUnknownPeer):
        await tx.push(name, "k:0", [0], b"x", timeout=1)
    with pytest.raises(KvBadDescriptor):  # metadata that is not NIXL's
        tx.add_peer(msgspec.structs.replace(info, metadata=b"garbage"))
    with pytest.raises(KvBadDescriptor):  # a region the receiver never registered: NIXL refuses the list
        tx.add_peer(msgspec.structs.replace(info, region_addr=info.region_addr + (1 << 30)))
    with pytest.raises(KvBadDescriptor):  # the pool's geometry does not add up
        tx.add_peer(msgspec.structs.replace(info, region_bytes=BLOCK))
    assert tx.peers == []
    tx.add_peer(info)
    arrived = shared.stats(name)["arrived"]
    payload = fill_pattern("bad", 2, BLOCK)
    for ids in ([0, NBLOCKS], [-1, 0], [3, 3], [0], [0, 1, 2]):  # out of range, negative, duplicate, count
        with pytest.raises(KvBadDescriptor):
            await tx.push(name, "bad:0", ids, payload, timeout=1)
    with pytest.raises(KvBadDescriptor):
        await tx.push(name, "bad:0", [], b"", timeout=1)
    assert shared.stats(name)["arrived"] == arrived
    assert tx.stats["failures"] == {"unknown_peer": 1, "bad_descriptor": 6}
    with pytest.raises(KvBadDescriptor):  # receiver side: explicit block ids out of range
        shared.reserve(name, "bad:1", BLOCK, [NBLOCKS])


@needs_nixl
async def test_corrupted_payload_fails_verification(tx: KvSender, shared: RemoteReceiver) -> None:
    name = _name(shared)
    tx.add_peer(shared.info(name))
    ids = shared.reserve(name, "rot:0", 300 * 1024)
    try:
        payload = fill_pattern("rot", 300, 1024)
        payload[200 * 1024 + 5] ^= 0x80
        await tx.push(name, "rot:0", ids, payload, timeout=10)  # the transfer itself succeeds
        with pytest.raises(KvCorrupt, match="token 200, offset 5"):
            shared.wait(name, "rot:0", timeout=10, tokens=300, bytes_per_token=1024)
    finally:
        shared.release(name, "rot:0")
    assert shared.stats(name)["failures"].get("corrupt", 0) == 1


@needs_nixl
async def test_pool_exhausted_is_out_of_kv_space(shared: RemoteReceiver) -> None:
    name = _name(shared)
    with pytest.raises(KvNoSpace, match="out of KV space"):
        shared.reserve(name, "huge:0", (NBLOCKS + 1) * BLOCK)
    shared.reserve(name, "fill:0", (NBLOCKS - 2) * BLOCK)
    try:
        shared.reserve(name, "two:0", 2 * BLOCK - 1)
        with pytest.raises(KvNoSpace, match="out of KV space"):
            shared.reserve(name, "one-more:0", 1)
        shared.release(name, "two:0")
        shared.reserve(name, "one-more:0", 1)
        shared.release(name, "one-more:0")
    finally:
        shared.release(name, "fill:0")
    stats = shared.stats(name)
    assert stats["free_blocks"] == NBLOCKS and stats["failures"]["no_space"] == 2


@needs_nixl
async def test_abandoned_blocks_are_quarantined_until_the_late_write_lands() -> None:
    """In one process: a receiver gives up, the sender's WRITE arrives later; no block is reused early."""
    async with KvReceiver(f"kvt-q-{TAG}", num_blocks=8, block_bytes=BLOCK, quarantine_s=30.0) as rx:
        with KvSender(f"kvt-qtx-{TAG}", staging_bytes=8 * BLOCK) as sender:
            sender.add_peer(rx.agent_info())
            ids = rx.reserve("late:0", 4 * BLOCK)
            with pytest.raises(KvTimeout):
                await rx.wait("late:0", 0.05)
            rx.release("late:0")
            assert rx.stats["quarantined_blocks"] == 4 and rx.stats["free_blocks"] == 4
            with pytest.raises(KvNoSpace):
                rx.reserve("other:0", 5 * BLOCK)
            await sender.push(rx.name, "late:0", ids, fill_pattern("late", 4, BLOCK), timeout=5)
            deadline = time.monotonic() + 5
            while rx.stats["quarantined_blocks"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert rx.stats["late_notifs"] == 1 and rx.stats["free_blocks"] == 8
            ids = rx.reserve("other:0", 8 * BLOCK)
            assert sorted(ids) == list(range(8))
            await sender.push(rx.name, "other:0", ids, fill_pattern("other", 8, BLOCK), timeout=5)
            data = await rx.wait("other:0", 5, tokens=8, bytes_per_token=BLOCK)
            assert data.size == 8 * BLOCK and not data.flags.writeable
            rx.release("other:0")
            rx.reserve("cancelled:0", BLOCK)  # released (request cancelled) while a task waits for it
            waiter = asyncio.create_task(rx.wait("cancelled:0", 30))
            await asyncio.sleep(0.01)
            rx.release("cancelled:0")
            with pytest.raises(KvBadDescriptor, match="released while waiting"):
                await asyncio.wait_for(waiter, 2)
    with pytest.raises(RuntimeError, match="closed"):
        rx.reserve("x:0", 1)


@needs_nixl
async def test_from_config_scales_the_profile_and_logs_it() -> None:
    cfg = WorkerConfig(worker_id="d0", kv_transport="nixl", kv_pool_mib=4, kv_block_tokens=16, kv_timeout=2.0)
    rx = receiver_from_config(cfg, name=f"kvt-cfg-{TAG}", profile_bytes_per_token=31104, capacity_tokens=8192)
    async with rx:
        assert rx.layout is not None and rx.layout.bytes_per_token == 512  # 4 MiB / 8192 tokens
        info = rx.agent_info()
        assert (info.block_bytes, info.num_blocks, info.region_bytes) == (8192, 512, 4 << 20)
        assert rx.quarantine_s == cfg.kv_timeout + 1.0
        with sender_from_config(cfg, name=f"kvt-cfgtx-{TAG}") as sender:
            sender.add_peer(info)
            peer_info = sender.peer_info(rx.name)
            assert peer_info is not None
            bpt = layout_from_info(peer_info, cfg.kv_block_tokens).bytes_per_token
            key = transfer_key("cfg-req", 3)
            ids = rx.reserve(key, rx.layout.nbytes(1000))
            result = await sender.push_pattern(rx.name, key, ids, request_id="cfg-req", tokens=1000,
                                               bytes_per_token=bpt, timeout=cfg.kv_timeout)
            assert result.nbytes == 1000 * 512 and result.blocks == 63
            await rx.wait(key, cfg.kv_timeout, tokens=1000, bytes_per_token=rx.layout.bytes_per_token)
            rx.release(key)


def test_errors_are_kv_transfer_errors() -> None:
    for cls in (KvBadDescriptor, KvCorrupt, KvNoSpace, KvPeerLost, KvTimeout, KvUnknownPeer):
        assert issubclass(cls, KvTransferError) and cls.reason
