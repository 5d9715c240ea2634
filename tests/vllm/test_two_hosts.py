"""KV hand-off across hosts: a prefill and a decode vLLM CPU engine on two "hosts".

The hosts are two network namespaces this test makes (`ip netns`), joined by a veth pair on a
private /30 (10.254.x.0/30) that exists only between them; nothing else is reachable from them
(each has its own loopback, no route out). Not link-local 169.254/16: UCX's TCP transport
ignores interfaces with link-local addresses. Each runs tests/vllm/twohost_node.py, which builds its
engine from worker settings exactly as a worker does: the prefill host advertises its NIXL
side channel at its own veth address on a fixed port (KAIROS_VLLM_SIDE_CHANNEL_HOST/_PORT),
binding it on every interface (KAIROS_VLLM_SIDE_CHANNEL_BIND=0.0.0.0). UCX is kept to TCP so
the KV bytes cross the link, as between machines (not shared memory, which the two namespaces
would otherwise still share). Every hand-off must load its KV over that link (zero fallbacks)
and produce exactly the greedy tokens of an in-place prefill of the same prompt.

Needs root and iproute2 (skipped otherwise, saying so).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.helpers import VLLM_MISSING
from tests.vllm.twohost_node import PREFIX

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
    pytest.mark.timeout(1200),
]
ROOT = Path(__file__).resolve().parents[2]
NETNS_MISSING = None
if os.geteuid() != 0 or shutil.which("ip") is None:
    NETNS_MISSING = "needs root and iproute2 (`ip netns`) to make two network namespaces"
SIDE_CHANNEL_PORT = 5611  # fixed, as a firewall would need it


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """(prefill netns, its address, decode netns, its address), removed afterwards."""
    if NETNS_MISSING:
        pytest.skip(NETNS_MISSING)
    tag = f"{os.getpid() % 100000}"
    ns_p, ns_d = f"kx-p-{tag}", f"kx-d-{tag}"
    veth_p, veth_d = f"kxp{tag}", f"kxd{tag}"
    octet = os.getpid() % 250 + 1
    addr_p, addr_d = f"10.254.{octet}.1", f"10.254.{octet}.2"
    made: list[str] = []
    try:
        for ns in (ns_p, ns_d):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", veth_p, "type", "veth", "peer", "name", veth_d)
        ip("link", "set", veth_p, "netns", ns_p)
        ip("link", "set", veth_d, "netns", ns_d)
        for ns, dev, addr in ((ns_p, veth_p, addr_p), (ns_d, veth_d, addr_d)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ns_p, addr_p, ns_d, addr_d
    finally:
        for ns in made:  # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Node:
    """twohost_node.py in one namespace, spoken to over its stdin/stdout."""

    def __init__(self, ns: str, role: str, model: Path, env: dict[str, str], log: Path) -> None:
        self.role = role
        self.log = log
        self._buf = b""
        full = {k: v for k, v in os.environ.items() if not k.startswith(("KAIROS_", "UCX_"))}
        full.update(env, PYTHONPATH=str(ROOT), UCX_TLS="tcp", KAIROS_LOG_FORMAT="json")
        with log.open("wb") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.vllm.twohost_node", role, str(model)],
                cwd=ROOT, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)

    def read(self, timeout: float) -> dict[str, Any]:
        """The next protocol line (unbuffered: select() must see every byte not yet consumed)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                if line.startswith(PREFIX.encode()):
                    return dict(json.loads(line[len(PREFIX):]))
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise TimeoutError(f"{self.role} host said nothing for {timeout:.0f}s; log {self.log}:\n"
                                   + self.tail())
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"{self.role} host exited ({self.proc.wait()}); log {self.log}:\n" + self.tail())
            self._buf += chunk

    def ask(self, msg: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def test_kv_handoff_between_two_hosts(two_hosts: tuple[str, str, str, str], tiny_model: Path,
                                      tmp_path: Path) -> None:
    ns_p, addr_p, ns_d, addr_d = two_hosts
    common = {"KAIROS_VLLM_KV_CACHE_MIB": "32", "KAIROS_VLLM_TOKEN_BUDGET": "256", "KAIROS_VLLM_MAX_BATCH": "16",
              "KAIROS_PROFILE": "cpu-tiny-llama", "KAIROS_VLLM_PROFILE": "cpu-tiny-llama",
              "KAIROS_KV_TIMEOUT": "30", "VLLM_CACHE_ROOT": str(tmp_path / "vc")}
    prefill = Node(ns_p, "prefill", tiny_model, {**common, "KAIROS_VLLM_SIDE_CHANNEL_HOST": addr_p,
                                                 "KAIROS_VLLM_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORT),
                                                 "KAIROS_VLLM_SIDE_CHANNEL_BIND": "0.0.0.0"}, tmp_path / "prefill.log")
    decode = Node(ns_d, "decode", tiny_model, {**common, "KAIROS_VLLM_SIDE_CHANNEL_HOST": addr_d},
                  tmp_path / "decode.log")
    try:
        ready_p, ready_d = prefill.read(600), decode.read(600)  # engine starts: minutes on a loaded 2-core VM
        assert ready_p["side_channel"] == [addr_p, SIDE_CHANNEL_PORT] and ready_p["bind"] == "0.0.0.0"
        assert ready_d["ready"] == "decode"
        prompts = {f"r{i}": [(13 * i + 7 * j) % 900 + 5 for j in range(40 + 97 * i)] for i in range(4)}
        handed: dict[str, list[int]] = {}
        for rid, prompt in prompts.items():
            pre = prefill.ask({"id": rid, "prompt": prompt})
            assert "kv_params" in pre, pre
            kv = pre["kv_params"]
            # what the decode host is told to reach: the advertised address and fixed port, not the bind address
            assert (kv["remote_host"], kv["remote_port"]) == (addr_p, SIDE_CHANNEL_PORT), kv
            out = decode.ask({"id": rid, "prompt": prompt, "kv_params": kv, "max_tokens": 12})
            assert out["finish"] == "length" and len(out["tokens"]) == 12, out
            handed[rid] = out["tokens"]
        stats = decode.ask({"stats": True})
        assert stats["kv_fallbacks"] == 0, f"hand-offs fell back to in-place prefill: {stats}\n{decode.tail()}"
        assert decode.ask({"reset": True})["reset"]
        for rid, prompt in prompts.items():  # the reference: the same prompt prefilled in place
            out = decode.ask({"id": rid + "-ref", "prompt": prompt, "kv_params": None, "max_tokens": 12})
            assert out["tokens"] == handed[rid], f"{rid}: hand-off {handed[rid]} != in place {out['tokens']}"
    finally:
        prefill.close()
        decode.close()
