"""common.sockets.hand_to_io_thread: after a latency-bound bus send, a process pinned to one CPU
yields it to libzmq's I/O thread (which would otherwise wait for the event loop to sleep); a
process with more CPUs does nothing. The router's sends to workers and a worker's sends to the
router both hand off."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import common.sockets as sockets
from common import messages as m

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """os.sched_yield counted, not called; the cached pinning forgotten before and after."""
    calls: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append(1))
    sockets.on_one_cpu.cache_clear()
    yield calls
    sockets.on_one_cpu.cache_clear()


def _pinned(monkeypatch: pytest.MonkeyPatch, cpus: set[int]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)


def test_yields_only_on_one_cpu(monkeypatch: pytest.MonkeyPatch, yields: list[int]) -> None:
    _pinned(monkeypatch, {0, 1})
    assert not sockets.on_one_cpu()
    sockets.hand_to_io_thread()
    assert yields == []
    sockets.on_one_cpu.cache_clear()
    _pinned(monkeypatch, {1})
    assert sockets.on_one_cpu()
    sockets.hand_to_io_thread()
    sockets.hand_to_io_thread()
    assert yields == [1, 1]


def test_no_affinity_call_means_no_yield(monkeypatch: pytest.MonkeyPatch, yields: list[int]) -> None:
    def gone(pid: int) -> set[int]:
        raise OSError("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", gone)
    assert not sockets.on_one_cpu()
    sockets.hand_to_io_thread()
    assert yields == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_pinned_process_sees_one_cpu() -> None:
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from common.sockets import on_one_cpu, hand_to_io_thread; hand_to_io_thread(); print(on_one_cpu())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_router_send_hands_off(monkeypatch: pytest.MonkeyPatch, yields: list[int]) -> None:
    from services.router.service import Router

    _pinned(monkeypatch, {0})
    sent: list[list[bytes]] = []

    def work_send(frames: list[bytes]) -> bool:
        sent.append(frames)
        return True

    fake: Any = SimpleNamespace(_work_send=work_send)
    assert Router.send(fake, b"w1", m.Cancel(request_id="r1", attempt=0))
    assert len(sent) == 1 and sent[0][0] == b"w1"
    assert yields == [1]


def test_worker_send_hands_off(monkeypatch: pytest.MonkeyPatch, yields: list[int]) -> None:
    from common.worker import WorkerService

    _pinned(monkeypatch, {0})
    fake: Any = SimpleNamespace(origins=SimpleNamespace(split=lambda msg: []))
    WorkerService.send(fake, m.TokenBatch(worker_id="d1", items=[], step_s=0.0))
    assert yields == [1]
