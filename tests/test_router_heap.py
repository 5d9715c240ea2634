"""The router freezes its start-up heap once it is ready (common/service.py `settle_heap`): the
cyclic collector's full passes then scan only what it made since, not the ~50,000 objects of its
modules, configuration and app (each such pass held the live router's loop 17-28 ms at 300 req/s)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import pytest
import structlog

from common.config import RouterConfig
from common.ports import free_ports
from common.service import settle_heap
from services.router import __main__ as router_main
from services.router.__main__ import serve


def test_settle_heap_moves_what_is_alive_out_of_the_collectors_sight() -> None:
    try:
        kept = [[i] for i in range(1000)]  # alive, tracked by the collector
        n = settle_heap()
        assert n == gc.get_freeze_count() and n >= len(kept)
        assert not any(o is kept[0] for o in gc.get_objects())  # frozen: in no generation
        made = [[i] for i in range(10)]  # made afterwards: collected as before
        assert any(o is made[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_the_router_freezes_its_start_up_heap_when_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    # serve() configures structlog for the whole process; the test session keeps its own
    monkeypatch.setattr(router_main.logging, "configure", lambda *a, **k: structlog.get_logger())
    http, work, tele, metrics = free_ports(4)
    cfg = RouterConfig(http_port=http, work_port=work, telemetry_port=tele, metrics_port=metrics,
                       log_level="warning")

    async def main() -> int:
        ready = asyncio.Event()
        task = asyncio.create_task(serve(cfg, ready=ready))
        await asyncio.wait_for(ready.wait(), 20)
        frozen = gc.get_freeze_count()
        os.kill(os.getpid(), signal.SIGTERM)  # its stop event (install_signals), then its drain
        assert await asyncio.wait_for(task, 20) == 0
        return frozen

    gc.unfreeze()
    try:
        assert asyncio.run(main()) > 0
    finally:
        gc.unfreeze()
