"""`kairos up` as a process manager: restarts with backoff, gives up on a crash loop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kairos import up
from kairos.supervisor import CrashLoop, RestartPolicy, Supervisor, describe_exit


class FakeProcs:
    """Services whose exits the test decides; a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.rc: dict[str, int | None] = {"decode-0": None, "router": None}
        self.started: list[tuple[str, float]] = []

    def start(self, name: str) -> None:
        self.started.append((name, self.now))
        self.rc[name] = None


def supervisor(p: FakeProcs, **kw: float) -> Supervisor:
    policy = RestartPolicy(**kw)  # type: ignore[arg-type]
    return Supervisor(policy, list(p.rc), alive=lambda n: p.rc[n], start=p.start,
                      log_path=lambda n: Path(f"logs/{n}.log"), clock=lambda: p.now)


def test_an_exit_is_restarted_after_a_backoff_that_doubles_then_resets() -> None:
    p = FakeProcs()
    s = supervisor(p, backoff_s=0.5, backoff_max_s=1.5, crash_loop_exits=10, crash_loop_window_s=60)
    s.step()
    assert p.started == []                       # all running: nothing to do
    delays = []
    for _ in range(4):
        p.rc["decode-0"] = -signal.SIGKILL
        exited_at, n = p.now, len(p.started)
        s.step()
        assert len(p.started) == n               # noticed, but restarted only after the backoff
        while len(p.started) == n:
            p.now += 0.125
            s.step()
        delays.append(p.now - exited_at)
    assert delays == [0.5, 1.0, 1.5, 1.5]        # doubles, capped
    assert s.state["decode-0"].restarts == 4 and s.state["router"].restarts == 0
    p.now += 61                                  # a quiet window: the backoff starts over
    p.rc["decode-0"] = 1
    s.step()
    assert s.state["decode-0"].restart_at == pytest.approx(p.now + 0.5)


def test_a_crash_loop_is_held_down_alone_and_tried_again_later() -> None:
    p = FakeProcs()
    s = supervisor(p, backoff_s=0.0, crash_loop_exits=3, crash_loop_window_s=10, hold_s=30, hold_max_s=50)

    def loop() -> None:
        for _ in range(3):
            p.rc["decode-0"] = 1
            s.step()
            s.step()

    loop()  # the third exit is a crash loop: held down, no exception, the others untouched
    assert set(s.held_down()) == {"decode-0"} and s.held_down()["decode-0"] == (30, "exit code 1")
    n = len(p.started)
    p.now += 29
    s.step()
    assert len(p.started) == n  # still held
    p.now += 1
    s.step()
    assert p.started[-1] == ("decode-0", 30.0) and s.held_down() == {}
    loop()  # crash-looping again at once: held twice as long, capped
    assert s.held_down()["decode-0"][0] == 50
    assert s.state["router"].restarts == 0
    p.now += 50
    s.step()
    p.now += 11  # it ran a whole window: the next crash loop starts over at 30 s
    loop()
    assert s.held_down()["decode-0"][0] == 30


def test_a_crash_loop_stops_with_one_line_naming_the_service_and_its_log() -> None:
    p = FakeProcs()
    s = supervisor(p, backoff_s=0.0, crash_loop_exits=3, crash_loop_window_s=10, on_crash_loop="stop")
    for i in range(2):
        p.rc["router"] = 2
        s.step()
        s.step()                                 # restarted at once (no backoff)
        assert s.state["router"].restarts == i + 1
    p.rc["router"] = 2
    with pytest.raises(CrashLoop) as e:
        s.step()
    msg = str(e.value)
    assert e.value.service == "router" and "\n" not in msg
    assert "3 exits within 10 s" in msg and "exit code 2" in msg and "logs/router.log" in msg


def test_exits_spread_wider_than_the_window_are_not_a_crash_loop() -> None:
    p = FakeProcs()
    s = supervisor(p, backoff_s=0.0, crash_loop_exits=2, crash_loop_window_s=5)
    for _ in range(4):
        p.rc["decode-0"] = 1
        s.step()
        s.step()
        p.now += 6
    assert s.state["decode-0"].restarts == 4


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_bad_restart_flags_are_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(crash_loop_exits=0)
    assert up.main(["--crash-loop-window", "0"]) == 2


def test_cluster_restarts_a_real_process_and_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    """Real processes: one that dies at once every time, under the Cluster's supervisor."""
    spec = up.ClusterSpec.ephemeral(log_dir=str(tmp_path), prefill=0, decode=1, monitor=False,
                                    restart=RestartPolicy(backoff_s=0.05, backoff_max_s=0.1, crash_loop_exits=3,
                                                          crash_loop_window_s=30, on_crash_loop="stop"))
    c = up.Cluster(spec)
    c.services = {"flaky": up.Service("flaky", [sys.executable, "-c", "import sys; print('boom'); sys.exit(7)"], {})}
    c.spawn("flaky")
    deadline = time.monotonic() + 20
    try:
        with pytest.raises(CrashLoop) as e:
            while time.monotonic() < deadline:
                c.supervise()
                time.sleep(0.02)
        assert "flaky" in str(e.value) and "exit code 7" in str(e.value)
        assert c.supervisor is not None and c.supervisor.state["flaky"].restarts == 2
        assert (tmp_path / "flaky.log").read_text().count("boom") == 3  # the first start + 2 restarts
    finally:
        c.stop(5)


def test_help_lists_the_restart_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "kairos.cli", "up", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--restart-backoff", "--restart-backoff-max", "--crash-loop-exits", "--crash-loop-window",
                 "--on-crash-loop"):
        assert flag in out


def test_an_ephemeral_cluster_gets_distinct_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports picked one at a time (bind to 0, close) can repeat: a CI run's cluster got the same port
    for two router buses and could not start. The picker keeps every socket bound until all are
    picked; here the kernel is made to offer the same port twice in a row, as it may."""
    offers = iter([41001, 41001, *range(41002, 41100)])
    real_socket = up.socket.socket

    class Repeating:
        def __init__(self) -> None:
            self.s = real_socket()
            self.port = 0

        def __enter__(self) -> Repeating:
            return self

        def __exit__(self, *exc: object) -> None:
            self.s.close()

        def bind(self, addr: tuple[str, int]) -> None:
            for port in offers:  # the next offered port this process can still bind
                try:
                    self.s.bind((addr[0], port))
                except OSError:
                    continue
                self.port = port
                return
            raise OSError("no port left")

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(up.socket, "socket", Repeating)
    spec = up.ClusterSpec.ephemeral(routers=3)
    ports = [spec.http_port, spec.work_port, spec.heartbeat_port, spec.telemetry_port, spec.monitor_port,
             *(p for trio in spec.replica_ports for p in trio)]
    assert len(ports) == 11 and len(set(ports)) == 11, ports


def test_a_crash_looping_decode_worker_is_held_down_and_the_others_serve(tmp_path: Path) -> None:
    """Issue 28: one decode worker that keeps dying must not take the cluster down."""
    import httpx

    from tests.conftest import start_cluster

    c = start_cluster(tmp_path, prefill=1, decode=2, profile="fast", policy="kairos", monitor=True,
                      restart=RestartPolicy(backoff_s=0.05, backoff_max_s=0.1, crash_loop_exits=3,
                                            crash_loop_window_s=30, hold_s=60))
    try:
        # from now on decode-1 dies as soon as it starts (a broken host, a bad driver)
        c.services["decode-1"].command = [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]
        c.signal("decode-1", signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and c.supervisor_held() == {}:
            c.supervise()  # no CrashLoop: held down instead
            time.sleep(0.02)
        assert set(c.supervisor_held()) == {"decode-1"}
        ok = 0
        for i in range(20):
            c.supervise()
            r = httpx.post(c.spec.api + "/v1/completions", json={"prompt": f"still serving {i}", "max_tokens": 4},
                           timeout=30)
            ok += r.status_code == 200
        assert ok == 20
        assert c.returncode("decode-0") is None and c.returncode("prefill-0") is None and c.returncode("router") is None
        # the monitor (its /api/state, the dashboard, kairos top) names the service held down, and why
        from rich.console import Console

        from services.monitor.top import render

        state = httpx.get(f"http://127.0.0.1:{c.spec.monitor_port}/api/state", timeout=10).json()
        assert [(d["service"], d["state"], d["last_exit"]) for d in state["services_down"]] == \
            [("decode-1", "held_down", "exit code 3")], state["services_down"]
        assert 0 < state["services_down"][0]["next_try_s"] <= 60
        console = Console(width=200, record=True)
        console.print(render(state, "http://monitor"))
        assert "decode-1 HELD DOWN: crash-looping (exit code 3), next try in" in console.export_text()
    finally:
        c.stop(10)
