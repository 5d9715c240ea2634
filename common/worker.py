"""What prefill and decode workers share: registration, heartbeats, the receive loop, drain.

A worker connects to the router (it needs no other address), says Hello until it is welcomed,
publishes heartbeats every interval and at once after a large state change, and says Hello
again whenever the router asks (the router restarted or declared it dead) and as soon as its
connection to the router comes back after a break (a restarted router hears from every worker
within a reconnect interval, ~0.1 s). Hello lists the requests the worker holds; the router's
Welcome names those it no longer tracks, which the worker drops (their KV is freed). A router
that refuses the worker (engine, model or KV transport incompatible with the cluster's) says
why; the worker logs it and tries again every REFUSED_RETRY_S.

Replicated routers (WorkerConfig.routers): all of the above happens per router, on one
RouterLink each (common/router_link.py); a request's messages go back to the router that sent
it, and each router's heartbeats acknowledge that router's own dispatch numbers.

The rules (what Hello and heartbeats say, what work is admitted or refused, what the worker
holds, cancellation, the drain's hand-back) are the worker's core (common/worker_core/:
`DecodeCore`, `PrefillCore`), which the simulator runs too; this class is its shell: the
sockets, the engine, the loops and the clock, and the core's ports (`WorkerPorts`: `send`,
`start`, `abort`, `beat_now`, `router_of`, `release_kv`).

No poison messages: a frame that does not decode is dropped; an error while handling a message
or admitting a request fails that request (RequestFailed with the reason), never the worker.
On SIGTERM it says Goodbye, finishes what it holds within `drain_timeout`, hands back the rest
(RequestFailed, retryable), says Goodbye(reason="drained") and exits.

A SetRole (the router's role planner) drains the same way (Goodbye "role_change": no new work;
what it holds finishes within `drain_timeout`, the rest is handed back), then `run` returns with
`next_role` set: the engine has taken the new role in place (`Engine.switch_role`, no restart)
and the caller (services/roles.py) builds the other role's service on the same engine and the
same router connections (`previous`), which says Hello under the new role. The simulated engine
and a vLLM engine started in the kv_both KV role (vllm_kv_both, the default) change role so; an
engine that cannot (vLLM started as kv_producer/kv_consumer) refuses the SetRole with a log line
(`role_change_refused`, with the engine's reason) and keeps serving in its role; the router's
planner abandons the flip after planner_flip_timeout_s.

An engine that steps its running decodes on through the switch (`Engine.keeps_decodes`: the
simulated engine; vLLM in kv_both, whose requests are tasks of their own) keeps them across the
flip, as the simulator does: the core's
`set_role(keep=True)` drains only what the new role cannot do (prefills, hand-offs, deflections
still prefilling), its Goodbye is "role_switch" (the routers keep it, draining), the engine
switches between two steps of its running loop with the kept requests (`between_steps`,
`switch_role(keep=...)`), the new service's core adopts them (`adopt`, in its constructor, where
the engine's callbacks move to it) and says Hello under the same incarnation naming them in
`held` (router core `role_changed`): they stream on, token for token, none handed back or
re-dispatched. A SIGTERM during such a flip turns it into a departure (`leave_instead`: the drain
waits for everything). A vLLM prefill worker decodes nothing of its own (route "retain" is the
simulated engine's), so only its flip to prefill has decodes to keep; in the prefill role it
takes no new one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import socket
import time
import uuid
from typing import Any

import msgspec
import structlog
import zmq

from common import codec, tracing
from common import messages as m
from common.config import WorkerConfig
from common.engines.base import Engine, EngineRequest
from common.errors import Overloaded
from common.loop_lag import LoopLag
from common.prefix_report import PrefixReporter
from common.router_link import Origins, RouterLink, router_addresses
from common.service import install_signals, settle_heap
from common.sockets import Inbox, WorkerBus, hand_to_io_thread
from common.worker_core import EngineInfo, WorkerCore

REFUSED_RETRY_S = 5.0
REDIAL_AFTER = 3  # unanswered Hellos (1 s apart) before the work connection is dropped and dialled again

# what to do about a refusal, by the reason's first word (common/router_core/trust.py, service.py)
_REFUSAL_FIX = {
    "": "make this worker's engine, model and KV transport match the cluster's",
    "key": "give this worker the key named after its id (kairos keys DIR --add --workers ID, then restart the "
           "routers), or unset KAIROS_CURVE_KEY_NAME",
    "protocol": "run the same Kairos release on the router and every worker",
    "identity": "leave KAIROS_WORKER_ID as the connection's identity (do not set a ZeroMQ identity of your own)",
}

class WorkerService(abc.ABC):
    role: m.Role
    worker_id: str
    incarnation: str
    links: list[RouterLink]
    origins: Origins
    core: WorkerCore

    def __init__(self, cfg: WorkerConfig, engine: Engine, *, previous: WorkerService | None = None) -> None:
        """`previous`: the service of this worker's other role it takes over from after a role
        change (its id, its router connections, and its engine, already started and switched)."""
        self.cfg = cfg
        self.engine = engine
        self.worker_id = (previous.worker_id if previous is not None
                          else cfg.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}")
        # a flip that keeps its running decodes says Hello under the same incarnation: the routers
        # take that for the same worker in its other role (router core `role_changed`), still decoding them
        keeping = previous is not None and previous.core.keep_running
        self.incarnation = previous.incarnation if keeping and previous is not None else uuid.uuid4().hex[:12]
        self.log = structlog.get_logger().bind(worker=self.worker_id)
        self.stop = asyncio.Event()
        self.engine_started = previous is not None
        # the engine's step loop: this service's, or, after a flip that kept running decodes, the
        # previous service's, still running (`between_steps` switched it in place)
        self.engine_task: asyncio.Task[None] | None = previous.engine_task if previous is not None else None
        self.next_role: m.Role | None = None  # set by a SetRole: the role `run` hands over to when it returns
        self.signalled = asyncio.Event()  # SIGTERM/SIGINT: leave, even in the middle of a role change
        if previous is not None:
            self.links = previous.links
            for link in self.links:  # registered again, under the new role
                link.welcomed.clear()
                link.answered.clear()
        else:
            self.links = [RouterLink(i, c) for i, c in enumerate(router_addresses(cfg))]
        self.origins = previous.origins if previous is not None else Origins(self.links)
        first = self.links[0]
        self.welcomed = first.welcomed    # the first router's (the only one, without replicas)
        self.hb_interval = cfg.heartbeat_interval
        self.prefix = PrefixReporter(engine)  # the prefix cache's changes, summarised in heartbeats
        self.left = False
        self._beat_now = asyncio.Event()
        self._at_once = False  # the beat asked for goes without the coalescing delay (`beat_now`)
        self._hello_now = first.hello_now
        self.answered = first.answered    # the router answered a Hello (Welcome or Refused)
        self.bus: WorkerBus                # the first router's sockets
        self.core = self.make_core(self.engine_info())
        if previous is not None and previous.core.kept():
            # (synchronous with the subclass binding the engine's callbacks to this core: every
            # token of a kept request goes to exactly one of the two cores)
            self.core.adopt(previous.core)
        self.counters = self.core.counters  # the core's, and the shell's own below
        self.counters.update(bad_frames=0, handler_errors=0, dropped_on_welcome=0)
        self.fitted: m.Coeffs | None = None  # online refit of the engine's step-time model
        engine.on_failed = self._on_engine_failed  # called only by engines that fail requests (vllm)
        # OpenTelemetry (common/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = tracing.from_config(cfg, f"kairos-{self.role}-worker")
        self.loop_lag = LoopLag(self.role)  # the event loop's lag: /metrics, heartbeats (common/loop_lag.py)

    def engine_info(self) -> EngineInfo:
        """The engine's settings, as Hello states them (some known only once the engine started)."""
        e = self.engine
        return EngineInfo(engine=e.name, token_budget=e.token_budget, kv_capacity_tokens=e.kv_capacity_tokens,
                          max_batch=e.max_batch, block_size=e.block_size, max_model_len=e.max_model_len)

    @property
    def draining(self) -> bool:
        return self.core.draining

    @property
    def refused(self) -> str:
        """Why the (first) router refuses this worker, while it does."""
        return self.links[0].refused

    @property
    def router_incarnation(self) -> str | None:
        return self.links[0].incarnation

    def router_of(self, request_id: str) -> str:
        """The incarnation of the router that sent this request."""
        return self.origins.of(request_id).incarnation or ""

    # -- to implement -------------------------------------------------------------------
    @abc.abstractmethod
    def make_core(self, info: EngineInfo) -> WorkerCore:
        """The worker's core, with this shell as its ports."""

    @abc.abstractmethod
    def heartbeat(self) -> m.PrefillHeartbeat | m.DecodeHeartbeat: ...

    @abc.abstractmethod
    def on_message(self, msg: Any) -> None: ...

    def extra_hello(self) -> dict[str, Any]:
        return {}

    # -- the core's, for the loops and for operators --------------------------------------
    def held_requests(self) -> list[tuple[str, int]]:
        """(request_id, attempt) of everything this worker holds, for the hand-back at drain."""
        return self.core.held_requests()

    def drop_request(self, request_id: str) -> None:
        """Abort a request and free what it holds (KV included); no message to the router."""
        self.core.drop(request_id)

    def held_ids(self) -> list[str]:
        """Every request this worker holds anything for (Hello.held)."""
        return self.core.held_ids()

    def drain_pending(self) -> bool:
        """Whether the drain must still wait for something beyond held_requests()."""
        return self.core.drain_pending(time.monotonic())

    # -- the core's ports (WorkerPorts) -----------------------------------------------------
    def start(self, req: EngineRequest) -> bool:
        return self.add_to_engine(req)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        return self.engine.lower_tbt_slo(request_id, tbt_slo)

    def release_kv(self, key: str) -> None:
        """No KV landing space is reserved by this worker (the decode worker's NIXL receiver is)."""

    decoder: codec.Decoder[Any]

    # -- lifecycle ----------------------------------------------------------------------
    async def run(self) -> int:
        install_signals(self.signalled)
        self.log.info("role_started" if self.engine_started else "worker_starting", role=self.role,
                      engine=self.engine.name, incarnation=self.incarnation,
                      routers=[link.address for link in self.links])
        first = not self.engine_started
        if first:
            await self.engine.start()
        self.core.info = self.engine_info()  # vLLM knows its KV capacity and block size only now
        await self.setup()
        if first:  # the engine's and the service's start-up heap out of the collector's full passes
            settle_heap()
        buses = [link.bus if link.bus is not None else link.open(self.worker_id) for link in self.links]
        self.bus = buses[0]
        if self.engine_task is None or self.engine_task.done():
            self.engine_task = asyncio.create_task(self.engine.run(), name="engine")
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._on_signal(), name="signals"),
                         tg.create_task(self.heartbeat_loop(), name="heartbeat"),
                         tg.create_task(self._watch_engine(self.engine_task), name="engine"),
                         tg.create_task(self.refit_loop(), name="refit"),
                         tg.create_task(self.loop_lag.run(), name="loop-lag"),
                         *[tg.create_task(c, name=n) for n, c in self.extra_loops()]]
                for link in self.links:
                    tasks += [tg.create_task(self._recv_loop(link), name=f"recv-{link.index}"),
                              tg.create_task(self._hello_loop(link), name=f"hello-{link.index}"),
                              tg.create_task(self._connection_loop(link), name=f"connection-{link.index}")]
                await self.stop.wait()
                await self._drain()
                for t in tasks:
                    t.cancel()
            if self.signalled.is_set() and self.next_role is not None:  # told to stop while changing role
                self.log.info("role_change_dropped", role=self.role, to=self.next_role, reason="stopping")
                self.next_role = None
            if self.next_role is not None:
                await self._switch_engine(self.next_role)
            if self.next_role is None and self.core.kept():  # leaving after all: what it kept goes back
                self.core.leave_instead()
                await self._to_all(self.core.hand_back())
        finally:
            if self.next_role is None:
                await self._stop_engine()
                for bus in buses:
                    bus.close()
            await self.teardown()
            if self.next_role is None:
                await self.engine.close()
            if self.tracing is not None:
                self.tracing.shutdown()  # export the spans still batched
        if self.next_role is not None:
            self.log.info("role_changed", role=self.role, to=self.next_role, action="registering again")
            return 0
        self.log.info("worker_stopped")
        return 0

    def extra_loops(self) -> list[tuple[str, Any]]:
        return []

    async def _watch_engine(self, task: asyncio.Task[None]) -> None:
        """The engine's step loop, as a task of this service: what it raises stops the service.
        Cancelled, it leaves the loop running (`_stop_engine` stops it; a flip that keeps its
        decodes hands it to the next role's service)."""
        await asyncio.wait([task])
        task.result()
        raise RuntimeError("the engine's step loop returned")

    async def _stop_engine(self) -> None:
        task = self.engine_task
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _switch_engine(self, role: m.Role) -> None:
        """The engine takes `role` in place. A flip that keeps its running decodes switches it
        between two steps of its running loop, with the requests the core keeps (they step on in
        the new role, the next service's core adopts them); any other flip stops the loop first
        (the engine holds nothing then). On failure `next_role` is cleared: the worker leaves."""
        if self.core.keep_running:
            async with self.engine.between_steps():
                why = self.engine.switch_role(role, keep=[rid for rid, _ in self.core.kept()])
        else:
            await self._stop_engine()
            why = self.engine.switch_role(role)
        if why:
            self.log.error("role_change_failed", role=self.role, to=role, error=why,
                           action="the worker exits; its supervisor starts it again in its configured role")
            self.next_role = None

    async def _on_signal(self) -> None:
        await self.signalled.wait()
        self.core.leave_instead()  # (a role change under way that kept its decodes: it drains them now)
        self.stop.set()

    async def setup(self) -> None:
        """Role-specific resources (the NIXL agent) created after the engine, before registering."""

    async def teardown(self) -> None:
        """Release what setup() created."""

    async def _drain(self) -> None:
        self.log.info("drain_started", held=len(self.held_requests()), timeout_s=self.cfg.drain_timeout,
                      role_change=self.next_role or "")
        if self.next_role is None:  # (a role change said its Goodbye "role_change" already)
            await self._to_all(self.core.start_drain())
        deadline = time.monotonic() + self.cfg.drain_timeout
        # (a role change that keeps its running decodes waits only for the rest: core `drained`)
        while not self.core.drained(time.monotonic()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        bye = self.core.hand_back()  # what is left goes back to its router (RequestFailed, retryable)
        self.left = True  # no more heartbeats: the router must not take us for a worker to re-register
        await self._to_all(bye)
        await asyncio.sleep(0.05)  # let the hand-backs leave before the socket closes

    async def _to_all(self, msg: m.Msg) -> None:
        payload = codec.encode(msg)
        for link in self.links:
            assert link.bus is not None
            await link.bus.send(payload)

    def _to_all_now(self, msg: m.Msg) -> None:
        """`_to_all` without waiting (from the inbox's callback); a router whose queue is full misses it."""
        payload = codec.encode(msg)
        for link in self.links:
            assert link.bus is not None
            if not link.bus.send_now(payload):
                self.log.error("send_failed", message=type(msg).__name__, router=link.address)

    # -- loops --------------------------------------------------------------------------
    def hello(self, link: RouterLink | None = None) -> m.Hello:
        held = self.held_ids()
        if link is not None and len(self.links) > 1:  # only what this router sent: it names what it no longer tracks
            held = [rid for rid in held if self.origins.of(rid) is link]
        if link is not None and link.held_rids:  # ended here, their last messages still waiting to go
            held = list(dict.fromkeys([*held, *link.held_rids]))
        return self.core.hello(held=held, coeffs=self.coeffs(), fixed_role=not self.engine.can_switch_role,
                               # the link's, with one router too: it survives a role flip, the core does not
                               last_dispatch=link.last_dispatch if link is not None else None,
                               **self.extra_hello())

    async def _hello_loop(self, link: RouterLink) -> None:
        assert link.bus is not None
        unanswered = 0
        while True:
            link.answered.clear()
            link.hello_now.clear()
            await link.bus.send(codec.encode(self.hello(link)))
            if not await _either(link.answered, link.hello_now, timeout=1.0):
                unanswered += 1
                # perhaps ignored as a duplicate of our old connection; at once when the connection
                # has just come back (the router is awake: its handshake succeeded) and the router
                # still did not answer in a second, so its liveness window does not pass meanwhile
                just_back, link.just_back = link.just_back, False
                if unanswered % REDIAL_AFTER == 0 or just_back:
                    self.log.warning("router_not_answering", router=link.address, hellos=unanswered,
                                     action="reconnecting")
                    link.bus.reconnect()
                else:
                    self.log.warning("router_not_answering", router=link.address, hellos=unanswered)
                continue
            unanswered = 0
            if not link.answered.is_set():  # reconnected meanwhile: say Hello again at once
                continue
            link.just_back = False
            if not link.welcomed.is_set():  # refused: say why, try again later (the cluster may change)
                try:
                    await asyncio.wait_for(link.hello_now.wait(), timeout=REFUSED_RETRY_S)
                except TimeoutError:
                    pass
                continue
            await link.hello_now.wait()

    async def _connection_loop(self, link: RouterLink) -> None:
        """Say Hello as soon as the connection to the router is back after a break: a restarted
        router then knows this worker within a reconnect interval, not a heartbeat round trip."""
        assert link.bus is not None
        broken = False
        while True:
            event = await link.bus.connection_event()
            if event == zmq.EVENT_DISCONNECTED:
                broken = True
                link.on_break()
                link.connected = False  # its heartbeats stop naming this router (the planner's leader)
                self.log.info("router_disconnected", router=link.address)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
            # a draining worker says Hello too when it holds what it sent across the break: only
            # the router's Welcome releases that (its heartbeats tell the router it is draining)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and ((broken and not self.draining) or link.broken):
                broken = False
                self.log.info("router_reconnected", router=link.address)
                link.just_back = True
                link.welcomed.clear()
                link.hello_now.set()

    async def heartbeat_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._beat_now.wait(), timeout=self.hb_interval)
                if not self._at_once:
                    await asyncio.sleep(0.002)  # coalesce a burst of state changes into one beat
            except TimeoutError:
                pass
            self._beat_now.clear()
            self._at_once = False
            if self.left:
                return
            hb = self.heartbeat()
            summary = self.prefix.summary()
            lag_ms = self.loop_lag.take_max() * 1000.0
            routers = [link.incarnation for link in self.links
                       if link.incarnation and link.connected and link.welcomed.is_set()]
            if summary is not None or lag_ms or routers:
                hb = msgspec.structs.replace(hb, prefix=summary, loop_lag_ms=lag_ms, routers=routers)
            now = time.monotonic()
            if len(self.links) == 1:  # (the link's number: it survives a role flip, the core's does not)
                link = self.links[0]
                missed = link.missed_now(now)
                if missed or hb.last_dispatch != link.last_dispatch:
                    hb = msgspec.structs.replace(hb, last_dispatch=link.last_dispatch, missed=missed)
                await self.bus.beat(codec.encode(hb))
                continue
            for link in self.links:  # each router's own dispatch numbers, acknowledged to it alone
                assert link.bus is not None
                await link.bus.beat(codec.encode(msgspec.structs.replace(hb, last_dispatch=link.last_dispatch,
                                                                         missed=link.missed_now(now))))

    def coeffs(self) -> m.Coeffs | None:
        """The step-time model the router should predict this worker with: the online refit when
        there is a good one, else the engine's profile."""
        return self.fitted or self.engine.coeffs()

    async def refit_loop(self) -> None:
        if not self.engine.can_refit or self.cfg.refit_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.cfg.refit_interval)
            result = self.engine.refit()
            if result is None:
                continue
            model, mape = result
            accepted = mape <= self.cfg.refit_max_mape
            self.log.info("model_refit", mape=round(mape, 4), accepted=accepted, a0=model.a0, a1=model.a1,
                          a2=model.a2, a3=model.a3, a4=model.a4, a5=model.a5)
            if accepted:
                self.fitted = model.to_coeffs()
                self.engine.predict_with(model)  # its step error is measured against what the routers are told

    def beat_now(self, at_once: bool = False) -> None:
        """Heartbeat soon (2 ms, changes coalesced); `at_once` without that delay, where this
        worker serves several router replicas (common/worker_core/ports.py)."""
        if at_once and len(self.links) > 1:
            self._at_once = True
        self._beat_now.set()

    async def _recv_loop(self, link: RouterLink) -> None:
        """Read the router's messages from the socket's reader callback (`Inbox`: no Future and no
        loop turn per message, as zmq.asyncio's `recv` costs), each handled there as it is read."""
        bus = link.bus
        assert bus is not None
        several = len(self.links) > 1

        def on_frames(frames: list[bytes]) -> None:
            if len(frames) != 1:
                self.counters["bad_frames"] += 1
                self.log.warning("bad_frame_dropped", frames=len(frames))
                return
            payload = frames[0]
            try:
                msg = self.decoder.decode(payload)
            except codec.DecodeError as e:
                self.counters["bad_frames"] += 1
                self.log.warning("bad_frame_dropped", error=str(e)[:200], bytes=len(payload))
                return
            if several:
                rid = getattr(msg, "request_id", None)
                if isinstance(rid, str):
                    self.origins.note(rid, link)
            link.saw(msg, time.monotonic())
            try:
                self._on_inbox(msg, link)
            except Exception as e:  # one bad message fails its request, never the worker
                self._on_handler_error(msg, e)

        inbox = bus.inbox = Inbox(bus.work, on_frames)
        try:
            await inbox.failed  # the reader callback does the work; this ends only on a bug
        finally:
            inbox.close()
            if bus.inbox is inbox:
                bus.inbox = None

    def _on_inbox(self, msg: Any, link: RouterLink | None = None) -> None:
        link = link or self.links[0]
        match msg:
            case m.Welcome():
                link.incarnation = msg.router_incarnation
                self.hb_interval = msg.heartbeat_interval_s
                if not link.welcomed.is_set():
                    self.log.info("registered", router_incarnation=msg.router_incarnation, router=link.address)
                link.refused = ""
                link.welcomed.set()
                link.answered.set()
                if link.broken:  # what waited while the connection was broken, in order, first
                    held = link.release()
                    assert link.bus is not None
                    sent = sum(link.bus.send_now(p) for p in held)
                    self.log.info("held_messages_sent", router=link.address, messages=len(held), sent=sent)
                self._drop_untracked(msg.drop if len(self.links) == 1
                                     else [rid for rid in msg.drop if self.origins.of(rid) is link])
            case m.Refused():
                if msg.reason != link.refused:
                    self.log.error("registration_refused", reason=msg.reason, retry_in_s=REFUSED_RETRY_S,
                                   router=link.address,
                                   fix=_REFUSAL_FIX.get(msg.reason.split(":", 1)[0], _REFUSAL_FIX[""]))
                link.refused = msg.reason
                link.welcomed.clear()
                link.answered.set()
            case m.SetRole():
                self._set_role(msg)
            case m.PlanBudget():
                self.core.on_plan_budget(msg)
            case m.Reregister():
                if self.draining:  # leaving: a router that does not know us has nothing of ours
                    return
                self.log.info("reregister_requested", router_incarnation=msg.router_incarnation,
                              reason=msg.reason, router=link.address)
                link.welcomed.clear()
                link.hello_now.set()
            case _:
                self.on_message(msg)

    def _set_role(self, msg: m.SetRole) -> None:
        """The router's role planner moves this worker to `msg.role`: drain (no new work, what it
        holds finishes or is handed back), then `run` returns for the new role's service."""
        if not self.engine.can_switch_role:
            self.log.error("role_change_refused", role=self.role, to=msg.role, reason=msg.reason,
                           error=f"{self.engine.role_fixed()}; it keeps serving as a {self.role} worker",
                           fix="pin this worker (the router's planner_pin) or turn the planner off (planner); "
                               "a vllm worker changes role in place when started with vllm_kv_both on (the default)")
            return
        if self.stop.is_set():  # leaving already
            self.log.info("role_change_ignored", role=self.role, to=msg.role, stopping=True)
            return
        bye = self.core.set_role(msg, keep=self.engine.keeps_decodes)
        if bye is None:
            return
        self.next_role = msg.role
        self._to_all_now(bye)
        self.stop.set()

    def _drop_untracked(self, ids: list[str]) -> None:
        """The router no longer tracks these (it restarted, or re-dispatched them): free them."""
        if n := self.core.welcomed(ids):
            self.counters["dropped_on_welcome"] += n
            self.log.info("dropped_untracked_requests", requests=n)

    def _on_handler_error(self, msg: Any, e: Exception) -> None:
        self.counters["handler_errors"] += 1
        rid = getattr(msg, "request_id", None)
        self.log.error("message_handler_failed", message=type(msg).__name__, request_id=rid,
                       error=f"{type(e).__name__}: {e}"[:300], exc_info=True)
        if not isinstance(rid, str):
            return
        try:
            self.drop_request(rid)
        except Exception as e2:  # already failing: report, do not raise
            self.log.error("drop_failed", request_id=rid, error=f"{type(e2).__name__}: {e2}"[:300])
        self.core.fail(rid, int(getattr(msg, "attempt", 0)),
                       f"worker error handling {type(msg).__name__}: {type(e).__name__}: {e}"[:500])

    def refuse(self, request_id: str, attempt: int, reason: str, *, invalid: bool = False) -> None:
        """Turn a request away here: counted, logged, and the router told (the core's rule)."""
        self.core.refuse(request_id, attempt, reason, invalid=invalid)

    def add_to_engine(self, req: EngineRequest) -> bool:
        """Hand a request to the engine; whatever the engine raises fails that request only (never
        the worker): overloaded and engine faults are retryable elsewhere, a ValueError means the
        engine refuses the request itself (vLLM: too long, bad ids, ...). True when admitted."""
        try:
            self.engine.add(req)
        except Overloaded as e:
            self.refuse(req.request_id, req.attempt, f"overloaded: {e}")
        except ValueError as e:
            self.refuse(req.request_id, req.attempt, f"engine refused the request: {e}", invalid=True)
        except Exception as e:
            self.log.error("engine_add_failed", request_id=req.request_id, error=f"{type(e).__name__}: {e}",
                           exc_info=True)
            self.refuse(req.request_id, req.attempt, f"engine error: {type(e).__name__}: {e}")
        else:
            return True
        return False

    def _on_engine_failed(self, request_id: str, attempt: int, reason: str, retryable: bool = True) -> None:
        self.core.engine_failed(request_id, attempt, reason, retryable)

    def send(self, msg: m.Msg) -> None:
        """To the router that sent the request (every router for a message about none); while the
        connection to it is broken, kept until it welcomes this worker again (RouterLink.hold)."""
        for link, part in self.origins.split(msg):
            assert link.bus is not None
            payload = codec.encode(part)
            if link.holding_out:
                if not link.hold(payload, part):
                    self.log.error("send_failed", message=type(msg).__name__, router=link.address,
                                   reason="the connection is broken and what waits for it is full")
                continue
            if not link.bus.send_now(payload):
                self.log.error("send_failed", message=type(msg).__name__, router=link.address)
            else:
                link.sent(time.monotonic(), payload, part)
        # a step's tokens on the wire now, not after the step loop has planned and armed the next
        # step: a pinned worker's I/O thread waits for the CPU (common/sockets.py hand_to_io_thread)
        hand_to_io_thread()


async def _either(a: asyncio.Event, b: asyncio.Event, *, timeout: float) -> bool:
    """Wait until `a` or `b` is set (True), or `timeout` seconds pass (False)."""
    if a.is_set() or b.is_set():
        return True
    waiters = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return bool(done)
