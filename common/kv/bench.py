"""`kairos kv-bench`: NIXL WRITE throughput between two processes on loopback, against memcpy.

    kairos kv-bench [--size BYTES] [--block-size BYTES] [--iters N] [--warmup N] --out FILE.json
    python -m common.kv.bench ...                     (the same; `--serve` is the child's mode)

The parent is the sender (KvSender); a child process runs the receivers (KvReceiver, see
common.kv.remote). Two cases, each `warmup` + `iters` pushes of `size` bytes:

- single: one block of `size` bytes (one descriptor);
- blocks: `size / block_size` blocks written to a random permutation of the receiver's blocks
  (prepared descriptor lists, no two destinations adjacent in order, as a fragmented KV pool).

Every push is verified in the child against the deterministic pattern (untimed). Throughput is
size / transfer time, transfer = post to DONE on the sender (PushResult.transfer_s); `push`
throughput also counts the copy of the payload into the sender's registered staging memory.
`ratio_to_memcpy` is the single-buffer median over an in-process numpy copy of the same size,
measured in the same run. GB/s = 1e9 bytes/s. Medians, with min and max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from common.kv import _nixl
from common.kv.pattern import fill_pattern
from common.kv.receiver import transfer_key


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = 0.0
    return {"cpus": os.cpu_count(), "arch": platform.machine(), "cpu_model": model, "mem_gib": mem_gib,
            "os": platform.platform(), "python": platform.python_version()}


def _summary(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"gbps_median": round(statistics.median(rates), 3), "gbps_min": round(min(rates), 3),
            "gbps_max": round(max(rates), 3), "ms_median": round(1e3 * statistics.median(seconds), 3)}


def memcpy_seconds(size: int, iters: int) -> list[float]:
    src = np.empty(size, np.uint8)
    src.fill(1)
    dst = np.empty(size, np.uint8)
    dst.fill(0)
    np.copyto(dst, src)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


async def _run_case(tx: Any, peer: Any, agent: str, case: str, size: int, block_ids_for: Any, iters: int,
                    warmup: int, timeout: float) -> dict[str, Any]:
    transfer, total = [], []
    blocks = 0
    for i in range(warmup + iters):
        key = transfer_key(f"kvbench-{case}-{i}", 0)
        payload = fill_pattern(f"kvbench-{case}-{i}", size, 1)
        ids = peer.reserve(agent, key, size, block_ids_for())
        result = await tx.push(agent, key, ids, payload, timeout=timeout)
        peer.wait(agent, key, timeout=timeout, tokens=size, bytes_per_token=1)  # verify every byte (untimed)
        peer.release(agent, key)
        blocks = result.blocks
        if i >= warmup:
            transfer.append(result.transfer_s)
            total.append(result.total_s)
    wire = _summary(size, transfer)
    return {"blocks": blocks, "verified": warmup + iters, **wire,
            "push_gbps_median": _summary(size, total)["gbps_median"]}


async def bench(size: int, block_size: int, iters: int, warmup: int, timeout: float) -> dict[str, Any]:
    from common.kv.remote import RemoteReceiver
    from common.kv.sender import KvSender

    nblocks = size // block_size
    rng = np.random.default_rng(0)
    tag = f"{os.getpid()}"
    single, many = f"kvbench-single-{tag}", f"kvbench-blocks-{tag}"
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": _machine(),
        "nixl_version": _nixl.version(), "size_bytes": size, "block_bytes": block_size, "iters": iters,
        "warmup": warmup,
    }
    report["memcpy"] = _summary(size, memcpy_seconds(size, iters))
    with RemoteReceiver([(single, 1, size), (many, nblocks, block_size)]) as peer, \
            KvSender(f"kvbench-tx-{tag}", staging_bytes=size) as tx:
        tx.add_peer(peer.info(single))
        tx.add_peer(peer.info(many))
        report["single"] = await _run_case(tx, peer, single, "single", size, lambda: None, iters, warmup, timeout)
        report["blocks"] = await _run_case(tx, peer, many, "blocks", size,
                                           lambda: rng.permutation(nblocks).tolist(), iters, warmup, timeout)
    report["memcpy_again"] = _summary(size, memcpy_seconds(size, iters))  # the machine did not change mid-run
    base = report["memcpy"]["gbps_median"]
    report["ratio_to_memcpy"] = round(report["single"]["gbps_median"] / base, 3)
    report["ratio_to_memcpy_blocks"] = round(report["blocks"]["gbps_median"] / base, 3)
    return report


def _print(r: dict[str, Any]) -> None:
    mib = r["size_bytes"] / 2**20
    print(f"kv-bench {r['date']}  NIXL {r['nixl_version']}  {r['machine']['cpus']} CPUs {r['machine']['cpu_model']}")
    print(f"  memcpy (numpy, in-process) {mib:.0f} MiB: {r['memcpy']['gbps_median']:.2f} GB/s "
          f"({r['memcpy']['ms_median']:.2f} ms); after the run {r['memcpy_again']['gbps_median']:.2f} GB/s")
    for case in ("single", "blocks"):
        c = r[case]
        print(f"  NIXL WRITE {case:6s} {c['blocks']:5d} x {r['size_bytes'] // c['blocks']:>9d} B: "
              f"{c['gbps_median']:.2f} GB/s median ({c['gbps_min']:.2f}-{c['gbps_max']:.2f}), {c['ms_median']:.2f} ms;"
              f" with staging copy {c['push_gbps_median']:.2f} GB/s; {c['verified']} verified")
    print(f"  ratio_to_memcpy {r['ratio_to_memcpy']:.2f} (blocks {r['ratio_to_memcpy_blocks']:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos kv-bench", description=__doc__.split("\n\n")[0] if __doc__ else "",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=int, default=64 << 20, help="bytes per transfer")
    p.add_argument("--block-size", type=int, default=16 << 10, help="block bytes of the many-blocks case")
    p.add_argument("--iters", type=int, default=20, help="timed transfers per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed transfers per case first")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one transfer, seconds")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # child mode (common.kv.remote)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--pool", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--poll-s", type=float, default=0.0002, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        from common.kv.remote import serve_main

        return serve_main(args.control, args.pool, args.poll_s)
    if not args.out:
        p.error("--out FILE.json is required")
    if args.size < 1 or args.block_size < 1 or args.size % args.block_size or args.iters < 1 or args.warmup < 0:
        p.error("--size must be a positive multiple of --block-size; --iters >= 1; --warmup >= 0")
    try:
        _nixl.api()
    except Exception as e:  # noqa: BLE001 - KvUnavailable: print the install hint
        print(f"kv-bench: {e}", file=sys.stderr)
        return 2
    report = asyncio.run(bench(args.size, args.block_size, args.iters, args.warmup, args.timeout))
    _print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
