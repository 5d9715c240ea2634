"""`kairos kv-bench`: NIXL WRITE throughput between two processes on loopback, against memcpy.

    kairos kv-bench [--size BYTES] [--block-size BYTES] [--iters N] [--warmup N] --out FILE.json
    kairos kv-bench --memory vram [--device N] [--peer-device N] ...   (GPU memory: common.kv.tensor_bench)
    python -m common.kv.bench ...                     (the same; `--serve` is the child's mode)

Host memory (the default, `--memory dram`):

The parent is the sender (KvSender); a child process runs the receivers (KvReceiver, see
common.kv.remote). Two cases, each `warmup` + `iters` pushes of `size` bytes:

- single: one block of `size` bytes (one descriptor);
- blocks: `size / block_size` blocks written to a random permutation of the receiver's blocks
  (prepared descriptor lists; destinations scattered, as in a fragmented KV pool);
- blocks_contiguous: the same blocks where the receiver's allocator puts them (one run, in
  order: the usual case), still one descriptor per block.

Every push is verified in the child against the deterministic pattern (untimed). Throughput is
size / transfer time, transfer = post to DONE on the sender (PushResult.transfer_s); `push`
throughput also counts the copy of the payload into the sender's registered staging memory.
`ratio_to_memcpy` is the single-buffer median over the median of an in-process numpy copy of the
same bytes, one copy timed just before each push (so both see the same machine load).
GB/s = 1e9 bytes/s. Medians, with min and max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

import common.kv._nixl as _nixl
from common import logging as klog
from common.kv.bench_report import machine, rate_summary
from common.kv.pattern import fill_pattern
from common.kv.receiver import transfer_key


class Memcpy:
    """The baseline: an in-process numpy copy of `size` bytes between two pre-touched buffers."""

    def __init__(self, size: int) -> None:
        self.src = np.empty(size, np.uint8)
        self.src.fill(1)
        self.dst = np.empty(size, np.uint8)
        self.dst.fill(0)

    def seconds(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


async def _run_case(tx: Any, peer: Any, agent: str, case: str, size: int, block_ids_for: Any, iters: int,
                    warmup: int, timeout: float, memcpy: Memcpy) -> dict[str, Any]:
    """warmup + iters pushes; each timed one is paired with a memcpy timed just before it."""
    transfer, total, copies = [], [], []
    blocks = 0
    for i in range(warmup + iters):
        key = transfer_key(f"kvbench-{case}-{i}", 0)
        payload = fill_pattern(f"kvbench-{case}-{i}", size, 1)
        ids = peer.reserve(agent, key, size, block_ids_for())
        copy_s = memcpy.seconds()
        result = await tx.push(agent, key, ids, payload, timeout=timeout)
        peer.wait(agent, key, timeout=timeout, tokens=size, bytes_per_token=1)  # verify every byte (untimed)
        peer.release(agent, key)
        blocks = result.blocks
        if i >= warmup:
            transfer.append(result.transfer_s)
            total.append(result.total_s)
            copies.append(copy_s)
    wire = rate_summary(size, transfer)
    base = rate_summary(size, copies)
    return {"blocks": blocks, "verified": warmup + iters, **wire,
            "push_gbps_median": rate_summary(size, total)["gbps_median"], "memcpy_gbps_median": base["gbps_median"],
            "ratio_to_memcpy": round(wire["gbps_median"] / base["gbps_median"], 3)}


async def bench(size: int, block_size: int, iters: int, warmup: int, timeout: float) -> dict[str, Any]:
    from common.kv.remote import RemoteReceiver
    from common.kv.sender import KvSender

    nblocks = size // block_size
    rng = np.random.default_rng(0)
    tag = f"{os.getpid()}"
    single, many = f"kvbench-single-{tag}", f"kvbench-blocks-{tag}"
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
        "nixl_version": _nixl.version(), "size_bytes": size, "block_bytes": block_size, "iters": iters,
        "warmup": warmup,
    }
    memcpy = Memcpy(size)
    with RemoteReceiver([(single, 1, size), (many, nblocks, block_size)]) as peer, \
            KvSender(f"kvbench-tx-{tag}", staging_bytes=size) as tx:
        tx.add_peer(peer.info(single))
        tx.add_peer(peer.info(many))
        report["single"] = await _run_case(tx, peer, single, "single", size, lambda: None, iters, warmup, timeout,
                                           memcpy)
        report["blocks"] = await _run_case(tx, peer, many, "blocks", size, lambda: rng.permutation(nblocks).tolist(),
                                           iters, warmup, timeout, memcpy)
        report["blocks_contiguous"] = await _run_case(tx, peer, many, "contig", size, lambda: None, iters, warmup,
                                                      timeout, memcpy)
    report["memcpy_gbps_median"] = report["single"]["memcpy_gbps_median"]
    report["ratio_to_memcpy"] = report["single"]["ratio_to_memcpy"]
    report["ratio_to_memcpy_blocks"] = report["blocks"]["ratio_to_memcpy"]
    report["ratio_to_memcpy_blocks_contiguous"] = report["blocks_contiguous"]["ratio_to_memcpy"]
    return report


def _print(r: dict[str, Any]) -> None:
    m = r["machine"]
    print(f"kv-bench {r['date']}  NIXL {r['nixl_version']}  {m['cpus']} CPUs {m['cpu_model']}  {m['mem_gib']} GiB")
    for case in ("single", "blocks", "blocks_contiguous"):
        c = r[case]
        print(f"  NIXL WRITE {case:17s} {c['blocks']:5d} x {r['size_bytes'] // c['blocks']:>9d} B: "
              f"{c['gbps_median']:.2f} GB/s median ({c['gbps_min']:.2f}-{c['gbps_max']:.2f}), {c['ms_median']:.2f} ms;"
              f" with staging copy {c['push_gbps_median']:.2f} GB/s; memcpy {c['memcpy_gbps_median']:.2f} GB/s;"
              f" ratio {c['ratio_to_memcpy']:.2f}; {c['verified']} verified")
    print(f"  ratio_to_memcpy {r['ratio_to_memcpy']:.2f} (blocks {r['ratio_to_memcpy_blocks']:.2f}, contiguous "
          f"blocks {r['ratio_to_memcpy_blocks_contiguous']:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos kv-bench", description=__doc__.split("\n\n")[0] if __doc__ else "",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=int, default=64 << 20, help="bytes per transfer")
    p.add_argument("--block-size", type=int, default=16 << 10, help="block bytes of the many-blocks case")
    p.add_argument("--iters", type=int, default=20, help="timed transfers per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed transfers per case first")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one transfer, seconds")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--memory", choices=("dram", "vram"), default="dram",
                   help="dram: host memory between two processes; vram: torch CUDA tensors registered as VRAM")
    p.add_argument("--device", type=int, default=0, help="--memory vram: the sender's CUDA device")
    p.add_argument("--peer-device", type=int, default=None,
                   help="--memory vram: the receiver's CUDA device (None: the sender's)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # child mode (common.kv.remote)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--pool", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--poll-s", type=float, default=0.0002, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    klog.configure("kv-bench", level="warning")
    if args.serve:
        from common.kv.remote import serve_main

        return serve_main(args.control, args.pool, args.poll_s)
    if not args.out:
        p.error("--out FILE.json is required")
    if args.size < 1 or args.block_size < 1 or args.size % args.block_size or args.iters < 1 or args.warmup < 0:
        p.error("--size must be a positive multiple of --block-size; --iters >= 1; --warmup >= 0")
    if args.memory == "vram":
        from common.kv import tensor_bench

        peer = args.device if args.peer_device is None else args.peer_device
        if problem := tensor_bench.cuda_problem(args.device, peer):
            print(f"kv-bench: {problem}", file=sys.stderr)
            return 2
    try:
        _nixl.api()
    except Exception as e:
        print(f"kv-bench: {e}", file=sys.stderr)
        return 2
    if args.memory == "vram":
        report = tensor_bench.bench(args.size, args.block_size, args.iters, args.warmup, args.timeout,
                                    device=args.device, peer_device=peer)
        tensor_bench.print_report(report)
    else:
        report = asyncio.run(bench(args.size, args.block_size, args.iters, args.warmup, args.timeout))
        _print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
