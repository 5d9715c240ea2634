"""The router's wait queue: requests that find no decode worker with KV room, and, with Kairos's
late binding, requests the policy holds (`Hold`: the prefill queues are deep and no decode
worker can prefill it in place now).

A request waiting for KV room blocks the queue (FIFO: nobody overtakes it). Held requests do
not: a new arrival is still decided at once. The queue is decided again when room may have
opened (any worker's heartbeat, a deflection's first token, a request's end): the first
`SCAN` waiting requests, in the policy's `retry_order` (Kairos late binding: first those that can
still meet their TTFT SLO, `latest_start`, by arrival), past the held ones, up to the first that still waits for
KV room. Every waiting request is bounded by `kv_wait_timeout` (then HTTP 503, the reason in
the message). The queue and its retry are common/wait_queue.py's, which the simulator
(sim/core.py) runs too; what is the router's here is how a request is tried and failed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.policy import Hold, Kairos, KairosConfig, NoKvRoom, NoWorkers
from common.policy.kairos import latest_start, retry_order
from common.wait_queue import Outcome

if TYPE_CHECKING:
    from services.router.requests import Request
    from services.router.service import Router

def late_config(router: Router) -> KairosConfig | None:
    p = router.policy
    return p.cfg if isinstance(p, Kairos) and p.cfg.late_binding else None


def alone_s(router: Router, tokens: int) -> float:
    """The prompt's prefill time on the fastest idle prefill worker (0 when none is live)."""
    times = [w.model.prefill_exec(tokens, w.hello.token_budget) for w in router.table.workers.values()
             if w.role == "prefill"]
    return min(times, default=0.0)


def blocked(router: Router) -> bool:
    """Does a request wait for KV room (so a new one must queue behind it)? Only held ones: no."""
    return any(not r.held and not r.done for r in router.kv_waiting)


def enqueue(router: Router, req: Request, e: NoKvRoom, now: float) -> None:
    req.held = isinstance(e, Hold)
    req.wait_reason = str(e)
    req.kv_wait_until = now + router.cfg.kv_wait_timeout
    router.kv_waiting.append(req)
    router.counts["late_held" if req.held else "kv_waited"] += 1


def retry(router: Router) -> None:
    """Decide the waiting requests again (see the module docstring)."""
    q = router.kv_waiting
    while q and q[0].done:  # aborted or past its deadline meanwhile
        q.popleft()
    if not q:
        return
    now = time.monotonic()
    late = late_config(router)

    def order(head: list[Request]) -> list[int]:
        latest = [latest_start(r.arrival, r.ttft_slo, alone_s(router, len(r.prompt_token_ids))) for r in head] \
            if late is not None else [0.0] * len(head)
        return retry_order(late, latest, now)

    def place(req: Request) -> Outcome:
        if req.done:
            return Outcome.GONE
        try:
            router._dispatch(req)
        except Hold as e:
            req.held, req.wait_reason = True, str(e)
            return Outcome.HELD
        except NoKvRoom as e:
            req.held, req.wait_reason = False, str(e)
            return Outcome.NO_ROOM
        except NoWorkers as e:
            q.remove(req)
            router._fail(req, f"no worker can serve it: {e}", code="unavailable")
            return Outcome.REMOVED
        req.kv_wait_until = 0.0
        req.held = False
        return Outcome.PLACED

    q.retry(order, place)


def expire(router: Router, now: float) -> None:
    """Fail the waiting requests past their wait timeout, each with what it waited for."""
    q = router.kv_waiting
    while q and (q[0].done or now > q[0].kv_wait_until):
        req = q.popleft()
        if req.done:
            continue
        router.counts["kv_wait_timeouts"] += 1
        t = router.cfg.kv_wait_timeout
        if req.held:
            router._fail(req, f"no worker could take it within {t:g} s (kv_wait_timeout; late binding held it: "
                              f"{req.wait_reason}); retry later, or add prefill or decode workers",
                         code="kv_wait_timeout")
        else:
            router._fail(req, f"no decode worker had KV room for it within {t:g} s (kv_wait_timeout); retry later, "
                              "or add decode workers", code="kv_wait_timeout")
