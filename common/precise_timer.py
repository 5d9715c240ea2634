"""Sleep to a deadline with the kernel timer's precision, not epoll's millisecond.

asyncio's selector waits with `epoll_wait`, whose timeout is whole milliseconds, and Python
rounds it up (selectors.EpollSelector: "wait *at least* timeout seconds"): `asyncio.sleep(0.0005)`
returns after 1 ms or more. The simulated engine sleeps each modeled step (0.5 ms in the `fast`
profile), so every step took at least 1 ms, twice the model, and a request's first token came
that much later than the model the benchmarks subtract (`kairos bench-router`'s added TTFT).

uvloop is coarser still: its timers and `loop.time()` are libuv's whole milliseconds, the time
cached at the start of each loop turn.

`PreciseTimer` arms a Linux timerfd (CLOCK_MONOTONIC, the clock of `time.monotonic()`) at an absolute
deadline and waits for it to become readable in the same event loop: nanosecond timer, no thread,
one `timerfd_settime` and one `read` per sleep. Where there is no timerfd (not Linux, or no libc
found) it falls back to `asyncio.sleep`, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
import time

_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = 0o2000000
_TFD_NONBLOCK = 0o4000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_create.restype = ctypes.c_int
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.c_void_p]
        libc.timerfd_settime.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class PreciseTimer:
    """One timer for one task's sleeps in the running loop (not shared between tasks: one
    deadline at a time). `close()` releases its file descriptor."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = -1
        self._waiter: asyncio.Future[None] | None = None
        self._spec = _Itimerspec()
        if _LIBC is not None:
            fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self._fd = fd
                self._loop.add_reader(fd, self._fired)

    @property
    def precise(self) -> bool:
        """False when it falls back to asyncio.sleep (no timerfd here)."""
        return self._fd >= 0

    async def sleep_until(self, deadline: float) -> None:
        """Return at `deadline` (time.monotonic(); not loop.time(), which uvloop keeps in whole
        milliseconds, cached per loop turn), or at once (after yielding) if it has passed."""
        delay = deadline - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)
            return
        if self._fd < 0:
            await asyncio.sleep(delay)
            return
        sec = int(deadline)
        self._spec.it_value.tv_sec = sec
        self._spec.it_value.tv_nsec = max(1, int((deadline - sec) * 1e9))
        if _LIBC is None or _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            await asyncio.sleep(delay)
            return
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
            if not waiter.done():  # cancelled: disarm, so a stale expiry does not wake a later sleep
                self._spec.it_value.tv_sec = self._spec.it_value.tv_nsec = 0
                _LIBC.timerfd_settime(self._fd, 0, ctypes.byref(self._spec), None)

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # (a disarmed timer's stale wake-up)
            return
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
