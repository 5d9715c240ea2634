"""The TBT delivery allowance: what the serving path adds to a token's gap beyond the engine's step.

The decode guard (the policy's decode room and third path, the deflection step budget, and the
worker's chunk guard beside running decodes) holds a worker's *step* within the TBT SLO. A client
sees more than the step: the worker's own loop between steps, the bus to the router, the router's
event loop and its socket write, the network and the client's read. On a 2-core host at full speed
(issue 44, K = 1) that added 11-13 ms to the client's largest gap on steps the guard had planned to
~90 ms of a 100 ms SLO. The allowance is taken off the TBT SLO before anything plans to it: the
router sends every request's work with `tbt_slo` = the SLO less the allowance (`plan_slo`), so the
policy at the router and the worker's own chunk planning use the same, smaller budget.

Two parts, added:
- measured (`observe`): per stream, the router's gap between two socket writes of its tokens less
  the step time the worker reported for the later token (`TokenBatch.step_s`): what the worker's
  loop, the bus and the router's loop and write add, which the worker's step timing does not see.
  A high quantile (`QUANTILE`, the P99.9: a request's SLO is on its largest gap) of the last
  `WINDOW` samples (to `BIN_S`, rounded up), counted once `MIN_SAMPLES` are in. A sample of
  `STALL_S` or more is a stall (the router's loop stopped: a SIGSTOP, a swap-in, a debugger), not
  a delivery cost: it is counted (`stalls`) and kept out of the window. No smaller step can
  absorb it, and kept in, one 10 s freeze under 50 streams put 50 samples past the cap into a
  window of ~1,100 and held the decode guard at half the TBT SLO for the next minute, with
  requests waiting at the router for decode room until their deadline
  (tests/chaos/test_stranded_live.py, 2026-12-07).
  Only the live router's HTTP layer feeds it: the simulator has no delivery path, so its measured
  part is 0 and its results are those of the configured part alone.
- configured (`RouterConfig.tbt_delivery_allowance_ms`): what the router cannot see (the network
  and the client's read). Default 0.

The sum is capped at `CAP` x the SLO (a planning SLO below half the SLO would mean the serving
path, not the engine, is the problem: the cap keeps the guard from shutting the pool).

A request is planned with the allowance in force when it is dispatched (its work says how much was
taken off: `allowance_s`); when the allowance moves, the router tells every worker (`PlanBudget`,
RouterCore.tell_allowance) and the requests they run for it whose budget is more than their SLO
less the new allowance are planned to that from then on (budgets only fall:
common/worker_core/base.py, `on_plan_budget`; their worker's heartbeat reports the strictest)."""

from __future__ import annotations

import math
from collections import deque

from common.messages import planned_tbt

# of the measured extra gap, per token. The TBT SLO is on a request's *largest* gap, over hundreds of
# tokens: at the P99, with the decode pool full (every step planned to the budget), one token in a
# hundred passed it and most 200-token streams broke their SLO at the router's socket by a fraction of
# a millisecond (a live 1P1D flood, 2026-12-07: docs/results/decode-bottleneck.md, "The delivery
# allowance's quantile"); the P99.9 is the tail such a stream meets
QUANTILE = 0.999
WINDOW = 16384  # the last this many samples (tokens written with a previous write on their stream)
MIN_SAMPLES = 256  # fewer: the measured part is 0
RECOMPUTE_EVERY = 256  # samples between two readings of the quantile off the histogram
BIN_S = 0.00025  # the histogram's resolution: a quarter of a millisecond (the quantile is a bin's upper edge)
BINS = 800  # up to 200 ms; a sample past it counts in the last bin
CAP = 0.5  # the allowance, configured and measured, is at most this fraction of the TBT SLO
STALL_S = 0.1  # an extra gap this long or longer is a stall of the router's loop: counted, not in the window


class DeliveryAllowance:
    """The allowance in force: `configured_s` + the measured quantile (see the module docstring).
    The window is kept as its samples' bins (a ring) and a histogram of them, so a sample costs
    O(1) and a reading of the quantile a scan of `BINS` counts."""

    __slots__ = ("_counts", "_ring", "_since", "configured_s", "measured", "measured_s", "stalls")

    def __init__(self, configured_s: float = 0.0, *, measured: bool = True) -> None:
        if not configured_s >= 0.0 or math.isinf(configured_s):
            raise ValueError(f"tbt_delivery_allowance_ms must be a finite number >= 0 (got {configured_s * 1000:g})")
        self.configured_s = configured_s
        self.measured = measured  # off: `observe` keeps nothing (the configured part alone)
        self._ring: deque[int] = deque()
        self._counts = [0] * BINS
        self.measured_s = 0.0
        self._since = 0  # samples since the quantile was last read
        self.stalls = 0  # samples of STALL_S or more, kept out of the window

    @property
    def samples(self) -> int:
        """Samples in the window."""
        return len(self._ring)

    def observe(self, extra_s: float) -> None:
        """One token's write gap less its step time (negative: its write came sooner; kept as 0)."""
        if not self.measured:
            return
        if extra_s >= STALL_S:
            self.stalls += 1
            return
        b = min(BINS - 1, int(extra_s / BIN_S)) if extra_s > 0.0 else 0
        ring, counts = self._ring, self._counts
        ring.append(b)
        counts[b] += 1
        if len(ring) > WINDOW:
            counts[ring.popleft()] -= 1
        self._since += 1
        if self._since >= RECOMPUTE_EVERY:
            self._since = 0
            n = len(ring)
            if n >= MIN_SAMPLES:
                k = math.ceil(QUANTILE * n)  # the k-th smallest sample's bin
                seen = 0
                for i, c in enumerate(counts):
                    seen += c
                    if seen >= k:
                        self.measured_s = (i + 1) * BIN_S if i else 0.0
                        break

    @property
    def raw_s(self) -> float:
        """The allowance before the cap (configured + measured): what PlanBudget tells the workers."""
        return self.configured_s + self.measured_s

    def total_s(self, slo: float) -> float:
        """The allowance taken off a TBT SLO of `slo` seconds (capped at `CAP` x it)."""
        a = self.raw_s
        return min(a, CAP * slo) if a > 0.0 else 0.0

    def plan_slo(self, slo: float) -> float:
        """The TBT budget the guard plans a request of TBT SLO `slo` to: the SLO less the allowance
        (exactly `slo` when there is none)."""
        return planned_tbt(slo, self.raw_s, CAP)

    def capped(self, slo: float) -> bool:
        return self.configured_s + self.measured_s > CAP * slo
