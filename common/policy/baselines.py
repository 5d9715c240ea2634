"""The stock disaggregated baselines, the Dynamo/llm-d style conditional rule, a plain
chunked-prefill pool without disaggregation, and deflect-all."""

from __future__ import annotations

import msgspec

from common.policy.base import (
    ClusterView,
    Decision,
    NoWorkers,
    Policy,
    RequestSpec,
    least_loaded_decode,
    least_loaded_prefill,
)


class DisaggRoundRobin(Policy):
    """vLLM's toy proxy: always prefill -> decode, round-robin over each pool, no load awareness."""

    name = "disagg-round-robin"

    def __init__(self) -> None:
        self._p = 0
        self._d = 0

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        if not view.prefill:
            raise NoWorkers("no live prefill worker")
        if not view.decode:
            raise NoWorkers("no live decode worker")
        p = view.prefill[self._p % len(view.prefill)]
        d = view.decode[self._d % len(view.decode)]
        self._p += 1
        self._d += 1
        return Decision(route="disagg", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        reason="round_robin")


class DisaggLeastLoaded(Policy):
    """Always disaggregated: the prefill worker with the fewest queued tokens, the decode worker
    with the lightest batch (llm-d / Dynamo style load-aware proxy without bypass)."""

    name = "disagg-least-loaded"

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        p = least_loaded_prefill(view)
        d = least_loaded_decode(view, req)
        return Decision(route="disagg", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        reason="least_loaded")


class DeflectAll(Policy):
    """Every request prefilled in place on the least-loaded decode worker (exercises that path)."""

    name = "deflect-all"

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        d = least_loaded_decode(view, req)
        return Decision(route="deflect", prefill_worker=None, decode_worker=d.worker_id, reason="deflect_all")


class ConditionalConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Dynamo's conditional disaggregation, both halves of its rule (`isl_or_load`): prefill on
    the decode worker iff the prompt is short (input-length half) OR the prefill worker the router
    would pick is busy (load half), unless that decode worker's KV is nearly full (see
    docs/reference/vllm.md section 7)."""

    eff_isl_threshold: int = 2048         # short: uncached prompt tokens below this (0: half off)
    eff_isl_ratio_threshold: float = 1.0  # ... and uncached/prompt below this; >= 1: no ratio condition
    prefill_busy_threshold: float = 2.0   # busy: queued tokens above this x its token budget (inf: half off)
    decode_busy_threshold: float = 0.9    # KV use above which a decode worker never takes a prefill

    def __post_init__(self) -> None:
        if self.eff_isl_threshold < 0 or self.eff_isl_ratio_threshold < 0 or self.prefill_busy_threshold < 0:
            raise ValueError("conditional-disagg thresholds must be >= 0")
        if not 0.0 <= self.decode_busy_threshold <= 1.0:
            raise ValueError(f"decode_busy_threshold must be in [0, 1] (got {self.decode_busy_threshold})")


class ConditionalDisagg(Policy):
    """Local prefill on the least-loaded decode worker iff (the uncached prompt is short) OR (the
    least-loaded prefill worker is busy); vetoed when that decode worker's KV is nearly full.

    The ratio condition of Dynamo >= 1.5 (`eff_isl_ratio_threshold` 0.7 there) only lets mostly
    cached prompts through, so without prefix-cache hits it switches the input-length half off;
    the default here leaves it out, as Dynamo's first rule (`max_local_prefill_length`) did."""

    name = "conditional-disagg"

    def __init__(self, cfg: ConditionalConfig | None = None) -> None:
        self.cfg = cfg or ConditionalConfig()

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        d = least_loaded_decode(view, req)
        if not view.prefill:
            return Decision(route="deflect", prefill_worker=None, decode_worker=d.worker_id,
                            reason="no_prefill_worker")
        p = least_loaded_prefill(view)
        c = self.cfg
        eff = req.prompt_tokens - req.cached_on(d.worker_id)
        isl_ok = eff < c.eff_isl_threshold and (
            c.eff_isl_ratio_threshold >= 1.0 or eff / max(req.prompt_tokens, 1) < c.eff_isl_ratio_threshold)
        busy = p.queued_tokens > c.prefill_busy_threshold * p.token_budget
        used = 1.0 - d.kv_free_tokens / max(d.kv_capacity_tokens, 1)
        if (isl_ok or busy) and used <= c.decode_busy_threshold:
            return Decision(route="deflect", prefill_worker=None, decode_worker=d.worker_id,
                            reason="short_prompt" if isl_ok else "prefill_busy")
        reason = "decode_busy" if (isl_ok or busy) else "prefill_not_busy"
        return Decision(route="disagg", prefill_worker=p.worker_id, decode_worker=d.worker_id, reason=reason)


class ChunkedPrefill(Policy):
    """No disaggregation (Sarathi-style): every request is prefilled in place on the least-loaded
    decode worker, in chunks that fill what the step's token budget leaves after the decodes
    (capped per request by the engine's chunk size). Meant for a pool of decode workers only
    (`--prefill 0`); it never uses a prefill worker."""

    name = "chunked-prefill"

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        d = least_loaded_decode(view, req)
        return Decision(route="deflect", prefill_worker=None, decode_worker=d.worker_id, reason="chunked_prefill")


class KvAwareConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Dynamo's KV router cost, per worker: overlap_weight x the prompt tokens it would have to
    compute (its uncached suffix) + the tokens it already has to work through (a prefill
    worker's queued tokens; a decode worker's KV in use, whose blocks it would add to)."""

    overlap_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0 (got {self.overlap_weight})")


class KvAware(Policy):
    """Always disaggregated, placed by prefix-cache hits (Dynamo's KV router style): the prefill
    worker with the least `overlap_weight` x uncached prompt + queued tokens, and the decode
    worker (among those with KV room) with the least `overlap_weight` x the KV it lacks (the
    transfer) + its KV in use. Hits come from the router's prefix index (`RequestSpec.cached`);
    without any it is least-loaded on both pools."""

    name = "kv-aware"

    def __init__(self, cfg: KvAwareConfig | None = None) -> None:
        self.cfg = cfg or KvAwareConfig()

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        if not view.prefill:
            raise NoWorkers("no live prefill worker")
        w = self.cfg.overlap_weight
        n = req.prompt_tokens
        p = min(view.prefill, key=lambda x: (w * (n - req.cached_on(x.worker_id)) + x.queued_tokens,
                                             x.queued_requests, x.worker_id))
        need = n + req.max_tokens
        room = [d for d in view.decode if d.kv_free_tokens >= need]
        if not room:
            least_loaded_decode(view, req)  # raises the right error
        d = min(room, key=lambda x: (w * (n - req.cached_on(x.worker_id)) + x.kv_capacity_tokens - x.kv_free_tokens,
                                     x.batch + x.pending + x.deflections, x.worker_id))
        return Decision(route="disagg", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        reason="kv_overlap" if req.cached_on(p.worker_id) else "least_loaded",
                        cached_tokens=req.cached_on(p.worker_id))
