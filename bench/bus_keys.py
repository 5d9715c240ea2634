"""`python -m bench.bus_keys`: what checking each bus message's CURVE key costs the router's reader.

Under CURVE the router reads every work-socket message with its sender's key (ZeroMQ's per-message
"User-Id", which needs zero-copy frames: `common.sockets.Inbox(keyed=True)`), so a message on a
registered worker's connection is checked against the key it registered with. This measures the
receiving thread's time per message for the three ways the router can read: no CURVE, CURVE read
plainly, CURVE read keyed (the shipped one), on one loopback connection with N messages already
queued (so only the reading is timed: decryption happens in ZeroMQ's I/O thread, before). The
three run alternately, `--runs` times; one JSON object with each run's microseconds per message
and the keyed/plain ratio per round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def _pair(ctx: zmq.Context[zmq.Socket[bytes]], keys: Path | None) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.RCVHWM, 0)
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.SNDHWM, 0)
    c.setsockopt(zmq.IDENTITY, b"decode-0")
    if keys is not None:
        spub, ssec = zmq.auth.load_certificate(str(keys / "s.key_secret"))
        cpub, csec = zmq.auth.load_certificate(str(keys / "c.key_secret"))
        r.curve_publickey, r.curve_secretkey, r.curve_server = spub, ssec, True
        c.curve_serverkey, c.curve_publickey, c.curve_secretkey = spub, cpub, csec
    port = r.bind_to_random_port("tcp://127.0.0.1")
    c.connect(f"tcp://127.0.0.1:{port}")
    c.send(b"hello")
    r.recv_multipart()
    return r, c


def one(ctx: zmq.Context[zmq.Socket[bytes]], keys: Path | None, keyed: bool, n: int, size: int) -> float:
    """Microseconds per message to read `n` queued messages."""
    r, c = _pair(ctx, keys)
    try:
        payload = b"x" * size
        for _ in range(n):
            c.send(payload)
        while r.poll(0) == 0:
            time.sleep(0.01)
        time.sleep(0.5)  # the rest is queued
        t0 = time.perf_counter()
        for _ in range(n):
            if keyed:
                parts = r.recv_multipart(copy=False)
                frames = [p.bytes for p in parts]
                key = parts[-1].get("User-Id")
                assert frames and key
            else:
                r.recv_multipart()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        r.close(0)
        c.close(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bus_keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--size", type=int, default=120, help="payload bytes (a heartbeat or a token batch: ~100-200)")
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args(argv)
    d = Path(tempfile.mkdtemp(prefix="kairos-bus-keys-"))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    try:
        zmq.auth.create_certificates(str(d), "s")
        zmq.auth.create_certificates(str(d), "c")
        (d / "allow").mkdir()
        shutil.copy(d / "c.key", d / "allow" / "c.key")
        auth.start()
        auth.configure_curve(domain="*", location=str(d / "allow"))
        out: dict[str, list[float]] = {"no_curve_us": [], "curve_plain_us": [], "curve_keyed_us": []}
        for _ in range(a.runs):
            out["no_curve_us"].append(round(one(ctx, None, False, a.messages, a.size), 3))
            out["curve_plain_us"].append(round(one(ctx, d, False, a.messages, a.size), 3))
            out["curve_keyed_us"].append(round(one(ctx, d, True, a.messages, a.size), 3))
        ratios = [round(k / p_, 2) for k, p_ in zip(out["curve_keyed_us"], out["curve_plain_us"], strict=True)]
        print(json.dumps({**out, "keyed_over_plain": ratios, "messages": a.messages, "size": a.size}))
    finally:
        auth.stop()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
