"""The monitor: subscribes to the router's telemetry and keeps the cluster picture.

This first version logs what it sees (workers, decisions, outcomes); metrics and the dashboard
build on the same `Monitor.on_message` dispatch.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from common import codec
from common import messages as m
from common.config import MonitorConfig
from common.service import install_signals
from common.sockets import MonitorBus

log = structlog.get_logger()


class Monitor:
    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.stop = asyncio.Event()
        self.workers: dict[str, m.WorkerSeen] = {}
        self.counts: dict[str, int] = {"bad_frames": 0, "decisions": 0, "requests": 0}

    def on_message(self, msg: Any) -> None:
        match msg:
            case m.WorkerSeen():
                if msg.worker_id not in self.workers:
                    log.info("worker_seen", worker=msg.worker_id, role=msg.role, engine=msg.engine)
                self.workers[msg.worker_id] = msg
            case m.WorkerLost():
                self.workers.pop(msg.worker_id, None)
                log.warning("worker_lost", worker=msg.worker_id, role=msg.role, reason=msg.reason)
            case m.DecisionRecord():
                self.counts["decisions"] += 1
                log.debug("decision", request_id=msg.request_id, route=msg.route, reason=msg.reason,
                          decode_worker=msg.decode_worker, prefill_worker=msg.prefill_worker)
            case m.RequestRecord():
                self.counts["requests"] += 1
            case m.RouterStats():
                pass
            case _:
                log.warning("unexpected_message", message=type(msg).__name__)

    async def _recv_loop(self, bus: MonitorBus) -> None:
        while True:
            frames = await bus.telemetry.recv_multipart()
            if len(frames) != 3:
                self.counts["bad_frames"] += 1
                continue
            try:
                msg = codec.telemetry_inbox.decode(frames[2])
            except codec.DecodeError as e:
                self.counts["bad_frames"] += 1
                log.warning("bad_frame_dropped", error=str(e)[:200])
                continue
            self.on_message(msg)

    async def run(self) -> int:
        install_signals(self.stop)
        bus = MonitorBus(self.cfg)
        log.info("monitor_started", router=f"{self.cfg.router_host}:{self.cfg.telemetry_port}")
        try:
            async with asyncio.TaskGroup() as tg:
                t = tg.create_task(self._recv_loop(bus))
                await self.stop.wait()
                t.cancel()
        finally:
            bus.close()
        log.info("monitor_stopped")
        return 0
