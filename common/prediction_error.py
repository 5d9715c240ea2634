"""How far the live predictor is off: relative errors of predictions against what happened.

Every request's predicted TTFT (the router's, for the route it chose) and every engine step's
predicted time (the step-time model the worker reports) is compared with the measured one; the
relative error (predicted - measured) / measured is kept for the last `window_s` seconds (at most
`maxlen` of them) and summarised as the median and 90th percentile of its absolute value, and
the median signed error (the bias: negative when things run slower than predicted).

Socket-free and clock-free (the caller passes `now`), so the monitor, the workers and the tests
(with a fake clock) keep the same books. The Prometheus side is a histogram of the absolute
relative errors with REL_ERROR_BUCKETS.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from common.engines.base import EngineLoad

STEP_ERROR_WINDOW_S = 120.0  # an engine's step errors: the last two minutes' steps ...
STEP_ERROR_MAXLEN = 1024     # ... at most this many (the heartbeats' step_err_p50 / p90)
REL_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class ErrorSummary(TypedDict):
    n: int
    median: float   # median |predicted - measured| / measured
    p90: float
    bias: float     # median (predicted - measured) / measured


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured, or None where it means nothing (a zero or unknown time)."""
    if not (measured > 0 and predicted >= 0) or not math.isfinite(predicted) or not math.isfinite(measured):
        return None
    return (predicted - measured) / measured


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ErrorWindow:
    """Relative prediction errors of the last `window_s` seconds (see the module docstring)."""

    def __init__(self, window_s: float = 300.0, maxlen: int = 4096) -> None:
        if window_s <= 0 or maxlen <= 0:
            raise ValueError("window_s and maxlen must be positive")
        self.window_s = window_s
        self.maxlen = maxlen
        self._errs: deque[tuple[float, float]] = deque()  # (when, signed relative error), oldest first
        # the same errors kept sorted, signed and absolute, as they come and go: a summary reads its
        # quantiles off them instead of sorting the window (a worker's engine load is asked for at
        # every request it is sent, and a step has changed the window since the last time)
        self._signed: list[float] = []
        self._absolute: list[float] = []
        self.total = 0  # errors observed since the start, the window's and older
        self._cached: tuple[tuple[int, int], ErrorSummary | None] = ((0, 0), None)  # heartbeats ask often

    def observe(self, predicted: float, measured: float, now: float) -> float | None:
        """Record one prediction against what happened; returns the relative error (None: not counted)."""
        err = relative_error(predicted, measured)
        if err is None:
            return None
        if len(self._errs) >= self.maxlen:
            self._drop_oldest()
        self._errs.append((now, err))
        insort(self._signed, err)
        insort(self._absolute, abs(err))
        self.total += 1
        return err

    def _drop_oldest(self) -> None:
        _, err = self._errs.popleft()
        del self._signed[bisect_left(self._signed, err)]
        del self._absolute[bisect_left(self._absolute, abs(err))]

    def _trim(self, now: float) -> None:
        while self._errs and self._errs[0][0] < now - self.window_s:
            self._drop_oldest()

    def errors(self, now: float) -> list[float]:
        """The window's signed relative errors, oldest first."""
        self._trim(now)
        return [e for _, e in self._errs]

    def summary(self, now: float) -> ErrorSummary | None:
        """Median and p90 of the absolute error and the median signed error; None with no errors."""
        self._trim(now)
        key = (self.total, len(self._errs))
        if key == self._cached[0]:
            return self._cached[1]
        out = None
        if self._errs:
            absolute, signed = self._absolute, self._signed
            out = ErrorSummary(n=len(signed), median=_quantile(absolute, 0.5), p90=_quantile(absolute, 0.9),
                               bias=_quantile(signed, 0.5))
        self._cached = (key, out)
        return out

    def fill(self, load: EngineLoad, now: float) -> EngineLoad:
        """An engine's EngineLoad with the window's step_err_p50 / step_err_p90 set (if any errors)."""
        s = self.summary(now)
        if s is not None:
            load.step_err_p50, load.step_err_p90 = round(s["median"], 4), round(s["p90"], 4)
        return load
