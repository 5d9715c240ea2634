"""bench/batch_flood.py's arithmetic: the router's worst event-loop lag between two readings of its
/metrics histogram, and the streams' summary."""

from __future__ import annotations

from bench.batch_flood import Row, summarize, worst_lag

INF = float("inf")


def test_worst_lag_is_the_bucket_the_slowest_new_sample_fell_in() -> None:
    a = {0.001: 5.0, 0.01: 8.0, 0.1: 9.0, 0.25: 9.0, 1.0: 10.0, INF: 10.0}
    b = {0.001: 15.0, 0.01: 19.0, 0.1: 20.0, 0.25: 21.0, 1.0: 23.0, INF: 23.0}  # 13 new, the worst <= 1 s
    assert worst_lag(a, b) == {"samples": 13, "worst_at_most_ms": 1000.0, "over_100ms": 2, "over_250ms": 1}
    c = {0.001: 20.0, 0.01: 29.0, 0.1: 30.0, 0.25: 31.0, 1.0: 33.0, INF: 33.0}  # 10 new, all within 10 ms
    assert worst_lag(b, c) == {"samples": 10, "worst_at_most_ms": 10.0, "over_100ms": 0, "over_250ms": 0}
    assert worst_lag(c, c)["samples"] == 0


def test_summary_counts_only_served_streams() -> None:
    rows = [Row(0.0, 1.0, 200, 0.05, 0.02, 8, None), Row(0.0, 1.0, 200, 0.15, 0.3, 8, None),
            Row(0.0, 0.1, 429, None, 0.0, 0, "http_429")]
    got = summarize(rows)
    assert (got["requests"], got["ok"], got["not_ok"]) == (3, 2, 1)
    assert got["max_gap_ms"] == 300.0 and got["ttft_max_ms"] == 150.0
