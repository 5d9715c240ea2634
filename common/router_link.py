"""A worker's connection to one router of a replicated cluster, and which router owns a request.

With several routers (WorkerConfig.routers) a worker holds one RouterLink per router: its own
bus sockets, its own registration state (welcomed, refused, the router's incarnation), and the
highest dispatch number that router sent it, which the heartbeats on that link acknowledge (each
router numbers its dispatches on its own, so one shared counter would clear another router's
ledger entries). Every request is remembered against the link it arrived on, so its replies,
KV hand-off messages and hand-backs go to the router that sent it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

import msgspec

from common import messages as m
from common.config import BusConfig, WorkerConfig
from common.errors import ConfigError
from common.sockets import WorkerBus

# Requests remembered against their router; the oldest are forgotten past this many (a request
# still alive after this many newer ones then answers on the first link).
ORIGIN_CAP = 1 << 16
# what a worker keeps for a router while their connection is broken (RouterLink.hold), at most
HOLD_MAX_BYTES = 64 << 20
# dispatch numbers skipped (`RouterLink.saw`): named in heartbeats this long, at most the
# MISSED_MAX latest (a heartbeat then carries up to about 20 KB more, for 10 s)
MISSED_REPORT_S = 10.0
MISSED_MAX = 4096


def router_addresses(cfg: WorkerConfig) -> list[BusConfig]:
    """The bus address of every router the worker serves: WorkerConfig.routers, a comma list of
    host:work_port:heartbeat_port[:router_key] (router_key: the name of that router's public key
    under CURVE, when each router has its own), or the one router at router_host/work_port."""
    text = cfg.routers.strip()
    if not text:
        return [cfg]
    out: list[BusConfig] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if (len(parts) not in (3, 4) or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit()
                or (len(parts) == 4 and not parts[3])):
            raise ConfigError(f"routers: {item.strip()!r} is not host:work_port:heartbeat_port[:router_key] "
                              "(example: 10.0.0.5:5555:5556, or 10.0.0.5:5555:5556:router-a)")
        out.append(msgspec.structs.replace(cfg, router_host=parts[0], work_port=int(parts[1]),
                                           heartbeat_port=int(parts[2]),
                                           curve_server_key=parts[3] if len(parts) == 4 else cfg.curve_server_key))
    return out


class RouterLink:
    """One router, as this worker sees it."""

    def __init__(self, index: int, bus_cfg: BusConfig) -> None:
        self.index = index
        self.cfg = bus_cfg
        self.address = f"{bus_cfg.router_host}:{bus_cfg.work_port}"
        self.welcomed = asyncio.Event()
        self.answered = asyncio.Event()  # the router answered a Hello (Welcome or Refused)
        self.hello_now = asyncio.Event()
        self.refused = ""                 # why the router refuses us, while it does
        self.incarnation: str | None = None
        self.connected = True             # False from a disconnection until the next handshake
        self.just_back = False            # reconnected, and no Hello answered since (redial at once if not)
        # a break in the connection: what this worker sends the router waits here, in order,
        # until the router welcomes it again (`hold`, `release`)
        self.broken = False
        self.held_out: deque[bytes] = deque()
        self.held_bytes = 0
        self.held_rids: set[str] = set()  # the requests those messages are about (Hello.held names them)
        # the token batches and prefill results sent in the last `replay_s` (RouterLink.sent): a
        # connection that breaks is noticed only once the ZeroMQ heartbeat times out, and what was
        # sent on it meanwhile may be lost with it; they are sent again after the break (the
        # router drops repeats: tokens by TokenItem.pos, a PrefillDone it already has). ZeroMQ
        # pings every zmq_heartbeat_s and gives up 3 x that after a ping unanswered, so a break is
        # noticed up to 4 x zmq_heartbeat_s after the last traffic; a second more for the wake-up
        self.replay_s = 4.0 * bus_cfg.zmq_heartbeat_s + 1.0
        self.recent: deque[tuple[float, bytes, m.Msg]] = deque()
        self.last_dispatch = 0            # the highest dispatch number this router sent us
        # dispatch numbers skipped -> when noticed: work sent into a connection that had broken
        # is lost with it, and the router, its send having succeeded, cannot tell (`saw`)
        self.missed: dict[int, float] = {}
        self.bus: WorkerBus | None = None

    def open(self, worker_id: str) -> WorkerBus:
        self.bus = WorkerBus(self.cfg, worker_id)
        return self.bus

    @property
    def holding_out(self) -> bool:
        """Whether messages to the router wait (`hold`): from a break in the connection until the
        router welcomes this worker again. A message sent meanwhile would be lost: queued on a
        connection that is gone, or on a new one the router does not hear yet (common/sockets.py,
        WorkerBus.reconnect)."""
        return self.broken or not self.connected

    def hold(self, payload: bytes, msg: m.Msg) -> bool:
        """Keep a message until `release`; False when the hold is full (HOLD_MAX_BYTES): the message
        is dropped (the router's position check resumes a request whose tokens went missing)."""
        if self.held_bytes + len(payload) > HOLD_MAX_BYTES:
            return False
        self.held_out.append(payload)
        self.held_bytes += len(payload)
        if isinstance(msg, m.TokenBatch):
            self.held_rids.update(it.request_id for it in msg.items)
        else:
            rid = getattr(msg, "request_id", None)
            if isinstance(rid, str):
                self.held_rids.add(rid)
        return True

    def sent(self, now: float, payload: bytes, msg: m.Msg) -> None:
        """Note a message sent now: token batches and prefill results are sent again after a break
        (`recent`); the rest are not (a lost refusal or end is found at the next Hello instead)."""
        if isinstance(msg, (m.TokenBatch, m.PrefillDone)):
            recent = self.recent
            recent.append((now, payload, msg))
            while recent[0][0] < now - self.replay_s:
                recent.popleft()

    def on_break(self) -> None:
        """The connection broke: what was sent on it lately is held again, ahead of anything else."""
        self.broken = True
        for _, payload, msg in self.recent:
            self.hold(payload, msg)
        self.recent.clear()

    def release(self) -> list[bytes]:
        """The router welcomed this worker again: what waited, in order, to send now."""
        self.broken = False
        out = list(self.held_out)
        self.held_out.clear()
        self.held_bytes = 0
        self.held_rids.clear()
        return out

    def saw(self, msg: object, now: float) -> None:
        """Note the dispatch number of work that arrived on this link (its heartbeats acknowledge
        it). The router numbers each worker's work 1, 2, 3, ... and sends it in that order on one
        connection, so a number skipped was lost on the way: a connection that broke drops what
        it held, and a send into one whose break the router had not noticed yet succeeded. The
        heartbeats name it (`missed_now`) and the router places that work again
        (common/router_core/membership.py, `lost_dispatches`). One that turns up late is struck off."""
        d = getattr(msg, "dispatch", None)
        if not isinstance(d, int):
            return
        last = self.last_dispatch
        if d > last:
            # the router numbers from the Hello's last_dispatch, this link's (0 for a link that has
            # seen nothing: it sends 1 first), so every jump is work lost on the way (or, after a
            # role flip that kept decodes, the old entry's numbers, which the router ignores).
            # At most the MISSED_MAX latest are named: heartbeats stay bounded
            missed = self.missed
            for k in range(max(last + 1, d - MISSED_MAX), d):
                missed[k] = now
            while len(missed) > MISSED_MAX:  # the oldest out (numbers only rise)
                del missed[next(iter(missed))]
            self.last_dispatch = d
        elif self.missed:
            self.missed.pop(d, None)

    def missed_now(self, now: float) -> list[int]:
        """The dispatch numbers skipped in the last MISSED_REPORT_S (each heartbeat repeats them:
        a heartbeat can be lost too; the router acts on each once)."""
        if not self.missed:
            return []
        for k in [k for k, at in self.missed.items() if now - at > MISSED_REPORT_S]:
            del self.missed[k]
        return list(self.missed)


class Origins:
    """request id -> the link it arrived on (bounded: see ORIGIN_CAP)."""

    def __init__(self, links: list[RouterLink]) -> None:
        self.links = links
        self._of: OrderedDict[str, RouterLink] = OrderedDict()

    def note(self, request_id: str, link: RouterLink) -> None:
        if len(self.links) == 1:
            return
        self._of[request_id] = link
        self._of.move_to_end(request_id)
        while len(self._of) > ORIGIN_CAP:
            self._of.popitem(last=False)

    def of(self, request_id: str) -> RouterLink:
        return self._of.get(request_id, self.links[0])

    def forget(self, request_id: str) -> None:
        self._of.pop(request_id, None)

    def split(self, msg: m.Msg) -> list[tuple[RouterLink, m.Msg]]:
        """Where a worker -> router message goes: the router of its request; a TokenBatch is cut
        into one batch per router; a message about no request goes to every router."""
        if len(self.links) == 1:
            return [(self.links[0], msg)]
        if isinstance(msg, m.TokenBatch):
            per: dict[int, tuple[list[m.TokenItem], list[str], list[str]]] = {}
            for it in msg.items:
                per.setdefault(self.of(it.request_id).index, ([], [], []))[0].append(it)
            reasons = msg.kv_fallback_reasons or [""] * len(msg.kv_fallback)
            for fid, why in zip(msg.kv_fallback, reasons, strict=False):
                _, fb, fbr = per.setdefault(self.of(fid).index, ([], [], []))
                fb.append(fid)
                fbr.append(why)
            for it in msg.items:
                if it.finish_reason is not None:
                    self.forget(it.request_id)
            return [(self.links[i], msgspec.structs.replace(msg, items=items, kv_fallback=fb,
                                                            kv_fallback_reasons=fbr if msg.kv_fallback_reasons else []))
                    for i, (items, fb, fbr) in per.items()]
        rid = getattr(msg, "request_id", None)
        if isinstance(rid, str):
            link = self.of(rid)
            if isinstance(msg, m.RequestFailed):
                self.forget(rid)
            return [(link, msg)]
        return [(link, msg) for link in self.links]
