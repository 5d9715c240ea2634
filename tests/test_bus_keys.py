"""Worker keys bound to worker ids: `kairos keys` records the id in each key, the router reads the
bindings, refuses a Hello under another id, and drops a message on a registered connection that
is signed with another key than the one it registered with (router-only: frames are handed to the
work-socket callback with the key ZeroMQ would report, as in tests/test_trust.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import structlog
import zmq
import zmq.asyncio
import zmq.auth

from common import codec, config
from common import messages as m
from common.errors import ConfigError
from common.sockets import key_metadata, worker_key_ids, worker_key_name
from kairos import keys as kkeys
from tests.test_trust import hello, make_router, sent


def _key(d: Path, name: str) -> str:
    return zmq.auth.load_certificate(str(d / f"{name}.key"))[0].decode()


def _hb(worker: str, seq: int, **kw: object) -> m.DecodeHeartbeat:
    return m.DecodeHeartbeat(worker_id=worker, incarnation="i1", seq=seq, batch=0, kv_tokens=0,
                             kv_free_tokens=10**6, kv_capacity_tokens=10**6, resident_prefill_tokens=0,
                             deflections=0, strictest_tbt_slo=None, token_budget=2048, **kw)  # type: ignore[arg-type]


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    assert kkeys.main([str(d), "--workers", "decode-0,decode-1"]) == 0
    return d


def test_keys_are_bound_to_their_worker_ids(keydir: Path) -> None:
    bus = config.load(config.BusConfig, env={}, overrides={"curve_keys_dir": str(keydir)})
    ids = worker_key_ids(bus)
    assert sorted(v for v in ids.values() if v) == ["decode-0", "decode-1"] and len(ids) == 2
    assert ids[_key(keydir, "decode-1")] == "decode-1"
    assert key_metadata(keydir / "allowed" / "worker" / "decode-0.key") == {"role": "worker", "worker_id": "decode-0"}
    assert worker_key_name(bus, "decode-1") == "decode-1"  # a worker takes the key named after its id
    with pytest.raises(ConfigError, match="--add --workers decode-5"):
        worker_key_name(bus, "decode-5")


def test_add_keeps_existing_keys_and_shared_keys_are_unbound(keydir: Path) -> None:
    before = _key(keydir, "decode-0")
    assert kkeys.main([str(keydir), "--add", "--workers", "decode-2", "--shared-worker-key"]) == 0
    assert _key(keydir, "decode-0") == before
    bus = config.load(config.BusConfig, env={}, overrides={"curve_keys_dir": str(keydir)})
    ids = worker_key_ids(bus)
    assert ids[_key(keydir, "decode-2")] == "decode-2" and ids[_key(keydir, "worker")] is None
    assert worker_key_name(bus, "decode-9") == "worker"  # no key of its own: the shared one
    assert kkeys.main([str(keydir), "--workers", "a,a"]) == 2


async def test_a_hello_under_another_workers_id_is_refused(keydir: Path) -> None:
    r = make_router(curve_keys_dir=str(keydir), open_bus=True)
    try:
        r._on_work_frames([b"decode-0", codec.encode(hello("decode-0"))], _key(keydir, "decode-1"))
        assert "decode-0" not in r.table.workers
        answer = sent(r)[-1][1]
        assert isinstance(answer, m.Refused) and answer.reason.startswith("key:")
        r._on_work_frames([b"decode-0", codec.encode(hello("decode-0"))], _key(keydir, "decode-0"))
        assert r.table.workers["decode-0"].key == _key(keydir, "decode-0")
    finally:
        r.close()


async def test_a_registered_connection_takes_nothing_signed_with_another_key(keydir: Path) -> None:
    r = make_router(curve_keys_dir=str(keydir), open_bus=True)
    try:
        own, other = _key(keydir, "decode-0"), _key(keydir, "decode-1")
        r._on_work_frames([b"decode-0", codec.encode(hello("decode-0"))], own)
        r._on_work_frames([b"decode-0", codec.encode(_hb("decode-0", 1, draining=True))], other)
        assert r.gate.dropped["message_from_another_key"] == 1
        assert not r.table.workers["decode-0"].draining and r.table.workers["decode-0"].heartbeats == 0
        r._on_work_frames([b"decode-0", codec.encode(_hb("decode-0", 2))], own)
        assert r.table.workers["decode-0"].heartbeats == 1
    finally:
        r.close()


async def test_the_router_warns_about_shared_keys_and_an_open_bus(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert kkeys.main([str(d), "--workers", "decode-0", "--shared-worker-key"]) == 0
    with structlog.testing.capture_logs() as logs:
        r = make_router(curve_keys_dir=str(d), open_bus=True)
        r.close()
        r = make_router(open_bus=True)
        r.close()
    events = {e["event"]: e for e in logs}
    assert events["shared_worker_key"]["keys"] == [_key(d, "worker")[:8]]
    assert "bus_insecure" in events


def test_late_messages_of_a_recovering_worker_are_routine_and_a_strangers_are_not() -> None:
    """A TokenBatch from an unregistered peer is dropped either way; it is logged at warning only
    when the peer is not a worker recovering (one this router saw leave, or any in a restarted
    router's first liveness windows)."""
    r = make_router()
    try:
        def tokens(worker: str) -> bytes:
            return codec.encode(m.TokenBatch(worker_id=worker, items=[]))

        with structlog.testing.capture_logs() as logs:
            r._on_work_frames([b"decode-0", tokens("decode-0")])  # just started: workers are coming back
            r.core.opened_at -= 100.0  # later on
            r._on_work_frames([b"stranger", tokens("stranger")])
            r.table.register(hello("decode-3"), b"decode-3", time.monotonic())
            r.table.remove("decode-3")  # lost
            r._on_work_frames([b"decode-3", tokens("decode-3")])
        drops = [(e["peer"], e["log_level"]) for e in logs if e["event"] == "message_dropped"]
        assert drops == [("decode-0", "info"), ("stranger", "warning"), ("decode-3", "info")]
        assert r.gate.dropped["unregistered_peer"] == 3
    finally:
        r.close()


async def test_each_router_replica_has_its_own_key(tmp_path: Path) -> None:
    """`kairos keys --routers router-a,router-b`: a router serves with its own pair, and a worker
    that expects router-a's key does not take router-b for it (nor the reverse)."""
    d = tmp_path / "keys"
    assert kkeys.main([str(d), "--routers", "router-a,router-b", "--workers", "decode-0"]) == 0
    assert not (d / "router.key").exists()
    r = make_router(curve_keys_dir=str(d), curve_key_name="router-b", open_bus=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        async def handshakes(expect: str) -> bool:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, b"decode-0")
            pub, sec = zmq.auth.load_certificate(str(d / "decode-0.key_secret"))
            s.curve_publickey, s.curve_secretkey = pub, sec
            s.curve_serverkey = zmq.auth.load_certificate(str(d / f"{expect}.key"))[0]
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            s.connect(f"tcp://127.0.0.1:{r.cfg.work_port}")
            ok = False
            for _ in range(30):  # the router's authenticator runs on this event loop: let it
                await asyncio.sleep(0.05)
                if mon.poll(0):
                    ok = True
                    break
            s.disable_monitor()
            mon.close(0)
            s.close(0)
            return ok

        assert await handshakes("router-b")
        assert not await handshakes("router-a")
    finally:
        ctx.destroy(linger=0)
        r.close()


async def test_a_peer_without_curve_leaves_a_log_line(keydir: Path) -> None:
    """A plaintext (non-CURVE) connection fails the handshake before any key is checked; it left
    no line at all (issue 48): now `bus_handshake_failed` says so, throttled like refused keys."""
    r = make_router(curve_keys_dir=str(keydir), open_bus=True)
    ctx = zmq.asyncio.Context()
    plain = ctx.socket(zmq.DEALER)
    task = None
    try:
        loops = dict(r.loops())
        for name, coro in loops.items():
            if name != "handshakes":
                coro.close()
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(loops["handshakes"])
            plain.setsockopt(zmq.LINGER, 0)
            plain.connect(f"tcp://127.0.0.1:{r.cfg.work_port}")
            try:  # never block on it: a DEALER whose handshake failed has no pipe to queue to
                await plain.send(b"hello?", flags=zmq.NOBLOCK)  # (CI once hung here past pytest's 300 s)
            except zmq.Again:
                pass  # the failed handshake is what the test waits for, not this message
            deadline = time.monotonic() + 10
            while not r.counts["handshakes_failed"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        lines = [e for e in logs if e["event"] == "bus_handshake_failed"]
        assert len(lines) == 1 and lines[0]["socket"] == "worker", logs
        assert "CURVE" in lines[0]["reason"]  # mechanism_mismatch, or no_detail (libzmq gives either)
    finally:
        if task is not None:
            task.cancel()
        plain.close(0)
        ctx.term()
        r.close()
