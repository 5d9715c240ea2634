"""What `kairos up` does when one of its services exits: restart it, like a process manager.

A service that exits (any exit code, any signal) is started again after a backoff that doubles
with each exit inside the crash-loop window (`backoff_s`, 2x, ... up to `backoff_max_s`), so a
service that dies once comes back at once and one that keeps dying does not spin. A service
that exits `crash_loop_exits` times within `crash_loop_window_s` is crash-looping. By default
(`on_crash_loop="hold"`) it alone is held down: one error line naming it, its last exit and its
log, then another try after `hold_s`, doubling with each crash loop in a row up to
`hold_max_s`, while the rest of the cluster keeps serving (a router has the other workers; the
cluster stops only on Ctrl-C or SIGTERM). `on_crash_loop="stop"` stops the whole cluster instead
(CrashLoop), for scripts that would rather fail.

Every exit and restart is a structlog line (`service_exited`, `service_restarted`) with the
service name, exit code or signal, and restart count.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.25            # delay before the first restart
    backoff_max_s: float = 10.0        # the longest delay between restarts
    crash_loop_exits: int = 5          # this many exits ...
    crash_loop_window_s: float = 60.0  # ... within this many seconds: crash-looping
    on_crash_loop: str = "hold"        # hold that service down (the rest serves on), or stop the cluster
    hold_s: float = 60.0               # a crash-looping service's first hold-down; doubles per loop in a row
    hold_max_s: float = 900.0

    def __post_init__(self) -> None:
        if self.crash_loop_exits < 1:
            raise ValueError(f"crash-loop exits must be >= 1 (got {self.crash_loop_exits})")
        if self.on_crash_loop not in ("hold", "stop"):
            raise ValueError(f"on crash loop: hold or stop (got {self.on_crash_loop!r})")
        if self.hold_s <= 0 or self.hold_max_s < self.hold_s:
            raise ValueError("need 0 < hold <= max hold")
        if self.crash_loop_window_s <= 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("need crash-loop window > 0 and 0 <= backoff <= max backoff")


class CrashLoop(RuntimeError):
    """A service exited too often; the message is the one line for the operator."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.service = name


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL' (Popen reports a signal as a negative code)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class RestartState:
    """One service's exits and the restart it is waiting for."""

    exits: deque[float] = field(default_factory=deque)  # monotonic times of recent exits
    restarts: int = 0
    restart_at: float | None = None                     # a restart is scheduled for then
    holds: int = 0                                      # crash loops in a row (held down this often)
    held_until: float | None = None                     # held down (crash-looping) until then
    last_exit: str = ""                                 # how it last exited ("exit code 3", ...)
    started_at: float = 0.0                             # when it was last (re)started


class Supervisor:
    """Call `step()` every few hundred ms: it notices exits, schedules and performs restarts.

    `alive(name)` is None while the service runs, else its return code; `start(name)` spawns
    it again; `log_path(name)` is where its output goes (for the crash-loop message).
    """

    def __init__(self, policy: RestartPolicy, names: list[str], *, alive: Callable[[str], int | None],
                 start: Callable[[str], None], log_path: Callable[[str], Path | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.state = {n: RestartState() for n in names}
        self._alive, self._start, self._log_path, self._clock = alive, start, log_path, clock

    def held_down(self) -> dict[str, tuple[float, str]]:
        """Services held down now: name -> (seconds until the next try, how it last exited)."""
        now = self._clock()
        return {n: (st.held_until - now, st.last_exit) for n, st in self.state.items() if st.held_until is not None}

    def backoff(self, exits_in_window: int) -> float:
        p = self.policy
        return float(min(p.backoff_max_s, p.backoff_s * 2 ** max(0, exits_in_window - 1)))

    def step(self) -> None:
        now = self._clock()
        for name, st in self.state.items():
            if st.restart_at is not None:
                if now >= st.restart_at:
                    st.restart_at = None
                    st.restarts += 1
                    held = st.held_until is not None
                    st.held_until = None
                    st.started_at = now
                    self._start(name)
                    log.info("service_restarted", service=name, restarts=st.restarts, after_hold_down=held)
                continue
            rc = self._alive(name)
            if rc is None:
                continue
            self._on_exit(name, st, rc, now)

    def _on_exit(self, name: str, st: RestartState, rc: int, now: float) -> None:
        p = self.policy
        st.exits.append(now)
        while st.exits and now - st.exits[0] > p.crash_loop_window_s:
            st.exits.popleft()
        how = st.last_exit = describe_exit(rc)
        fields: dict[str, Any] = {"service": name, "exit": how, "returncode": rc, "restarts": st.restarts,
                                  "exits_in_window": len(st.exits)}
        if st.holds and now - st.started_at > p.crash_loop_window_s:
            st.holds = 0  # it ran a whole window since it was let back up: the next loop starts over
        if len(st.exits) >= p.crash_loop_exits:
            where = self._log_path(name)
            if p.on_crash_loop == "stop":
                log.error("service_crash_looping", **fields, window_s=p.crash_loop_window_s, log=str(where or ""))
                raise CrashLoop(name, f"{name} is crash-looping: {len(st.exits)} exits within "
                                      f"{p.crash_loop_window_s:g} s (last: {how}); stopping the cluster. "
                                      f"Its log: {where or '(none)'}")
            hold = min(p.hold_max_s, p.hold_s * 2 ** st.holds)
            st.holds += 1
            st.exits.clear()
            st.held_until = st.restart_at = now + hold
            log.error("service_held_down", **fields, window_s=p.crash_loop_window_s, held_for_s=hold,
                      log=str(where or ""),
                      detail=f"{name} is crash-looping ({how}); held down for {hold:g} s while the rest of the "
                             f"cluster serves on; see {where or 'its log'}")
            return
        delay = self.backoff(len(st.exits))
        # a clean exit (0) is routine (a drain, an upgrade); anything else is worth a look
        (log.info if rc == 0 else log.warning)("service_exited", **fields, restart_in_s=round(delay, 3))
        st.restart_at = now + delay
