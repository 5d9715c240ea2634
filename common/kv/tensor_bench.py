"""`kairos kv-bench --memory vram`: NIXL WRITE between two torch CUDA tensors registered as VRAM.

    kairos kv-bench --memory vram [--device 0] [--peer-device 0] [--size BYTES] ... --out FILE.json

Two NIXL agents (UCX backend, progress thread off) in one process: the sender owns a source
tensor, the receiver a pool tensor of `size / block_size` blocks, both registered with NIXL from
the tensors themselves (NIXL reads the memory type, VRAM, and the GPU id off each tensor). The
sender loads the receiver's metadata as a remote agent, so the WRITE goes through UCX as it does
between a prefill and a decode worker (cuda_ipc on one host); a notification follows each WRITE.
`--peer-device` puts the pool on another GPU (a hand-off between two GPUs of one host). Not yet
run on a GPU: two agents in one process may not take the UCX path (cuda_ipc) that a prefill and a
decode process would; `UCX_PROTO_INFO=y` prints the path taken (scripts/gpu-check.sh keeps it).

The cases are those of the host-memory bench (common.kv.bench): single (one descriptor), blocks
(one descriptor per block, scattered over a random permutation of the pool) and
blocks_contiguous (the same blocks in order). Each push writes fresh random bytes and is checked
on the device (untimed): the pool's blocks must equal the source. The baseline is a copy of the
same bytes between two tensors of the sender's device (`dst.copy_(src)`, synchronised), timed
just before each push. Transfer = post to DONE on the sender; GB/s = 1e9 bytes/s; medians.

The same code runs on torch CPU tensors (DRAM) with `device=None`: that is how the test suite
checks it on machines without a GPU. Without CUDA, `cuda_problem()` says why in one line.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt

from common.kv import _nixl
from common.kv.bench import _machine, _summary
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


def _descs(tensor: Any, block_bytes: int, count: int) -> npt.NDArray[np.uint64]:
    """Nx3 (address, length, device id) descriptors of `count` consecutive blocks of `tensor`."""
    d = np.zeros((count, 3), dtype=np.uint64)
    d[:, 0] = tensor.data_ptr() + np.arange(count, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = max(tensor.get_device(), 0)
    return d


class _Pair:
    """A sender and a receiver agent, their registered tensors and prepared block lists."""

    def __init__(self, torch: Any, size: int, block_size: int, device: str, peer_device: str) -> None:
        self.torch = torch
        self.size, self.block_size, self.nblocks = size, block_size, size // block_size
        self.cuda = device.startswith("cuda")
        self.tx = _nixl.make_agent(f"kvbench-vram-tx-{time.monotonic_ns()}")
        self.rx = _nixl.make_agent(f"kvbench-vram-rx-{time.monotonic_ns()}")
        self.src = torch.zeros(size, dtype=torch.uint8, device=device)
        self.pool = torch.zeros(size, dtype=torch.uint8, device=peer_device)
        self.copy_dst = torch.zeros(size, dtype=torch.uint8, device=device)  # the baseline's destination
        self.mem = "VRAM" if self.cuda else "DRAM"
        self.src_reg = self.tx.register_memory(self.src)  # memory type and GPU id from the tensor
        self.pool_reg = self.rx.register_memory(self.pool)
        name = self.tx.add_remote_agent(self.rx.get_agent_metadata())
        self.rx_name = name.decode() if isinstance(name, bytes) else str(name)
        self.local_one = self.tx.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(self.src, size, 1), self.mem)
        self.remote_one = self.tx.prep_xfer_dlist(self.rx_name, _descs(self.pool, size, 1), self.mem)
        self.local = self.tx.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(self.src, block_size, self.nblocks), self.mem)
        self.remote = self.tx.prep_xfer_dlist(self.rx_name, _descs(self.pool, block_size, self.nblocks), self.mem)
        self.gen = torch.Generator(device=device).manual_seed(0)
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

    def push(self, case: str, key: bytes, timeout: float) -> tuple[float, int]:
        """One WRITE of fresh random bytes; returns (post-to-DONE seconds, descriptors) after checking."""
        torch = self.torch
        self.src.random_(0, 256, generator=self.gen)
        self.pool.zero_()
        self.sync()
        if case == "single":
            local, remote, lidx, ridx = self.local_one, self.remote_one, [0], [0]
        else:
            local, remote, lidx = self.local, self.remote, list(range(self.nblocks))
            ridx = self.rng.permutation(self.nblocks).tolist() if case == "blocks" else lidx
        handle = self.tx.make_prepped_xfer("WRITE", local, lidx, remote, ridx, key)
        try:
            deadline = time.monotonic() + timeout
            t0 = time.perf_counter()
            state = self.tx.transfer(handle)
            notes: dict[str, list[bytes]] = {}
            while state == "PROC":  # both agents in this process: drive the receiver's progress too
                for src, msgs in self.rx.get_new_notifs().items():
                    notes.setdefault(src, []).extend(msgs)
                state = self.tx.check_xfer_state(handle)
                if time.monotonic() > deadline:
                    raise KvTimeout(f"{key.decode()}: WRITE of {self.size} bytes not DONE within {timeout:.1f}s")
            seconds = time.perf_counter() - t0
            if state != "DONE":
                raise KvNixlError(f"{key.decode()}: WRITE ended in state {state}")
            while not any(key in m for m in notes.values()):
                if time.monotonic() > deadline:
                    raise KvTimeout(f"{key.decode()}: no notification within {timeout:.1f}s of the WRITE")
                for src, msgs in self.rx.get_new_notifs().items():
                    notes.setdefault(src, []).extend(msgs)
        finally:
            self.tx.release_xfer_handle(handle)
        self.sync()
        got, want = self.pool, self.src
        if case != "single":  # block ridx[i] of the pool holds block lidx[i] of the source
            got = self.pool.view(self.nblocks, self.block_size)[torch.tensor(ridx, device=self.pool.device)]
            want = self.src.view(self.nblocks, self.block_size)[torch.tensor(lidx, device=self.src.device)]
        if not torch.equal(got.to(self.src.device), want):
            raise KvCorrupt(f"{key.decode()}: the pool's bytes differ from the source after the WRITE")
        return seconds, len(lidx)

    def close(self) -> None:
        for dl in (self.local_one, self.remote_one, self.local, self.remote):
            self.tx.release_dlist_handle(dl)
        self.tx.remove_remote_agent(self.rx_name)
        self.tx.deregister_memory(self.src_reg)
        self.rx.deregister_memory(self.pool_reg)


def bench(size: int, block_size: int, iters: int, warmup: int, timeout: float, device: int | None = 0,
          peer_device: int | None = None) -> dict[str, Any]:
    """The report of `kv-bench --memory vram` (device None: torch CPU tensors, DRAM, for tests)."""
    import torch

    if device is None:
        torch.set_num_threads(1)  # idle OpenMP threads spinning beside UCX skew the CPU baseline tenfold
    dev = "cpu" if device is None else f"cuda:{device}"
    peer = dev if peer_device is None or device is None else f"cuda:{peer_device}"
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": _machine(),
        "nixl_version": _nixl.version(), "torch": torch.__version__, "memory": "VRAM" if device is not None else "DRAM",
        "device": dev, "peer_device": peer,
        "device_name": torch.cuda.get_device_name(device) if device is not None else "cpu",
        "size_bytes": size, "block_bytes": block_size, "iters": iters, "warmup": warmup,
        "agents": "two NIXL agents (UCX) in one process; torch tensors registered from the tensors",
    }
    pair = _Pair(torch, size, block_size, dev, peer)
    try:
        for case in ("single", "blocks", "blocks_contiguous"):
            wire, copies, blocks = [], [], 0
            for i in range(warmup + iters):
                copy_s = pair.copy_seconds()
                seconds, blocks = pair.push(case, f"kvbench-{case}-{i}".encode(), timeout)
                if i >= warmup:
                    wire.append(seconds)
                    copies.append(copy_s)
            w, c = _summary(size, wire), _summary(size, copies)
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
