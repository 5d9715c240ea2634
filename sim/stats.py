"""Summary statistics of per-request timings, shared by `kairos sim` and the load generator.

Definitions (the same wherever these keys appear):
- TTFT: arrival (at the router) to the first output token. A request that never produced a
  token (rejected after waiting for KV room, or failed) has `ttft=None`: it counts in `requests`,
  misses both SLOs, and counts in the TTFT percentiles as an infinite TTFT (it ranks above every
  served request), so overload shows up in the tail instead of leaving it. A percentile that
  falls among such requests is infinite (written as null in JSON, "inf" in tables);
  `ttft_pXX_served` are over the served requests only, and `ttft_mean` too. `rejected` counts
  the requests the router gave up on, `failed` every request without a token (rejected ones
  included).
- TBT: the gaps between a request's consecutive output tokens. `tbt_pXX` are percentiles over
  the gaps of all requests pooled (each gap weighs the same).
- A request meets the TTFT SLO iff its TTFT <= ttft_slo.
- A request meets the TBT SLO iff its **largest** gap <= tbt_slo: every token arrived in time (a
  request with one output token has no gap and meets it). `tbt_slo_attainment` (and
  `tbt_p99_slo_attainment`) are fractions of the **served** requests: a request without a token
  has no gaps, so it is a TTFT miss (an infinite TTFT), never a TBT miss, and a policy that
  rejects cannot trade its rejections for TBT. We use the max and
  not a per-request percentile because a deflected prefill hurts the residents through a few
  long steps, which a per-request p95 would hide for long outputs. For comparison with papers
  that use a percentile, `tbt_p99_slo_attainment` is the fraction of requests whose own P99 gap
  is <= tbt_slo.
- `slo_attainment`: fraction of all requests that meet both (TBT by the largest gap);
  `slo_attainment_p99`: the same with TBT by the P99 gap.
- `deflection_rate`: fraction of all requests routed "deflect" (prefilled on a decode worker).
- `ttft_pred_mape`: mean |predicted - actual| / actual TTFT over the requests with a
  prediction; `ttft_pred_mape_by_route`: the same per route ("disagg", "deflect", and "retain",
  a prefill worker decoded it itself, when any did).
- `ttft_tail_*_share`: over the requests with TTFT >= its P95, the mean share of TTFT spent
  queueing for prefill, prefilling and transferring the KV cache.
- Percentiles use linear interpolation between order statistics (numpy's default); a key whose
  sample is empty is None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's outcome. Only `ttft` and `tbt_gaps` are required; the rest is reported
    when given (None or empty: unknown)."""

    ttft: float | None
    tbt_gaps: Sequence[float] = ()
    route: str | None = None
    reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    e2e: float | None = None
    queue_s: float | None = None      # arrival to the first prefill chunk (either path)
    prefill_s: float | None = None    # first prefill chunk to prompt complete
    xfer_s: float | None = None       # KV transfer (disaggregated path)
    ttft_pred: float | None = None    # the policy's prediction for the path it chose
    rejected: bool = False            # the router gave up on it (no token): see the module docstring
    wait_s: float | None = None       # time spent waiting for KV room at the router (None: never waited)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _pct_with_unserved(served: np.ndarray, n: int, q: float) -> float | None:
    """Percentile q (numpy's linear interpolation) of n values: the sorted `served` ones plus
    n - len(served) infinite ones."""
    if n == 0:
        return None
    h = (n - 1) * q / 100.0
    lo = int(np.floor(h))
    hi = int(np.ceil(h))
    if hi >= served.size:
        return float("inf")
    return float(served[lo] + (served[hi] - served[lo]) * (h - lo))


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _tail_shares(records: Sequence[RequestTiming], p95: float | None) -> tuple[float | None, ...]:
    """Mean shares of queueing, prefill execution and KV transfer in the TTFT of the requests at
    or above the P95 TTFT (the paper's Table 3 breakdown); the rest is the first decode step and
    the wait to join the decode batch. None when no tail request reports its components."""
    if p95 is None:
        return (None, None, None)
    q, e, x = [], [], []
    for r in records:
        if r.ttft is None or r.ttft < p95 or r.ttft <= 0 or r.queue_s is None or r.prefill_s is None:
            continue
        q.append(r.queue_s / r.ttft)
        e.append(r.prefill_s / r.ttft)
        x.append((r.xfer_s or 0.0) / r.ttft)
    if not q:
        return (None, None, None)
    return (sum(q) / len(q), sum(e) / len(e), sum(x) / len(x))


def pred_mape_by_route(records: Sequence[RequestTiming]) -> dict[str, float | None]:
    """`ttft_pred_mape` per route: mean |predicted - actual| / actual TTFT of the requests that
    took it (the policy predicts the TTFT of the route it chooses)."""
    errs: dict[str, list[float]] = {"disagg": [], "deflect": [], "retain": []}
    for r in records:
        if r.ttft_pred is not None and r.ttft is not None and r.ttft > 0 and r.route in errs:
            errs[r.route].append(abs(r.ttft_pred - r.ttft) / r.ttft)
    if not errs["retain"]:
        del errs["retain"]  # the third path is off (as shipped), or took nothing
    return {k: (sum(v) / len(v) if v else None) for k, v in errs.items()}


def summarize(records: Sequence[RequestTiming], *, ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """The summary dict of a run; see the module docstring for the definitions."""
    n = len(records)
    ttft = np.sort(np.array([r.ttft for r in records if r.ttft is not None], dtype=np.float64))
    gap_arrays = [np.asarray(r.tbt_gaps, dtype=np.float64) for r in records if len(r.tbt_gaps)]
    gaps = np.concatenate(gap_arrays) if gap_arrays else np.zeros(0)
    max_gap = np.array([float(np.max(r.tbt_gaps)) if len(r.tbt_gaps) else 0.0
                        for r in records if r.ttft is not None], dtype=np.float64)
    ttft_ok = tbt_ok = both_ok = tbt99_ok = both99_ok = 0
    for r in records:
        if r.ttft is None:
            continue
        t_ok = r.ttft <= ttft_slo
        n_gaps = len(r.tbt_gaps)
        g_ok = (max(r.tbt_gaps) if n_gaps else 0.0) <= tbt_slo
        g99_ok = g_ok or float(np.percentile(np.asarray(r.tbt_gaps, dtype=np.float64), 99)) <= tbt_slo
        ttft_ok += t_ok
        tbt_ok += g_ok
        both_ok += t_ok and g_ok
        tbt99_ok += g99_ok
        both99_ok += t_ok and g99_ok
    routes = Counter(r.route for r in records if r.route is not None)
    reasons = Counter(r.reason for r in records if r.reason)

    def opt(values: list[float | None]) -> np.ndarray:
        return np.array([v for v in values if v is not None], dtype=np.float64)

    queue = opt([r.queue_s for r in records])
    prefill = opt([r.prefill_s for r in records])
    xfer = opt([r.xfer_s for r in records])
    e2e = opt([r.e2e for r in records])
    pred_err = opt([abs(r.ttft_pred - r.ttft) / r.ttft for r in records
                    if r.ttft_pred is not None and r.ttft is not None and r.ttft > 0])
    deflected = np.array([r.ttft for r in records if r.route == "deflect" and r.ttft is not None])
    disagg = np.array([r.ttft for r in records if r.route == "disagg" and r.ttft is not None])
    tail = _tail_shares(records, _pct(ttft, 95))
    waits = opt([r.wait_s for r in records])
    out: dict[str, Any] = {
        "requests": n,
        "completed": int(ttft.size),
        "failed": n - int(ttft.size),
        "rejected": sum(1 for r in records if r.rejected),
        "waited_for_kv": int(waits.size),
        "kv_wait_mean": _mean(waits),
        "kv_wait_max": float(waits.max()) if waits.size else None,
        "ttft_mean": _mean(ttft),
        "ttft_p50": _pct_with_unserved(ttft, n, 50),
        "ttft_p90": _pct_with_unserved(ttft, n, 90),
        "ttft_p95": _pct_with_unserved(ttft, n, 95),
        "ttft_p99": _pct_with_unserved(ttft, n, 99),
        "ttft_max": (float(ttft.max()) if ttft.size == n else float("inf")) if n else None,
        "ttft_p95_served": _pct(ttft, 95),
        "ttft_p99_served": _pct(ttft, 99),
        "tbt_mean": _mean(gaps),
        "tbt_p50": _pct(gaps, 50),
        "tbt_p95": _pct(gaps, 95),
        "tbt_p99": _pct(gaps, 99),
        "tbt_max": float(gaps.max()) if gaps.size else None,
        "tbt_max_gap_p99": _pct(max_gap, 99),
        "ttft_slo": ttft_slo,
        "tbt_slo": tbt_slo,
        "ttft_slo_attainment": ttft_ok / n if n else None,
        "tbt_slo_attainment": tbt_ok / ttft.size if ttft.size else None,
        "tbt_p99_slo_attainment": tbt99_ok / ttft.size if ttft.size else None,
        "slo_attainment": both_ok / n if n else None,
        "slo_attainment_p99": both99_ok / n if n else None,
        "deflection_rate": routes.get("deflect", 0) / n if n else None,
        "routes": dict(sorted(routes.items())),
        "reasons": dict(sorted(reasons.items())),
        "ttft_p95_deflected": _pct(deflected, 95),
        "ttft_p95_disagg": _pct(disagg, 95),
        "queue_mean": _mean(queue),
        "queue_p50": _pct(queue, 50),
        "queue_p95": _pct(queue, 95),
        "prefill_mean": _mean(prefill),
        "xfer_mean": _mean(xfer),
        "e2e_p50": _pct(e2e, 50),
        "e2e_p95": _pct(e2e, 95),
        "ttft_pred_mape": _mean(pred_err),
        "ttft_pred_mape_by_route": pred_mape_by_route(records),
        "ttft_tail_queue_share": tail[0],
        "ttft_tail_prefill_share": tail[1],
        "ttft_tail_xfer_share": tail[2],
        "prompt_tokens": int(sum(r.prompt_tokens for r in records)),
        "output_tokens": int(sum(r.output_tokens for r in records)),
    }
    return out


def json_safe(obj: Any) -> Any:
    """`obj` with every infinite or NaN float replaced by None (JSON has no infinity)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def fmt(v: Any, kind: str = "s") -> str:
    """One table cell, the same in every report (sim, bench, demo): "-" for missing, "inf" for
    infinite; kind "%": a fraction as a percentage; "ms": seconds as milliseconds; "n": a count
    or rate; "s": seconds."""
    if v is None:
        return "-"
    if isinstance(v, float) and not np.isfinite(v):
        return "inf"
    if kind == "%":
        return f"{100 * v:.1f}%"
    if kind == "ms":
        return f"{1000 * v:.0f}" if abs(v) >= 0.01 else f"{1000 * v:.1f}"
    if kind == "n":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"

