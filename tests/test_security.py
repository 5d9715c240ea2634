"""An authenticated bus (CURVE with an allow-list) and the HTTP API key."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth

from common import codec
from common import messages as m
from kairos.up import Cluster
from tests.conftest import start_cluster


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys") / "curve"
    rc = subprocess.run([sys.executable, "-m", "kairos.cli", "keys", str(d)], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    assert (d / "router.key_secret").exists()
    assert sorted(p.name for p in (d / "allowed" / "worker").glob("*.key")) == [
        "decode-0.key", "decode-1.key", "prefill-0.key", "prefill-1.key"]  # one key per worker id
    assert [p.name for p in (d / "allowed" / "monitor").glob("*.key")] == ["monitor.key"]
    assert not (d / "worker.key").exists()  # no shared worker key unless asked for
    return d


@pytest.fixture(scope="module")
def cluster(keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("curve"), prefill=1, decode=1, profile="fast", policy="kairos",
                      curve_keys_dir=str(keys), router_env={"KAIROS_API_KEY": "s3cret"})
    yield c
    c.stop(15)


def test_authenticated_cluster_serves_and_checks_the_api_key(cluster: Cluster) -> None:
    url = cluster.spec.api + "/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert r.headers["x-kairos-error"] == "invalid_api_key"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, headers={"authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, headers={"authorization": "Bearer s3cret"},
                   timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(cluster.spec.api + "/health", timeout=5).status_code == 200  # probes need no key


def _hello(worker_id: str) -> bytes:
    return codec.encode(m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=worker_id, role="decode", incarnation="evil",
                                engine="sim", model="kairos-sim", token_budget=64, kv_capacity_tokens=10**9))


def _registered(cluster: Cluster) -> set[str]:
    r = httpx.get(cluster.spec.api + "/v1/kairos/stats", headers={"authorization": "Bearer s3cret"}, timeout=5)
    return set(r.json()["workers"])


@pytest.mark.parametrize("mode", ["plain", "unknown-key", "monitor-key"])
def test_unauthenticated_worker_is_refused(cluster: Cluster, keys: Path, tmp_path: Path, mode: str) -> None:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        wid = f"intruder-{mode}"
        s.setsockopt(zmq.IDENTITY, wid.encode())
        if mode == "unknown-key":  # a well-formed CURVE client whose key is not on the allow-list
            zmq.auth.create_certificates(str(tmp_path), "rogue")
            pub, sec = zmq.auth.load_certificate(str(tmp_path / "rogue.key_secret"))
            server_pub, _ = zmq.auth.load_certificate(str(keys / "router.key"))
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_pub
        if mode == "monitor-key":  # a key allowed on the telemetry socket only: not a worker's
            pub, sec = zmq.auth.load_certificate(str(keys / "monitor.key_secret"))
            server_pub, _ = zmq.auth.load_certificate(str(keys / "router.key"))
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_pub
        s.connect(f"tcp://127.0.0.1:{cluster.spec.work_port}")
        for _ in range(5):
            try:  # a refused handshake leaves no peer to queue for: never block on it
                s.send(_hello(wid), zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.1)
        assert s.poll(500) == 0, "the router answered an unauthenticated peer"
        assert wid not in _registered(cluster)
        assert _registered(cluster) == {"prefill-0", "decode-0"}
    finally:
        ctx.destroy(linger=0)


def _handshakes(keys: Path, key_name: str, port: int, sock_type: int) -> bool:
    """Whether a CURVE client with key `key_name` completes the handshake with the router on `port`."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(sock_type)
        s.setsockopt(zmq.LINGER, 0)
        if sock_type == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        pub, sec = zmq.auth.load_certificate(str(keys / f"{key_name}.key_secret"))
        server_pub, _ = zmq.auth.load_certificate(str(keys / "router.key"))
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_pub
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        s.connect(f"tcp://127.0.0.1:{port}")
        if not mon.poll(10_000):
            raise AssertionError("no handshake outcome within 10 s")
        event = int.from_bytes(mon.recv_multipart()[0][:2], "little")
        s.disable_monitor()
        mon.close(0)
        return event == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        ctx.destroy(linger=0)


def test_each_socket_admits_only_its_roles_keys(cluster: Cluster, keys: Path) -> None:
    spec = cluster.spec
    assert _handshakes(keys, "decode-1", spec.work_port, zmq.DEALER)
    assert _handshakes(keys, "monitor", spec.telemetry_port, zmq.SUB)
    assert not _handshakes(keys, "monitor", spec.work_port, zmq.DEALER)      # a monitor cannot be a worker
    assert not _handshakes(keys, "decode-1", spec.telemetry_port, zmq.SUB)   # nor a worker read the telemetry
    log = (Path(spec.log_dir) / "router.log").read_text()
    assert '"bus_key_refused"' in log  # refused keys are logged, with the key's fingerprint


def test_keys_if_missing_keeps_existing_keys(keys: Path) -> None:
    before = (keys / "router.key").read_bytes()
    rc = subprocess.run([sys.executable, "-m", "kairos.cli", "keys", str(keys), "--if-missing"],
                        capture_output=True, text=True)
    assert rc.returncode == 0 and (keys / "router.key").read_bytes() == before
    rc = subprocess.run([sys.executable, "-m", "kairos.cli", "keys", str(keys)], capture_output=True, text=True)
    assert rc.returncode == 1 and "--force" in rc.stderr and "--add" in rc.stderr


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], keys: Path, key_name: str, identity: str,
            port: int) -> zmq.Socket[bytes]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, identity.encode())
    pub, sec = zmq.auth.load_certificate(str(keys / f"{key_name}.key_secret"))
    server_pub, _ = zmq.auth.load_certificate(str(keys / "router.key"))
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_pub
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def test_a_key_registers_only_its_own_worker(cluster: Cluster, keys: Path) -> None:
    """decode-1's key (a worker not running here) cannot register as any other id: refused with the reason."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        s = _dealer(ctx, keys, "decode-1", "decode-7", cluster.spec.work_port)
        s.send(codec.encode(m.Hello(protocol=m.PROTOCOL_VERSION, worker_id="decode-7", role="decode", incarnation="x",
                                    engine="sim", model="kairos-sim", token_budget=64, kv_capacity_tokens=10**6,
                                    kv_transport="nixl", max_model_len=0)))
        assert s.poll(5000), "no answer to Hello"
        answer = codec.decode_inbox.decode(s.recv())
        assert isinstance(answer, m.Refused) and answer.reason.startswith("key:") and "'decode-1'" in answer.reason
        assert "decode-7" not in _registered(cluster)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("key_name", ["decode-1", "decode-0"])
def test_no_connection_takes_over_a_live_worker(cluster: Cluster, keys: Path, key_name: str) -> None:
    """A peer that connects under a live worker's id, with another worker's key or even with that
    worker's own, gets nothing: the id is never handed to a newer connection, so the clients'
    prompts keep going to the worker that registered, and every request is served."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        thief = _dealer(ctx, keys, key_name, "decode-0", cluster.spec.work_port)
        time.sleep(0.5)  # its handshake is done
        thief.send(codec.encode(m.Goodbye(worker_id="decode-0", incarnation="whatever", reason="drained")))
        for i in range(10):
            r = httpx.post(cluster.spec.api + "/v1/completions", headers={"authorization": "Bearer s3cret"},
                           json={"prompt": f"take {i} " * 40, "max_tokens": 4}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert thief.poll(200) == 0, "the router sent work to the peer that took the id"
        assert _registered(cluster) == {"prefill-0", "decode-0"}
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("key_name", ["", "decode-1"])
def test_telemetry_gives_nothing_without_the_monitor_key(cluster: Cluster, keys: Path, key_name: str) -> None:
    """The router publishes telemetry every second (worker ids, incarnations, counters): a
    subscriber without a key, or with a worker's, reads none of it; the monitor's key does."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        def sub(name: str) -> zmq.Socket[bytes]:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            if name:
                pub, sec = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
                server_pub, _ = zmq.auth.load_certificate(str(keys / "router.key"))
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_pub
            s.connect(f"tcp://127.0.0.1:{cluster.spec.telemetry_port}")
            return s

        sniffer, monitor = sub(key_name), sub("monitor")
        assert monitor.poll(5000), "the monitor's key reads no telemetry"
        assert sniffer.poll(2500) == 0, "telemetry reached a subscriber without the monitor's key"
    finally:
        ctx.destroy(linger=0)
