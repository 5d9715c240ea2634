"""How long a bus message waits for libzmq's I/O thread when its sender goes on running Python.

    python -m bench.bus_handoff                  # 200 messages per case, sender pinned to CPU 0

A ROUTER (this process, pinned to one CPU as `kairos bench-router` pins the router) sends one
200-byte message to a DEALER in a child process pinned to another CPU, then spins for --busy
microseconds (the HTTP handler's Python after a dispatch); the child stamps `time.monotonic()` at
receipt and sends it back. One way = receipt less the send, p50 / p10 / p90 per case, with and
without `common.sockets.hand_to_io_thread()` right after the send. router-throughput.md, "The
first token waits for the CPU its sender holds".
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import time

import zmq

from common import sockets


def _echo(port: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(b"hi")
    while True:
        p = s.recv()
        t = time.monotonic()
        if p == b"stop":
            return
        s.send(struct.pack("d", t))


def one_case(r: zmq.Socket[bytes], ident: bytes, n: int, busy_s: float, hand_off: bool) -> list[float]:
    out = []
    for _ in range(n):
        time.sleep(0.02)
        t = time.monotonic()
        r.send_multipart([ident, b"x" * 200])
        if hand_off:
            sockets.hand_to_io_thread()
        end = t + busy_s
        while time.monotonic() < end:
            pass
        _, b = r.recv_multipart()
        out.append(struct.unpack("d", b)[0] - t)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="messages per case")
    p.add_argument("--busy", default="0,300", help="µs of Python after each send, per case (comma list)")
    p.add_argument("--rounds", type=int, default=2, help="each case this many times, alternated")
    p.add_argument("--cpu", type=int, default=0, help="the sender's CPU (the echo takes the next one)")
    p.add_argument("--echo", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.echo:
        _echo(a.echo)
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {a.cpu})
    echo_cpu = next((c for c in cpus if c != a.cpu), a.cpu)
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen(["taskset", "-c", str(echo_cpu), sys.executable, "-m", "bench.bus_handoff",
                              "--echo", str(port)])
    try:
        ident, _ = r.recv_multipart()
        print(f"sender on CPU {a.cpu} (one CPU: {sockets.on_one_cpu()}), echo on CPU {echo_cpu}; one way, µs")
        for _ in range(a.rounds):
            for busy in (float(x) for x in a.busy.split(",")):
                for hand_off in (False, True):
                    xs = one_case(r, ident, a.n, busy / 1e6, hand_off)
                    print(f"  busy {busy:5.0f} µs, {'hand-off' if hand_off else 'plain   '}: p50 "
                          f"{xs[len(xs) // 2] * 1e6:6.1f}  p10 {xs[len(xs) // 10] * 1e6:6.1f}  "
                          f"p90 {xs[len(xs) * 9 // 10] * 1e6:6.1f}")
        r.send_multipart([ident, b"stop"])
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
        r.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
