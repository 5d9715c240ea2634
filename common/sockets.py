"""Sockets, one small class per side of the bus: type, bind/connect, HWM and linger on one screen.

Frame layouts (see common/messages.py): ROUTER [identity, payload]; DEALER [payload];
PUB/SUB [topic, seq, payload]. Every socket has linger 0 (nothing is left to flush at close:
requests are owned by futures that are resolved or failed), a bounded HWM, and a maximum
message size. With `curve_keys_dir` set, every socket uses CURVE: the router is the server, and
each of its sockets has its own allow-list by role (ZAP domains): the work socket (which carries
the heartbeats too) takes only keys in `<dir>/allowed/worker/`, the telemetry socket only keys in
`<dir>/allowed/monitor/`; so a monitor's key cannot register as a worker, nor a worker's read
the telemetry.

Keys bound to workers: `kairos keys` makes one key pair per worker id and records the id in the
key files; the router reads which id each allowed key may register (`worker_key_ids`) and its
Inbox hands it each message's CURVE key (ZeroMQ's per-message "User-Id", the z85 public key set
by the authenticator), so a Hello under an id another key is bound to is refused, and a message
on a registered connection under another key than the one it registered with is dropped. A key
without an id (the one shared `worker` key of older `kairos keys`, or `--shared-worker-key`) may
register as any worker; the router warns about each one at start. ZAP requests carry the
server's own routing id, not the peer's, so the binding cannot be checked at the handshake:
it is checked at Hello and on every message.

Liveness below the application: ZeroMQ heartbeats (ZMQ_HEARTBEAT_IVL/TIMEOUT/TTL) and TCP
keepalive on every bus connection, so a peer whose host died is noticed in seconds, not when
TCP gives up. No ROUTER_HANDOVER: a second connection under an identity in use never takes it
over (with handover, a holder of any worker key could take a live worker's connection, and its
clients' prompts, before saying a word). libzmq then ignores that connection for good, even
after the old one closes; so a worker whose Hello goes unanswered for a few seconds dials again
(WorkerBus.reconnect), and is accepted once the router has dropped the old connection (at once
when the old process died and its host closed the connection; ZeroMQ heartbeats, ~3 x
zmq_heartbeat_s, when the host itself went away).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from common.config import BusConfig
from common.errors import ConfigError

WORK_HWM = 100_000        # work and tokens: large, but bounded (admission control is upstream)
TELEMETRY_HWM = 10_000    # the monitor is best effort; drop rather than slow the router

TELEMETRY_TOPIC = b"t"


WORKER_DOMAIN = "worker"    # ZAP domain of the work socket (heartbeats too): workers' keys only
MONITOR_DOMAIN = "monitor"  # ZAP domain of the telemetry socket: the monitor's keys only
ROLES = (WORKER_DOMAIN, MONITOR_DOMAIN)

TCP_KEEPALIVE_IDLE_S = 10   # then probes every 5 s, 3 of them: a dead host is noticed in ~25 s by TCP
TCP_KEEPALIVE_INTVL_S = 5
TCP_KEEPALIVE_CNT = 3


def _common(sock: zmq.asyncio.Socket, cfg: BusConfig, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    if cfg.zmq_heartbeat_s > 0:  # ZMTP pings: a silent connection is closed (and reconnected) in seconds
        ivl = max(1, int(cfg.zmq_heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)


def _keys(cfg: BusConfig) -> Path:
    d = Path(cfg.curve_keys_dir)
    if not d.is_dir():
        raise ConfigError(f"curve_keys_dir {d} does not exist: create keys with `kairos keys {d}`")
    return d


def _load(d: Path, file: str, what: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(d / file))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {what} {d / file}: {e} (create keys with `kairos keys {d}`, or "
                          f"`kairos keys {d} --add ...` for a name it lacks)") from e


def allow_list(d: Path, role: str) -> Path:
    """The directory of public keys allowed on the sockets of `role` (worker or monitor)."""
    allowed = d / "allowed" / role
    if not allowed.is_dir():
        raise ConfigError(f"curve_keys_dir {d} has no allow-list {allowed}/ (keys from an older `kairos keys`?): "
                          f"create them again with `kairos keys {d} --force`")
    return allowed


def curve_server(sock: zmq.asyncio.Socket, cfg: BusConfig, role: str) -> None:
    """Make `sock` a CURVE server that admits only the keys allowed for `role`."""
    d = _keys(cfg)
    name = cfg.curve_key_name or "router"
    pub, sec = _load(d, f"{name}.key_secret", "the router's secret key")
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    sock.curve_server = True
    sock.zap_domain = role.encode()


WORKER_ID_FIELD = "worker_id"  # the key file's metadata field naming the one worker id the key may register
_META = re.compile(r"^\s+([A-Za-z0-9_-]+)\s*=\s*\"?([^\"\n]*)\"?\s*$")


def key_metadata(path: Path) -> dict[str, str]:
    """The metadata section of a key file `kairos keys` wrote (ZeroMQ's certificate format)."""
    out: dict[str, str] = {}
    section = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
            continue
        mt = _META.match(line)
        if section == "metadata" and mt:
            out[mt.group(1)] = mt.group(2)
    return out


def fingerprint(key: str) -> str:
    """A short, loggable name for a z85 public key (its first 8 characters; grep allowed/ for it)."""
    return key[:8]


def worker_key_ids(cfg: BusConfig) -> dict[str, str | None]:
    """Each allowed worker key (z85 public key, as ZeroMQ's User-Id gives it) -> the worker id it
    may register (None: any, a shared key)."""
    out: dict[str, str | None] = {}
    for f in sorted(allow_list(_keys(cfg), WORKER_DOMAIN).glob("*.key")):
        try:
            pub, _ = zmq.auth.load_certificate(str(f))
            meta = key_metadata(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the allowed worker key {f}: {e}") from e
        out[pub.decode("ascii")] = meta.get(WORKER_ID_FIELD) or None
    return out


def worker_key_name(cfg: BusConfig, worker_id: str) -> str:
    """The key a worker connects with: KAIROS_CURVE_KEY_NAME if set, else the key made for its id,
    else the shared `worker` key of an older `kairos keys`."""
    if cfg.curve_key_name:
        return cfg.curve_key_name
    d = _keys(cfg)
    if (d / f"{worker_id}.key_secret").exists():
        return worker_id
    if (d / "worker.key_secret").exists():
        return "worker"
    raise ConfigError(f"no CURVE key for worker {worker_id!r} in {d} (no {worker_id}.key_secret): add one with "
                      f"`kairos keys {d} --add --workers {worker_id}` (the router must be restarted to allow it)")


def server_key(cfg: BusConfig, name: str = "") -> bytes:
    """The public key of the router a client connects to: `name`, else cfg.curve_server_key, else `router`."""
    server = name or cfg.curve_server_key or "router"
    return _load(_keys(cfg), f"{server}.key", f"the router's public key {server!r}")[0]


def curve_client(sock: zmq.asyncio.Socket, cfg: BusConfig, default_name: str, server: str = "") -> None:
    """Make `sock` a CURVE client with its own key (`default_name` unless curve_key_name names
    another) that accepts only the router whose public key is `server` (server_key's default)."""
    d = _keys(cfg)
    name = cfg.curve_key_name or default_name
    pub, sec = _load(d, f"{name}.key_secret", f"this service's key {name!r}")
    sock.curve_serverkey = server_key(cfg, server)
    sock.curve_publickey = pub
    sock.curve_secretkey = sec


KeyRefused = Callable[[str, str, str], None]  # (domain, z85 key, peer address)


class _Authenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler, telling its owner about every CURVE key it refuses (an unknown key, or
    one of another role): pyzmq itself only logs those at debug level."""

    def __init__(self, ctx: zmq.asyncio.Context, on_refused: KeyRefused | None) -> None:
        super().__init__(ctx)
        self._on_refused = on_refused

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if self._on_refused is not None and len(msg) == 7 and msg[5] == b"CURVE" and len(msg[6]) == 32:
            domain = msg[2].decode("utf-8", "replace")
            key = z85.encode(msg[6])
            if key not in self.certs.get(domain, {}):
                self._on_refused(domain, key.decode("ascii"), msg[3].decode("utf-8", "replace"))
        await super().handle_zap_message(msg)


def start_authenticator(ctx: zmq.asyncio.Context, cfg: BusConfig,
                        on_refused: KeyRefused | None = None) -> AsyncioAuthenticator | None:
    if not cfg.curve_keys_dir:
        return None
    d = _keys(cfg)
    lists = {role: allow_list(d, role) for role in ROLES}
    auth = _Authenticator(ctx, on_refused)
    auth.start()
    for role, allowed in lists.items():  # one allow-list per ZAP domain; no "*": nothing falls through
        auth.configure_curve(domain=role, location=str(allowed))
    return auth


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def handshake_reason(event: int, value: int) -> str:
    """What a failed-handshake monitor event means, for the operator reading the log."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return ("mechanism_mismatch: the peer does not use CURVE (a plaintext client, or a service without "
                "KAIROS_CURVE_KEYS_DIR)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"protocol_error {value:#x}: not a ZeroMQ peer of this version, or a garbled greeting"
    # what libzmq 4.3 reports for a plaintext (NULL mechanism) peer on a CURVE socket
    return ("no_detail: most often a peer without CURVE (a plaintext client, or a service without "
            "KAIROS_CURVE_KEYS_DIR), else one that went away mid-handshake")


class RouterBus:
    """The router's sockets: ROUTER (work and heartbeats), PUB (telemetry), both bound."""

    def __init__(self, cfg: Any, on_key_refused: KeyRefused | None = None) -> None:
        self.cfg = cfg
        # each allowed worker key -> the worker id it may register (None: any); empty without CURVE
        self.key_ids: dict[str, str | None] = worker_key_ids(cfg) if cfg.curve_keys_dir else {}
        # set before anything can fail: close() reads it (a failed bind once raised AttributeError here,
        # which hid the bind error itself)
        self.monitors: list[tuple[str, zmq.asyncio.Socket]] = []
        self.ctx = zmq.asyncio.Context()
        self.auth = start_authenticator(self.ctx, cfg, on_key_refused)
        self.work = self.ctx.socket(zmq.ROUTER)
        _common(self.work, cfg, WORK_HWM)
        self.work.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise instead of vanishing
        # No ROUTER_HANDOVER (module docstring): an identity in use is never handed to a newer connection.
        self.telemetry = self.ctx.socket(zmq.PUB)
        _common(self.telemetry, cfg, TELEMETRY_HWM)
        if cfg.curve_keys_dir:
            curve_server(self.work, cfg, WORKER_DOMAIN)
            curve_server(self.telemetry, cfg, MONITOR_DOMAIN)
        try:
            self.work.bind(endpoint(cfg.bind_host, cfg.work_port))
            self.telemetry.bind(endpoint(cfg.bind_host, cfg.telemetry_port))
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"cannot bind the router's bus on {cfg.bind_host} ports "
                              f"{cfg.work_port}/{cfg.telemetry_port}: {e}", event="bus_failed_to_start",
                              host=cfg.bind_host, port=cfg.work_port, telemetry_port=cfg.telemetry_port,
                              fix="another router is running on these ports: stop it, or pick other ones with "
                                  "--work-port and --telemetry-port (KAIROS_WORK_PORT, KAIROS_TELEMETRY_PORT)") from e
        # under CURVE, a handshake that fails before ZAP is asked (a peer without CURVE, or a
        # garbled greeting) is seen only by a socket monitor: `handshake_failures` reads them
        if cfg.curve_keys_dir:
            events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            self.monitors = [(WORKER_DOMAIN, self.work.get_monitor_socket(events)),
                             (MONITOR_DOMAIN, self.telemetry.get_monitor_socket(events))]
        self._tseq = 0
        # Each router names itself in the telemetry topic (the monitor may subscribe to several
        # replicas and numbers each one's messages apart): host and telemetry port.
        self._ttopic = TELEMETRY_TOPIC + f"{socket.gethostname()}:{cfg.telemetry_port}".encode()
        # A plain view of the send-only telemetry socket: a non-blocking send without a Future.
        self._telemetry_nowait: zmq.Socket[bytes] = zmq.Socket.shadow(self.telemetry.underlying)

    def publish(self, payload: bytes) -> None:
        self._tseq += 1
        try:
            self._telemetry_nowait.send_multipart([self._ttopic, self._tseq.to_bytes(8, "big"), payload],
                                                  flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # monitor slow or absent: telemetry is best effort

    async def handshake_failures(self, on_failed: Callable[[str, str], None]) -> None:
        """Call `on_failed(socket domain, why)` for each failed handshake (see `monitors`)."""
        if not self.monitors:
            return
        from zmq.utils.monitor import parse_monitor_message

        async def watch(domain: str, mon: zmq.asyncio.Socket) -> None:
            while True:
                ev = parse_monitor_message(await mon.recv_multipart())
                on_failed(domain, handshake_reason(int(ev["event"]), int(ev["value"])))

        await asyncio.gather(*(watch(d, mon) for d, mon in self.monitors))

    def close(self) -> None:
        for _, mon in self.monitors:
            mon.close(linger=0)
        for s in (self.work, self.telemetry):
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class WorkerBus:
    """A worker's socket: DEALER (work and heartbeats, identity = worker id), connected. Heartbeats
    travel on the connection the worker registered on, so the router takes a heartbeat for worker
    X only from X's own connection (a peer that knows X's id and incarnation cannot speak for it).

    While a worker service reads the socket it does so through an `Inbox` (`inbox`), and every send
    goes through that Inbox too: any operation on a ZeroMQ socket may consume its file
    descriptor's (edge-triggered) read event, and only the Inbox knows to read again after its own
    sends. Without one (before the service's loops start, after they end) the asyncio socket is
    used, which knows the same."""

    def __init__(self, cfg: BusConfig, worker_id: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.work = self.ctx.socket(zmq.DEALER)
        _common(self.work, cfg, WORK_HWM)
        self.work.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.work.setsockopt(zmq.RECONNECT_IVL, 100)
        self.work.setsockopt(zmq.RECONNECT_IVL_MAX, 200)  # a restarted router hears from us within 0.2 s
        if cfg.curve_keys_dir:
            curve_client(self.work, cfg, worker_key_name(cfg, worker_id))
        # Connection events of the work socket: a worker says Hello again as soon as it reconnects
        # (the router may have restarted), instead of waiting to be asked.
        self.events = self.work.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._work_ep = endpoint(cfg.router_host, cfg.work_port)
        self.work.connect(self._work_ep)
        self.inbox: Inbox | None = None  # the reader of the work socket, while a service has one

    def reconnect(self) -> None:
        """Drop the work connection and dial again. A ROUTER without ROUTER_HANDOVER keeps a
        connection that arrived under an identity still in use anonymous, and libzmq never looks
        at it again, even once the old connection is gone: a worker that reconnected while the
        router still held its old connection (both stalled past the ZeroMQ heartbeat timeout) is
        never heard. A fresh connection, once the old one is gone, is."""
        self.work.disconnect(self._work_ep)
        self.work.connect(self._work_ep)
        if self.inbox is not None:
            self.inbox.kick()  # (the calls above may have consumed the read edge)

    def send_now(self, payload: bytes) -> bool:
        """Queue a message without waiting; False when the router's queue is full (or it is
        unroutable). Through the Inbox while one reads the socket (see the class docstring)."""
        if self.inbox is not None:
            return self.inbox.send([payload])
        return send_nowait(self.work, payload)

    async def send(self, payload: bytes) -> None:
        """Send, waiting while the queue to the router is full."""
        while True:
            inbox = self.inbox
            if inbox is None:
                await self.work.send(payload)
                return
            if inbox.send([payload]):
                return
            # full: wait as a blocking send would, but not on the asyncio socket, whose wait would
            # take the FD's watch from the Inbox
            await asyncio.sleep(0.01)

    async def beat(self, payload: bytes) -> None:
        """Send a heartbeat now or drop it (not connected, or the router is not reading: the
        next heartbeat supersedes it). Never through a plain shadow of the socket outside an
        Inbox: its send could leave work that arrived meanwhile unread (see the class docstring)."""
        self.send_now(payload)

    async def connection_event(self) -> int:
        """The next connection event of the work socket (zmq.EVENT_HANDSHAKE_SUCCEEDED or _DISCONNECTED)."""
        frames = await self.events.recv_multipart()
        event: int = int.from_bytes(frames[0][:2], "little")
        return event

    def close(self) -> None:
        self.work.disable_monitor()
        self.events.close(linger=0)
        self.work.close(linger=0)
        self.ctx.term()


def telemetry_endpoints(cfg: Any) -> list[tuple[str, int, str]]:
    """Every router the monitor reads, with the name of its public key ("" for the default):
    `telemetry` (host:port[:key], comma separated), else the one router."""
    spec = getattr(cfg, "telemetry", "")
    if not spec:
        return [(cfg.router_host, cfg.telemetry_port, "")]
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit() or (len(parts) == 3 and not parts[2]):
            raise ConfigError(f"telemetry: {item.strip()!r} is not host:port or host:port:router_key (give every "
                              "router's telemetry endpoint, comma separated, e.g. 10.0.0.5:5557,10.0.0.6:5557)")
        out.append((parts[0], int(parts[1]), parts[2] if len(parts) == 3 else ""))
    return out


class MonitorBus:
    """The monitor's SUB socket on the router's telemetry."""

    def __init__(self, cfg: BusConfig) -> None:
        self.ctx = zmq.asyncio.Context()
        self.telemetry = self.ctx.socket(zmq.SUB)
        _common(self.telemetry, cfg, TELEMETRY_HWM)
        self.telemetry.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
        routers = telemetry_endpoints(cfg)
        if cfg.curve_keys_dir:
            curve_client(self.telemetry, cfg, "monitor", routers[0][2])
        for host, port, key in routers:
            if cfg.curve_keys_dir:  # each router's own public key: ZeroMQ takes it at connect
                self.telemetry.curve_serverkey = server_key(cfg, key)
            self.telemetry.connect(endpoint(host, port))

    def close(self) -> None:
        self.telemetry.close(linger=0)
        self.ctx.term()


@functools.cache  # (read at the first hand-off: a process is pinned before it runs)
def on_one_cpu() -> bool:
    """This process may run on one CPU only (`taskset -c N`, a cpuset of one): libzmq's I/O
    thread then shares that CPU with the event loop that sends."""
    try:
        return len(os.sched_getaffinity(0)) == 1 and hasattr(os, "sched_yield")
    except (AttributeError, OSError):  # (not Linux)
        return False


def hand_to_io_thread() -> None:
    """Let libzmq's I/O thread put what was just queued on the wire now. A send only queues the
    message for the context's I/O thread and signals it; where that thread shares the only CPU
    with the event loop (a pinned process), the scheduler (EEVDF, measured on kernel 6.18) let it
    run when the loop slept or its slice ended, not when it was signalled. So a request's work or
    its first token waited for whatever Python the loop ran after the send: on this project's
    2-core VM (`python -m bench.bus_handoff`) a message whose sender ran 300 us of Python after
    the send reached its peer 0.53 ms later, 0.33-0.37 ms when the sender yielded, and the same
    0.34-0.40 either way with nothing after the send; router-throughput.md, "The first token waits
    for the CPU its sender holds". One `sched_yield` hands the CPU to that thread (and back when it
    has written): about a microsecond, the thread's switch earlier rather than extra. A no-op
    unless this process may run on one CPU only: elsewhere the woken thread takes an idle CPU. On a
    CPU shared with other runnable processes the yield hands it to them too. The router calls it
    after each send to a worker, a worker after each send to its routers."""
    if on_one_cpu():
        os.sched_yield()


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


_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: the enum member's lookup costs more than the call, per message


class Inbox:
    """A ROUTER or DEALER socket driven straight from the event loop: frames are handed to
    `on_frames` from a reader callback, as many as are queued per wakeup (up to `batch`), and
    sends never wait. zmq.asyncio instead allocates a Future and re-polls ZMQ_EVENTS for every
    message, which costs more than the message's own handling at the router's rates.

    ZMQ_FD is edge-triggered and any operation on the socket (sends included) may consume the
    edge, so every wakeup reads until EAGAIN and every send schedules one more read on the next
    loop iteration; otherwise a message could sit unread until the next one arrives. The reader
    callback reads at once (one loop pass per wakeup, not two). Do not use the asyncio socket
    for anything else while an Inbox owns it. An exception raised by `on_frames` fails
    `failed`, which the owner awaits (so it ends the process, as a loop would).

    `idle_gap`: called at each wakeup, the least time (seconds) between two reads now, 0 for
    none. The router asks for `idle_read_ms` (50 ms) while no request is in flight, when nothing
    latency-bound travels on its work socket: a fleet's heartbeats, which arrive spread out
    (2,560 a second from 256 workers), are then read in batches instead of one per wakeup. While
    paused the socket's FD is not watched; a send ends the pause at once (its reply may matter),
    and `catch_up` reads what waits at once (a request arrived: its decision needs it).
    """

    def __init__(self, sock: zmq.asyncio.Socket, on_frames: Callable[..., None], *,
                 batch: int = 256, keyed: bool = False, idle_gap: Callable[[], float] | None = None) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._on_frames = on_frames
        # keyed (CURVE sockets only): on_frames(frames, key), key the sender's z85 public key
        self._keyed = keyed
        self._batch = batch
        self._idle_gap = idle_gap
        self._loop = asyncio.get_running_loop()
        self.failed: asyncio.Future[None] = self._loop.create_future()
        self._scheduled = False
        self._closed = False
        self._last_read = -1e9  # loop time of the last read
        self._paused: asyncio.TimerHandle | None = None  # the FD unwatched until this read
        self.wakeups = 0  # reads, and messages read: their ratio is the batching the load allowed
        self.messages = 0
        # time.monotonic() when a read last found the socket empty: every message read after it
        # was sent after it, less its transit (a busy reader's backlog makes a message older)
        self.drained_at = time.monotonic()
        self._loop.add_reader(self._fd, self._readable)
        self.kick()

    def send(self, frames: list[bytes]) -> bool:
        """Queue a message without waiting; False if the peer is unroutable or its queue is full."""
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        finally:
            self.kick()
        return True

    def kick(self) -> None:
        """Read soon: after a send, or after something else operated on the socket (either may
        have consumed its read edge)."""
        if self._paused is not None:  # a send during a pause: read soon, whatever the gap
            self._paused.cancel()
            self._resume()
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._read)

    def _readable(self) -> None:
        """The FD's reader callback: read now, unless a read is already scheduled, or reads are
        to be spaced out (then stop watching the FD until the next read is due)."""
        if self._scheduled or self._closed:
            return
        if self._idle_gap is not None:
            gap = self._idle_gap()
            if gap > 0:
                due = self._last_read + gap
                if due > self._loop.time():
                    self._loop.remove_reader(self._fd)
                    self._paused = self._loop.call_at(due, self._resume_read)
                    return
        self._read()

    def catch_up(self, max_batches: int = 16) -> None:
        """If reads are paused (`idle_gap`), read what is queued now, before returning: a request
        arrived at an idle router, and its decision must see every heartbeat that came since the
        last read, as it would had each been read as it came. Up to `max_batches` reads of `batch`
        messages (what is left then is read on the loop's next pass, as usual). Nothing to do
        otherwise (not paused, every message has been read as it came)."""
        if self._paused is None or self._closed:
            return
        self._paused.cancel()
        self._resume()
        self._read()
        for _ in range(max_batches - 1):
            if not self._scheduled:  # the last read ended with nothing more queued
                return
            self._read()  # a full batch: more may wait (the read scheduled meanwhile finds what is left)

    def read_queued(self) -> None:
        """Read what is queued now (one batch), before returning, paused or not. A busy loop reads
        the socket only when its reader callback's turn comes: a router replica deciding a request
        in a callback that runs first would decide on a view without the heartbeats already
        waiting here (another replica's dispatch, acknowledged by its worker)."""
        if self._closed:
            return
        if self._paused is not None:
            self.catch_up()
            return
        self._read()

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            self._loop.add_reader(self._fd, self._readable)

    def _resume_read(self) -> None:
        self._resume()
        if not self._scheduled:
            self._read()

    def _read(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        self._last_read = self._loop.time()
        self.wakeups += 1
        recv, on_frames, keyed, noblock = self._sock.recv, self._on_frames, self._keyed, _NOBLOCK
        n = 0
        try:
            # zero-copy frames, for their `more` flag: ZMQ_RCVMORE (and ZMQ_EVENTS) through
            # getsockopt build an enum member per call, which costs more than the frame
            while n < self._batch:
                try:
                    f = recv(noblock, copy=False)
                except zmq.Again:  # nothing more (and the FD's edge re-armed): once per wakeup
                    self.messages += n
                    self.drained_at = time.monotonic()
                    return
                n += 1
                frames = [f.bytes]
                while f.more:
                    f = recv(noblock, copy=False)
                    frames.append(f.bytes)
                if keyed:
                    on_frames(frames, f.get("User-Id"))
                else:
                    on_frames(frames)
        except Exception as e:
            if not self.failed.done():
                self.failed.set_exception(e)
            return
        self.messages += n
        self.kick()  # more may be queued: go on after the loop has served the others

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._paused is not None:
                self._paused.cancel()
                self._paused = None
            self._loop.remove_reader(self._fd)
