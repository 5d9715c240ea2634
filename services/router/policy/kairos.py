"""Kairos: load-aware prefill deflection (reference/paper.md sections 2-4).

Per request: predict TTFT on the prefill path with Equation 1 (best prefill worker), build on
every decode worker the largest-safe chunk schedule (Algorithm 1) under beta x the strictest
resident TBT SLO, and deflect to the fastest eligible decode worker iff
TTFT_D <= alpha * TTFT_P and TTFT_D <= the request's TTFT SLO.

Beyond the paper, each switchable (KairosConfig): the ledger (done by the router, which folds
dispatched work into the views), per-worker model coefficients (`per_worker_models`), several
concurrent deflections per decode worker (`max_deflections` > 1: the in-flight ones' step cost
is reserved out of the budget), prefix-cache-aware token counts (`prefix_aware`).
"""

from __future__ import annotations

import msgspec

from common.perf_model import PerfModel
from services.router.policy.base import (
    ClusterView,
    Decision,
    DecodeView,
    NoWorkers,
    RequestSpec,
    least_loaded_decode,
    ttft_prefill_path,
)


class KairosConfig(msgspec.Struct, frozen=True, kw_only=True):
    candidates: tuple[int, ...] = (2048, 1024, 512, 256, 128)
    alpha: float = 1.3
    beta: float = 0.9
    transfer_term: bool = True
    max_deflections: int = 1
    per_worker_models: bool = True
    prefix_aware: bool = True
    max_steps: int = 4096

    def __post_init__(self) -> None:
        if self.alpha < 1.0:
            raise ValueError(f"alpha must be >= 1 (got {self.alpha})")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1] (got {self.beta})")
        if not self.candidates or any(c <= 0 for c in self.candidates):
            raise ValueError("candidates must be positive chunk sizes")
        if self.max_deflections < 1:
            raise ValueError("max_deflections must be >= 1")


def largest_safe_schedule(model: PerfModel, d: DecodeView, tokens: int, budget_s: float,
                          candidates: tuple[int, ...], limit_s: float, max_steps: int
                          ) -> tuple[tuple[int, ...], float] | None:
    """Algorithm 1 on one decode worker. Returns (schedule, TTFT_D) or None if some step has no
    safe candidate, or if the running TTFT_D already exceeds `limit_s` (it can only lose).

    The step cost rises with the prompt's own context, so once a candidate fails as a full chunk
    it fails for every later step: the search resumes from the last candidate that fit, which
    keeps a decision to O(steps + candidates) per worker. Only the remainder can fit again (a
    smaller chunk), so the scan restarts from the top once the remainder is within the largest
    candidate; the schedule is non-increasing except possibly for its last chunk.
    """
    a0, a1, a2, a3, a4, a5 = model.a0, model.a1, model.a2, model.a3, model.a4, model.a5
    base0 = a0 + a1 * d.batch + a2 * d.kv_tokens + d.reserved_step_s
    cap = d.token_budget - d.batch
    cands = [c for c in sorted(candidates, reverse=True) if c <= cap]
    if not cands:
        return None
    sched: list[int] = []
    total = 0.0
    done = 0
    i = 0
    n = len(cands)
    while done < tokens:
        rem = tokens - done
        base = base0 + a2 * done
        if rem <= cands[0]:
            # near the end every candidate >= rem proposes the whole remainder, which may fit
            # although those candidates failed as full chunks earlier: rescan, as the printed greedy does
            i = 0
        while i < n:
            chi = cands[i] if cands[i] < rem else rem
            t = base + a3 * chi + a4 * chi * (done + chi * 0.5) + a5 * chi * chi
            if t <= budget_s:
                break
            i += 1
        else:
            return None
        sched.append(chi)
        total += t
        done += chi
        if total > limit_s or len(sched) > max_steps:
            return None
    return tuple(sched), total


class Kairos:
    name = "kairos"

    def __init__(self, cfg: KairosConfig | None = None, *, default_model: PerfModel | None = None) -> None:
        self.cfg = cfg or KairosConfig()
        self.default_model = default_model

    def _model(self, m: PerfModel) -> PerfModel:
        if self.cfg.per_worker_models or self.default_model is None:
            return m
        return self.default_model

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        cfg = self.cfg
        tokens = req.prompt_tokens - (req.cached_tokens if cfg.prefix_aware else 0)
        # prefill path: Equation 1 on every prefill worker, take the best
        best_p = None
        ttft_p = float("inf")
        for p in view.prefill:
            pv = p if cfg.per_worker_models or self.default_model is None else msgspec.structs.replace(
                p, model=self.default_model)
            t = ttft_prefill_path(pv, req, transfer=cfg.transfer_term, prefix_aware=cfg.prefix_aware)
            if t < ttft_p:
                best_p, ttft_p = p, t
        if not view.decode:
            raise NoWorkers("no live decode worker")
        # decode path: Algorithm 1 on every eligible decode worker (sorted by id: ties -> lowest id)
        limit = min(cfg.alpha * ttft_p, req.ttft_slo)
        best_d: DecodeView | None = None
        best: tuple[tuple[int, ...], float] | None = None
        why_not = "no_decode_slack"
        need_kv = req.prompt_tokens + req.max_tokens
        for d in sorted(view.decode, key=lambda x: x.worker_id):
            if d.deflections >= cfg.max_deflections:
                why_not = "deflection_in_flight" if why_not == "no_decode_slack" else why_not
                continue
            if d.kv_free_tokens < need_kv:
                continue
            slo = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else req.tbt_slo
            cut = limit if best is None else min(limit, best[1])
            found = largest_safe_schedule(self._model(d.model), d, tokens, cfg.beta * slo,
                                          cfg.candidates, cut, cfg.max_steps)
            if found is None:
                continue
            if best is None or found[1] < best[1]:
                best_d, best = d, found
        if best_d is None or best is None:
            if best_p is None:
                raise NoWorkers("no live prefill worker and no decode worker can prefill this request in place")
            d = least_loaded_decode(view, req)
            reason = why_not if ttft_p < float("inf") else "no_decode_slack"
            if why_not == "no_decode_slack":
                reason = self._reason_without_schedule(req, view, tokens, ttft_p)
            return Decision(route="disagg", prefill_worker=best_p.worker_id, decode_worker=d.worker_id,
                            reason=reason, ttft_prefill_pred=ttft_p, ttft_decode_pred=None)
        sched, ttft_d = best
        return Decision(route="deflect", prefill_worker=None, decode_worker=best_d.worker_id,
                        reason="decode_faster" if ttft_d <= ttft_p else "within_alpha",
                        ttft_prefill_pred=ttft_p if best_p else None, ttft_decode_pred=ttft_d,
                        chunk_schedule=sched)

    def _reason_without_schedule(self, req: RequestSpec, view: ClusterView, tokens: int, ttft_p: float) -> str:
        """Explain a disaggregated decision: was there no slack, or was the decode path just slower?"""
        cfg = self.cfg
        for d in view.decode:
            if d.deflections >= cfg.max_deflections or d.kv_free_tokens < req.prompt_tokens + req.max_tokens:
                continue
            slo = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else req.tbt_slo
            found = largest_safe_schedule(self._model(d.model), d, tokens, cfg.beta * slo, cfg.candidates,
                                          float("inf"), cfg.max_steps)
            if found is not None:
                if found[1] > req.ttft_slo and found[1] <= cfg.alpha * ttft_p:
                    return "ttft_slo_gate"
                return "decode_slower"
        return "no_decode_slack"
