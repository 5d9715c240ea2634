"""`kairos kv-bench --memory vram` (common.kv.tensor_bench) without a GPU.

The VRAM path registers torch tensors with NIXL; the same code runs on CPU tensors (DRAM) here,
so everything but the CUDA allocation is exercised: the receiver process, registration from
tensors, a remote agent, single / scattered / in-order block WRITEs, notifications, checksums. The CLI's
refusal without CUDA is checked too. Lives in the vLLM tier: that venv has PyTorch and NIXL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch", reason="the tensor bench needs PyTorch (the vLLM tier's venv has it)")


def test_tensor_bench_moves_and_verifies_every_case_on_cpu_tensors() -> None:
    from common.kv import _nixl, tensor_bench

    if not _nixl.available():
        pytest.skip("NIXL is not importable in this venv")
    size, block = 256 << 10, 16 << 10
    r = tensor_bench.bench(size, block, iters=2, warmup=1, timeout=30.0, device=None)
    assert r["memory"] == "DRAM" and r["device"] == r["peer_device"] == "cpu"
    assert r["single"]["blocks"] == 1
    assert r["blocks"]["blocks"] == r["blocks_contiguous"]["blocks"] == size // block
    for case in ("single", "blocks", "blocks_contiguous"):
        c = r[case]
        assert c["verified"] == 3 and 0 < c["gbps_min"] <= c["gbps_median"] <= c["gbps_max"]
        assert c["memcpy_gbps_median"] > 0 and c["ratio_to_memcpy"] > 0


def test_tensor_bench_fails_when_the_receiver_holds_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check compares: a source checksum the receiver's bytes cannot match is KvCorrupt.
    (The passing test cannot pass without the bytes arriving: the pool is cleared before each
    WRITE and the source is fresh random bytes.)"""
    from common.kv import _nixl, tensor_bench
    from common.kv.errors import KvCorrupt

    if not _nixl.available():
        pytest.skip("NIXL is not importable in this venv")
    real = tensor_bench.checksum
    monkeypatch.setattr(tensor_bench, "checksum", lambda t, data: real(t, data) + 1)  # the parent's side only
    with pytest.raises(KvCorrupt, match="differ"):
        tensor_bench.bench(64 << 10, 16 << 10, iters=1, warmup=0, timeout=30.0, device=None)


def test_checksum_sees_a_moved_block() -> None:
    from common.kv.tensor_bench import checksum

    data = torch.randint(0, 256, (4 * 1024,), dtype=torch.uint8)
    swapped = data.view(4, 1024)[torch.tensor([1, 0, 2, 3])].reshape(-1)
    assert checksum(torch, data) == checksum(torch, data.clone())
    assert checksum(torch, data) != checksum(torch, swapped)


def test_vram_mode_refuses_without_cuda_in_one_line(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the VRAM bench would run")
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, "-m", "common.kv.bench", "--memory", "vram", "--out", str(out)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.count("\n") == 1 and "needs a CUDA GPU" in r.stderr and "torch.cuda.is_available()" in r.stderr
