"""The monitor: subscribes to the router's telemetry, exports metrics, serves the dashboard.

Loops (one TaskGroup): `telemetry` decodes frames from the bus and folds each message into the
state (services/monitor/state.py) and the metrics (services/monitor/metrics.py); `tick` builds
the dashboard snapshot once a second and wakes the event streams; `http` is uvicorn serving
services/monitor/http.py. The monitor never talks back to the router: if it is slow, the
router's PUB socket drops telemetry (counted here from sequence gaps) rather than wait.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import uvicorn

from common import codec
from common import messages as m
from common.config import MonitorConfig
from common.service import HttpServer, install_signals, listen_socket
from common.sockets import TELEMETRY_TOPIC, MonitorBus, telemetry_endpoints
from services.monitor.http import App, Feed
from services.monitor.metrics import MonitorMetrics
from services.monitor.state import MonitorState

log = structlog.get_logger()

_json = msgspec.json.Encoder()


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit:  # uvicorn exits the process when it cannot start; we report it and stop instead
        pass


class Monitor:
    def __init__(self, cfg: MonitorConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.stop = asyncio.Event()
        self.state = MonitorState(max_routers=len(telemetry_endpoints(cfg)))
        self.metrics = MonitorMetrics(self.state, clock)
        self.feed = Feed()
        self.app = App(snapshot=self.snapshot, metrics=self.metrics.render, health=self.health, feed=self.feed,
                       stop=self.stop, api_key=cfg.api_key)
        self._services: tuple[float, dict[str, Any]] = (-1.0, {})  # services.json: (mtime, content)

    # ------------------------------------------------------------------ intake
    def on_message(self, msg: m.TelemetryInbox, router: str = "") -> None:
        match msg:
            case m.WorkerSeen():
                known = self.state.workers.get(msg.worker_id)
                if known is None or known.seen.incarnation != msg.incarnation:
                    log.info("worker_seen", worker=msg.worker_id, role=msg.role, engine=msg.engine,
                             incarnation=msg.incarnation)
            case m.WorkerLost():
                if msg.reason == "departed":  # drained and left: normal life, not a loss
                    log.info("worker_departed", worker=msg.worker_id, role=msg.role)
                else:
                    log.warning("worker_lost", worker=msg.worker_id, role=msg.role, reason=msg.reason)
            case m.RoleFlip():
                log.info("role_flip", worker=msg.worker_id, from_role=msg.frm, to=msg.to, reason=msg.reason,
                         phase=msg.phase, took_s=round(msg.took_s, 2), **msg.evidence)
            case m.DecisionRecord() | m.RequestRecord() | m.RouterStats():
                pass
            case _:
                log.warning("unexpected_message", message=type(msg).__name__)
                return
        self.state.on_message(msg, self.clock(), router)
        self.metrics.observe(msg)

    def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.state.on_bad_frame()
            log.warning("bad_frame_dropped", frames=len(frames))
            return
        router = frames[0][len(TELEMETRY_TOPIC):].decode(errors="replace")  # which replica sent it
        missed = self.state.on_frame_seq(codec.unpack_seq(frames[1]), router)
        if missed:
            log.warning("telemetry_missed", messages=missed, router=router)
        try:
            msg = codec.telemetry_inbox.decode(frames[2])
        except codec.DecodeError as e:
            self.state.on_bad_frame()
            log.warning("bad_frame_dropped", error=str(e)[:200])
            return
        self.on_message(msg, router)

    # ------------------------------------------------------------------ what HTTP serves
    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        out = self.state.snapshot(now)
        out["services_down"] = self.services_down(now)
        return out

    def services_down(self, now: float) -> list[dict[str, Any]]:
        """The services `kairos up` holds down for crash-looping, or is restarting after an exit
        (from its services.json, re-read when it changes): whom to look at, and why."""
        path = self.cfg.services_status
        if not path:
            return []
        try:
            mtime = os.stat(path).st_mtime
            if mtime != self._services[0]:
                with open(path, "rb") as f:
                    self._services = (mtime, msgspec.json.decode(f.read()))
        except (OSError, msgspec.DecodeError):
            return []  # not written yet, or kairos up is gone
        out = []
        for name, st in sorted(dict(self._services[1].get("services") or {}).items()):
            if not isinstance(st, dict) or st.get("state") not in ("held_down", "restarting"):
                continue
            until = st.get("held_until")
            out.append({"service": name, "state": st["state"], "last_exit": st.get("last_exit") or "",
                        "restarts": st.get("restarts", 0),
                        "next_try_s": round(max(0.0, until - now), 1) if isinstance(until, (int, float)) else None})
        return out

    def health(self) -> dict[str, Any]:
        st = self.state
        now = self.clock()
        return {"status": "ok", "router_seen_s_ago": round(now - st.router_seen, 3) if st.router else None,
                "workers": len(st.workers)}

    # ------------------------------------------------------------------ loops
    async def _telemetry_loop(self, bus: MonitorBus) -> None:
        while True:
            self.on_frames(await bus.telemetry.recv_multipart())

    async def _tick_loop(self) -> None:
        while True:
            for wid in self.state.expire(self.clock()):
                log.warning("worker_unreported", worker=wid, after_s=self.state.worker_expiry_s)
            self.feed.publish(_json.encode(self.snapshot()))
            await asyncio.sleep(1.0)

    async def run(self) -> int:
        install_signals(self.stop)
        cfg = self.cfg
        server = HttpServer(uvicorn.Config(self.app, host=cfg.http_host, port=cfg.http_port, lifespan="off",
                                               access_log=False, log_level="warning", http="httptools",
                                               timeout_graceful_shutdown=3, limit_concurrency=256))
        sock = listen_socket(cfg.http_host, cfg.http_port, reuse_port=False)  # a port in use: ConfigError
        try:
            bus = MonitorBus(cfg)
        except BaseException:
            sock.close()
            raise
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self._telemetry_loop(bus), name="telemetry"),
                         tg.create_task(self._tick_loop(), name="tick")]
                http = tg.create_task(_serve(server, sock), name="http")
                while not server.started and not http.done():
                    await asyncio.sleep(0.02)
                if not server.started:
                    log.error("http_failed_to_start", host=cfg.http_host, port=cfg.http_port,
                              hint="is the port in use? pick another with --http-port")
                    self.stop.set()
                else:
                    log.info("monitor_started", routers=[f"{h}:{p}" for h, p, _ in telemetry_endpoints(cfg)],
                             dashboard=f"http://{cfg.http_host}:{cfg.http_port}/")
                await self.stop.wait()
                self.feed.publish(self.feed.data)  # wake the event streams so they see `stop` and end
                server.should_exit = True
                await http
                for t in loops:
                    t.cancel()
        finally:
            bus.close()
        log.info("monitor_stopped")
        return 0 if server.started else 1
