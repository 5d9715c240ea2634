"""Sockets, one small class per side of the bus: type, bind/connect, HWM and linger on one screen.

Frame layouts (see common/messages.py): ROUTER [identity, payload]; DEALER [payload];
PUB/SUB [topic, seq, payload]. Every socket has linger 0 (nothing is left to flush at close:
requests are owned by futures that are resolved or failed), a bounded HWM, and a maximum
message size. With `curve_keys_dir` set, every socket uses CURVE: the router is the server and
only clients whose public key is in `<dir>/allowed/` get through (ZAP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from common.config import BusConfig
from common.errors import ConfigError

WORK_HWM = 100_000        # work and tokens: large, but bounded (admission control is upstream)
HEARTBEAT_HWM = 16        # heartbeats may be dropped: the next one supersedes
TELEMETRY_HWM = 10_000    # the monitor is best effort; drop rather than slow the router

HB_TOPIC = b"hb"
TELEMETRY_TOPIC = b"t"


def _common(sock: zmq.asyncio.Socket, cfg: BusConfig, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)


def _keys(cfg: BusConfig) -> Path:
    d = Path(cfg.curve_keys_dir)
    if not (d / "router.key").exists():
        raise ConfigError(f"curve_keys_dir {d} has no router.key: create keys with `kairos keys {d}`")
    return d


def curve_server(sock: zmq.asyncio.Socket, cfg: BusConfig) -> None:
    d = _keys(cfg)
    try:
        pub, sec = zmq.auth.load_certificate(str(d / "router.key_secret"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the router's secret key in {d}: {e}") from e
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    sock.curve_server = True


def curve_client(sock: zmq.asyncio.Socket, cfg: BusConfig, default_name: str) -> None:
    d = _keys(cfg)
    name = cfg.curve_key_name or default_name
    try:
        server_pub, _ = zmq.auth.load_certificate(str(d / "router.key"))
        pub, sec = zmq.auth.load_certificate(str(d / f"{name}.key_secret"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE keys {name!r} in {d}: {e}") from e
    sock.curve_serverkey = server_pub
    sock.curve_publickey = pub
    sock.curve_secretkey = sec


def start_authenticator(ctx: zmq.asyncio.Context, cfg: BusConfig) -> AsyncioAuthenticator | None:
    if not cfg.curve_keys_dir:
        return None
    allowed = _keys(cfg) / "allowed"
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed))
    return auth


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


class RouterBus:
    """The router's sockets: ROUTER (work), SUB (heartbeats), PUB (telemetry), all bound."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.auth = start_authenticator(self.ctx, cfg)
        self.work = self.ctx.socket(zmq.ROUTER)
        _common(self.work, cfg, WORK_HWM)
        self.work.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise instead of vanishing
        self.heartbeats = self.ctx.socket(zmq.SUB)
        _common(self.heartbeats, cfg, HEARTBEAT_HWM * 64)
        self.heartbeats.setsockopt(zmq.SUBSCRIBE, HB_TOPIC)
        self.telemetry = self.ctx.socket(zmq.PUB)
        _common(self.telemetry, cfg, TELEMETRY_HWM)
        socks = (self.work, self.heartbeats, self.telemetry)
        if cfg.curve_keys_dir:
            for s in socks:
                curve_server(s, cfg)
        try:
            self.work.bind(endpoint(cfg.bind_host, cfg.work_port))
            self.heartbeats.bind(endpoint(cfg.bind_host, cfg.heartbeat_port))
            self.telemetry.bind(endpoint(cfg.bind_host, cfg.telemetry_port))
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"cannot bind the router's bus on {cfg.bind_host} ports "
                              f"{cfg.work_port}/{cfg.heartbeat_port}/{cfg.telemetry_port}: {e} "
                              "(another router running? pick other ports)") from e
        self._tseq = 0
        # A plain view of the send-only telemetry socket: a non-blocking send without a Future.
        self._telemetry_nowait: zmq.Socket[bytes] = zmq.Socket.shadow(self.telemetry.underlying)

    def publish(self, payload: bytes) -> None:
        self._tseq += 1
        try:
            self._telemetry_nowait.send_multipart([TELEMETRY_TOPIC, self._tseq.to_bytes(8, "big"), payload],
                                                  flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # monitor slow or absent: telemetry is best effort

    def close(self) -> None:
        for s in (self.work, self.heartbeats, self.telemetry):
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class WorkerBus:
    """A worker's sockets: DEALER (work, identity = worker id) and PUB (heartbeats), connected."""

    def __init__(self, cfg: BusConfig, worker_id: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.work = self.ctx.socket(zmq.DEALER)
        _common(self.work, cfg, WORK_HWM)
        self.work.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.work.setsockopt(zmq.RECONNECT_IVL, 100)
        self.work.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.heartbeats = self.ctx.socket(zmq.PUB)
        _common(self.heartbeats, cfg, HEARTBEAT_HWM)
        self.heartbeats.setsockopt(zmq.CONFLATE, 0)
        if cfg.curve_keys_dir:
            for s in (self.work, self.heartbeats):
                curve_client(s, cfg, "worker")
        self.work.connect(endpoint(cfg.router_host, cfg.work_port))
        self.heartbeats.connect(endpoint(cfg.router_host, cfg.heartbeat_port))
        self._seq = 0

    async def send(self, payload: bytes) -> None:
        await self.work.send(payload)

    def beat(self, payload: bytes) -> None:
        self._seq += 1
        try:
            self.heartbeats.send_multipart([HB_TOPIC, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # dropped: the next heartbeat supersedes it

    def close(self) -> None:
        self.work.close(linger=0)
        self.heartbeats.close(linger=0)
        self.ctx.term()


class MonitorBus:
    """The monitor's SUB socket on the router's telemetry."""

    def __init__(self, cfg: BusConfig) -> None:
        self.ctx = zmq.asyncio.Context()
        self.telemetry = self.ctx.socket(zmq.SUB)
        _common(self.telemetry, cfg, TELEMETRY_HWM)
        self.telemetry.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
        if cfg.curve_keys_dir:
            curve_client(self.telemetry, cfg, "monitor")
        self.telemetry.connect(endpoint(cfg.router_host, cfg.telemetry_port))

    def close(self) -> None:
        self.telemetry.close(linger=0)
        self.ctx.term()


def send_nowait(sock: zmq.Socket[Any] | zmq.asyncio.Socket, frames: list[bytes] | bytes) -> bool:
    """Send without waiting (from synchronous callbacks on the event loop). False if the peer's
    queue is full or the peer is unroutable: the caller decides what that means. A plain socket
    (or an `Inbox`) is cheapest: the asyncio one allocates a Future per send."""
    if not isinstance(sock, zmq.asyncio.Socket):
        try:
            if isinstance(frames, bytes):
                sock.send(frames, flags=zmq.NOBLOCK)
            else:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True
    fut: Any
    try:
        if isinstance(frames, bytes):
            fut = sock.send(frames, flags=zmq.NOBLOCK)
        else:
            fut = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        return False
    return fut.done() and fut.exception() is None


class Inbox:
    """A ROUTER or DEALER socket driven straight from the event loop: frames are handed to
    `on_frames` from a reader callback, as many as are queued per wakeup (up to `batch`), and
    sends never wait. zmq.asyncio instead allocates a Future and re-polls ZMQ_EVENTS for every
    message, which costs more than the message's own handling at the router's rates.

    ZMQ_FD is edge-triggered and any operation on the socket (sends included) may consume the
    edge, so every wakeup reads until EAGAIN and every send schedules one more read on the next
    loop iteration; otherwise a message could sit unread until the next one arrives. Do not use
    the asyncio socket for anything else while an Inbox owns it. An exception raised by
    `on_frames` fails `failed`, which the owner awaits (so it ends the process, as a loop would).
    """

    def __init__(self, sock: zmq.asyncio.Socket, on_frames: Callable[[list[bytes]], None], *,
                 batch: int = 256) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._on_frames = on_frames
        self._batch = batch
        self._loop = asyncio.get_running_loop()
        self.failed: asyncio.Future[None] = self._loop.create_future()
        self._scheduled = False
        self._closed = False
        self._loop.add_reader(self._fd, self._kick)
        self._kick()

    def send(self, frames: list[bytes]) -> bool:
        """Queue a message without waiting; False if the peer is unroutable or its queue is full."""
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        finally:
            self._kick()
        return True

    def _kick(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock, on_frames = self._sock, self._on_frames
        try:
            for _ in range(self._batch):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                on_frames(frames)
        except Exception as e:
            if not self.failed.done():
                self.failed.set_exception(e)
            return
        self._kick()  # more may be queued: go on after the loop has served the others

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
