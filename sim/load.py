"""What a trace asks of a cluster, apart from any policy: the physical limit of its TTFTs (each
prompt alone on an idle worker, chunked the fastest way), and the load it offers the prefill
pool, on average and in its busiest window (how `kairos sim`, the fair evaluation and the demo
pick and describe a load)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from common.perf_model import PerfModel, Profile
from common.traces import TraceRequest
from sim.stats import RequestTiming, summarize


def fastest_prefill(model: PerfModel, tokens: int) -> float:
    """The shortest time a prompt alone can be prefilled in on an idle engine, over every way
    of chunking it: alone in its steps a chunk is the step's total, so n chunks cost
    n*(a0 + a6) + a3*L + a4*L^2/2 + sum over chunks of (a7*max(0, chi - knee) + a5*chi^2) (the
    attention term does not depend on the chunking). The last two are convex in chi, so for a
    given n equal chunks are best; n is searched around L*sqrt(a5/(a0 + a6)) (about 680 tokens
    a chunk for a100-dsv2-lite) and up to where chunks reach the knee (one chunk when a5 = 0
    and a0 + a6 >= a7*knee, as in the measured profiles)."""
    if tokens <= 0:
        return 0.0
    fixed = model.a3 * tokens + model.a4 * tokens * tokens / 2.0
    per_step = model.a0 + model.a6

    def cost(n: int) -> float:
        q, r = divmod(tokens, n)
        over = r * max(0.0, q + 1 - model.knee) + (n - r) * max(0.0, q - model.knee)
        return n * per_step + fixed + model.a7 * over + model.a5 * (r * (q + 1) ** 2 + (n - r) * q * q)

    ns = {1, tokens}
    if model.a5 > 0 and per_step > 0:
        guess = int(tokens * math.sqrt(model.a5 / per_step))
        ns.update(range(max(1, guess - 2), min(tokens, guess + 3) + 1))
    if model.a7 > 0 and model.knee > 0:
        top = min(tokens, int(tokens / model.knee) + 2)
        ns.update(range(1, top + 1))
    return min(cost(n) for n in ns)


def lower_bound(trace: Sequence[TraceRequest], profile: Profile, *, ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """The physical limit: every request's own prefill, alone on an idle worker, chunked the
    fastest way (`fastest_prefill`), with no queueing and no KV transfer (the last chunk's step
    samples the first token). The TTFT keys match `summarize`; `tbt_single_decode_step` is a
    decode step with one request and an empty cache."""
    model = profile.model
    cache: dict[int, float] = {}
    recs = []
    for tr in trace:
        t = cache.get(tr.input_length)
        if t is None:
            t = cache[tr.input_length] = fastest_prefill(model, tr.input_length)
        recs.append(RequestTiming(ttft=t, route=None, prompt_tokens=tr.input_length, output_tokens=tr.output_length))
    s = summarize(recs, ttft_slo=ttft_slo, tbt_slo=tbt_slo)
    keep = ("requests", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99", "ttft_max",
            "ttft_slo", "ttft_slo_attainment", "prompt_tokens")
    out = {k: s[k] for k in keep}
    out["tbt_single_decode_step"] = model.decode_time(1, 0)
    return out


def prefill_load(trace: Sequence[TraceRequest], profile: Profile, n_prefill: int) -> float | None:
    """Offered load on the prefill pool: the trace's total prefill work (each prompt alone at
    the token budget) over the trace span times the number of prefill workers."""
    if not trace or n_prefill < 1:
        return None
    span = trace[-1].t - trace[0].t
    if span <= 0:
        return None
    work = sum(profile.model.prefill_exec(tr.input_length, profile.prefill_token_budget) for tr in trace)
    return work / (span * n_prefill)


def peak_load(reqs: Sequence[TraceRequest], profile: Profile, n_prefill: int, window: float = 10.0) -> float:
    """Offered prefill load in the busiest `window` seconds (1.0 = the prefill pool's capacity)."""
    model, budget = profile.model, profile.prefill_token_budget
    work = [model.prefill_exec(r.input_length, budget) for r in reqs]
    best, j, acc = 0.0, 0, 0.0
    for i, r in enumerate(reqs):
        acc += work[i]
        while reqs[j].t <= r.t - window:
            acc -= work[j]
            j += 1
        best = max(best, acc)
    return best / (window * n_prefill)
