"""Heartbeats are bound to their sender (protocol 2): the router takes a heartbeat for worker X
only from X's own registered connection. A peer that knows X's id and incarnation (both readable
off the unauthenticated telemetry, or the monitor's /api/state) can no longer drain the cluster
or keep a frozen worker alive by forging X's heartbeats, through any channel: the old heartbeat
port (protocol 1 read heartbeats from anyone there), a connection of its own on the work socket,
or one under X's identity (libzmq keeps X's connection and ignores the newcomer's)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import zmq

from common import codec
from common import messages as m
from tests.conftest import start_cluster


def _incarnations(log: Path) -> dict[str, str]:
    out = {}
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"worker_joined"' in line:
            ev = json.loads(line)
            out[ev["worker"]] = ev["incarnation"]
    return out


def _forged(worker: str, incarnation: str, seq: int, *, draining: bool) -> bytes:
    return codec.encode(m.DecodeHeartbeat(worker_id=worker, incarnation=incarnation, seq=seq, batch=0, kv_tokens=0,
                                          kv_free_tokens=10**6, kv_capacity_tokens=10**6, resident_prefill_tokens=0,
                                          deflections=0, strictest_tbt_slo=None, token_budget=8192,
                                          draining=draining))


def test_forged_heartbeats_neither_drain_the_cluster_nor_keep_a_frozen_worker_alive(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, prefill=1, decode=2, profile="fast", policy="kairos")
    ctx = zmq.Context()
    try:
        inc = _incarnations(tmp_path / "router.log")
        assert {"decode-0", "decode-1"} <= set(inc), inc
        channels = []
        old = ctx.socket(zmq.PUB)  # protocol 1's heartbeat socket: took heartbeats from anyone
        old.connect(f"tcp://127.0.0.1:{c.spec.heartbeat_port}")
        own = ctx.socket(zmq.DEALER)  # a connection of its own on the work socket
        own.setsockopt(zmq.IDENTITY, b"intruder")
        own.connect(f"tcp://127.0.0.1:{c.spec.work_port}")
        taken = ctx.socket(zmq.DEALER)  # under a live worker's identity
        taken.setsockopt(zmq.IDENTITY, b"decode-0")
        taken.connect(f"tcp://127.0.0.1:{c.spec.work_port}")
        for s in (old, own, taken):
            s.setsockopt(zmq.LINGER, 0)
            channels.append(s)
        time.sleep(0.3)
        seq = 10**9

        def forge(workers: list[str], *, draining: bool) -> None:
            nonlocal seq
            seq += 1
            for w in workers:
                payload = _forged(w, inc[w], seq, draining=draining)
                try:
                    old.send_multipart([b"hb", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    own.send(payload, zmq.NOBLOCK)
                    taken.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    pass

        # 1. "draining" for both decode workers, while 20 requests are sent: all served
        ok = 0
        with httpx.Client(base_url=c.spec.api, timeout=20) as client:
            for _ in range(20):
                forge(["decode-0", "decode-1"], draining=True)
                ok += client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
                time.sleep(0.05)
        assert ok == 20
        stats = c.get("/v1/kairos/stats")[1]
        workers = stats["workers"]
        assert isinstance(workers, dict) and not workers["decode-0"]["draining"] and not workers["decode-1"]["draining"]

        # 2. decode-1 frozen, its heartbeats forged: it is still found dead (liveness 1 s)
        c.signal("decode-1", signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 8
            while "decode-1" in c.get("/v1/kairos/stats")[1]["workers"]:  # type: ignore[operator]
                assert time.monotonic() < deadline, "forged heartbeats kept a frozen worker alive"
                forge(["decode-1"], draining=False)
                time.sleep(0.05)
        finally:
            c.signal("decode-1", signal.SIGCONT)
        log = (tmp_path / "router.log").read_text()
        assert '"heartbeat_for_another_worker"' in log  # the intruder's own connection, logged at warning
    finally:
        ctx.destroy(linger=0)
        c.stop(15)
