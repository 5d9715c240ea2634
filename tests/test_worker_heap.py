"""A worker freezes its start-up heap (the engine's, the service's) before it first says Hello
(common/service.py `settle_heap`): a full collector pass over it holds the worker's loop, so every
stream on it and every DecodeWork waiting, for as long as the pass takes."""

from __future__ import annotations

import gc

import pytest

from tests.test_poison import _start


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_a_worker_has_frozen_its_start_up_heap_when_it_first_says_hello(
        role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    try:
        async for _w, _router in _start(role, monkeypatch):  # it has said Hello
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
