"""Running one request on a real engine in a test: its step loop started, the request added, then
stopped once the request's last token is out (no worker, no socket)."""

from __future__ import annotations

import asyncio

from common import messages as m
from common.engines.base import Engine, EngineRequest


async def run_to_end(engine: Engine, request: EngineRequest, timeout: float = 10.0) -> list[m.TokenItem]:
    """Run `request` on `engine` until it finishes (its step loop stopped after); the token items
    it emitted, in order."""
    out: list[m.TokenItem] = []
    done = asyncio.Event()

    def on_tokens(items: list[m.TokenItem], step_s: float) -> None:
        out.extend(items)
        if any(it.finish_reason for it in items):
            done.set()

    engine.on_tokens = on_tokens
    task = asyncio.create_task(engine.run())
    engine.add(request)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return out
