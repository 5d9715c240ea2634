"""What prefill and decode workers share: registration, heartbeats, the receive loop, drain.

A worker connects to the router (it needs no other address), says Hello until it is welcomed,
publishes heartbeats every interval and at once after a large state change, and says Hello
again whenever the router asks (the router restarted or declared it dead). On SIGTERM it says
Goodbye, finishes what it holds within `drain_timeout`, hands back the rest (RequestFailed,
retryable) and exits.
"""

from __future__ import annotations

import abc
import asyncio
import os
import socket
import time
import uuid
from typing import Any

import structlog

from common import codec
from common import messages as m
from common.config import WorkerConfig
from common.engines.base import Engine
from common.service import install_signals
from common.sockets import WorkerBus, send_nowait


class WorkerService(abc.ABC):
    role: m.Role

    def __init__(self, cfg: WorkerConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.worker_id = cfg.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        self.incarnation = uuid.uuid4().hex[:12]
        self.log = structlog.get_logger().bind(worker=self.worker_id)
        self.stop = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.router_incarnation: str | None = None
        self.hb_interval = cfg.heartbeat_interval
        self.hb_seq = 0
        self.last_dispatch = 0
        self.draining = False
        self._beat_now = asyncio.Event()
        self._hello_now = asyncio.Event()
        self.bus: WorkerBus
        self.counters: dict[str, int] = {"bad_frames": 0}
        self.fitted: m.Coeffs | None = None  # online refit of the engine's step-time model
        if hasattr(engine, "on_failed"):  # engines that can fail a request (vllm)
            engine.on_failed = self._on_engine_failed

    # -- to implement -------------------------------------------------------------------
    @abc.abstractmethod
    def heartbeat(self) -> m.Msg: ...

    @abc.abstractmethod
    async def on_message(self, msg: Any) -> None: ...

    @abc.abstractmethod
    def held_requests(self) -> list[tuple[str, int]]:
        """(request_id, attempt) of everything this worker holds, for the hand-back at drain."""

    def extra_hello(self) -> dict[str, Any]:
        return {}

    decoder: codec.Decoder[Any]

    # -- lifecycle ----------------------------------------------------------------------
    async def run(self) -> int:
        install_signals(self.stop)
        self.log.info("worker_starting", role=self.role, engine=self.engine.name, incarnation=self.incarnation,
                      router=f"{self.cfg.router_host}:{self.cfg.work_port}")
        await self.engine.start()
        await self.setup()
        self.bus = WorkerBus(self.cfg, self.worker_id)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._recv_loop(), name="recv"),
                         tg.create_task(self._hello_loop(), name="hello"),
                         tg.create_task(self._heartbeat_loop(), name="heartbeat"),
                         tg.create_task(self.engine.run(), name="engine"),
                         tg.create_task(self._refit_loop(), name="refit"),
                         *[tg.create_task(c, name=n) for n, c in self.extra_loops()]]
                await self.stop.wait()
                await self._drain()
                for t in tasks:
                    t.cancel()
        finally:
            self.bus.close()
            await self.teardown()
            await self.engine.close()
        self.log.info("worker_stopped")
        return 0

    def extra_loops(self) -> list[tuple[str, Any]]:
        return []

    async def setup(self) -> None:
        """Role-specific resources (the NIXL agent) created after the engine, before registering."""

    async def teardown(self) -> None:
        """Release what setup() created."""

    async def _drain(self) -> None:
        self.draining = True
        self.log.info("drain_started", held=len(self.held_requests()), timeout_s=self.cfg.drain_timeout)
        await self.bus.send(codec.encode(m.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation)))
        self.beat_now()
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.held_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.held_requests()
        for rid, attempt in left:
            self.engine.abort(rid)
            await self.bus.send(codec.encode(m.RequestFailed(
                request_id=rid, attempt=attempt, worker_id=self.worker_id, reason="worker_draining",
                retryable=True)))
        self.log.info("drain_finished", handed_back=len(left))
        await asyncio.sleep(0.05)  # let the hand-backs leave before the socket closes

    # -- loops --------------------------------------------------------------------------
    async def _hello_loop(self) -> None:
        while True:
            hello = m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=self.worker_id, role=self.role,
                            incarnation=self.incarnation, engine=self.engine.name,
                            model=self.cfg.served_model_name, token_budget=self.engine.token_budget,
                            kv_capacity_tokens=self.engine.kv_capacity_tokens, max_batch=self.engine.max_batch,
                            coeffs=self.coeffs(), kv_transport=self.cfg.kv_transport, **self.extra_hello())
            await self.bus.send(codec.encode(hello))
            try:
                await asyncio.wait_for(self.welcomed.wait(), timeout=1.0)
            except TimeoutError:
                self.log.warning("router_not_answering", router=f"{self.cfg.router_host}:{self.cfg.work_port}")
                continue
            self._hello_now.clear()
            await self._hello_now.wait()

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._beat_now.wait(), timeout=self.hb_interval)
                await asyncio.sleep(0.002)  # coalesce a burst of state changes into one beat
            except TimeoutError:
                pass
            self._beat_now.clear()
            self.hb_seq += 1
            self.bus.beat(codec.encode(self.heartbeat()))

    def coeffs(self) -> m.Coeffs | None:
        """The step-time model the router should predict this worker with: the online refit when
        there is a good one, else the engine's profile."""
        return self.fitted or self.engine.coeffs()

    async def _refit_loop(self) -> None:
        refit = getattr(self.engine, "refit", None)
        if refit is None or self.cfg.refit_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.cfg.refit_interval)
            result = refit()
            if result is None:
                continue
            model, mape = result
            accepted = mape <= self.cfg.refit_max_mape
            self.log.info("model_refit", mape=round(mape, 4), accepted=accepted, a0=model.a0, a1=model.a1,
                          a2=model.a2, a3=model.a3, a4=model.a4, a5=model.a5)
            if accepted:
                self.fitted = model.to_coeffs()

    def beat_now(self) -> None:
        self._beat_now.set()

    async def _recv_loop(self) -> None:
        sock = self.bus.work
        while True:
            payload = await sock.recv()
            try:
                msg = self.decoder.decode(payload)
            except codec.DecodeError as e:
                self.counters["bad_frames"] += 1
                self.log.warning("bad_frame_dropped", error=str(e)[:200], bytes=len(payload))
                continue
            match msg:
                case m.Welcome():
                    self.router_incarnation = msg.router_incarnation
                    self.hb_interval = msg.heartbeat_interval_s
                    if not self.welcomed.is_set():
                        self.log.info("registered", router_incarnation=msg.router_incarnation)
                    self.welcomed.set()
                case m.Reregister():
                    self.log.info("reregister_requested", router_incarnation=msg.router_incarnation,
                                  reason=msg.reason)
                    self.welcomed.clear()
                    self._hello_now.set()
                case _:
                    await self.on_message(msg)

    def _on_engine_failed(self, request_id: str, attempt: int, reason: str) -> None:
        self.log.warning("engine_request_failed", request_id=request_id, reason=reason)
        self.forget(request_id)
        self.send(m.RequestFailed(request_id=request_id, attempt=attempt, worker_id=self.worker_id, reason=reason,
                                  retryable=True))

    def forget(self, request_id: str) -> None:
        """Drop the worker's own bookkeeping of a request the engine gave up on."""

    def send(self, msg: m.Msg) -> None:
        if not send_nowait(self.bus.work, codec.encode(msg)):
            self.log.error("send_failed", message=type(msg).__name__)
