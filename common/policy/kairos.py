"""Kairos: load-aware prefill deflection (docs/reference/paper.md sections 2-4).

Per request: predict TTFT on the prefill path (best prefill worker), build on
every decode worker the largest-safe chunk schedule (Algorithm 1) under beta x the strictest
resident TBT SLO, and deflect to the fastest eligible decode worker iff
TTFT_D <= alpha * TTFT_P and TTFT_D <= the request's TTFT SLO.

Beyond the paper, each switchable (KairosConfig): the ledger (done by the router, which folds
dispatched work into the views), per-worker model coefficients (`per_worker_models`), several
concurrent deflections per decode worker (`max_deflections` > 1: the in-flight ones' step cost
is reserved out of the budget), prefix-cache-aware pricing (`prefix_aware`: with the router's
prefix index, `RequestSpec.cached`, each decode worker is priced by its own uncached suffix, whose
chunks attend over the cached prefix, and the prefill path by the chosen prefill worker's
uncached tokens plus the transfer of what the disaggregated path's decode worker lacks), and:

- `predictor`: "paper" is Equation 1 for TTFT_P and Algorithm 1's step sum for TTFT_D, as
  printed. "replay" replays the prefill worker's known queue through its batching rule
  (predict.py), and on the decode path times each step as the worker will run it: after its
  step in flight, with the decodes' context growing one token each per step (and not the
  deflected prompt's own context a second time: its attention is in the chunk's cost).
- `budget_fit`: a schedule's chunks leave room in the decode worker's token budget for its
  decodes and for the chunks of the deflections predicted to be still in flight at each step.
- `share_expect` (replay; off by default: it measured worse on h100-llama2-70b-tp4): the
  prompt's last prefill step usually has spare budget, which requests sent to that worker
  after it take before the step starts (FIFO puts them in the same step); its predicted TTFT
  then counts the tokens the worker has been getting per second (an exponentially weighted
  rate of this policy's own dispatches) over that wait.
- `late_binding` (off by default): a request Kairos would send to the prefill pool while the
  chosen prefill worker already holds `late_depth` token budgets or more is not committed to
  that queue: `decide` raises `Hold`, the router keeps it in its wait queue (arrival order) and
  decides again when a worker's heartbeat or the ledger may show room, so it goes to whichever
  frees first: a prefill queue that dropped below the depth, or a decode worker whose TBT slack
  now admits a chunk schedule. The rule is `holds` (one implementation, for router and simulator).
  `late_order` is the order the waiting requests are decided again in (`retry_order`): "fifo"
  by arrival, or "slack" (default): first those that can still meet their TTFT SLO (arrival +
  SLO, less their own prefill time on an idle worker, is still ahead), by arrival, then the
  others. FIFO spreads a burst's wait over every request, so more of them miss the SLO each by a
  little; "slack" keeps the ones that can still make it on time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import is_, itemgetter
from typing import Literal

import msgspec

from common.engines.replay import Tail, alone, drain, extend, extend_end_after, last_step_sums, shares
from common.perf_model import PerfModel
from common.policy.base import (
    ClusterView,
    Decision,
    DecodeView,
    Hold,
    NoWorkers,
    PrefillView,
    RequestSpec,
    least_loaded_decode,
)
from common.policy.predict import ReplayCache


class KairosConfig(msgspec.Struct, frozen=True, kw_only=True):
    candidates: tuple[int, ...] = (2048, 1024, 512, 256, 128)
    alpha: float = 1.3
    beta: float = 0.9
    transfer_term: bool = True
    max_deflections: int = 4
    per_worker_models: bool = True
    prefix_aware: bool = True
    max_steps: int = 4096
    predictor: Literal["paper", "replay"] = "replay"
    budget_fit: bool = True
    share_expect: bool = False
    late_binding: bool = False
    late_depth: float = 1.0  # late binding: hold while the prefill worker has this many token budgets queued
    late_order: Literal["slack", "fifo"] = "slack"  # late binding: which waiting request is decided first

    def __post_init__(self) -> None:
        if self.alpha < 1.0:
            raise ValueError(f"alpha must be >= 1 (got {self.alpha})")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1] (got {self.beta})")
        if not self.candidates or any(c <= 0 for c in self.candidates):
            raise ValueError("candidates must be positive chunk sizes")
        if self.max_deflections < 1:
            raise ValueError("max_deflections must be >= 1")
        if self.predictor not in ("paper", "replay"):
            raise ValueError(f"predictor must be 'paper' or 'replay' (got {self.predictor!r})")
        if self.late_order not in ("slack", "fifo"):
            raise ValueError(f"late_order must be 'slack' or 'fifo' (got {self.late_order!r})")
        if not self.late_depth > 0:
            raise ValueError(f"late_depth must be > 0 token budgets (got {self.late_depth})")


_OK, _INFEASIBLE, _OVER_LIMIT = 0, 1, 2
_INF = float("inf")
_RATE_TAU_S = 1.0  # time constant of the dispatch rate behind `share_expect`


def _lower_bound(model: PerfModel, base0: float, tokens: int, budget_s: float, cands: list[int],
                 batch: int = 0) -> float:
    """A lower bound on TTFT_D of any schedule the search can build, to skip a worker that
    cannot beat the limit without walking its steps.

    n chunks cost at least n*base0 + a3'*L + a4*L^2/2 + a5*L^2/n (a3' = a3 + 2*a5*batch: the
    step-total term a5*T**2 grows by a5*(chi**2 + 2*batch*chi) with a chunk beside `batch`
    decodes; base0 holds the decodes' own share): the attention term sums to
    exactly a4*L^2/2 for any chunking, and sum(chi^2) >= L^2/n; the roofline term a7 (>= 0) is
    left out, which keeps the bound a bound. Every chunk satisfies
    base0 + a3*chi + (a4/2 + a5)*chi^2 <= budget, which caps its size (chi_max, rounded up so
    the bound stays valid under float error); all but the last are candidates <= chi_max, so
    n >= 1 + ceil((L - min(top, chi_max)) / largest such candidate). The part that does not
    depend on L is `_bound_terms` (kept per decode view by `decide`), the rest `_bound`."""
    return _bound(_bound_terms(model, base0, budget_s, cands, batch), tokens)


# `_lower_bound`'s terms that do not depend on the prompt: (base0, a3', a4/2, a5, last, body,
# sqrt(a5/base0) or 0); None when no chunk fits (the bound is then 0: the search finds that)
_BoundTerms = tuple[float, float, float, float, float, int, float] | None


def _bound_terms(model: PerfModel, base0: float, budget_s: float, cands: list[int], batch: int,
                 relief: float = 0.0) -> _BoundTerms:
    """`relief`: the reserved step cost of the deflections in flight, which every step's safety
    check counts (in `base0`) but the predicted TTFT_D stops counting once each ends: the cost
    part of the bound takes them as ended at once."""
    a4, a5 = model.a4, model.a5
    a3 = model.a3 + 2.0 * a5 * batch
    room = budget_s - base0
    if room <= 0:
        return None
    if relief > 0:
        base0 -= relief
        if base0 <= 0:
            return None  # no useful bound: 0
    q = a4 / 2.0 + a5
    if q > 0:
        chi_max = (-a3 + math.sqrt(a3 * a3 + 4.0 * q * room)) / (2.0 * q)
    elif a3 > 0:
        chi_max = room / a3
    else:
        chi_max = _INF
    chi_max = chi_max * (1 + 1e-9) + 1e-6
    last = cands[0] if cands[0] < chi_max else chi_max
    body = 0
    for c in cands:
        if c <= chi_max:
            body = c
            break
    s = math.sqrt(a5 / base0) if a5 > 0 and base0 > 0 else 0.0
    return (base0, a3, a4 / 2.0, a5, last, body, s)


def _bound(terms: _BoundTerms, tokens: int) -> float:
    if terms is None:
        return 0.0
    base0, a3, a4h, a5, last, body, s = terms
    if tokens <= last:
        n_min = 1.0
    elif body == 0:
        return 0.0  # infeasible: left to the search
    else:
        n_min = 1.0 + math.ceil((tokens - last) / body)
    n = n_min
    if s:
        n = tokens * s
        if n < n_min:
            n = n_min
    return n * base0 + a5 * tokens * tokens / n + a3 * tokens + a4h * tokens * tokens


def _held(terms: _BoundTerms, tokens: int, inflight: tuple[tuple[float, float, int], ...], start: float,
          budget_s: float) -> float:
    """What the deflections in flight add to `_bound`, which takes them as ended at once: each
    one's reserved step cost counts in every step that starts before its predicted end, and
    steps start at most `budget_s` apart (each fits the budget), so in the first ceil(end /
    budget_s) steps (rounded down where float error could make it one more), of at least the
    bound's fewest steps. `start`: when the schedule starts (its ends are relative to it)."""
    if terms is None:
        return 0.0
    last, body = terms[4], terms[5]
    n = 1 if tokens <= last else 1 + math.ceil((tokens - last) / body) if body else 0
    extra = 0.0
    for end, cost, _ in inflight:
        k = math.ceil((end - start) / budget_s - 1e-9)
        if k > 0:
            extra += cost * (k if k < n else n)
    return extra


def _base0(model: PerfModel, d: DecodeView) -> float:
    """PerfModel.step_time(b, kv + done, [(chi, done)]) unrolled, the part without the chunk:
    the decodes' share of the step-total terms and the prefill step's a6 (the chunk's share goes
    to a3 in `_search`: a5*T**2 = a5*(b**2 + 2*b*chi + chi**2); the roofline a7*max(0, T - knee)
    is per step), plus the reserved cost of the deflections in flight."""
    b = d.batch
    return (model.a0 + model.a6 + (model.a1 + model.a3) * b + model.a5 * b * b + model.a2 * d.kv_tokens
            + d.reserved_step_s)


# `Kairos._prep` of one decode view: (view, TBT SLO, model, step budget, busy_until, stale wait,
# token cap, candidates, bound terms, reserved cost of the deflections in flight, whether even
# the smallest candidate cannot start, its `least_loaded_decode` key, the prompt size from which
# no schedule exists, the terms of `decode_time(batch + 1, ...)` for a handoff: a0 + a1*(batch + 1),
# a2, and the GEMM terms)
_Prep = tuple[DecodeView, float, PerfModel, float, float, float, int, list[int], _BoundTerms, float, bool,
              tuple[int, int, str], float, tuple[float, float, float]]

# `Kairos._tail_entry` of one prefill view: (view, model, replayed tail, its last step's tokens and
# attention sum (`last_step_sums`))
_TailEntry = tuple[PrefillView, PerfModel, Tail, int, float]

_by_bound = itemgetter(0, 1)  # (lower bound incl. the wait, worker id): the search order of `decide`


def largest_safe_schedule(model: PerfModel, d: DecodeView, tokens: int, budget_s: float,
                          candidates: tuple[int, ...], limit_s: float, max_steps: int, *, exact: bool = False,
                          fit: bool = False) -> tuple[tuple[int, ...], float] | None:
    """Algorithm 1 on one decode worker. Returns (schedule, TTFT_D) or None if some step has no
    safe candidate, or if the running TTFT_D already exceeds `limit_s` (it can only lose).
    `exact`: step times as the worker runs them (see the module docstring, "replay"); `fit`:
    the chunks also leave `d.reserved_tokens` of the token budget to the deflections in flight.

    The step cost rises with the prompt's own context, so once a candidate fails as a full chunk
    it fails for every later step: the search resumes from the last candidate that fit, and
    walks each run of equal full chunks in closed form, which keeps a decision to
    O(candidates) per worker (O(steps) with deflections in flight, whose ends change the
    cost). Only the remainder can fit again (a smaller chunk), so the scan restarts from the
    top once the remainder is within the largest candidate; the schedule is non-increasing
    except possibly for its last chunk.
    """
    cap = d.token_budget - d.batch - (d.reserved_tokens if fit else 0)
    cands = [c for c in sorted(candidates, reverse=True) if c <= cap]
    status, sched, total = _search(model, d, tokens, budget_s, cands, limit_s, max_steps, exact)
    return (sched, total) if status == _OK else None


def _search(model: PerfModel, d: DecodeView, tokens: int, budget_s: float, cands: list[int], limit_s: float,
            max_steps: int, exact: bool = False, lead: int = 0,
            ends: list[tuple[float, float, int]] | None = None, fit_tokens: int = -1, ctx0: int = 0,
            bounded: bool = False) -> tuple[int, tuple[int, ...], float]:
    """`largest_safe_schedule` with the reason it gave up: _INFEASIBLE (no safe candidate at
    some step, or the step cap; also without a limit) or _OVER_LIMIT (TTFT_D passed `limit_s`;
    feasibility beyond is unknown). `cands`: usable candidates, largest first.

    The step cost is `PerfModel.step_time` written out (tests check they agree): paper form
    a2*(K + done), exact form a2*(K + B*(lead + step)), the decodes' context growing by one
    token per step (`lead` = 1: a step in flight first adds one). `ends`: when each deflection
    in flight is predicted to finish (seconds after this schedule starts), its reserved step
    cost and its largest chunk; the safety check always reserves every one's cost, the predicted
    TTFT_D only until it ends. `fit_tokens` >= 0: a chunk also leaves in the token budget the
    largest chunks of the deflections still in flight at its step (predicted), of `fit_tokens`
    tokens left beside the decodes (`cands` are those up to `fit_tokens`); the engine cuts a
    chunk short should one of them run longer, so the budget holds either way. `ctx0`: prompt
    tokens already in the worker's prefix cache; the `tokens` to prefill come after them, so
    every chunk attends over them too. `bounded`: the caller already checked `_lower_bound`
    against `limit_s`."""
    if not cands:
        return _INFEASIBLE, (), 0.0
    a2, a3, a4, a5 = model.a2, model.a3, model.a4, model.a5
    a7, over0 = model.a7, d.batch - model.knee
    b = d.batch
    base0 = _base0(model, d)
    a3 = a3 + 2.0 * a5 * b
    ka, g = (0.0, a2 * b) if exact else (a2, 0.0)
    if ctx0:  # a4*chi*(ctx0 + done + chi/2): the cached prefix adds a term linear in chi
        base0 += ka * ctx0
        a3 += a4 * ctx0
    ends = ends or []
    if not bounded and not ends and limit_s < _INF and tokens > 0 and \
            _lower_bound(model, base0, tokens, budget_s, cands, b) > limit_s * (1 + 1e-9):
        return _OVER_LIMIT, (), 0.0
    sched: list[int] = []
    steps = 0  # len(sched)
    total = 0.0
    done = 0
    i = 0
    n = len(cands)
    top = cands[0]
    off = 0.0  # reserved cost of the deflections in flight predicted to have ended
    ei, ne = 0, len(ends)
    cap = fit_tokens if fit_tokens >= 0 else 1 << 60
    if fit_tokens >= 0:
        for end in ends:
            cap -= end[2]
    while done < tokens:
        while ei < ne and ends[ei][0] <= total:
            off += ends[ei][1]
            cap += ends[ei][2]
            ei += 1
            i = 0  # more token budget: larger candidates may fit again
        rem = tokens - done
        base = base0 + ka * done + g * (steps + lead)
        chi = 0
        if rem <= top:
            # near the end every candidate >= rem proposes the whole remainder, which may fit
            # although those candidates failed as full chunks earlier (the printed greedy rescans
            # from the top): tried once here; the smaller candidates are full chunks, and those
            # that failed as such before (below index i) fail again
            if rem <= cap:
                t = base + a3 * rem + a4 * rem * (done + rem * 0.5) + a5 * rem * rem
                if over0 + rem > 0:
                    t += a7 * (over0 + rem)
                if t <= budget_s:
                    chi = rem
            while i < n and cands[i] >= rem:
                i += 1
        if not chi:
            while i < n:
                chi = cands[i] if cands[i] < rem else rem
                if chi > cap:
                    i += 1
                    continue
                t = base + a3 * chi + a4 * chi * (done + chi * 0.5) + a5 * chi * chi
                if over0 + chi > 0:
                    t += a7 * (over0 + chi)
                if t <= budget_s:
                    break
                i += 1
            else:
                return _INFEASIBLE, (), 0.0
        if chi < rem:
            # A run of full chunks of this candidate: t grows by `inc` a step (the prompt's own
            # context, and the decodes' in the exact form), so it lasts while t <= budget_s, no
            # deflection in flight ends (its end changes `off` and `cap`), and: above `top`,
            # while the remainder stays above `top` (then the scan restarts); within `top`,
            # while the remainder stays above the chunk and does not fit whole (tried first at
            # every step). Walked in closed form: O(candidates + deflections in flight) per
            # schedule, not O(steps). The sum differs from a step-by-step one in the last bits.
            inc = ka * chi + g + a4 * chi * chi
            k = -(-(rem - top) // chi) if rem > top else -(-(rem - chi) // chi)
            if inc > 0.0:
                fit_k = int((budget_s - t) / inc) + 1
                if fit_k < k:
                    k = fit_k
            u = t - off
            if ei < ne and k > 1:
                # step j of the run starts at total + j*u + inc*j*(j-1)/2 (increasing in j): it
                # runs only if the next end is still ahead then; the largest such j, bisected
                e = ends[ei][0]
                h = inc * 0.5
                if total + (k - 1) * (u + h * (k - 2)) >= e:
                    lo, hi = 0, k - 1  # step lo starts before e, step hi does not
                    while hi - lo > 1:
                        mid = (lo + hi) >> 1
                        if total + mid * (u + h * (mid - 1)) < e:
                            lo = mid
                        else:
                            hi = mid
                    k = lo + 1
            if rem <= top and k > 1:
                # the whole remainder r at step j: it fits from some step on, as r shrinks, when
                # its cost falls step by step: the context grows by ka*chi + g a step and the
                # remainder's own terms fall by at least a3*chi (the attention's, a5's and a7's
                # fall too, done + r being fixed). Then the first step it fits ends the run, bisected.
                if ka * chi + g <= a3 * chi:
                    lo, hi, j = 0, k, k - 1  # it does not fit at step lo; fits at hi (k: not in this run)
                    while j > lo:  # step k - 1 first (usually it does not fit there: one test), then bisect
                        r, dj = rem - j * chi, done + j * chi
                        tr = (base0 + ka * dj + g * (steps + j + lead) + a3 * r + a4 * r * (dj + r * 0.5)
                              + a5 * r * r)
                        if over0 + r > 0:
                            tr += a7 * (over0 + r)
                        if r <= cap and tr <= budget_s:
                            hi = j
                        else:
                            lo = j
                        j = (lo + hi) >> 1
                    k = hi
                else:
                    k = 1
            sched.extend([chi] * k)
            steps += k
            total += k * u + inc * (k * (k - 1) // 2)
            done += chi * k
        else:
            sched.append(chi)
            steps += 1
            total += t - off
            done += chi
        if steps > max_steps:
            return _INFEASIBLE, (), 0.0
        if total > limit_s:
            return _OVER_LIMIT, (), 0.0
    return _OK, tuple(sched), total


def _surely_feasible(model: PerfModel, d: DecodeView, tokens: int, budget_s: float, cands: list[int],
                     max_steps: int, exact: bool, lead: int) -> bool:
    """A sufficient condition for `_search` (no limit, no deflections in flight, no cached
    prefix) to find a schedule, in O(1): the smallest candidate (or a smaller remainder) fits
    even at the most loaded step the prompt can reach, with the context of the whole prompt
    and the most steps (every chunk but the last at least that candidate). The greedy then
    never runs out of candidates. False when unsure (a coefficient < 0, no candidates)."""
    if not cands or tokens <= 0:
        return False
    a2, a3, a4, a5, a7 = model.a2, model.a3, model.a4, model.a5, model.a7
    b = d.batch
    a3 = a3 + 2.0 * a5 * b
    if min(a2, a3, a4, a5, a7) < 0.0:
        return False
    chi = cands[-1]
    steps = tokens // chi + 1
    if steps > max_steps:
        return False
    ka, g = (0.0, a2 * b) if exact else (a2, 0.0)
    t = (_base0(model, d) + ka * tokens + g * (steps + lead) + a3 * chi + a4 * chi * (tokens + chi * 0.5)
         + a5 * chi * chi)
    if b - model.knee + chi > 0:
        t += a7 * (b - model.knee + chi)
    return t * (1 + 1e-9) <= budget_s


def holds(cfg: KairosConfig, p: PrefillView) -> bool:
    """Late binding: keep a request bound for prefill worker `p` at the router instead, because
    `p` already holds `cfg.late_depth` token budgets or more (in flight, queued, and dispatched
    since its heartbeat). Below that depth the worker's next steps are already fed, so a request
    dispatched now runs as soon as one sent later would."""
    return cfg.late_binding and p.queued_tokens >= cfg.late_depth * p.token_budget


def latest_start(arrival: float, ttft_slo: float, alone_s: float) -> float:
    """The latest time a request can still start and meet its TTFT SLO: arrival + SLO less its
    own prefill on an idle worker (`alone_s`, e.g. `PerfModel.prefill_exec` at the token budget)."""
    return arrival + ttft_slo - alone_s


def retry_order(cfg: KairosConfig | None, latest: Sequence[float], now: float) -> list[int]:
    """The order to decide waiting requests again in, as indices into `latest` (each one's
    `latest_start`, the requests in arrival order): see `late_order` (FIFO without a Kairos config)."""
    if cfg is None or cfg.late_order == "fifo":
        return list(range(len(latest)))
    return [i for i, t in enumerate(latest) if t > now] + [i for i, t in enumerate(latest) if t <= now]


def reserved_step_cost(model: PerfModel, schedule: tuple[int, ...] | list[int], step_tokens: int = 0,
                       cached: int = 0) -> float:
    """The step time a deflection in flight may add to its decode worker: the largest chunk
    cost over its schedule, each chunk at the context it will run at. This is what to put in
    `DecodeView.reserved_step_s` for a further concurrent deflection (max_deflections > 1);
    the first chunk alone underestimates it, since later chunks attend over a longer prefix.
    With a superlinear step-total term (a5 > 0) a chunk costs more beside other tokens: each
    chunk is costed as if the rest of its step held `step_tokens` - chi tokens (pass the
    worker's token budget), which covers its cross terms with the decodes and the other chunks.
    `cached`: prompt tokens the worker's prefix cache already holds (the schedule follows them)."""
    worst = 0.0
    done = cached
    for chi in schedule:
        worst = max(worst, model.chunk_cost(chi, done, max(0, step_tokens - chi)))
        done += chi
    return worst


class _ClusterPrep:
    """What `Kairos.decide` needs of a cluster view that does not depend on the request (beyond
    its TBT SLO, which idle decode workers take as theirs) or the clock: the prefill workers in
    increasing end of their replayed queues (the prefill path's search stops at the first whose
    queue alone outlasts the best so far), the decode workers in the handoff's order
    (`least_loaded_decode`), and those that may take a deflection: below `max_deflections`
    (`dec`), of those the ones where a token fits in a step (`alive`), and of those, for a prompt
    of at least the smallest candidate, the ones not stuck (`live`; `_prep`: even the smallest
    chunk would break their TBT budget at the first step)."""

    __slots__ = ("alive", "dec", "decode", "defl_full", "live", "ll", "monotone", "pre", "prefill", "slo")

    def __init__(self, k: Kairos, view: ClusterView, slo: float, now: float) -> None:
        self.prefill, self.decode, self.slo = view.prefill, view.decode, slo
        cfg = k.cfg
        dflt = None if cfg.per_worker_models else k.default_model
        pre = []
        models = set()
        if k._replay_p:
            tails, entry = k._last_tail, k._tail_entry
            for i, p in enumerate(view.prefill):
                m = p.model if dflt is None else dflt
                e = tails.get(p.worker_id)
                if e is None or e[0] is not p or e[1] is not m:
                    e = entry(p, m, now)
                pre.append((e[2].end, i, p, m, e))
                models.add(id(m))
            pre.sort(key=_by_bound)
        self.pre = pre
        # the queue ends bound the prefill path's TTFT from below in increasing order only when
        # every worker pays the same transfer and steps cost more with more tokens
        m0 = pre[0][3] if pre else None
        self.monotone = len(models) == 1 and m0 is not None and min(
            m0.a0, m0.a1, m0.a2, m0.a3, m0.a4, m0.a5, m0.a6, m0.a7) >= 0.0
        preps, prep_of = k._dprep, k._prep
        max_defl = cfg.max_deflections
        dec, alive, live, ll = [], [], [], []
        full = False
        for d in view.decode:
            s = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else slo
            prep = preps.get(d.worker_id)
            if prep is None or prep[0] is not d or prep[1] != s:
                prep = prep_of(d, s)
            ll.append((prep[11], prep))
            if d.deflections >= max_defl:
                full = True
                continue
            dec.append(prep)
            if prep[12] > 1.0:
                alive.append(prep)
                if not prep[10]:
                    live.append(prep)
        ll.sort(key=itemgetter(0))
        self.ll = [prep for _, prep in ll]
        self.dec, self.alive, self.live, self.defl_full = dec, alive, live, full


class Kairos:
    name = "kairos"

    def __init__(self, cfg: KairosConfig | None = None, *, default_model: PerfModel | None = None) -> None:
        self.cfg = cfg or KairosConfig()
        self.default_model = default_model
        self._desc = sorted(self.cfg.candidates, reverse=True)
        self._replay_p = self.cfg.predictor == "replay"
        self._cands_by_cap: dict[int, list[int]] = {}
        self._replays = ReplayCache()
        self._last_tail: dict[str, _TailEntry] = {}
        self._alone: dict[int, tuple[PerfModel, dict[tuple[int, int], float]]] = {}  # id(model) -> run alone
        self._bases: dict[str, tuple[tuple[tuple[int, int], ...], float, PerfModel, Tail]] = {}
        self._rates: dict[str, tuple[float, float]] = {}  # prefill worker -> (when, tokens/s sent to it)
        self._dprep: dict[str, _Prep] = {}  # decode worker -> `_prep` of its last view
        self._cp: _ClusterPrep | None = None  # `_cluster` of the last view
        self._min_cand = min(self.cfg.candidates)

    def _model(self, m: PerfModel) -> PerfModel:
        if self.cfg.per_worker_models or self.default_model is None:
            return m
        return self.default_model

    def _cands(self, cap: int) -> list[int]:
        c = self._cands_by_cap.get(cap)
        if c is None:
            if len(self._cands_by_cap) > 256:
                self._cands_by_cap.clear()
            c = self._cands_by_cap[cap] = [x for x in self._desc if x <= cap]
        return c

    def _prep(self, d: DecodeView, slo: float) -> _Prep:
        """What `decide` needs of decode view `d` that does not depend on the request or the
        clock, kept per worker until its view changes (views are frozen: a new heartbeat or a
        dispatch folded in by the router is a new object): see `_Prep`. The wait on a busy
        worker is `busy_until` - now; on a stale view of a busy one, half its decode step
        (`decode_time` written out)."""
        cfg = self.cfg
        dm = d.model if cfg.per_worker_models or self.default_model is None else self.default_model
        b = d.batch
        replay_p = self._replay_p
        busy_until, stale = -_INF, 0.0
        if replay_p:
            busy_until = d.busy_until
            if b or d.deflections:
                stale = 0.5 * dm.decode_time(b, d.kv_tokens)
        cap = d.token_budget - b
        inflight = d.inflight if replay_p else ()
        if cfg.budget_fit and not inflight:
            cap -= d.reserved_tokens
        cands = self._cands_by_cap.get(cap) or self._cands(cap)
        budget_s = cfg.beta * slo
        relief = sum(c for _, c, _ in inflight) if inflight else 0.0
        base0 = _base0(dm, d)
        terms: _BoundTerms = None
        # the search's first step with the smallest candidate, written as `_search` computes it
        # (no step in flight, no cached prefix): when it does not fit, no schedule starts, for
        # any prompt of at least that many tokens. Valid when a step's cost rises with the chunk,
        # the context and the step count (coefficients >= 0; fits are non-negative).
        stuck = False
        doom = _INF
        if cands:
            a3, a4, a5, a7 = dm.a3 + 2.0 * dm.a5 * b, dm.a4, dm.a5, dm.a7
            if a3 >= 0 and dm.a2 >= 0 and a4 >= 0 and a5 >= 0 and a7 >= 0:
                chi = cands[-1]
                first = base0 + a3 * chi + a4 * chi * (0 + chi * 0.5) + a5 * chi * chi
                if b - dm.knee + chi > 0:
                    first += a7 * (b - dm.knee + chi)
                stuck = first > budget_s
                # past the context `dstar` that chunk no longer fits (the step count and a
                # cached prefix only add), nor does any larger one; chunks are at most the
                # largest candidate and what fits at the first step (`top`), so a prompt
                # of `doom` tokens or more reaches such a context with at least that chunk
                # left to prefill, and its search fails there
                slope = (0.0 if replay_p else dm.a2) + a4 * chi
                if stuck:
                    # not even one token fits (the deflections in flight reserve the budget):
                    # no prompt with anything left to prefill has a schedule
                    one = base0 + a3 + a4 * 0.5 + a5
                    if b - dm.knee + 1 > 0:
                        one += a7 * (b - dm.knee + 1)
                    if one * (1 - 1e-9) > budget_s:
                        doom = 1.0
                elif slope > 0:
                    dstar = (budget_s - first) / slope
                    q, room = a4 / 2.0 + a5, budget_s - base0
                    top = (-a3 + math.sqrt(a3 * a3 + 4.0 * q * room)) / (2.0 * q) if q > 0 else room / a3 \
                        if a3 > 0 else _INF
                    top = min(float(cands[0]), top * (1 + 1e-9) + 1.0)
                    doom = dstar * (1 + 1e-9) + 1.0 + top + chi
            terms = _bound_terms(dm, base0, budget_s, cands, b, relief)
        if len(self._dprep) > 4096:
            self._dprep.clear()
        got = self._dprep[d.worker_id] = (d, slo, dm, budget_s, busy_until, stale, cap, cands, terms, relief,
                                          stuck, (b + d.pending + d.deflections, d.kv_tokens, d.worker_id), doom,
                                          (dm.a0 + dm.a1 * (b + 1), dm.a2, dm._gemm(b + 1)))
        return got

    def _tail(self, p: PrefillView, m: PerfModel, now: float) -> Tail:
        """The replay of `p`'s known queue: the drain it reported (else its backlog replayed
        here), extended by the ledger (cached per worker, see predict.py). A worker that reports
        no backlog is taken to hold its queued tokens (beyond the ledger's) as one request."""
        return self._tail_entry(p, m, now)[2]

    def _tail_entry(self, p: PrefillView, m: PerfModel, now: float) -> _TailEntry:
        """`_tail` kept per worker with its last step's sums (`last_step_sums`), by view identity."""
        last = self._last_tail.get(p.worker_id)
        if last is not None and last[0] is p and last[1] is m:
            return last  # the very same view as last time (the router keeps unchanged ones)
        base = p.drain if p.drain is not None and m is p.model else self._base(p, m, now)
        tail = self._replays.tail(p.worker_id, m, p.token_budget, p.max_batch, base, p.ledger)
        if len(self._last_tail) > 4096:
            self._last_tail.clear()
        tot, attn = last_step_sums(tail)
        got = self._last_tail[p.worker_id] = (p, m, tail, tot, attn)
        return got

    def _base(self, p: PrefillView, m: PerfModel, now: float) -> Tail:
        backlog, busy = p.backlog, p.busy_until
        if backlog is None:
            rest = p.queued_tokens - sum(t for t, _ in p.ledger)
            return drain(m, p.token_budget, p.max_batch, now, ((rest, 0),) if rest > 0 else ())
        got = self._bases.get(p.worker_id)
        if got is not None and got[0] is backlog and got[1] == busy and got[2] is m:
            return got[3]
        base = drain(m, p.token_budget, p.max_batch, busy, backlog)
        if len(self._bases) > 4096:
            self._bases.clear()
        self._bases[p.worker_id] = (backlog, busy, m, base)
        return base

    def _replay_ttft(self, p: PrefillView, m: PerfModel, tail: Tail, tokens: int, ex: float, now: float) -> float:
        """Prefill-path TTFT (without T_xfer) of `tokens` joining `p`'s replayed queue now."""
        if shares(p.token_budget, p.max_batch, tail, now):
            return extend(m, p.token_budget, p.max_batch, tail, tokens, now).end - now
        return (tail.end - now if tail.end > now else 0.0) + ex

    def _note_dispatch(self, worker_id: str, tokens: int, now: float) -> None:
        t0, rate = self._rates.get(worker_id, (now, 0.0))
        if len(self._rates) > 4096:
            self._rates.clear()
        self._rates[worker_id] = (now, rate * math.exp(-max(0.0, now - t0) / _RATE_TAU_S) + tokens / _RATE_TAU_S)

    def _expected_sharing(self, p: PrefillView, m: PerfModel, tokens: int, now: float) -> float:
        """What the tokens sent to `p` between now and the start of this prompt's last prefill
        step add to that step, at the rate the worker has been getting them."""
        got = self._rates.get(p.worker_id)
        if got is None:
            return 0.0
        rate = got[1] * math.exp(-max(0.0, now - got[0]) / _RATE_TAU_S)
        fin = extend(m, p.token_budget, p.max_batch, self._tail(p, m, now), tokens, now)
        spare = p.token_budget - fin.used
        if spare <= 0 or not fin.chunks or (p.max_batch > 0 and len(fin.chunks) >= p.max_batch):
            return 0.0
        extra = min(spare, int(rate * max(0.0, fin.start - now)))
        if extra <= 0:
            return 0.0
        return m.step_time(0, 0, (*fin.chunks, (extra, 0))) - m.step_time(0, 0, fin.chunks)

    def _alone_time(self, m: PerfModel, chunk: int, tokens: int) -> float:
        """Prefill time of `tokens` alone on an idle worker of model `m` in `chunk`-token steps
        (the replay's `alone`, or Equation 1's Exec), kept per model object across decisions."""
        got = self._alone.get(id(m))
        if got is None or got[0] is not m:
            if len(self._alone) > 64:
                self._alone.clear()
            got = self._alone[id(m)] = (m, {})
        runs = got[1]
        run = runs.get((chunk, tokens))
        if run is None:
            if len(runs) > 8192:
                runs.clear()
            run = runs[(chunk, tokens)] = alone(m, chunk, tokens) if self._replay_p else m.prefill_exec(tokens, chunk)
        return run

    def prepare(self, view: ClusterView, now: float, tbt_slo: float) -> None:
        """Do now the work of the next decision that depends only on `view` (each changed
        worker's replayed queue and decode terms, the cluster's orderings), so that a request
        decided on the same view, at a TBT SLO of `tbt_slo`, waits only for its own part. The
        router calls it when its views change (a heartbeat, a dispatch); optional: `decide`
        does whatever is not done yet. The bench times it apart (`kairos bench-decision`)."""
        self._cluster(view, tbt_slo, now)

    def _cluster(self, view: ClusterView, slo: float, now: float) -> _ClusterPrep:
        """`view`'s prepared form (`_ClusterPrep`), kept until a worker's view changes: views are
        frozen and an unchanged worker keeps its view object, so identity tells what changed."""
        cp = self._cp
        if cp is not None and cp.slo == slo:
            pre, dec = view.prefill, view.decode
            if (cp.prefill is pre or (len(pre) == len(cp.prefill) and all(map(is_, pre, cp.prefill)))) and \
                    (cp.decode is dec or (len(dec) == len(cp.decode) and all(map(is_, dec, cp.decode)))):
                return cp
        cp = self._cp = _ClusterPrep(self, view, slo, now)
        return cp

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        cfg = self.cfg
        tokens = req.prompt_tokens - (req.cached_tokens if cfg.prefix_aware else 0)
        replay_p = self._replay_p
        # with the router's prefix index each worker is priced by its own uncached suffix, and
        # the prefill path's KV transfer by what the decode worker that gets it lacks
        per_worker = cfg.prefix_aware and bool(req.cached)
        cp = self._cluster(view, req.tbt_slo, now)
        # the disaggregated path's handoff: `least_loaded_decode`, in the order kept in `cp`
        need_kv = req.prompt_tokens + req.max_tokens
        handoff0: DecodeView | None = None
        hprep: _Prep | None = None
        for x in cp.ll:
            if x[0].kv_free_tokens >= need_kv:
                handoff0, hprep = x[0], x
                break
        # the decode path's candidates, each with a lower bound on its TTFT_D (searched below,
        # once the prefill path's prediction sets the limit). Workers `_prep` rules out for this
        # prompt are skipped: a stuck one unless the prompt (or, with the prefix index, a
        # worker's suffix) may be smaller than the smallest candidate, one where not a token
        # fits unless there may be nothing to prefill, and any whose `doom` the prompt reaches
        why_not = "deflection_in_flight" if cp.defl_full else "no_decode_slack"
        preps = cp.dec if per_worker or tokens <= 0 else cp.alive if tokens < self._min_cand else cp.live
        todo = []
        for prep in preps:
            d, _, dm, budget_s, busy_until, stale, cap, cands, terms, _, stuck, _, doom, _ = prep
            if d.kv_free_tokens < need_kv:
                continue
            td = req.prompt_tokens - req.cached_on(d.worker_id) if per_worker else tokens
            if td >= doom or (stuck and td >= cands[-1]):
                continue  # what its search finds (at the first step, if stuck)
            wait = busy_until - now if busy_until > now else stale
            ctx0 = req.prompt_tokens - td if per_worker else 0
            if td > 0 and cands:
                if ctx0:  # the cached prefix changes base0 (and a3, left out: the bound stays one), as in `_search`
                    base0 = _base0(dm, d) + (0.0 if replay_p else dm.a2) * ctx0
                    terms = _bound_terms(dm, base0, budget_s, cands, d.batch, prep[9])
                lb = _bound(terms, td)
                if lb > 0.0 and replay_p and d.inflight:
                    lb += _held(terms, td, d.inflight, now + wait, budget_s)
                todo.append((wait + lb, d.worker_id, d, dm, budget_s, wait, lb, cands, cap, td, ctx0))
            else:  # no bound: searched first (it finds nothing to do, or no candidate), never skipped
                todo.append((-_INF, d.worker_id, d, dm, budget_s, wait, -1.0, cands, cap, td, ctx0))
        lack = req.prompt_tokens
        if per_worker and handoff0 is not None:
            lack -= req.cached_on(handoff0.worker_id)
        # prefill path: predicted TTFT on every prefill worker, take the best (ties to the first
        # in the view). Exec and T_xfer depend only on the model and the token budget, so they
        # are computed once per pair (the model by identity: hashing it costs more than this).
        best_p = None
        ttft_p = _INF
        best_tp = tokens
        last_m: PerfModel | None = None
        last_chunk = last_tp = 0
        ex = xfer = 0.0
        transfer = cfg.transfer_term
        if replay_p:
            # in increasing end of each worker's queue: its end (+ T_xfer) bounds its TTFT
            # from below, so once it exceeds the best, so do all later ones (`cp.monotone`)
            best_i = -1
            stop = cp.monotone
            for end, i, p, m, e in cp.pre:
                chunk = p.token_budget
                tp = req.prompt_tokens - req.cached_on(p.worker_id) if per_worker else tokens
                if m is not last_m or chunk != last_chunk or tp != last_tp:
                    ex = self._alone_time(m, chunk, tp)
                    if m is not last_m:
                        xfer = m.xfer_time(lack) if transfer else 0.0
                    last_m, last_chunk, last_tp = m, chunk, tp
                lb = end - now + xfer
                if lb >= ttft_p:
                    if lb > ttft_p:
                        if stop:
                            break
                        continue  # its queue alone outlasts the best so far
                    if i > best_i:
                        continue  # at best a tie, and later in the view
                if end <= now:
                    t = ex + xfer  # idle (its queue ends before now): alone, at once
                    if t < ttft_p or (t == ttft_p and i < best_i):
                        best_p, ttft_p, best_tp, best_i = p, t, tp, i
                    continue
                tail = e[2]
                if now < tail.start and shares(chunk, p.max_batch, tail, now):  # `_replay_ttft`, inline
                    t = (extend_end_after(m, chunk, tail, e[3], e[4], tp) if tp > 0 else tail.end) - now + xfer
                else:
                    t = (tail.end - now if tail.end > now else 0.0) + ex + xfer
                if t < ttft_p or (t == ttft_p and i < best_i):
                    best_p, ttft_p, best_tp, best_i = p, t, tp, i
        else:
            dflt = None if cfg.per_worker_models else self.default_model  # `_model`, inline
            for p in view.prefill:
                m = p.model if dflt is None else dflt
                chunk = p.token_budget
                tp = req.prompt_tokens - req.cached_on(p.worker_id) if per_worker else tokens
                if m is not last_m or chunk != last_chunk or tp != last_tp:
                    ex = self._alone_time(m, chunk, tp)
                    if m is not last_m:
                        xfer = m.xfer_time(lack) if transfer else 0.0
                    last_m, last_chunk, last_tp = m, chunk, tp
                t = m.queue_wait(p.queued_tokens, chunk) + ex + xfer
                if t < ttft_p:
                    best_p, ttft_p, best_tp = p, t, tp
        if not view.decode:
            raise NoWorkers("no live decode worker")
        if replay_p and cfg.share_expect and best_p is not None:
            ttft_p += self._expected_sharing(best_p, self._model(best_p.model), best_tp, now)
        handoff: DecodeView | None = None
        if replay_p and best_p is not None:
            # the disaggregated path's first token comes from the decode worker's next step after
            # the KV lands: half a step of waiting on average when it is busy, then that step
            handoff = handoff0
            if handoff is not None and hprep is not None:
                # `decode_time(batch + 1, kv_tokens + prompt)`, from the terms kept in its `_prep`
                c1, a2, g1 = hprep[13]
                step = c1 + a2 * (handoff.kv_tokens + req.prompt_tokens) + g1
                if handoff.batch + handoff.deflections + handoff.pending:
                    step = 1.5 * max(step, handoff.step_s)  # its steps run as they have lately
                ttft_p += step
        # decode path: Algorithm 1 on every eligible decode worker; the best TTFT_D wins, ties to
        # the lowest id. Branch and bound: each worker's lower bound on TTFT_D first, then the
        # searches in increasing bound, each cut at the best found so far, until the next bound
        # cannot beat it (the same decision as searching every worker in id order, cheaper).
        limit = min(cfg.alpha * ttft_p, req.ttft_slo)
        best_d: DecodeView | None = None
        best: tuple[tuple[int, ...], float] | None = None
        best_td = tokens
        fit = cfg.budget_fit
        status: dict[str, int] = {}
        todo.sort(key=_by_bound)
        for key, wid, d, dm, budget_s, wait, lb, cands, cap, td, ctx0 in todo:
            if best is not None and key > best[1] * (1 + 1e-9):
                break  # this bound and every later one exceed the best TTFT_D found
            cut = (limit if best is None else min(limit, best[1])) - wait
            if lb >= 0.0 and lb > cut * (1 + 1e-9):
                status[wid] = _OVER_LIMIT
                continue
            ends = None
            if replay_p and d.inflight:
                ends = [(e - now - wait, c, k) for e, c, k in d.inflight]
                if len(ends) > 1:
                    ends.sort()
            st, sched, total = _search(dm, d, td, budget_s, cands, cut, cfg.max_steps, replay_p,
                                       1 if wait > 0 else 0, ends, cap if fit and ends else -1, ctx0, bounded=True)
            status[wid] = st
            if st != _OK:
                continue
            total += wait
            if best is None or total < best[1] or (total == best[1] and best_d is not None and wid < best_d.worker_id):
                best_d, best, best_td = d, (sched, total), td
        if best_d is None or best is None:
            if best_p is None:
                raise NoWorkers("no live prefill worker and no decode worker can prefill this request in place")
            d = handoff or least_loaded_decode(view, req)
            if holds(cfg, best_p):
                raise Hold(f"prefill worker {best_p.worker_id} holds {best_p.queued_tokens} tokens "
                           f"(late binding: waits below {cfg.late_depth:g} x {best_p.token_budget}) "
                           "and no decode worker can prefill it in place now")
            reason = why_not if ttft_p < float("inf") else "no_decode_slack"
            if why_not == "no_decode_slack":
                reason = self._reason_without_schedule(req, preps, tokens, ttft_p, status, now, per_worker)
            if cfg.share_expect:
                self._note_dispatch(best_p.worker_id, best_tp, now)
            return Decision(route="disagg", prefill_worker=best_p.worker_id, decode_worker=d.worker_id,
                            reason=reason, ttft_prefill_pred=ttft_p, ttft_decode_pred=None,
                            cached_tokens=req.prompt_tokens - best_tp)
        sched, ttft_d = best
        slo = best_d.strictest_tbt_slo if best_d.strictest_tbt_slo is not None else req.tbt_slo
        return Decision(route="deflect", prefill_worker=None, decode_worker=best_d.worker_id,
                        reason="decode_faster" if ttft_d <= ttft_p else "within_alpha",
                        ttft_prefill_pred=ttft_p if best_p else None, ttft_decode_pred=ttft_d,
                        chunk_schedule=sched, cached_tokens=req.prompt_tokens - best_td,
                        step_budget_s=cfg.beta * slo)

    def _reason_without_schedule(self, req: RequestSpec, preps: list[_Prep], tokens: int, ttft_p: float,
                                 status: dict[str, int], now: float, per_worker: bool = False) -> str:
        """Explain a disaggregated decision: was there no slack, or was the decode path just slower?

        `preps`: the decode workers `decide` looked at, in view order (`_ClusterPrep`); `status`:
        what the limited search found per worker. One found infeasible stays so without the
        limit (the same steps fail), as does one `_prep` rules out, so only the others are
        searched again."""
        cfg = self.cfg
        need_kv = req.prompt_tokens + req.max_tokens
        exact = self._replay_p
        todo = []
        for prep in preps:
            d = prep[0]
            if d.kv_free_tokens < need_kv or status.get(d.worker_id) == _INFEASIBLE:
                continue
            td = req.prompt_tokens - req.cached_on(d.worker_id) if per_worker else tokens
            if td >= prep[12] or (prep[10] and td >= prep[7][-1]):
                continue  # no schedule (`_prep`), as `decide` found
            cap = d.token_budget - d.batch - (d.reserved_tokens if cfg.budget_fit else 0)
            todo.append((prep, d, td, self._cands(cap), 1 if exact and d.busy_until > now else 0))
        # "ttft_slo_gate" needs SLO < TTFT_D <= alpha * TTFT_P: impossible when alpha * TTFT_P is
        # within the SLO, and then any worker's feasibility decides the label, whichever it is:
        # first those `_surely_feasible` shows feasible without a search
        if cfg.alpha * ttft_p <= req.ttft_slo and not per_worker:
            for prep, d, td, cands, lead in todo:
                if _surely_feasible(prep[2], d, td, prep[3], cands, cfg.max_steps, exact, lead):
                    return "decode_slower"
        for prep, d, td, cands, lead in todo:
            st, _, total = _search(prep[2], d, td, prep[3], cands, _INF, cfg.max_steps, exact, lead,
                                   ctx0=req.prompt_tokens - td if per_worker else 0)
            if lead:
                total += d.busy_until - now
            if st == _OK:
                if total > req.ttft_slo and total <= cfg.alpha * ttft_p:
                    return "ttft_slo_gate"
                return "decode_slower"
        return "no_decode_slack"
