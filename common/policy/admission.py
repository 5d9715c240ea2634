"""Decode-side admission of deflections: the decode worker has the last word.

A router plans a deflection (its chunk schedule) against its own view of the decode worker:
the last heartbeat plus its ledger of what it sent since. With several routers, no ledger
holds the deflections the other routers sent, and chunks stack on one worker (the TBT SLO
falls; docs/results.md). The decode worker is the only party that sees every deflection, so
it checks each one against its live state before it starts it:

    every step i of the schedule (chunk chi_i over d_i tokens already prefilled) must fit
    step_time(B, K + B*i, [(chi_i, d_i)]) + sum(reserved cost of the deflections it accepted)
        <= the step budget,

B and K its running decodes and their KV tokens now (their context grows one token per step),
the reserved cost of an accepted deflection its largest chunk's cost over its schedule as the
router's ledger reserves it (`reserved_step_cost`, kept until the deflection's first token),
and the step budget the least of the one the deflection carries (the router's beta x TBT SLO),
those of the deflections already accepted, and beta x the worker's strictest resident TBT SLO
(beta read off the deflection: its budget over its TBT SLO). A deflection that does not fit
is rejected at once with the reason; the router then decides again with that worker closed to
deflections (`decide_without`): another decode worker's deflection (checked there in turn), or
the disaggregated path. The live decode worker (services/decode_worker) and the simulator
(sim/router.py) call the same functions. Decode heartbeats also list the deflections a worker
holds and which router sent each, so that a router's view counts the other routers' ones too
(common/router_core/workers.py); admission covers what a heartbeat has not shown yet.

A deflection that carries no budget (0: an older router, or a policy that plans none, such as
deflect-all) is admitted unchecked, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from common.perf_model import PerfModel
from common.policy.base import (
    ClusterView,
    Decision,
    NoKvRoom,
    NoWorkers,
    Policy,
    RequestSpec,
    least_loaded_decode,
    least_loaded_prefill,
)
from common.policy.schedule import reserved_step_cost

REJECTED_REASON = "deflect_rejected"  # the decision reason (and RequestFailed.code) of a rejected deflection


class Accepted(msgspec.Struct, frozen=True, array_like=True):
    """A deflection a decode worker admitted and has not finished prefilling."""

    reserved_s: float  # step time it may add (reserved_step_cost of its schedule)
    budget_s: float    # the step budget it was planned under


def accepted_entry(model: PerfModel, schedule: Iterable[int], budget_s: float, token_budget: int,
                   cached: int = 0) -> Accepted:
    """`cached`: prompt tokens the worker's prefix cache holds (the schedule covers the rest)."""
    return Accepted(reserved_s=reserved_step_cost(model, tuple(schedule), token_budget, cached), budget_s=budget_s)


def check_deflection(model: PerfModel, *, batch: int, kv_tokens: int, schedule: tuple[int, ...], budget_s: float,
                     tbt_slo: float, accepted: Iterable[Accepted], strictest_tbt_slo: float | None = None,
                     cached: int = 0) -> str:
    """'' when the deflection fits the worker's live state, else why not (one line, for logs).
    `cached`: prompt tokens its prefix cache holds; the schedule's chunks run after them."""
    if budget_s <= 0 or not schedule:
        return ""
    budget = budget_s
    reserved = 0.0
    n = 0
    for a in accepted:
        reserved += a.reserved_s
        budget = min(budget, a.budget_s) if a.budget_s > 0 else budget
        n += 1
    if strictest_tbt_slo is not None and tbt_slo > 0:
        budget = min(budget, strictest_tbt_slo * budget_s / tbt_slo)
    done = cached
    for i, chi in enumerate(schedule):
        t = model.step_time(batch, kv_tokens + batch * i, ((chi, done),)) + reserved
        if t > budget:
            return (f"step {i + 1} of {len(schedule)} ({chi} tokens) would take {t * 1e3:.1f} ms > "
                    f"{budget * 1e3:.1f} ms budget beside {batch} decodes and {n} deflections in flight")
        done += chi
    return ""


def decide_without(policy: Policy, req: RequestSpec, view: ClusterView, now: float,
                   closed: frozenset[str] | None = None) -> Decision:
    """Decide again for a request whose deflection a decode worker rejected: the decode workers
    in `closed` (None: every one) are shown at `max_deflections`, so the policy deflects to
    another one or takes the disaggregated path with its own prefill-path prediction; a policy
    that deflects anyway to a closed worker (deflect-all) gets the least-loaded prefill and
    decode workers. Raises NoWorkers when that needs a prefill worker and none is live, and the
    policy's own NoKvRoom (Kairos: `Hold`, the prefill queues are deep and no open decode worker
    can prefill it in place; `NoDecodeRoom`): the request then waits at the router like any other
    (`RouterCore.unplaced`). Before (issue 44, branch gap44) such a request went to the
    least-loaded prefill worker whatever its queue: at the change from an output-heavy phase to a
    prompt-heavy one, ~100 rejected deflections (H100 `shift` seed 12 x1.62) piled ~200k tokens
    (20 s) on the one prefill worker, late themselves and every prompt behind them."""
    shut = tuple(msgspec.structs.replace(d, deflections=1 << 30) if closed is None or d.worker_id in closed else d
                 for d in view.decode)
    try:
        d = policy.decide(req, ClusterView(view.prefill, shut), now)
    except NoKvRoom:
        raise
    except NoWorkers:
        d = None
    if d is not None and d.route == "deflect" and closed is not None and d.decode_worker not in closed:
        return d
    if d is None or d.route != "disagg" or d.prefill_worker is None:
        p = least_loaded_prefill(view)
        dw = least_loaded_decode(view, req)
        return Decision(route="disagg", prefill_worker=p.worker_id, decode_worker=dw.worker_id,
                        reason=REJECTED_REASON)
    return msgspec.structs.replace(d, reason=REJECTED_REASON, ttft_decode_pred=None)


__all__ = ["REJECTED_REASON", "Accepted", "accepted_entry", "check_deflection", "decide_without"]
