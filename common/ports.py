"""Free TCP ports for clusters that tests, benchmarks and `kairos up --ephemeral` start.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the same range it draws
outgoing connections' source ports from. Between picking such a port and the service binding it
(a second or more later, in another process), any outgoing connection on the machine may take it,
and the service then fails with "Address already in use". CI hit exactly this: the router of a
test cluster could not bind while the vLLM tier ran beside it. So ports are picked at random below
the ephemeral range, where the kernel never assigns one on its own, and fall back to `bind(0)`
only where that range leaves no room.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services' usual ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` right now. Every socket stays bound until all are picked:
    ports picked one at a time could come back twice, and a cluster given the same port for two of
    its buses fails to start."""
    low = ephemeral_low()
    rng = random.Random()
    with contextlib.ExitStack() as stack:
        picked: list[int] = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            for _ in range(200 if low > LOWEST + 1000 else 0):
                port = rng.randrange(LOWEST, low)
                try:
                    s.bind((host, port))
                    break
                except OSError:
                    continue
            else:
                s.bind((host, 0))
            picked.append(int(s.getsockname()[1]))
        return picked


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
