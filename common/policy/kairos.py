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
- `late_binding` (off in this class; on as shipped: sim/knobs.py SHIPPED, RouterConfig): a
  request Kairos would send to the prefill pool while the
  chosen prefill worker already holds `late_depth` token budgets or more is not committed to
  that queue: `decide` raises `Hold`, the router keeps it in its wait queue (arrival order) and
  decides again when a worker's heartbeat or the ledger may show room, so it goes to whichever
  frees first: a prefill queue that dropped below the depth, or a decode worker whose TBT slack
  now admits a chunk schedule. The rule is `holds` (one implementation, for router and simulator).
  `late_order` is the order the waiting requests are decided again in (`retry_order`): "fifo" by
  arrival; "slack": first those that can still meet their TTFT SLO (arrival + SLO, less their own
  prefill time on an idle worker, is still ahead), by arrival, then the others; or "short"
  (default): those that can still meet it first as "slack", but the shortest prefill first among
  them (the prompt less the prefix a prefill worker holds, as the router's prefix index last found
  it: `waiting.prefill_tokens`; ties by arrival), then the others by arrival. FIFO spreads a
  burst's wait over every request, so more of them miss the SLO each by a little; "slack" keeps
  the ones that can still make it on time; "short" gives a free prefill slot to the prompt that
  takes the least of it, so that when the prompts arriving outrun the prefill capacity (a
  prompt-heavy phase right after an output-heavy one, whose long answers fill the decode workers:
  issue 44) the most of them still start in time. Its price is the long prompts' share under such
  overload (branch gap44: H100 `shift` x1.62 seed 12, prompts of 4-8k tokens 50 -> 44 % on time,
  every other size up). A held request's latest start counts the same prefill (its cached prefix
  off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import itemgetter
from typing import Literal

import msgspec

from common.engines.replay import Tail, alone, drain, extend, extend_end_after, last_step_sums, shares
from common.engines.step_error import stricter_margin
from common.perf_model import PerfModel
from common.policy.base import (
    ClusterView,
    Decision,
    DecodeView,
    Hold,
    NoDecodeRoom,
    NoWorkers,
    Policy,
    PrefillView,
    RequestSpec,
    least_loaded_decode,
)
from common.policy.predict import ReplayCache
from common.policy.prepared import ClusterPrep, _Prep, _TailEntry
from common.policy.schedule import (
    INFEASIBLE,
    OK,
    OVER_LIMIT,
    BoundTerms,
    bound_of,
    bound_terms,
    chunk_step,
    fixed_step_cost,
    held_bound,
    largest_chunk,
    search,
    surely_feasible,
)


def step_budget(beta: float, margin: float, slo: float) -> float:
    """The step time a deflection's chunks are planned to: beta x the TBT SLO, or less where the
    worker measures its steps running slower than the model (its margin: measured / predicted,
    read at `TARGET`, left beside the bias), made stricter for `DECODE_TARGET` as the decode
    worker's chunk guard plans the step (`ChunkGuard.margin`): a step with a chunk holds every
    running decode, and one overrun breaks all of them at once."""
    return min(beta, 1.0 / stricter_margin(margin)) * slo if margin > 0 else beta * slo


def decode_limit(decode_beta: float, margin: float, slo: float) -> float:
    """The predicted time a decode-only step is planned to by the decode room (`_room`):
    `decode_beta` x the TBT SLO or the SLO / the worker's margin made stricter for
    `DECODE_TARGET` (`stricter_margin`), whichever is less; not their product. The margin is
    the measured noise, read so that a step predicted at SLO / margin passes the SLO with
    chance `DECODE_TARGET`, which is what that target promises;
    `decode_beta` is for what the model misses even when it is exact (the residents' contexts
    grow after the check, a handoff's prompt is longer than the batch's mean: under 0.1 ms on a
    95 ms step, issue 44). Multiplied, they held a decode step under 10 % noise to 0.95 x 100 ms /
    1.50 = 63 ms, which passes 100 ms at a 1.58 draw (4.6 sigma, about 2e-6 a step): ten times
    stricter than `DECODE_TARGET` (branch noise44c, docs/cost-model.md). A worker whose margin
    is below 1 (faster than the model it is predicted with) keeps `decode_beta` x SLO / margin,
    as before. A deflection's chunks are planned with `step_budget` (the same rule with `beta`).
    The third path (`_retain`) keeps the product: its step carries the prefill worker's own
    chunks, and `decode_beta` there also keeps the prefill room (planned to the less, chat under
    10 % noise at x1 lost 3.1 points: more retained decodes, 299 instead of 190 retained requests
    late on their own prefill)."""
    m = decode_margin(margin)
    return min(decode_beta / min(m, 1.0), 1.0 / m) * slo


def decode_margin(margin: float) -> float:
    """A worker's measured margin made stricter for a decode step (`stricter_margin`); 1.0
    before any is measured."""
    return stricter_margin(margin) if margin > 0 else 1.0


class KairosConfig(msgspec.Struct, frozen=True, kw_only=True):
    candidates: tuple[int, ...] = (2048, 1024, 512, 256, 128)
    alpha: float = 1.3  # the paper's rule; what kairos up, kairos sim and the router ship: sim/knobs.py SHIPPED
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
    late_order: Literal["short", "slack", "fifo"] = "short"  # late binding: which waiting request is decided first
    decode_room: bool = False  # no request goes to a decode worker whose decode step it would push past the TBT SLO
    decode_beta: float = 0.95  # decode room: decode-only steps are planned to decode_beta x the SLO (x the margin)
    # the third path (route "retain"): a request no decode worker has room for is decoded by a
    # prefill worker itself, when its decodes, with this one, leave room for a prefill chunk of
    # `retain_chunk` tokens in a step within decode_beta x the TBT SLO, and at most `retain_max` there
    retain: bool = False
    retain_chunk: int = 512
    retain_max: int = 64

    def __post_init__(self) -> None:
        if self.alpha < 1.0:
            raise ValueError(f"alpha must be >= 1 (got {self.alpha})")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1] (got {self.beta})")
        if not 0.0 < self.decode_beta <= 1.0:
            raise ValueError(f"decode_beta must be in (0, 1] (got {self.decode_beta})")
        if not self.candidates or any(c <= 0 for c in self.candidates):
            raise ValueError("candidates must be positive chunk sizes")
        if self.max_deflections < 1:
            raise ValueError("max_deflections must be >= 1")
        if self.predictor not in ("paper", "replay"):
            raise ValueError(f"predictor must be 'paper' or 'replay' (got {self.predictor!r})")
        if self.late_order not in ("short", "slack", "fifo"):
            raise ValueError(f"late_order must be 'short', 'slack' or 'fifo' (got {self.late_order!r})")
        if not self.late_depth > 0:
            raise ValueError(f"late_depth must be > 0 token budgets (got {self.late_depth})")
        if self.retain_chunk < 1 or self.retain_max < 1:
            raise ValueError(f"retain_chunk and retain_max must be >= 1 (got {self.retain_chunk}, {self.retain_max})")


_INF = float("inf")
_RATE_TAU_S = 1.0
# from this many workers (prefill + decode) on, the prepared view is updated one changed worker
# at a time (common/policy/prepared.py); below, rebuilding it on a change costs less
# (`kairos bench-decision`, BENCHMARKS.md)
_INCREMENTAL_MIN = 32  # time constant of the dispatch rate behind `share_expect`
_by_bound = itemgetter(0, 1)  # (lower bound incl. the wait, worker id): the search order of `decide`


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


def retry_order(cfg: KairosConfig | None, latest: Sequence[float], now: float,
                sizes: Sequence[int] | None = None) -> list[int]:
    """The order to decide waiting requests again in, as indices into `latest` (each one's
    `latest_start`, the requests in arrival order): see `late_order` (FIFO without a Kairos config).
    `sizes`: each one's prompt tokens, which "short" orders those that can still make it by
    (without them "short" is "slack")."""
    if cfg is None or cfg.late_order == "fifo":
        return list(range(len(latest)))
    ok = [i for i, t in enumerate(latest) if t > now]
    if cfg.late_order == "short" and sizes is not None and len(ok) > 1:
        ok.sort(key=sizes.__getitem__)  # stable: ties stay in arrival order
    return ok + [i for i, t in enumerate(latest) if t <= now]


def _room(dm: PerfModel, d: DecodeView, slo: float | None, decode_beta: float = 1.0, chunk: int = 0) -> float:
    """Decode room (`KairosConfig.decode_room`): the largest context (prompt tokens) a new decode
    may bring to decode worker `d` so that its decode-only step, with every request it holds or
    is sent decoding (the handoffs dispatched to it and its deflections, each at the batch's
    mean context), times its measured margin, stays within `slo`, the strictest TBT SLO of the
    requests running there. The margin is the worker's (read at `TARGET`, the chance a step
    beside a chunk is planned to overrun) made stricter for a decode step, which every running
    request goes through hundreds of times (`stricter_margin`, `DECODE_TARGET`); the step is
    planned to the less of SLO / that margin and `decode_beta` x the SLO (`decode_limit`). A decode step
    over the SLO breaks every running request's TBT at once, and no chunk sizing can help, so
    the request waits at the router instead (its TTFT pays, as for KV room). With an exact
    model (margin 1) the decode-only step is still planned to `decode_beta` x the SLO (0.95 as
    shipped), not the SLO itself: the residents' contexts grow a token per step after the check
    and handoffs land with prompts longer than the batch's mean, and a pool planned to the SLO
    itself missed it by under 0.1 ms on half its requests (issue 44). It protects the requests
    already there: a worker running none (`slo` None) takes any request, so a request whose own
    SLO no step could meet is still served. -inf when not even an empty prompt fits.

    A worker with a deflected prompt still prefilling (deflections in flight or resident prefill
    tokens left) and `chunk` > 0 also keeps a chunk step's room: its decode-only step is planned
    to at most the chunk guard's limit (SLO / the same stricter margin, `ChunkGuard.fit`) less
    the added cost of a `chunk`-token prefill chunk beside those decodes (the model's fixed a6
    and the chunk's tokens, `PerfModel.chunk_cost`). The worker's guard runs a chunk only when
    at least one token fits (common/engines/batcher.py); a pool refilled by handoffs up to
    `decode_limit` alone (95 ms at SLO 100 ms, a6 17 ms on the H100) left such a prompt no step
    until its residents drained or its request timed out."""
    if slo is None:
        return _INF
    b = d.batch
    n = b + d.pending + d.deflections + 1
    mean_ctx = d.kv_tokens / b if b else 0.0
    kv = d.kv_tokens + (d.pending + d.deflections) * mean_ctx + d.resident_prefill_tokens
    limit = decode_limit(decode_beta, d.step_margin, slo)
    if chunk > 0 and (d.deflections or d.resident_prefill_tokens):
        limit = min(limit, slo / decode_margin(d.step_margin) - dm.chunk_cost(chunk, 0, n))
    left = limit - dm.decode_time(n, 0) - dm.a2 * kv
    if left < 0.0:
        return -_INF
    return left / dm.a2 if dm.a2 > 0.0 else _INF


def retained_ttft(m: PerfModel, p: PrefillView, tokens: int, limit: float, now: float) -> float:
    """TTFT of a request retained on prefill worker `p` (route "retain"), `tokens` to prefill:
    after the step in flight, its queue and this prompt prefilled in steps beside the requests it
    decodes now, each step's chunks as large as the token budget and the TBT guard allow (the
    largest chunk whose step with those decodes fits `limit`), the last step also sampling the
    first token. With no decodes there it is Equation 1 (queue wait + prefill, no transfer)."""
    wait = max(0.0, p.busy_until - now)
    work = p.queued_tokens + tokens
    b, kv = p.decodes, p.decode_kv_tokens
    cap = max(1, p.token_budget - b)
    if b:
        lo, hi = 1, cap
        if m.step_time(b, kv, [(hi, 0)]) > limit:
            while lo < hi:  # the step time grows with the chunk: the largest that fits, by bisection
                mid = (lo + hi + 1) // 2
                if m.step_time(b, kv, [(mid, 0)]) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            cap = lo
    steps = -(-work // cap)
    return wait + steps * m.step_time(b, kv, [(min(cap, work), 0)])


class Kairos(Policy):
    name = "kairos"
    prepares = True

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
        self._cp: ClusterPrep | None = None  # `_cluster` of the last view
        self._min_cand = min(self.cfg.candidates)
        self.incremental_min = _INCREMENTAL_MIN  # fleet size from which `_cluster` updates in place

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
        budget_s = step_budget(cfg.beta, d.step_margin, slo)
        relief = sum(c for _, c, _ in inflight) if inflight else 0.0
        base0 = fixed_step_cost(dm, d)
        terms: BoundTerms = None
        # the search's first step with the smallest candidate, written as `search` computes it
        # (no step in flight, no cached prefix): when it does not fit, no schedule starts, for
        # any prompt of at least that many tokens. Valid when a step's cost rises with the chunk,
        # the context and the step count (coefficients >= 0; fits are non-negative).
        stuck = False
        doom = _INF
        if cands:
            a3, a4, a5, a7 = dm.a3 + 2.0 * dm.a5 * b, dm.a4, dm.a5, dm.a7
            if a3 >= 0 and dm.a2 >= 0 and a4 >= 0 and a5 >= 0 and a7 >= 0:
                chi = cands[-1]
                first = chunk_step(base0, a3, a4, a5, a7, b - dm.knee, chi, 0)
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
                    if chunk_step(base0, a3, a4, a5, a7, b - dm.knee, 1, 0) * (1 - 1e-9) > budget_s:
                        doom = 1.0
                elif slope > 0:
                    dstar = (budget_s - first) / slope
                    top = min(float(cands[0]), largest_chunk(a3, a4 / 2.0 + a5, budget_s - base0) * (1 + 1e-9) + 1.0)
                    doom = dstar * (1 + 1e-9) + 1.0 + top + chi
            terms = bound_terms(dm, base0, budget_s, cands, b, relief)
        if len(self._dprep) > 4096:
            self._dprep.clear()
        got = self._dprep[d.worker_id] = (d, slo, dm, budget_s, busy_until, stale, cap, cands, terms, relief,
                                          stuck, (b + d.pending + d.deflections, d.kv_tokens, d.worker_id), doom,
                                          (dm.a0 + dm.a1 * (b + 1), dm.a2, dm._gemm(b + 1)),
                                          _room(dm, d, d.strictest_tbt_slo, cfg.decode_beta, cfg.retain_chunk)
                                          if cfg.decode_room else _INF)
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

    def orders_waiting(self) -> bool:
        """Late binding orders the wait queue by latest start (`late_order`)."""
        return self.cfg.late_binding

    def retry_order(self, latest: Sequence[float], now: float) -> list[int]:
        return retry_order(self.cfg if self.cfg.late_binding else None, latest, now)

    def orders_by_size(self) -> bool:
        return self.cfg.late_binding and self.cfg.late_order == "short"

    def wait_order(self, latest: Sequence[float], sizes: Sequence[int], now: float) -> list[int]:
        return retry_order(self.cfg if self.cfg.late_binding else None, latest, now, sizes)

    def _cluster(self, view: ClusterView, slo: float, now: float) -> ClusterPrep:
        """`view`'s prepared form (`ClusterPrep`), brought up to date for the workers whose view
        changed since the last call: views are frozen and an unchanged worker keeps its view
        object, so identity tells what changed (common/policy/prepared.py)."""
        cp = self._cp
        if cp is not None and cp.slo == slo:
            if cp.prefill is view.prefill and cp.decode is view.decode:
                return cp
            if cp.update(view, now):
                return cp
        n = len(view.prefill) + len(view.decode)
        cp = self._cp = ClusterPrep(self, view, slo, now, incremental=n >= self.incremental_min)
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
        prompt = req.prompt_tokens
        for x in cp.ll:
            if x[0].kv_free_tokens >= need_kv and prompt <= x[14]:
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
            d, _, dm, budget_s, busy_until, stale, cap, cands, terms, _, stuck, _, doom, _, room = prep
            if d.kv_free_tokens < need_kv or prompt > room:
                continue
            td = req.prompt_tokens - req.cached_on(d.worker_id) if per_worker else tokens
            if td >= doom or (stuck and td >= cands[-1]):
                continue  # what its search finds (at the first step, if stuck)
            wait = busy_until - now if busy_until > now else stale
            ctx0 = req.prompt_tokens - td if per_worker else 0
            if td > 0 and cands:
                if ctx0:  # the cached prefix changes base0 (and a3, left out: the bound stays one), as in `search`
                    base0 = fixed_step_cost(dm, d) + (0.0 if replay_p else dm.a2) * ctx0
                    terms = bound_terms(dm, base0, budget_s, cands, d.batch, prep[9])
                lb = bound_of(terms, td)
                if lb > 0.0 and replay_p and d.inflight:
                    lb += held_bound(terms, td, d.inflight, now + wait, budget_s)
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
        # with the replay predictor, in increasing end of each worker's queue: its end (+ T_xfer)
        # bounds its TTFT from below, so once it exceeds the best, so do all later ones
        # (`cp.monotone`); with Equation 1 (no replay), in view order
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
            if e is None:
                t = m.queue_wait(p.queued_tokens, chunk) + ex + xfer
            else:
                lb = end - now + xfer
                if lb >= ttft_p:
                    if lb > ttft_p:
                        if stop:
                            break
                        continue  # its queue alone outlasts the best so far
                    if i > best_i:
                        continue  # at best a tie, and later in the view
                tail = e[2]
                if end <= now:
                    t = ex + xfer  # idle (its queue ends before now): alone, at once
                elif now < tail.start and shares(chunk, p.max_batch, tail, now):  # `_replay_ttft`, inline
                    t = (extend_end_after(m, chunk, tail, e[3], e[4], tp) if tp > 0 else tail.end) - now + xfer
                else:
                    t = tail.end - now + ex + xfer
            if t < ttft_p or (t == ttft_p and i < best_i):
                best_p, ttft_p, best_tp, best_i = p, t, tp, i
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
                status[wid] = OVER_LIMIT
                continue
            ends = None
            if replay_p and d.inflight:
                ends = [(e - now - wait, c, k) for e, c, k in d.inflight]
                if len(ends) > 1:
                    ends.sort()
            st, sched, total = search(dm, d, td, budget_s, cands, cut, cfg.max_steps, replay_p,
                                       1 if wait > 0 else 0, ends, cap if fit and ends else -1, ctx0, bounded=True)
            status[wid] = st
            if st != OK:
                continue
            total += wait
            if best is None or total < best[1] or (total == best[1] and best_d is not None and wid < best_d.worker_id):
                best_d, best, best_td = d, (sched, total), td
        if best_d is None or best is None:
            if best_p is None:
                raise NoWorkers("no live prefill worker and no decode worker can prefill this request in place")
            if handoff0 is None and cfg.retain and (kept := self._retain(req, view, tokens, now)) is not None:
                return kept
            d = handoff0 or self._no_room(view, req, cp)
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
                        step_budget_s=step_budget(cfg.beta, best_d.step_margin, slo))

    def _retain(self, req: RequestSpec, view: ClusterView, tokens: int, now: float) -> Decision | None:
        """The third path (`KairosConfig.retain`), for a request no decode worker can take now and
        no decode worker can prefill in place: the prefill worker that would give it the earliest
        first token keeps it and decodes it itself (no KV transfer), if (TBT) its decode step with
        every request it decodes, this one added, still leaves room for a `retain_chunk` chunk
        within `decode_beta` x the strictest TBT SLO there, times its measured margin made
        stricter for a step every decode goes through (as `_room`), and (TTFT) its predicted first
        token is within the request's TTFT SLO. TTFT_R: its queue (and this prompt) prefilled in
        the chunks its present decodes leave room for (`retained_ttft`). None: no such worker."""
        cfg = self.cfg
        need_kv = req.prompt_tokens + req.max_tokens
        best: tuple[float, str, PrefillView, int] | None = None
        for p in view.prefill:
            if p.kv_free_tokens < need_kv or p.decodes >= cfg.retain_max:
                continue
            m = self._model(p.model)
            slo = min(req.tbt_slo, p.strictest_tbt_slo) if p.strictest_tbt_slo is not None else req.tbt_slo
            # decode_beta x the product, not `decode_limit`: the prefill worker's own chunks need the room
            limit = cfg.decode_beta * slo / max(stricter_margin(p.step_margin), 1e-9)
            n, kv = p.decodes + 1, p.decode_kv_tokens + req.prompt_tokens
            chi = min(cfg.retain_chunk, max(tokens, 1))  # its own last chunk, over the rest of its prompt
            if m.step_time(n, kv, [(chi, max(0, req.prompt_tokens - chi))]) > limit:
                continue  # with it, its decodes would leave its prefills too little room, or break TBT
            tp = req.prompt_tokens - req.cached_on(p.worker_id) if cfg.prefix_aware and req.cached else tokens
            t = retained_ttft(m, p, max(tp, 1), limit, now)
            if t > req.ttft_slo:
                continue
            if best is None or (t, p.worker_id) < best[:2]:
                best = (t, p.worker_id, p, tp)
        if best is None:
            return None
        t, wid, p, tp = best
        return Decision(route="retain", prefill_worker=wid, decode_worker=wid, reason="decode_pool_full",
                        ttft_prefill_pred=t, ttft_decode_pred=None, cached_tokens=req.prompt_tokens - tp)

    def _no_room(self, view: ClusterView, req: RequestSpec, cp: ClusterPrep) -> DecodeView:
        """No decode worker can take the request's decode now: raise why (`least_loaded_decode`'s
        NoWorkers or NoKvRoom, else NoDecodeRoom: KV room, but its decode step would pass the SLO)."""
        least_loaded_decode(view, req)  # raises when no decode worker is live, or none has KV room
        best = max(cp.ll, key=itemgetter(14))
        raise NoDecodeRoom(f"decode pool full: every decode worker's decode step would pass its TBT SLO with this "
                           f"request ({req.prompt_tokens} prompt tokens) added; the most room is on "
                           f"{best[0].worker_id}, {max(best[14], 0.0):.0f} tokens of context within {best[1] * 1000:g} "
                           f"ms (planned to {self.cfg.decode_beta:g} x it, or less by the worker's measured step "
                           f"margin, or less by a {self.cfg.retain_chunk}-token chunk step where a deflected "
                           f"prompt is still prefilling); waits for a decode to finish")

    def _reason_without_schedule(self, req: RequestSpec, preps: list[_Prep], tokens: int, ttft_p: float,
                                 status: dict[str, int], now: float, per_worker: bool = False) -> str:
        """Explain a disaggregated decision: was there no slack, or was the decode path just slower?

        `preps`: the decode workers `decide` looked at, in view order (`ClusterPrep`); `status`:
        what the limited search found per worker. One found infeasible stays so without the
        limit (the same steps fail), as does one `_prep` rules out, so only the others are
        searched again."""
        cfg = self.cfg
        need_kv = req.prompt_tokens + req.max_tokens
        exact = self._replay_p
        todo = []
        for prep in preps:
            d = prep[0]
            if d.kv_free_tokens < need_kv or req.prompt_tokens > prep[14] or status.get(d.worker_id) == INFEASIBLE:
                continue
            td = req.prompt_tokens - req.cached_on(d.worker_id) if per_worker else tokens
            if td >= prep[12] or (prep[10] and td >= prep[7][-1]):
                continue  # no schedule (`_prep`), as `decide` found
            cap = d.token_budget - d.batch - (d.reserved_tokens if cfg.budget_fit else 0)
            todo.append((prep, d, td, self._cands(cap), 1 if exact and d.busy_until > now else 0))
        # "ttft_slo_gate" needs SLO < TTFT_D <= alpha * TTFT_P: impossible when alpha * TTFT_P is
        # within the SLO, and then any worker's feasibility decides the label, whichever it is:
        # first those `surely_feasible` shows feasible without a search
        if cfg.alpha * ttft_p <= req.ttft_slo and not per_worker:
            for prep, d, td, cands, lead in todo:
                if surely_feasible(prep[2], d, td, prep[3], cands, cfg.max_steps, exact, lead):
                    return "decode_slower"
        for prep, d, td, cands, lead in todo:
            st, _, total = search(prep[2], d, td, prep[3], cands, _INF, cfg.max_steps, exact, lead,
                                   ctx0=req.prompt_tokens - td if per_worker else 0)
            if lead:
                total += d.busy_until - now
            if st == OK:
                if total > req.ttft_slo and total <= cfg.alpha * ttft_p:
                    return "ttft_slo_gate"
                return "decode_slower"
        return "no_decode_slack"
