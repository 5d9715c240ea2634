"""`kairos kv-bench --memory vram`: NIXL WRITE between two torch CUDA tensors registered as VRAM.

    kairos kv-bench --memory vram [--device 0] [--peer-device 0] [--size BYTES] ... --out FILE.json

Two processes, as a prefill and a decode worker are: this one is the sender, a NIXL agent (UCX
backend, progress thread off) with a source tensor; a child process (`python -m
common.kv.tensor_bench --serve`, driven over its stdin/stdout) is the receiver, an agent with a
pool tensor of `size / block_size` blocks that polls its notifications. Both tensors are
registered with NIXL as themselves (NIXL reads the memory type, VRAM, and the GPU id off each
tensor); the sender loads the receiver's metadata as a remote agent, so each WRITE, followed by
its notification, goes the UCX way a KV hand-off goes (cuda_ipc between processes on one host).
`--peer-device` puts the pool on another GPU (a hand-off between two GPUs of one host). Not yet
run on a GPU; `UCX_PROTO_INFO=y` prints the path UCX took (scripts/gpu-check.sh keeps it).

The cases are those of the host-memory bench (common.kv.bench): single (one descriptor), blocks
(one descriptor per block, scattered over a random permutation of the pool) and
blocks_contiguous (the same blocks in order). Each push writes fresh random bytes into a cleared
pool and is checked on the devices (untimed): a position-weighted checksum of the pool's blocks,
in the order written, must equal the source's. The baseline is a copy of the
same bytes between two tensors of the sender's device (`dst.copy_(src)`, synchronised), timed
just before each push. Transfer = post to DONE on the sender; GB/s = 1e9 bytes/s; medians.

The same code runs on torch CPU tensors (DRAM) with `device=None`: that is how the test suite
checks it on machines without a GPU. Without CUDA, `cuda_problem()` says why in one line.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import common.kv._nixl as _nixl
from common.kv.bench_report import machine, rate_summary
from common.kv.errors import KvCorrupt, KvNixlError, KvTimeout


def cuda_problem(device: int, peer_device: int) -> str:
    """Why `--memory vram` cannot run here (one line), or "" when it can."""
    try:
        import torch
    except ImportError:
        return ("--memory vram needs PyTorch with CUDA in this environment (torch is not installed); "
                "run without --memory vram to measure host memory")
    if not torch.cuda.is_available():
        return (f"--memory vram needs a CUDA GPU, and PyTorch {torch.__version__} sees none "
                "(torch.cuda.is_available() is False); run without --memory vram to measure host memory")
    count = torch.cuda.device_count()
    for d in (device, peer_device):
        if not 0 <= d < count:
            return f"--memory vram: no CUDA device {d} (this host has {count}: 0..{count - 1})"
    return ""


def _descs(addr: int, block_bytes: int, count: int, device_id: int) -> npt.NDArray[np.uint64]:
    """Nx3 (address, length, device id) descriptors of `count` consecutive blocks from `addr`."""
    d = np.zeros((count, 3), dtype=np.uint64)
    d[:, 0] = addr + np.arange(count, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = device_id
    return d


def checksum(torch: Any, data: Any) -> int:
    """A position-weighted sum of `data`'s 32-bit words (uint8, length a multiple of 4), on its
    device: a block written to the wrong place, a stale or a missing block changes it."""
    words = data.contiguous().reshape(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item())


def serve(device: int, size: int, block_size: int) -> int:
    """The receiver process: a NIXL agent with a registered pool tensor, driven over stdin/stdout
    (JSON lines); it polls notifications between requests (the progress thread is off)."""
    import select

    import torch

    dev = "cpu" if device < 0 else f"cuda:{device}"
    if device < 0:
        torch.set_num_threads(1)
    rx = _nixl.make_agent(f"kvbench-vram-rx-{os.getpid()}")
    pool = torch.zeros(size, dtype=torch.uint8, device=dev)
    reg = rx.register_memory(pool)  # VRAM and the GPU id, read off the tensor
    print(json.dumps({"metadata": bytes(rx.get_agent_metadata()).hex(), "addr": pool.data_ptr(),
                      "device_id": max(pool.get_device(), 0)}), flush=True)
    arrived: set[bytes] = set()

    def poll() -> None:
        for msgs in rx.get_new_notifs().values():
            arrived.update(bytes(m) for m in msgs)

    try:
        while True:
            poll()
            if not select.select([sys.stdin], [], [], 0.0002)[0]:
                continue
            line = sys.stdin.readline()
            if not line:
                return 0
            req = json.loads(line)
            if req["op"] == "quit":
                return 0
            if req["op"] == "clear":
                pool.zero_()
                if device >= 0:
                    torch.cuda.synchronize(dev)
                reply: dict[str, Any] = {"ok": True}
            else:  # check: wait for the key's notification, then sum the pool's blocks in `ridx` order
                key, deadline = req["key"].encode(), time.monotonic() + req["timeout"]
                while key not in arrived and time.monotonic() < deadline:
                    poll()
                if key not in arrived:
                    reply = {"arrived": False}
                else:
                    arrived.discard(key)
                    rows = torch.tensor(req["ridx"], device=pool.device)
                    reply = {"arrived": True,
                             "checksum": checksum(torch, pool.view(-1, block_size)[rows] if req["blocks"] else pool)}
            print(json.dumps(reply), flush=True)
    finally:
        rx.deregister_memory(reg)


class _Peer:
    """The receiver process (`python -m common.kv.tensor_bench --serve`) and its control pipe."""

    def __init__(self, device: int | None, size: int, block_size: int, timeout: float) -> None:
        cmd = [sys.executable, "-m", "common.kv.tensor_bench", "--serve", "--device",
               str(-1 if device is None else device), "--size", str(size), "--block-size", str(block_size)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parents[2])
        try:
            self.info = self._read(timeout + 60.0)  # a CUDA context and NIXL agent: seconds
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            what = "did not answer" if code is None else f"exited with {code}"
            raise KvNixlError(f"the receiver process {what} within {timeout:.0f}s (its stderr is above)")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout + 30.0)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class _Pair:
    """The sender (an agent and a registered source tensor, in this process) and the receiver process."""

    def __init__(self, torch: Any, size: int, block_size: int, device: int | None, peer_device: int | None,
                 timeout: float) -> None:
        self.torch = torch
        self.size, self.block_size, self.nblocks = size, block_size, size // block_size
        self.cuda = device is not None
        dev = "cpu" if device is None else f"cuda:{device}"
        self.mem = "VRAM" if self.cuda else "DRAM"
        self.tx = _nixl.make_agent(f"kvbench-vram-tx-{os.getpid()}")
        self.src = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.copy_dst = torch.zeros(size, dtype=torch.uint8, device=dev)  # the baseline's destination
        self.src_reg = self.tx.register_memory(self.src)  # memory type and GPU id from the tensor
        self.peer = _Peer(peer_device, size, block_size, timeout)
        info = self.peer.info
        name = self.tx.add_remote_agent(bytes.fromhex(info["metadata"]))
        self.rx_name = name.decode() if isinstance(name, bytes) else str(name)
        src_id = max(self.src.get_device(), 0)
        addr, rx_id = int(info["addr"]), int(info["device_id"])
        self.local_one = self.tx.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(self.src.data_ptr(), size, 1, src_id),
                                                 self.mem)
        self.remote_one = self.tx.prep_xfer_dlist(self.rx_name, _descs(addr, size, 1, rx_id), self.mem)
        self.local = self.tx.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(self.src.data_ptr(), block_size, self.nblocks, src_id), self.mem)
        self.remote = self.tx.prep_xfer_dlist(self.rx_name, _descs(addr, block_size, self.nblocks, rx_id), self.mem)
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.rng = np.random.default_rng(0)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def copy_seconds(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.copy_dst.copy_(self.src)
        self.sync()
        return time.perf_counter() - t0

    def push(self, case: str, key: str, timeout: float) -> tuple[float, int]:
        """One WRITE of fresh random bytes; returns (post-to-DONE seconds, descriptors) after checking."""
        self.src.random_(0, 256, generator=self.gen)
        self.sync()
        self.peer.call({"op": "clear"}, timeout)  # nothing of an earlier push can pass the check
        if case == "single":
            local, remote, lidx, ridx = self.local_one, self.remote_one, [0], [0]
        else:
            local, remote, lidx = self.local, self.remote, list(range(self.nblocks))
            ridx = self.rng.permutation(self.nblocks).tolist() if case == "blocks" else lidx
        handle = self.tx.make_prepped_xfer("WRITE", local, lidx, remote, ridx, key.encode())
        try:
            deadline = time.monotonic() + timeout
            t0 = time.perf_counter()
            state = self.tx.transfer(handle)
            while state == "PROC":
                state = self.tx.check_xfer_state(handle)
                if time.monotonic() > deadline:
                    raise KvTimeout(f"{key}: WRITE of {self.size} bytes not DONE within {timeout:.1f}s")
            seconds = time.perf_counter() - t0
            if state != "DONE":
                raise KvNixlError(f"{key}: WRITE ended in state {state}")
        finally:
            self.tx.release_xfer_handle(handle)
        got = self.peer.call({"op": "check", "key": key, "timeout": timeout, "ridx": ridx, "blocks": case != "single"},
                             timeout)
        if not got["arrived"]:
            raise KvTimeout(f"{key}: the receiver saw no notification within {timeout:.1f}s of the WRITE")
        if got["checksum"] != checksum(self.torch, self.src):  # pool block ridx[i] = source block i
            raise KvCorrupt(f"{key}: the receiver's bytes differ from the source after the WRITE")
        return seconds, len(lidx)

    def close(self) -> None:
        for dl in (self.local_one, self.remote_one, self.local, self.remote):
            self.tx.release_dlist_handle(dl)
        self.tx.remove_remote_agent(self.rx_name)
        self.tx.deregister_memory(self.src_reg)
        self.peer.close()


def bench(size: int, block_size: int, iters: int, warmup: int, timeout: float, device: int | None = 0,
          peer_device: int | None = None) -> dict[str, Any]:
    """The report of `kv-bench --memory vram` (device None: torch CPU tensors, DRAM, for tests)."""
    import torch

    if size % block_size or block_size % 4:
        raise ValueError(f"size ({size}) must be a multiple of block_size ({block_size}), itself a multiple of 4")
    if device is None:
        torch.set_num_threads(1)  # idle OpenMP threads spinning beside UCX skew the CPU baseline tenfold
    dev = "cpu" if device is None else f"cuda:{device}"
    peer = dev if peer_device is None or device is None else f"cuda:{peer_device}"
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
        "nixl_version": _nixl.version(), "torch": torch.__version__, "memory": "VRAM" if device is not None else "DRAM",
        "device": dev, "peer_device": peer,
        "device_name": torch.cuda.get_device_name(device) if device is not None else "cpu",
        "size_bytes": size, "block_bytes": block_size, "iters": iters, "warmup": warmup,
        "agents": "sender in this process, receiver in a child process; NIXL agents over UCX; tensors registered as "
                  "themselves",
    }
    pair = _Pair(torch, size, block_size, device, device if peer_device is None else peer_device, timeout)
    try:
        for case in ("single", "blocks", "blocks_contiguous"):
            wire, copies, blocks = [], [], 0
            for i in range(warmup + iters):
                copy_s = pair.copy_seconds()
                seconds, blocks = pair.push(case, f"kvbench-{case}-{i}", timeout)
                if i >= warmup:
                    wire.append(seconds)
                    copies.append(copy_s)
            w, c = rate_summary(size, wire), rate_summary(size, copies)
            report[case] = {"blocks": blocks, "verified": warmup + iters, **w, "memcpy_gbps_median": c["gbps_median"],
                            "ratio_to_memcpy": round(w["gbps_median"] / c["gbps_median"], 3)}
    finally:
        pair.close()
    report["memcpy_gbps_median"] = report["single"]["memcpy_gbps_median"]
    report["ratio_to_memcpy"] = report["single"]["ratio_to_memcpy"]
    report["ratio_to_memcpy_blocks"] = report["blocks"]["ratio_to_memcpy"]
    report["ratio_to_memcpy_blocks_contiguous"] = report["blocks_contiguous"]["ratio_to_memcpy"]
    return report


def print_report(r: dict[str, Any]) -> None:
    print(f"kv-bench {r['date']}  NIXL {r['nixl_version']}  {r['memory']} {r['device']} -> {r['peer_device']} "
          f"({r['device_name']}), torch {r['torch']}")
    for case in ("single", "blocks", "blocks_contiguous"):
        c = r[case]
        print(f"  NIXL WRITE {case:17s} {c['blocks']:5d} x {r['size_bytes'] // c['blocks']:>9d} B: "
              f"{c['gbps_median']:.2f} GB/s median ({c['gbps_min']:.2f}-{c['gbps_max']:.2f}), {c['ms_median']:.2f} ms;"
              f" device copy {c['memcpy_gbps_median']:.2f} GB/s; ratio {c['ratio_to_memcpy']:.2f}; "
              f"{c['verified']} verified")


def main(argv: list[str] | None = None) -> int:
    """`--serve`: the receiver process (the parent runs `kairos kv-bench --memory vram`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m common.kv.tensor_bench")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--device", type=int, required=True, help="CUDA device, -1 for CPU tensors")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    args = p.parse_args(argv)
    return serve(args.device, args.size, args.block_size)


if __name__ == "__main__":
    sys.exit(main())
