"""Every request that fails is in the router's log (`request_failed`), whatever --log-requests
says: the CI run that found requests stranded until their deadline had no line naming them.
Overload refusals after a wait come in storms and are rate-limited per code."""

from __future__ import annotations

import structlog

from common import messages as m
from tests.test_migrate import NOW, make_router


def test_a_request_failed_by_its_deadline_is_logged_with_its_id() -> None:
    r, _ = make_router("deflect-all")
    req = r.submit(list(range(100, 140)), m.Sampling(max_tokens=4), NOW)
    with structlog.testing.capture_logs() as logs:
        for wid in r.table.workers:
            r.table.workers[wid].last_seen = req.deadline + 1.0
        r.tick(req.deadline + 1.0)
    failed = [x for x in logs if x["event"] == "request_failed"]
    assert req.done and len(failed) == 1
    assert failed[0]["request_id"] == req.request_id and failed[0]["code"] == "deadline_exceeded"
    assert failed[0]["log_level"] == "warning" and failed[0]["decode_worker"] == req.decode_worker


def test_overload_refusals_after_a_wait_are_rate_limited_per_code() -> None:
    r, _ = make_router("deflect-all")
    reqs = [r.submit(list(range(100 + i, 140 + i)), m.Sampling(max_tokens=4), NOW) for i in range(5)]
    with structlog.testing.capture_logs() as logs:
        for q in reqs:
            r.fail(q, "overloaded: ...", "decode_busy", NOW + 1.0)
        r.fail(r.submit([1, 2, 3], m.Sampling(max_tokens=4), NOW), "x", "worker_error", NOW + 1.0)
    codes = [x["code"] for x in logs if x["event"] == "request_failed"]
    assert codes == ["decode_busy", "worker_error"]
