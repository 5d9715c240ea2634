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
    assert (d / "allowed" / "worker" / "worker.key").exists() and (d / "allowed" / "monitor" / "monitor.key").exists() and (d / "router.key_secret").exists()
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
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
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


@pytest.mark.parametrize("mode", ["plain", "unknown-key"])
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
