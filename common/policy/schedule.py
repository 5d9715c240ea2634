"""Algorithm 1 of the Kairos paper on one decode worker: the largest-safe chunk schedule of a
prompt under a step-time budget (the worker's TBT SLO times beta), its predicted TTFT_D, and the
bounds that let `Kairos.decide` (common/policy/kairos.py) skip workers without searching them.

Everything here is a pure function of a decode view, a model and a prompt size; the step cost is
`PerfModel.step_time` written out (tests/test_predict.py and tests/test_policy.py check the two
agree), and the search walks runs of equal chunks in closed form.
"""

from __future__ import annotations

import math

from common.perf_model import PerfModel
from common.policy.base import DecodeView

_INF = float("inf")


OK, INFEASIBLE, OVER_LIMIT = 0, 1, 2


def lower_bound(model: PerfModel, base0: float, tokens: int, budget_s: float, cands: list[int],
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
    depend on L is `bound_terms` (kept per decode view by `decide`), the rest `bound_of`."""
    return bound_of(bound_terms(model, base0, budget_s, cands, batch), tokens)


# `lower_bound`'s terms that do not depend on the prompt: (base0, a3', a4/2, a5, last, body,
# sqrt(a5/base0) or 0); None when no chunk fits (the bound is then 0: the search finds that)
BoundTerms = tuple[float, float, float, float, float, int, float] | None


def largest_chunk(a3: float, q: float, room: float) -> float:
    """The largest chunk chi with a3*chi + q*chi**2 <= room (`room`: the step budget less the
    step's cost without the chunk; q = a4/2 + a5, the chunk's own attention and step-total
    terms at no context): what fits in a step at best, since context only adds. Unrounded."""
    if q > 0:
        return (-a3 + math.sqrt(a3 * a3 + 4.0 * q * room)) / (2.0 * q)
    return room / a3 if a3 > 0 else _INF


def chunk_step(base: float, a3: float, a4: float, a5: float, a7: float, over0: float, chi: int,
               done: int) -> float:
    """One step with a chunk of `chi` tokens after `done` of the prompt, as `search` writes
    `PerfModel.step_time` out: `base` the step without the chunk, `a3` with the decodes' cross
    term (a3 + 2*a5*batch), `over0` = batch - knee (the roofline term a7 counts the step's
    tokens past the knee)."""
    t = base + a3 * chi + a4 * chi * (done + chi * 0.5) + a5 * chi * chi
    if over0 + chi > 0:
        t += a7 * (over0 + chi)
    return t


def bound_terms(model: PerfModel, base0: float, budget_s: float, cands: list[int], batch: int,
                 relief: float = 0.0) -> BoundTerms:
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
    chi_max = largest_chunk(a3, a4 / 2.0 + a5, room) * (1 + 1e-9) + 1e-6
    last = cands[0] if cands[0] < chi_max else chi_max
    body = 0
    for c in cands:
        if c <= chi_max:
            body = c
            break
    s = math.sqrt(a5 / base0) if a5 > 0 and base0 > 0 else 0.0
    return (base0, a3, a4 / 2.0, a5, last, body, s)


def bound_of(terms: BoundTerms, tokens: int) -> float:
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


def held_bound(terms: BoundTerms, tokens: int, inflight: tuple[tuple[float, float, int], ...], start: float,
          budget_s: float) -> float:
    """What the deflections in flight add to `bound_of`, which takes them as ended at once: each
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


def fixed_step_cost(model: PerfModel, d: DecodeView) -> float:
    """PerfModel.step_time(b, kv + done, [(chi, done)]) unrolled, the part without the chunk:
    the decodes' share of the step-total terms and the prefill step's a6 (the chunk's share goes
    to a3 in `search`: a5*T**2 = a5*(b**2 + 2*b*chi + chi**2); the roofline a7*max(0, T - knee)
    is per step), plus the reserved cost of the deflections in flight."""
    b = d.batch
    return (model.a0 + model.a6 + (model.a1 + model.a3) * b + model.a5 * b * b + model.a2 * d.kv_tokens
            + d.reserved_step_s)






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
    status, sched, total = search(model, d, tokens, budget_s, cands, limit_s, max_steps, exact)
    return (sched, total) if status == OK else None


def search(model: PerfModel, d: DecodeView, tokens: int, budget_s: float, cands: list[int], limit_s: float,
            max_steps: int, exact: bool = False, lead: int = 0,
            ends: list[tuple[float, float, int]] | None = None, fit_tokens: int = -1, ctx0: int = 0,
            bounded: bool = False) -> tuple[int, tuple[int, ...], float]:
    """`largest_safe_schedule` with the reason it gave up: INFEASIBLE (no safe candidate at
    some step, or the step cap; also without a limit) or OVER_LIMIT (TTFT_D passed `limit_s`;
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
    every chunk attends over them too. `bounded`: the caller already checked `lower_bound`
    against `limit_s`."""
    if not cands:
        return INFEASIBLE, (), 0.0
    a2, a3, a4, a5 = model.a2, model.a3, model.a4, model.a5
    a7, over0 = model.a7, d.batch - model.knee
    b = d.batch
    base0 = fixed_step_cost(model, d)
    a3 = a3 + 2.0 * a5 * b
    ka, g = (0.0, a2 * b) if exact else (a2, 0.0)
    if ctx0:  # a4*chi*(ctx0 + done + chi/2): the cached prefix adds a term linear in chi
        base0 += ka * ctx0
        a3 += a4 * ctx0
    ends = ends or []
    if not bounded and not ends and limit_s < _INF and tokens > 0 and \
            lower_bound(model, base0, tokens, budget_s, cands, b) > limit_s * (1 + 1e-9):
        return OVER_LIMIT, (), 0.0
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
                return INFEASIBLE, (), 0.0
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
            return INFEASIBLE, (), 0.0
        if total > limit_s:
            return OVER_LIMIT, (), 0.0
    return OK, tuple(sched), total


def surely_feasible(model: PerfModel, d: DecodeView, tokens: int, budget_s: float, cands: list[int],
                     max_steps: int, exact: bool, lead: int) -> bool:
    """A sufficient condition for `search` (no limit, no deflections in flight, no cached
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
    t = chunk_step(fixed_step_cost(model, d) + ka * tokens + g * (steps + lead), a3, a4, a5, a7, b - model.knee, chi,
                   tokens)
    return t * (1 + 1e-9) <= budget_s


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
