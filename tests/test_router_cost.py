"""What the router's per-request bookkeeping was made cheaper with (issue 26) still does what it did:
the one-pass histogram observation gives prometheus_client's own counts, cached label children
are the metric's children, and the request_done line is written when asked and only then."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram
from structlog.testing import capture_logs

from common import messages as m
from common.promfast import child, observe_many
from tests.router_fakes import hello, make_core
from tests.test_router_pins import PROMPT, SAMPLING, shell


def _series(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for mf in reg.collect() for s in mf.samples
            if not s.name.endswith("_created")}


def test_observe_many_counts_as_observe_does() -> None:
    rng = random.Random(7)
    bounds = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)
    values = [rng.choice([0.0, 0.001, 0.0025, 1.0, 5.0, -1.0, rng.random() * 0.02, rng.expovariate(100)])
              for _ in range(3000)] + [math.nan]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("gap", "gaps", ["route"], buckets=bounds, registry=one)
    h2 = Histogram("gap", "gaps", ["route"], buckets=bounds, registry=many)
    for v in values:
        h1.labels("deflect").observe(v)
    observe_many(child(h2, "deflect"), values[:1000])
    observe_many(child(h2, "deflect"), values[1000:])
    observe_many(child(h2, "deflect"), [])
    a, b = _series(one), _series(many)
    assert a.keys() == b.keys()
    for k in a:
        if k[0] == "gap_sum":  # NaN in both (the loop observes NaN; so does observe_many then)
            assert math.isnan(a[k]) and math.isnan(b[k])
        else:
            assert a[k] == b[k], k


def test_child_is_the_metrics_own() -> None:
    h = Histogram("x", "x", ["a", "b"], registry=CollectorRegistry())
    assert child(h, "1", "2") is h.labels("1", "2")
    assert child(h, "1", "2") is child(h, "1", "2")


def _finish_one(**overrides: Any) -> str:
    """One request through the router's shell (the request_done line is the shell's), to the end."""
    r, _ = shell(**overrides)
    r.core.on_message(b"decode-0", hello("decode-0", "decode"), time.monotonic())
    req = r.submit(PROMPT, SAMPLING)
    now = time.monotonic()
    for ids, finish, dt in (([5, 6], None, 0.0), ([7], None, 0.01), ([8], "length", 0.25)):
        now += dt
        batch = m.TokenBatch(worker_id="decode-0", items=[m.TokenItem(req.request_id, 0, ids, finish)])
        r.core.on_message(b"decode-0", batch, now)
    assert req.done
    return req.request_id


async def test_request_done_only_when_asked() -> None:
    with capture_logs() as logs:
        _finish_one()
    assert not [e for e in logs if e["event"] == "request_done"]

    with capture_logs() as logs:
        rid = _finish_one(log_requests=True)
    done = [e for e in logs if e["event"] == "request_done"]
    assert len(done) == 1 and done[0]["log_level"] == "info"
    assert done[0]["request_id"] == rid and done[0]["output_tokens"] == 4 and done[0]["outcome"] == "ok"
    # the largest gap between token batches as the router saw them (issue 44's TBT check), beside the P99
    assert done[0]["tbt_max_s"] == pytest.approx(0.25) and done[0]["tbt_p50_s"] == pytest.approx(0.25)
    assert done[0]["waited_for"] is None  # placed at once: it waited for nothing

    with capture_logs() as logs:
        _finish_one(log_level="debug")
    assert [e["log_level"] for e in logs if e["event"] == "request_done"] == ["debug"]


def test_observe_many_in_bulk_counts_as_observe_does() -> None:
    """From BULK values on numpy finds the buckets (a list or an array, as vLLM's fold passes every
    token's gap): the same bucket counts, values on a bound included, and the same sum to rounding."""
    import numpy as np

    from common.promfast import BULK

    rng = random.Random(11)
    bounds = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)
    values = [rng.choice([0.0, 0.001, 0.0025, 1.0, 5.0, -1.0, math.inf, rng.random() * 0.02, rng.expovariate(100)])
              for _ in range(3 * BULK)]
    one, many, arr = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    hs = [Histogram("gap", "gaps", ["route"], buckets=bounds, registry=r) for r in (one, many, arr)]
    for v in values:
        hs[0].labels("deflect").observe(v)
    observe_many(child(hs[1], "deflect"), values)
    observe_many(child(hs[2], "deflect"), np.array(values))
    observe_many(child(hs[2], "deflect"), np.array([]))
    a = _series(one)
    for b in (_series(many), _series(arr)):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == (pytest.approx(a[k]) if k[0] == "gap_sum" else a[k]), k


def test_the_decision_line_is_built_only_at_debug_level() -> None:
    """The dispatcher's "decision" line is debug-level: at any other level its fields are not built
    and structlog is not called (a dropped call still cost about 4 µs a request); at debug it is."""
    for level, want in (("info", 0), ("warning", 0), ("debug", 1)):
        core, _ = make_core(log_level=level)
        calls: list[str] = []

        class Log:
            def __init__(self, calls: list[str]) -> None:
                self.calls = calls

            def debug(self, event: str, **kw: Any) -> None:
                self.calls.append(event)

            def __getattr__(self, name: str) -> Any:
                return lambda *a, **k: None

        core.dispatcher.log = Log(calls)
        core.on_message(b"decode-0", hello("decode-0", "decode"), time.monotonic())
        req = core.submit(PROMPT, SAMPLING, time.monotonic())
        assert req.decode_worker == "decode-0"
        assert calls.count("decision") == want, level
