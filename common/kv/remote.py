"""A KvReceiver in a child process, driven over a ZeroMQ REQ/REP control socket (kv-bench and tests).

    with RemoteReceiver([("rx", 1024, 16384)]) as peer:    # spawns `python -m common.kv.bench --serve`
        tx.add_peer(peer.info("rx"))
        ids = peer.reserve("rx", key, nbytes)
        await tx.push("rx", key, ids, payload, timeout=5)
        peer.wait("rx", key, timeout=5, tokens=n, bytes_per_token=bpt)   # raises the child's KvError
        peer.freeze() / peer.thaw() / peer.kill()                          # fault injection

The control messages below are a harness between a parent and the child it spawned, never on
the service bus, so they live here rather than in common.messages. msgpack, no pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgspec
import zmq
import zmq.asyncio

from common.kv.errors import (
    KvBadDescriptor,
    KvCorrupt,
    KvError,
    KvNixlError,
    KvNoSpace,
    KvPeerLost,
    KvTimeout,
    KvUnavailable,
    KvUnknownPeer,
)
from common.messages import KvAgentInfo

REPO_ROOT = Path(__file__).resolve().parents[2]
_ERRORS: dict[str, type[KvError]] = {c.reason: c for c in (KvBadDescriptor, KvCorrupt, KvNixlError, KvNoSpace,
                                                           KvPeerLost, KvTimeout, KvUnavailable, KvUnknownPeer)}


class Ctl(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Base of the control requests; `agent` names one of the child's receivers."""

    agent: str = ""


class CtlInfo(Ctl, frozen=True, kw_only=True):
    pass


class CtlReserve(Ctl, frozen=True, kw_only=True):
    key: str
    nbytes: int
    block_ids: list[int] | None = None


class CtlWait(Ctl, frozen=True, kw_only=True):
    key: str
    timeout: float
    tokens: int | None = None
    bytes_per_token: int | None = None


class CtlRelease(Ctl, frozen=True, kw_only=True):
    key: str


class CtlStats(Ctl, frozen=True, kw_only=True):
    pass


class CtlQuit(Ctl, frozen=True, kw_only=True):
    pass


CtlRequest = CtlInfo | CtlReserve | CtlWait | CtlRelease | CtlStats | CtlQuit


class CtlReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    reason: str = ""
    error: str = ""
    info: KvAgentInfo | None = None
    block_ids: list[int] = []
    nbytes: int = 0
    wait_s: float = 0.0
    stats: dict[str, Any] = {}


# ------------------------------------------------------------------------------ child side


async def serve(control: str, pools: list[tuple[str, int, int]], poll_s: float) -> int:
    """Run receivers named in `pools` and answer control requests on `control` until CtlQuit."""
    from common.kv.receiver import KvReceiver

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control)
    decoder = msgspec.msgpack.Decoder(CtlRequest)
    encoder = msgspec.msgpack.Encoder()
    receivers = {name: KvReceiver(name, num_blocks=nb, block_bytes=bb, poll_s=poll_s, quarantine_s=0)
                 for name, nb, bb in pools}
    try:
        for rx in receivers.values():
            await rx.start()
        while True:
            req = decoder.decode(await sock.recv())
            reply = await _handle(receivers, req)
            await sock.send(encoder.encode(reply))
            if isinstance(req, CtlQuit):
                return 0
    finally:
        for rx in receivers.values():
            await rx.close()
        sock.close()
        ctx.term()


async def _handle(receivers: dict[str, Any], req: CtlRequest) -> CtlReply:
    if isinstance(req, CtlQuit):
        return CtlReply(ok=True)
    rx = receivers.get(req.agent)
    if rx is None:
        return CtlReply(ok=False, reason=KvUnknownPeer.reason, error=f"no receiver {req.agent!r}")
    try:
        match req:
            case CtlInfo():
                return CtlReply(ok=True, info=rx.agent_info())
            case CtlReserve(key=key, nbytes=nbytes, block_ids=ids):
                return CtlReply(ok=True, block_ids=rx.reserve(key, nbytes, block_ids=ids))
            case CtlWait(key=key, timeout=timeout, tokens=tokens, bytes_per_token=bpt):
                t0 = time.monotonic()
                data = await rx.wait(key, timeout, tokens=tokens, bytes_per_token=bpt)
                return CtlReply(ok=True, nbytes=int(data.size), wait_s=time.monotonic() - t0)
            case CtlRelease(key=key):
                rx.release(key)
                return CtlReply(ok=True)
            case CtlStats():
                return CtlReply(ok=True, stats=rx.stats)
    except KvError as e:
        return CtlReply(ok=False, reason=e.reason, error=str(e))
    return CtlReply(ok=False, reason="bad_request", error=f"unhandled {type(req).__name__}")


# ------------------------------------------------------------------------------ parent side


class RemoteReceiver:
    """Spawn and drive a receiver child process. Always closed by `with` (kills the child)."""

    def __init__(self, pools: list[tuple[str, int, int]], *, poll_s: float = 0.0002, startup_timeout: float = 30.0,
                 log: IO[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.pools = pools
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.REQ_RELAXED, 1)  # a request may time out (frozen child): resend later
        self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._sock.bind("tcp://127.0.0.1:*")
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        cmd = [sys.executable, "-m", "common.kv.bench", "--serve", "--control", endpoint, "--poll-s", str(poll_s)]
        for name, nb, bb in pools:
            cmd += ["--pool", f"{name}:{nb}:{bb}"]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CtlReply)
        out = log if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        try:
            for name, _, _ in pools:
                self.call(CtlInfo(agent=name), timeout=startup_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, req: CtlRequest, *, timeout: float = 30.0) -> CtlReply:
        """One request/reply; TimeoutError if the child does not answer in time (frozen or dead)."""
        self._sock.send(self._encoder.encode(req))
        deadline = time.monotonic() + timeout
        while not self._sock.poll(50):
            if self.proc.poll() is not None:
                raise KvPeerLost(f"receiver process exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver process did not answer {type(req).__name__} within {timeout}s")
        return self._decoder.decode(self._sock.recv())

    def _ok(self, reply: CtlReply) -> CtlReply:
        if not reply.ok:
            raise _ERRORS.get(reply.reason, KvError)(reply.error)
        return reply

    def info(self, agent: str) -> KvAgentInfo:
        info = self._ok(self.call(CtlInfo(agent=agent))).info
        assert info is not None
        return info

    def reserve(self, agent: str, key: str, nbytes: int, block_ids: list[int] | None = None) -> list[int]:
        return self._ok(self.call(CtlReserve(agent=agent, key=key, nbytes=nbytes, block_ids=block_ids))).block_ids

    def wait(self, agent: str, key: str, *, timeout: float, tokens: int | None = None,
             bytes_per_token: int | None = None) -> CtlReply:
        """The child's rx.wait (with verification when tokens are given); raises its KvError."""
        req = CtlWait(agent=agent, key=key, timeout=timeout, tokens=tokens, bytes_per_token=bytes_per_token)
        return self._ok(self.call(req, timeout=timeout + 30.0))

    def release(self, agent: str, key: str) -> None:
        self._ok(self.call(CtlRelease(agent=agent, key=key)))

    def stats(self, agent: str) -> dict[str, Any]:
        return self._ok(self.call(CtlStats(agent=agent))).stats

    # fault injection
    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a stopped process
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Ask the child to quit; kill it if it does not within 5 s. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.thaw()
                self.call(CtlQuit(), timeout=5.0)
                self.proc.wait(timeout=5.0)
            except (TimeoutError, KvPeerLost, subprocess.TimeoutExpired, ProcessLookupError):
                pass
            self.kill()
        if not self._sock.closed:
            self._sock.close()
            self._ctx.term()

    def __enter__(self) -> RemoteReceiver:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def serve_main(control: str, pools: list[str], poll_s: float) -> int:
    parsed = []
    for spec in pools:
        name, nb, bb = spec.rsplit(":", 2)
        parsed.append((name, int(nb), int(bb)))
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(control, parsed, poll_s))
    return 0
