"""The monitor's picture of the cluster, built from the router's telemetry: pure code, no I/O.

`MonitorState.on_message(msg, now)` folds one telemetry message in; `snapshot(now)` returns the
JSON-ready picture the dashboard, `/api/state` and `kairos top` show. Time is passed in (the
monitor's own wall clock at receipt), so tests drive it without sleeping.

Rolling window: completions and decisions land in one-second buckets; the last `window_s`
seconds are kept. Each point of the time series summarises the `smooth_s` seconds ending at that
second (a point per second of a few requests each would be noise); the headline numbers cover
the whole window. Samples per bucket are capped so a burst cannot grow memory without bound.

Inter-token latency: a RequestRecord carries per-request TBT p50/p99/max. When it also carries
the gaps themselves (`tbt_gaps_s`, proposed in docs/observability.md), percentiles pool the
gaps; until then they pool the per-request p50 (for "p50") and p99 (for "p99") values.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common import messages as m
from common.prediction_error import ErrorWindow

ROUTES: tuple[str, ...] = ("disagg", "deflect", "retain")
MAX_SAMPLES_PER_BUCKET = 2000  # per list, per second: bounds memory under any load


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (q in [0, 1]); None when empty."""
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def record_gaps(rec: m.RequestRecord) -> Sequence[float] | None:
    """The request's token gaps if the record carries them (a later schema version), else None."""
    gaps = getattr(rec, "tbt_gaps_s", None)
    return gaps if gaps else None


def slo_verdict(rec: m.RequestRecord) -> tuple[bool, bool] | None:
    """(TTFT SLO met, TBT SLO met) when the record carries its SLOs (a later schema version).

    A request that did not finish ok meets neither; TBT is judged on the request's p99 gap."""
    ttft_slo = getattr(rec, "ttft_slo_s", None)
    tbt_slo = getattr(rec, "tbt_slo_s", None)
    if ttft_slo is None or tbt_slo is None:
        return None
    if rec.outcome != "ok":
        return False, False
    ttft_ok = rec.ttft_s is not None and rec.ttft_s <= ttft_slo
    tbt_ok = rec.tbt_p99_s is None or rec.tbt_p99_s <= tbt_slo
    return ttft_ok, tbt_ok


def _route(route: str | None) -> str:
    return route if route else "none"


def _add(samples: list[float], value: float) -> None:
    if len(samples) < MAX_SAMPLES_PER_BUCKET:
        samples.append(value)


@dataclass(slots=True)
class Bucket:
    """Everything that happened in one second (monitor clock)."""

    second: int
    decisions: Counter[str] = field(default_factory=Counter)           # route -> n
    outcomes: Counter[str] = field(default_factory=Counter)            # outcome -> n
    ttft: dict[str, list[float]] = field(default_factory=dict)         # route -> seconds
    tbt_p50: list[float] = field(default_factory=list)
    tbt_p99: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    pred_err: list[float] = field(default_factory=list)                # predicted - actual TTFT
    decision_us: list[float] = field(default_factory=list)
    kv_fallbacks: int = 0
    output_tokens: int = 0
    slo_judged: int = 0
    slo_met: int = 0                                                    # both TTFT and TBT


@dataclass(slots=True)
class WorkerInfo:
    seen: m.WorkerSeen
    first_seen: float
    last_seen: float
    history: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=120))  # (second, load)

    @property
    def load(self) -> float:
        """The one number that says how busy a worker is: queued prompt tokens, or decode batch."""
        s = self.seen.state
        return float(s.get("queued_tokens", 0.0) if self.seen.role == "prefill" else s.get("batch", 0.0))


@dataclass(slots=True)
class Recent:
    """One routing decision, completed with the outcome once its RequestRecord arrives."""

    decision: m.DecisionRecord
    seen_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    outcome: str = ""
    kv_fallback: bool = False


LOST_SAME_S = 10.0  # WorkerLost reports of one worker for one reason this close together are one loss


class MonitorState:
    """The rolling cluster picture. Not thread-safe: owned by the monitor's event loop."""

    def __init__(self, *, window_s: int = 60, smooth_s: int = 5, recent: int = 40,
                 worker_expiry_s: float = 10.0, lost_keep_s: float = 300.0, max_routers: int = 1) -> None:
        self.window_s = window_s
        self.smooth_s = smooth_s
        self.worker_expiry_s = worker_expiry_s
        self.lost_keep_s = lost_keep_s
        self.started = 0.0
        self.buckets: deque[Bucket] = deque()
        self.workers: dict[str, WorkerInfo] = {}
        # predicted against actual TTFT, relative, over the window (common/prediction_error.py)
        self.ttft_errors = ErrorWindow(window_s=float(window_s))
        self.lost: deque[tuple[float, m.WorkerLost]] = deque(maxlen=20)
        self.flips: deque[tuple[float, m.RoleFlip]] = deque(maxlen=20)  # the role planner's, newest last
        self._lost_from: dict[tuple[str, str], tuple[float, str]] = {}  # (worker, reason) -> (when, router) listed
        self.recent: deque[Recent] = deque(maxlen=recent)
        self._recent_by_id: dict[str, Recent] = {}
        self.routers: dict[str, tuple[m.RouterStats, float]] = {}  # by router name: its last stats, when
        # as many routers as the monitor subscribes to: a router that comes back under another name
        # (a recreated container has a new host name) replaces the stalest one at once
        self.max_routers = max(max_routers, 1)
        self.policy = ""
        self.totals: Counter[str] = Counter()                       # messages by type, bad frames, gaps
        self.decisions: Counter[tuple[str, str]] = Counter()        # (route, reason) since start
        self.outcomes: Counter[tuple[str, str]] = Counter()         # (route, outcome) since start
        self._last_seq: dict[str, int] = {}  # by router name: each router numbers its own messages

    @property
    def router(self) -> m.RouterStats | None:
        """Every router's stats summed (replicated routers each report their own requests)."""
        if not self.routers:
            return None
        rs = [r for r, _ in self.routers.values()]
        fresh = self.router_seen - self.worker_expiry_s  # a silent replica's last in-flight count is stale
        return m.RouterStats(at=max(r.at for r in rs),
                             in_flight=sum(r.in_flight for r, t in self.routers.values() if t >= fresh),
                             accepted=sum(r.accepted for r in rs), completed=sum(r.completed for r in rs),
                             failed=sum(r.failed for r in rs), rejected=sum(r.rejected for r in rs),
                             loop_lag_ms=max(r.loop_lag_ms for r, t in self.routers.values() if t >= fresh)
                             if any(t >= fresh for _, t in self.routers.values()) else 0.0,
                             delivery_allowance_ms=max(r.delivery_allowance_ms for r, t in self.routers.values()
                                                       if t >= fresh)
                             if any(t >= fresh for _, t in self.routers.values()) else 0.0)

    @property
    def router_seen(self) -> float:
        return max((t for _, t in self.routers.values()), default=0.0)

    # ------------------------------------------------------------------ intake
    def on_frame_seq(self, seq: int, router: str = "") -> int:
        """Track one router's PUB sequence number; returns how many messages were missed (dropped at a HWM)."""
        last, self._last_seq[router] = self._last_seq.get(router), seq
        if last is None or seq <= last:  # first frame, or the router restarted
            return 0
        missed = seq - last - 1
        if missed:
            self.totals["missed"] += missed
        return missed

    def on_bad_frame(self) -> None:
        self.totals["bad_frames"] += 1

    def on_message(self, msg: m.TelemetryInbox, now: float, router: str = "") -> None:
        if not self.started:
            self.started = now
        self.totals[type(msg).__name__] += 1
        match msg:
            case m.WorkerSeen():
                self._on_worker_seen(msg, now)
            case m.WorkerLost():
                self._on_worker_lost(msg, now, router)
            case m.RoleFlip():
                if msg.phase != "started":  # its end replaces its start: one row per flip
                    kept = [(t, f) for t, f in self.flips
                            if not (f.worker_id == msg.worker_id and f.phase == "started")]
                    self.flips.clear()
                    self.flips.extend(kept)
                self.flips.append((now, msg))
            case m.DecisionRecord():
                self._on_decision(msg, now)
            case m.RequestRecord():
                self._on_request(msg, now)
            case m.RouterStats():
                self.routers[router] = (msg, now)
                while len(self.routers) > self.max_routers:
                    self._forget_router(min((n for n in self.routers if n != router),
                                            key=lambda n: self.routers[n][1]))

    def _forget_router(self, name: str) -> None:
        del self.routers[name]
        self._last_seq.pop(name, None)

    def _on_worker_seen(self, w: m.WorkerSeen, now: float) -> None:
        info = self.workers.get(w.worker_id)
        if info is None or info.seen.incarnation != w.incarnation or info.seen.role != w.role:
            info = WorkerInfo(seen=w, first_seen=now, last_seen=now)
            self.workers[w.worker_id] = info
        info.seen, info.last_seen = w, now
        sec = int(now)
        if info.history and info.history[-1][0] == sec:
            info.history.pop()
        info.history.append((sec, info.load))

    def _on_worker_lost(self, w: m.WorkerLost, now: float, router: str = "") -> None:
        self.workers.pop(w.worker_id, None)
        # every router replica reports the same loss: listed once (the same worker and reason,
        # from another router, within LOST_SAME_S of the first report)
        key = (w.worker_id, w.reason)
        first = self._lost_from.get(key)
        if first is not None and first[1] != router and now - first[0] < LOST_SAME_S:
            return
        if len(self._lost_from) > 1024:
            self._lost_from.clear()
        self._lost_from[key] = (now, router)
        self.lost.append((now, w))

    def _on_decision(self, d: m.DecisionRecord, now: float) -> None:
        self.policy = d.policy
        self.decisions[(d.route, d.reason)] += 1
        b = self._bucket(now)
        b.decisions[d.route] += 1
        _add(b.decision_us, d.decision_us)
        old = self._recent_by_id.get(d.request_id)
        if old is not None:  # a re-dispatch: the newer decision replaces the older one in the list
            old.decision = d
            return
        if len(self.recent) == self.recent.maxlen:
            self._recent_by_id.pop(self.recent[0].decision.request_id, None)
        r = Recent(decision=d, seen_at=now)
        self.recent.append(r)
        self._recent_by_id[d.request_id] = r

    def _on_request(self, rec: m.RequestRecord, now: float) -> None:
        route = _route(rec.route)
        self.outcomes[(route, rec.outcome)] += 1
        b = self._bucket(now)
        b.outcomes[rec.outcome] += 1
        b.output_tokens += rec.output_tokens
        b.kv_fallbacks += rec.kv_fallback
        if rec.outcome == "ok":
            _add(b.e2e, rec.e2e_s)
        if rec.ttft_s is not None:
            _add(b.ttft.setdefault(route, []), rec.ttft_s)
            if rec.ttft_pred_s is not None:
                _add(b.pred_err, rec.ttft_pred_s - rec.ttft_s)
                self.ttft_errors.observe(rec.ttft_pred_s, rec.ttft_s, now)
        gaps = record_gaps(rec)
        if gaps is not None:
            for g in gaps[:64]:  # pooled gaps: a sample of each request is enough for percentiles
                _add(b.tbt_p50, g)
                _add(b.tbt_p99, g)
        else:
            if rec.tbt_p50_s is not None:
                _add(b.tbt_p50, rec.tbt_p50_s)
            if rec.tbt_p99_s is not None:
                _add(b.tbt_p99, rec.tbt_p99_s)
        verdict = slo_verdict(rec)
        if verdict is not None:
            b.slo_judged += 1
            b.slo_met += verdict[0] and verdict[1]
        r = self._recent_by_id.get(rec.request_id)
        if r is not None:
            r.ttft_s, r.e2e_s, r.outcome, r.kv_fallback = rec.ttft_s, rec.e2e_s, rec.outcome, rec.kv_fallback

    def _bucket(self, now: float) -> Bucket:
        sec = int(now)
        if self.buckets and self.buckets[-1].second == sec:
            return self.buckets[-1]
        if self.buckets and self.buckets[-1].second > sec:  # clock stepped back: reuse the newest
            return self.buckets[-1]
        b = Bucket(second=sec)
        self.buckets.append(b)
        self._trim(now)
        return b

    def _trim(self, now: float) -> None:
        oldest = int(now) - self.window_s - self.smooth_s
        while self.buckets and self.buckets[0].second <= oldest:
            self.buckets.popleft()

    def expire(self, now: float) -> list[str]:
        """Forget workers the router has stopped reporting (the router itself may be gone)."""
        gone = [wid for wid, w in self.workers.items() if now - w.last_seen > self.worker_expiry_s]
        for wid in gone:
            del self.workers[wid]
        while self.lost and now - self.lost[0][0] > self.lost_keep_s:
            self.lost.popleft()
        while self.flips and now - self.flips[0][0] > self.lost_keep_s:
            self.flips.popleft()
        for name in [n for n, (_, t) in self.routers.items() if now - t > self.lost_keep_s]:
            self._forget_router(name)  # a replica gone for good (its counts leave the totals with it)
        self._trim(now)
        return gone

    # ------------------------------------------------------------------ the picture
    def _window(self, lo: int, hi: int) -> list[Bucket]:
        return [b for b in self.buckets if lo < b.second <= hi]

    @staticmethod
    def _summary(buckets: Iterable[Bucket], span_s: float) -> dict[str, Any]:
        decisions: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        ttft: dict[str, list[float]] = {}
        tbt50: list[float] = []
        tbt99: list[float] = []
        e2e: list[float] = []
        err: list[float] = []
        dus: list[float] = []
        fallbacks = tokens = judged = met = 0
        for b in buckets:
            decisions.update(b.decisions)
            outcomes.update(b.outcomes)
            for r, v in b.ttft.items():
                ttft.setdefault(r, []).extend(v)
            tbt50 += b.tbt_p50
            tbt99 += b.tbt_p99
            e2e += b.e2e
            err += b.pred_err
            dus += b.decision_us
            fallbacks += b.kv_fallbacks
            tokens += b.output_tokens
            judged += b.slo_judged
            met += b.slo_met
        all_ttft = sorted(v for vs in ttft.values() for v in vs)
        for vs in ttft.values():
            vs.sort()
        tbt50.sort()
        tbt99.sort()
        e2e.sort()
        dus.sort()
        n_dec = sum(decisions.values())
        done = sum(outcomes.values())
        span = max(span_s, 1.0)
        return {
            "decisions": n_dec,
            "deflect_ratio": decisions["deflect"] / n_dec if n_dec else None,
            "decisions_by_route": dict(decisions),
            "completed": done,
            "errors": done - outcomes["ok"],
            "outcomes": dict(outcomes),
            "rps": done / span,
            "tokens_per_s": tokens / span,
            "kv_fallbacks": fallbacks,
            "slo_attainment": met / judged if judged else None,
            "ttft_p50": percentile(all_ttft, 0.5),
            "ttft_p95": percentile(all_ttft, 0.95),
            "ttft_p99": percentile(all_ttft, 0.99),
            "ttft_by_route": {r: {"n": len(v), "p50": percentile(v, 0.5), "p95": percentile(v, 0.95),
                                  "p99": percentile(v, 0.99)} for r, v in sorted(ttft.items())},
            "tbt_p50": percentile(tbt50, 0.5),
            "tbt_p99": percentile(tbt99, 0.99),
            "e2e_p50": percentile(e2e, 0.5),
            "e2e_p95": percentile(e2e, 0.95),
            "ttft_pred_bias": sum(err) / len(err) if err else None,
            "ttft_pred_mae": sum(abs(x) for x in err) / len(err) if err else None,
            "decision_us_p50": percentile(dus, 0.5),
            "decision_us_p99": percentile(dus, 0.99),
        }

    def series(self, now: float) -> list[dict[str, Any]]:
        """One point per whole second of the window (the current, partial second excluded)."""
        end = int(now) - 1
        out = []
        for sec in range(end - self.window_s + 1, end + 1):
            s = self._summary(self._window(sec - self.smooth_s, sec), self.smooth_s)
            out.append({"t": sec, "rps": s["rps"], "deflect_ratio": s["deflect_ratio"],
                        "ttft_p50": s["ttft_p50"], "ttft_p95": s["ttft_p95"],
                        "tbt_p50": s["tbt_p50"], "tbt_p99": s["tbt_p99"],
                        "errors_per_s": s["errors"] / self.smooth_s})
        return out

    def worker_rows(self, now: float) -> list[dict[str, Any]]:
        rows = []
        for wid in sorted(self.workers, key=lambda w: (self.workers[w].seen.role != "prefill", w)):
            w = self.workers[wid]
            lo = int(now) - self.window_s
            rows.append({"worker_id": wid, "role": w.seen.role, "engine": w.seen.engine,
                         "incarnation": w.seen.incarnation, "state": dict(w.seen.state),
                         "age_s": round(now - w.last_seen, 3), "up_s": round(now - w.first_seen, 1),
                         "load_history": [[s, v] for s, v in w.history if s > lo]})
        return rows

    def snapshot(self, now: float) -> dict[str, Any]:
        self.expire(now)
        lo = int(now) - self.window_s
        window = self._summary(self._window(lo, int(now)), min(self.window_s, max(1.0, now - self.started)))
        # |predicted - actual| / actual TTFT over the window: median, p90, how many; bias: median signed
        err = self.ttft_errors.summary(now)
        window["ttft_pred_err"] = dict(err) if err is not None else None
        router = None
        if (r := self.router) is not None:  # all routers together; age_s: the freshest one's
            router = {"in_flight": r.in_flight, "accepted": r.accepted, "completed": r.completed,
                      "failed": r.failed, "rejected": r.rejected, "age_s": round(now - self.router_seen, 3),
                      "loop_lag_ms": round(r.loop_lag_ms, 2),
                      "delivery_allowance_ms": round(r.delivery_allowance_ms, 2),
                      "replicas": [{"name": name or "router", "in_flight": st.in_flight, "accepted": st.accepted,
                                    "failed": st.failed, "age_s": round(now - t, 3),
                                    "loop_lag_ms": round(st.loop_lag_ms, 2)}
                                   for name, (st, t) in sorted(self.routers.items())]}
        recent = []
        for rc in reversed(self.recent):
            d = rc.decision
            recent.append({"request_id": d.request_id, "at": rc.seen_at, "route": d.route, "reason": d.reason,
                           "prefill_worker": d.prefill_worker, "decode_worker": d.decode_worker,
                           "prompt_tokens": d.prompt_tokens, "ttft_prefill_pred": d.ttft_prefill_pred,
                           "ttft_decode_pred": d.ttft_decode_pred, "chunk_schedule": list(d.chunk_schedule),
                           "decision_us": d.decision_us, "attempt": d.attempt, "ttft_s": rc.ttft_s,
                           "e2e_s": rc.e2e_s, "outcome": rc.outcome, "kv_fallback": rc.kv_fallback})
        roles = Counter(w.seen.role for w in self.workers.values())
        return {
            "at": now,
            "window_s": self.window_s,
            "smooth_s": self.smooth_s,
            "policy": self.policy,
            "router": router,
            "live_workers": {"prefill": roles["prefill"], "decode": roles["decode"]},
            "workers": self.worker_rows(now),
            "lost": [{"worker_id": w.worker_id, "role": w.role, "reason": w.reason, "ago_s": round(now - t, 1)}
                     for t, w in reversed(self.lost)],
            "flips": [{"worker_id": f.worker_id, "from": f.frm, "to": f.to, "reason": f.reason, "phase": f.phase,
                       "took_s": round(f.took_s, 1), "evidence": f.evidence, "ago_s": round(now - t, 1)}
                      for t, f in reversed(self.flips)],
            "window": window,
            "series": self.series(now),
            "recent": recent,
            "totals": {"decisions": {f"{r}/{why}": n for (r, why), n in sorted(self.decisions.items())},
                       "outcomes": {f"{r}/{o}": n for (r, o), n in sorted(self.outcomes.items())},
                       "messages": dict(self.totals)},
        }
