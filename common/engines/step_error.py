"""How wrong the step-time model is on one engine, and what a worker does about it.

Two halves, both pure (no clock, no I/O; randomness passed in):

- `StepError`: error *injected* into a simulated engine, so the simulator (`kairos sim`) and the
  live simulated engine (`kairos up`) run steps that the policy's model does not predict exactly:
  every executed step takes model time x scale x worker speed x a noise factor. The factor is a
  mean-1 lognormal with sigma `noise` (independent per step), times `slow_factor` while the
  worker is in a slow period (a two-state process: slow periods start at rate 1/`slow_every_s`
  and last `slow_for_s` on average, both exponential: co-tenants, thermal or power capping,
  a noisy neighbour on the NVLink or PCIe switch), times `straggler_factor` for a fraction
  `straggler_p` of steps (allocator stalls, a host-side hiccup). The defaults inject nothing.
  Real engines show all three kinds (per-step jitter of a few percent, bias of 10-20 % between
  a profile and another driver or GPU revision, rare slow steps); the sizes here are
  assumptions to stress the policy, not measurements, and docs/cost-model.md says so.

- `StepErrorEstimator`: what a decode worker *measures*: for every executed step, measured /
  predicted. It keeps the last `window` ratios and gives their bias (median) and the margin the
  worker plans with: the (1 - target) quantile of the ratio, so that a step planned to take at
  most SLO / margin by the model exceeds the SLO with probability about `target` (the worker's
  `overrun_target`, `TARGET` by default). The quantile is read off the window while it holds at least
  `TAIL_SAMPLES` ratios beyond it; for a smaller target (say 1 %/30: the TBT SLO is per request,
  and a request lives through many steps beside prefill chunks) it is that of a lognormal fitted
  to the window's ratios. After an
  overrun (a step whose ratio exceeds the margin) the margin is at least that step's ratio until
  a step comes back within the quantile: correlated slowness is answered at the next step, on
  the worker, without waiting for the window or the router. Until `min_samples` steps have been
  seen the margin is the largest ratio seen so far, at least 1: a freshly started worker plans
  its first steps with what it has measured, not with the model alone (with an exact model,
  1: nothing changes).

- `bias_factor`: the router-side use of the bias. Workers report their bias in heartbeats; each
  router predicts a worker with its model times `bias_factor(bias)` (TTFT on both routes, chunk
  costs, the prefill queue's drain stretched alike) and plans chunks against the margin left
  beside it (margin / bias). Within a 2 % deadband the model is taken as exact, so an exact
  model decides exactly as without any of this.

- `ChunkGuard`: the worker-side use of the margin. When a decode step is planned, each chunk of
  a scheduled (router-planned) deflection, also once its schedule has run out, is cut so that
  the step's predicted time x margin stays within the strictest TBT SLO of the decodes in the
  batch; the rest of the chunk runs next step. The margin it plans with is the measured one made
  stricter for `DECODE_TARGET` (`ChunkGuard.margin`): such a step holds every running decode.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from statistics import NormalDist

import msgspec

from common.perf_model import PerfModel


class StepError(msgspec.Struct, frozen=True, kw_only=True):
    """Injected model error (see the module docstring). All defaults: the model is exact."""

    noise: float = 0.0            # sigma of a mean-1 lognormal factor per step
    scale: float = 1.0            # every step takes scale x the model's time (all workers)
    speeds: tuple[float, ...] = ()  # per-worker factors, in worker order (cycled); () = 1.0 each
    slow_every_s: float = 0.0     # mean seconds between slow periods (0: none)
    slow_for_s: float = 1.0       # mean length of a slow period
    slow_factor: float = 1.5      # steps in a slow period take this much longer
    straggler_p: float = 0.0      # fraction of steps that straggle
    straggler_factor: float = 3.0  # a straggling step takes this much longer

    def __post_init__(self) -> None:
        if self.noise < 0 or self.scale <= 0 or any(s <= 0 for s in self.speeds):
            raise ValueError("step noise must be >= 0, step scale and worker speeds > 0")
        if self.slow_every_s < 0 or self.slow_for_s <= 0 or self.slow_factor <= 0:
            raise ValueError("slow periods: every >= 0, for > 0, factor > 0")
        if not 0.0 <= self.straggler_p < 1.0 or self.straggler_factor <= 0:
            raise ValueError("straggler probability must be in [0, 1), its factor > 0")

    @property
    def exact(self) -> bool:
        return (self.noise == 0 and self.scale == 1.0 and all(s == 1.0 for s in self.speeds)
                and self.slow_every_s == 0 and self.straggler_p == 0)

    def speed(self, index: int) -> float:
        return self.speeds[index % len(self.speeds)] if self.speeds else 1.0

    def source(self, index: int, rng: random.Random) -> StepErrorSource:
        return StepErrorSource(self, self.speed(index) * self.scale, rng)


class StepErrorSource:
    """The injected error of one worker: `factor(now)` for the step that starts at `now`."""

    def __init__(self, cfg: StepError, base: float, rng: random.Random) -> None:
        self.cfg = cfg
        self.base = base
        self.rng = rng
        self._mu = -cfg.noise ** 2 / 2.0
        self._slow_until = -math.inf
        self._next_slow = rng.expovariate(1.0 / cfg.slow_every_s) if cfg.slow_every_s > 0 else math.inf

    def factor(self, now: float) -> float:
        cfg = self.cfg
        f = self.base
        if cfg.noise > 0:
            f *= self.rng.lognormvariate(self._mu, cfg.noise)
        if cfg.slow_every_s > 0:
            while now >= self._next_slow:  # periods that started (and perhaps ended) since the last step
                self._slow_until = self._next_slow + self.rng.expovariate(1.0 / cfg.slow_for_s)
                self._next_slow = self._slow_until + self.rng.expovariate(1.0 / cfg.slow_every_s)
            if now < self._slow_until:
                f *= cfg.slow_factor
        if cfg.straggler_p > 0 and self.rng.random() < cfg.straggler_p:
            f *= cfg.straggler_factor
        return f


def parse_speeds(text: str) -> tuple[float, ...]:
    """'0.9,1.1' -> (0.9, 1.1); '' -> ()."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ValueError(f"--worker-speed takes numbers separated by commas (got {text!r})") from e


# the chance of a gap over the SLO a step beside a chunk is planned for (a worker's overrun_target, by
# default): about 1 % of requests over the ~30 such steps a request lives through (docs/cost-model.md)
TARGET = 0.00033
# the chance of a gap over the SLO a decode step is held to by the router's decode room (Kairos's
# `decode_room`): a decode step holds every running request, and a request lives through hundreds
# of them, so about 1 % of requests over 500 decode steps
DECODE_TARGET = 0.00002
TAIL_SAMPLES = 5   # ratios beyond the target quantile the window must hold to read it off directly
WINDOW = 512       # steps the estimator remembers
MIN_SAMPLES = 32   # steps before the measured margin replaces 1.0


BIAS_DEADBAND = 0.02        # a measured bias this close to 1 is no bias: an exact model decides as before
BIAS_RANGE = (0.5, 2.0)     # what a router will believe of one worker's bias


def bias_factor(bias: float) -> float:
    """What a router scales a worker's model by, given the median measured / predicted step time
    its heartbeats report: 1.0 within the deadband, else rounded to a whole per cent (a worker's
    view changes only when its bias moves) and clamped to BIAS_RANGE."""
    if not math.isfinite(bias) or abs(bias - 1.0) <= BIAS_DEADBAND:
        return 1.0
    return min(max(round(bias, 2), BIAS_RANGE[0]), BIAS_RANGE[1])


class StepErrorEstimator:
    """Measured / predicted step time of one worker (see the module docstring)."""

    def __init__(self, *, target: float = TARGET, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if not 0.0 < target < 0.5:
            raise ValueError("the overrun target must be in (0, 0.5)")
        self.target = target
        self.min_samples = min_samples
        self.ratios: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.overruns = 0      # steps whose ratio exceeded the margin planned with
        self._stale = True
        self._quantile = 1.0
        self._bias = 1.0
        # a smaller target than the window can show: a lognormal fitted to it (sums of log ratios)
        self._z = NormalDist().inv_cdf(1.0 - target) if target * window < TAIL_SAMPLES else 0.0
        self._log_sum = self._log_sq = 0.0
        self._hold = 0.0       # after an overrun: plan as if steps run this slow, until one does not
        self._sorted: list[float] = []  # the window's ratios in order (kept so, not sorted per step)

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if not (predicted_s > 0 and measured_s > 0):  # (NaN too: it would break the sorted window)
            return
        r = measured_s / predicted_s
        if not math.isfinite(r):
            return
        margin = self.margin()
        if len(self.ratios) == self.ratios.maxlen:
            gone = self.ratios[0]
            del self._sorted[bisect.bisect_left(self._sorted, gone)]
            if self._z:
                old = math.log(gone)
                self._log_sum -= old
                self._log_sq -= old * old
        bisect.insort(self._sorted, r)
        if self._z:
            lr = math.log(r)
            self._log_sum += lr
            self._log_sq += lr * lr
        self.ratios.append(r)
        self.steps += 1
        self._stale = True
        if len(self.ratios) < self.min_samples:
            return
        if r > margin:
            self.overruns += 1
            self._hold = r
        elif r <= self._q():
            self._hold = 0.0

    def _q(self) -> float:
        if self._stale:
            s = self._sorted
            n = len(s)
            self._quantile = s[min(n - 1, math.ceil((1.0 - self.target) * n) - 1)] if n else 1.0
            if self._z and n:
                mu = self._log_sum / n
                sd = math.sqrt(max(0.0, self._log_sq / n - mu * mu))
                self._quantile = math.exp(mu + self._z * sd) if sd > 1e-6 else s[-1]
            self._bias = s[n // 2] if n else 1.0
            self._stale = False
        return self._quantile

    def margin(self) -> float:
        """What a planned step's predicted time is multiplied by before it is held to the SLO."""
        if len(self.ratios) < self.min_samples:  # too few for a quantile: the worst seen so far
            return max(1.0, self._sorted[-1]) if self._sorted else 1.0
        return max(self._q(), self._hold)

    def bias(self) -> float:
        """The median of measured / predicted (1.0 until `min_samples`)."""
        if len(self.ratios) < self.min_samples:
            return 1.0
        self._q()
        return self._bias


def stricter_margin(margin: float, target: float = TARGET, to: float = DECODE_TARGET) -> float:
    """A margin (measured / predicted step time, relative to the bias) read at overrun chance
    `target`, extrapolated to the smaller chance `to` as the quantile of the same lognormal:
    log margin = z(1 - target) x sigma, so the stricter one is margin ** (z(1 - to) / z(1 - target)).
    A margin of at most 1 (no spread measured) stays as it is."""
    if margin <= 1.0 or to >= target:
        return margin
    if target == TARGET and to == DECODE_TARGET:
        return float(margin ** _DECODE_EXP)
    nd = NormalDist()
    return float(margin ** (nd.inv_cdf(1.0 - to) / nd.inv_cdf(1.0 - target)))


_DECODE_EXP = NormalDist().inv_cdf(1.0 - DECODE_TARGET) / NormalDist().inv_cdf(1.0 - TARGET)


class ChunkGuard:
    """Cuts a deflection's chunk to what fits its step beside the batch (see the module docstring)."""

    def __init__(self, model: PerfModel, estimator: StepErrorEstimator, target: float | None = DECODE_TARGET) -> None:
        self.model = model
        self.estimator = estimator
        self.target = target  # the chance a planned step may overrun (None: the estimator's own target)
        self.cuts = 0  # chunks cut

    def margin(self) -> float:
        """What a step beside running decodes is planned with: the measured margin, read at the
        estimator's target, made stricter (relative to the bias, as `stricter_margin`) for the
        guard's `target`: `DECODE_TARGET` by default, the chance a decode-only step is held to.
        A step carrying a chunk holds every running decode just as a decode-only step does, and
        one overrun breaks all of their TBT at once (issue 44: one step of 1.48 x its prediction
        beside 59 decodes was 2 % of a run's requests), so it gets the same chance, not the
        per-request `TARGET`. An exact model (margin 1) and a uniform bias (margin = bias) are
        unchanged."""
        est = self.estimator
        margin = est.margin()
        bias = est.bias()
        to = self.target
        if to is None or margin <= bias or est.target <= to or bias <= 0:
            return margin
        return bias * stricter_margin(margin / bias, est.target, to)

    def fit(self, batch: int, kv_tokens: int, chunks: Sequence[tuple[int, int]], chi: int, context: int,
            tbt_slo: float) -> int:
        """The largest chunk <= chi (at least 1 token) whose step, beside `batch` decodes over
        `kv_tokens` and the chunks already planned, is predicted within tbt_slo / margin()."""
        if batch == 0 or tbt_slo <= 0 or chi <= 1:
            return chi
        limit = tbt_slo / self.margin()
        step = self.model.step_time
        if step(batch, kv_tokens, [*chunks, (chi, context)]) <= limit:
            return chi
        lo, hi = 1, chi  # step time grows with the chunk: the largest chunk that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step(batch, kv_tokens, [*chunks, (mid, context)]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        self.cuts += 1
        return lo

    def fits(self, batch: int, kv_tokens: int, chunks: Sequence[tuple[int, int]], chi: int, context: int,
             tbt_slo: float) -> bool:
        """Whether a chunk of `chi` tokens (as `fit` sized it) keeps the step within tbt_slo / margin."""
        if batch == 0 or tbt_slo <= 0:
            return True
        return self.model.step_time(batch, kv_tokens, [*chunks, (chi, context)]) <= tbt_slo / self.margin()


__all__ = ["BIAS_DEADBAND", "BIAS_RANGE", "DECODE_TARGET", "MIN_SAMPLES", "TARGET", "WINDOW", "ChunkGuard",
           "StepError", "StepErrorEstimator", "StepErrorSource", "bias_factor", "parse_speeds", "stricter_margin"]
