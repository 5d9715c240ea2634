"""Mid-stream migration: resume a streaming request on another decode worker.

When the decode worker of a request that has already streamed tokens dies, freezes past the
liveness window, restarts, or hands the request back, the router does not fail the request: it
dispatches it again (next attempt, same request id, by the same policy: deflected in place or
through a prefill worker) with the prompt plus every token already sent as the new prompt and
the tokens left as max_tokens (`Request.work`). The new decode worker prefills that and
continues the stream at the position the client has reached; a greedy engine produces exactly
the tokens the first worker would have (the simulated engine continues its synthetic sequence
from `DecodeWork.resume_tokens`, or `PrefillWork.resume_tokens` when a prefill worker decodes
it itself, route "retain": without them it started the output over). Tokens of the old
attempt that still arrive (a frozen worker waking up) are dropped by the attempt check in the
router, so the client sees one stream with no token repeated or missing, the usage counts
every token once, and finish_reason is the final worker's.

A request with a grammar (`Sampling.structured`: response_format, structured_outputs, tool
calls) is resumed the same way: the vLLM decode engine's grammar first accepts the output already
sent (`DecodeWork.resume_tokens`; common/engines/vllm_scheduler.py, "Resumed grammars"), so it
continues the structure instead of starting it over. Each request is resumed at most
`max_migrations` times; after that it fails with `worker_lost_midstream` as before.
Counted in `counts["migrated"]`, the `kairos_router_migrations` metric and the `migrations`
field of the request's log line.

When it cannot be placed now, the router's one rule applies (`RouterCore.unplaced`, core.py),
as for a request that had not streamed: no decode worker with KV room -> it waits first in the
wait queue (waiting.py; past `kv_wait_timeout` it fails with `worker_lost_midstream`); no
worker at all that could take it (the only other one was lost too, or is restarting under
`kairos up`) -> parked: it waits in `Migration.parked` for up to `park_timeout` seconds and is
dispatched as soon as a worker can take it (checked every liveness tick), or moves to the wait
queue if the workers that came back have no room.

`Migration` owns the parked requests and reaches the rest of the router only through the
callbacks it is given (dispatch, finish, fail, start a next attempt).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import structlog

from common.config import RouterConfig
from common.policy import NoKvRoom, NoWorkers
from common.router_core.ports import NULL_METRICS, Log, Metrics
from common.router_core.requests import Request


class Resumer(Protocol):
    """What migration and parking ask of the rest of the router core (core.py's RouterCore is one)."""

    def dispatch(self, req: Request, now: float, *, rejected: bool = False) -> None:
        """Decide and send at `now`; raises the policy's NoKvRoom/Hold/NoWorkers when it cannot."""

    def dispatch_again(self, req: Request, now: float) -> bool:
        """Dispatch a request's next attempt; False: it could not be placed (`unplaced` put it away)."""

    def unplaced(self, req: Request, e: NoWorkers, now: float) -> None:
        """Put a request that cannot be placed now where it waits (the wait queue, or parked)."""

    def next_attempt(self, req: Request, reason: str, bad_worker: str | None) -> None:
        """Stop a request's work where it ran and start its next attempt."""

    def finish(self, req: Request, finish_reason: str, now: float) -> None:
        """End a request that completed."""

    def fail(self, req: Request, message: str, code: str, now: float) -> None:
        """End a request with an error."""


class Migration:
    """Resuming requests that lost their decode worker, and parking those no worker can take. It
    reaches the rest of the router only through `core` (`Resumer`)."""

    def __init__(self, cfg: RouterConfig, counts: Counter[str], core: Resumer, *,
                 metrics: Metrics = NULL_METRICS, log: Log | None = None) -> None:
        self.cfg, self.counts, self.metrics, self.core = cfg, counts, metrics, core
        self.log = log if log is not None else structlog.get_logger()
        self.parked: dict[str, Request] = {}  # lost their worker with none left to go to

    def resume(self, req: Request, why: str, bad_worker: str | None, now: float, *, counted: bool = True) -> None:
        """Settle a request that streamed tokens and lost its decode worker: resume it elsewhere,
        or fail it with a clear error. The caller has checked `req.streamed` and `not req.done`.
        `counted` False: its last attempt never reached a worker (its work could not be sent), so
        this is no new migration and the limit does not apply."""
        limit = self.cfg.max_migrations
        lost = f"worker failed after streaming {req.n_out} tokens ({why})"
        if req.n_out >= req.sampling.max_tokens:  # every token is out; only the end event was lost
            self.core.finish(req, "length", now)
            return
        if counted and req.migrations >= limit:
            self.metrics.observe_migration("limit")
            self.core.fail(req, f"{lost}; not resumed: it was already resumed {req.migrations} times (limit "
                                f"{limit}); the output is incomplete", "worker_lost_midstream", now)
            return
        self.core.next_attempt(req, "migrated", bad_worker)
        req.migrations += counted
        req.resume_from = req.n_out
        self.counts["migrated"] += 1
        where: dict[str, Any]
        if self.core.dispatch_again(req, now):
            outcome = "resumed"
            where = {"decode_worker": req.decode_worker, "route": req.decision.route if req.decision else None}
        else:  # it waits for KV room or is parked (RouterCore.unplaced)
            outcome = "parked" if req.request_id in self.parked else "waiting"
            where = {"decode_worker": None, "waiting": req.wait_reason or "for KV room"}
        self.metrics.observe_migration(outcome)
        if outcome != "parked":  # park() says so in its own line
            self.log.warning("request_migrated", request_id=req.request_id, attempt=req.attempt,
                             migrations=req.migrations, sent_tokens=req.n_out, why=why, bad_worker=bad_worker, **where)

    def park(self, req: Request, why: str, now: float) -> None:
        """No live worker can take this (already re-attempted) request now: hold it briefly."""
        req.parked_until = min(req.deadline, now + self.cfg.park_timeout)
        self.parked[req.request_id] = req
        self.counts["parked"] += 1
        self.log.warning("request_parked", request_id=req.request_id, attempt=req.attempt, sent_tokens=req.n_out,
                    why=why, timeout_s=self.cfg.park_timeout)

    def retry_parked(self, now: float) -> None:
        """Dispatch parked requests a worker can take now; fail those parked too long."""
        parked = self.parked
        if not parked:
            return
        for rid, req in list(parked.items()):
            if req.done:
                del parked[rid]
                continue
            req.exclude.clear()
            try:
                self.core.dispatch(req, now)
            except NoKvRoom as e:  # workers again, but none with room: it waits for room, first in line
                del parked[rid]
                self.core.unplaced(req, e, now)
                continue
            except NoWorkers as e:
                if now < req.parked_until:
                    continue
                del parked[rid]
                if req.streamed:
                    self.metrics.observe_migration("no_worker")
                    self.core.fail(req, f"worker failed after streaming {req.n_out} tokens; no worker to resume it on "
                                        f"within {self.cfg.park_timeout:g} s ({e}); the output is incomplete",
                                   "worker_lost_midstream", now)
                else:
                    self.core.fail(req, f"no worker left to retry on within {self.cfg.park_timeout:g} s: {e}",
                                   "unavailable", now)
                continue
            del parked[rid]
            self.log.info("request_unparked", request_id=req.request_id, attempt=req.attempt,
                     decode_worker=req.decode_worker)
