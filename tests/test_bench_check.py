"""bench/check.py (`make bench-check`): the comparison with bench/baseline.json. The runs
themselves are CI's bench-check tier; here, what passes and what fails."""

import json
from pathlib import Path

from bench.check import BASELINE, compare

BASE = {"router_cost_ratio": 4.0, "decision_total_ratio": 10.0, "tolerance": 1.6}


def test_within_tolerance_passes() -> None:
    assert compare({"router_cost_ratio": 6.3, "decision_total_ratio": 15.9}, BASE) == []


def test_each_ratio_fails_on_its_own() -> None:
    bad = compare({"router_cost_ratio": 9.3, "decision_total_ratio": 10.0}, BASE)  # 3c42f7e's median
    assert len(bad) == 1 and bad[0].startswith("router_cost_ratio 9.30")
    bad = compare({"router_cost_ratio": 4.0, "decision_total_ratio": 16.5}, BASE)
    assert len(bad) == 1 and bad[0].startswith("decision_total_ratio")


def test_committed_baseline_is_complete() -> None:
    base = json.loads(Path(BASELINE).read_text())
    assert {"router_cost_ratio", "decision_total_ratio", "tolerance"} <= set(base)
    assert 1.0 < base["tolerance"] < 2.5  # wide enough for the machine's spread, narrow enough to catch 2x


def test_median_of_the_runs_ratios_counts(monkeypatch) -> None:
    """Each run's ratio has both sides from the same run; the median over runs counts, and a
    second measurement adds to the first one's runs."""
    import bench.check as bc

    router = iter([(900.0, 150.0), (400.0, 200.0), (500.0, 100.0)])
    decision = iter([(30.0, 3.0), (20.0, 4.0), (24.0, 2.0)])
    monkeypatch.setattr(bc, "_router_run", lambda path: next(router))
    monkeypatch.setattr(bc, "_decision_run", lambda path: next(decision))
    m = bc.measure(3)
    assert m["router_cost_ratio"] == 5.0
    assert m["decision_total_ratio"] == 10.0
    assert m["runs"]["router_cost_ratio"] == [6.0, 2.0, 5.0]
    more = iter([(300.0, 100.0)])
    monkeypatch.setattr(bc, "_router_run", lambda path: next(more))
    monkeypatch.setattr(bc, "_decision_run", lambda path: (22.0, 2.0))
    m2 = bc.measure(1, prior=m)
    assert m2["router_cost_ratio"] == 4.0 and len(m2["raw"]["router"]) == 4
    assert len(m["raw"]["router"]) == 3  # the prior measurement is not changed


def test_a_regression_must_show_again(monkeypatch, tmp_path, capsys) -> None:
    """Over the limit once: as many runs more, judged on all; noise that does not repeat passes,
    a cost that grew fails."""
    import bench.check as bc

    base = tmp_path / "baseline.json"
    base.write_text(json.dumps(BASE))  # limit 6.4
    runs = iter([(800.0, 100.0), (420.0, 100.0)])  # one noisy run, then a normal one: median 6.1
    monkeypatch.setattr(bc, "_router_run", lambda path: next(runs))
    monkeypatch.setattr(bc, "_decision_run", lambda path: (20.0, 2.0))
    assert bc.main(["--runs", "1", "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "1 more run(s) to confirm" in out and "bench-check: ok" in out
    monkeypatch.setattr(bc, "_router_run", lambda path: (900.0, 100.0))  # every run costs more
    assert bc.main(["--runs", "1", "--baseline", str(base)]) == 1
    assert "REGRESSION: router_cost_ratio 9.00" in capsys.readouterr().out


def test_cpu_seconds_counts_every_thread_finer_than_a_tick() -> None:
    """The benchmarks' CPU reading: all of a process's threads, ended ones included, in
    nanoseconds, close to what the kernel's tick-based user + system time says."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from bench.steps import _cpu_ticks, cpu_seconds

    pid = os.getpid()
    before = cpu_seconds(pid)

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    after = cpu_seconds(pid)
    assert 0.29 <= after - before < 1.0  # the ended thread's 0.3 s stays counted
    assert abs(after - _cpu_ticks(pid)) < 0.05
    assert abs(after - time.process_time()) < 0.01
    # another process's clock, read from outside
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nend = time.process_time() + 0.2\n"
                              "while time.process_time() < end: pass\nsys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds(child.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = cpu_seconds(child.pid)
        assert 0.2 <= used < 5
        assert round(used * 1e9) % 10_000_000 != 0  # finer than a 10 ms tick
    finally:
        child.communicate(b"")
