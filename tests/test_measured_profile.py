"""A worker's own profile (common/engines/measured.py), measured on the simulated engine: the
short sweep, the store by keys, the lock, and `kairos up`'s and the worker config's defaults.
The vLLM tier measures a real engine (tests/vllm/test_measured_profile.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from common.config import WorkerConfig
from common.engines import measured
from common.engines.sim import SimEngine
from common.perf_model import load_profile

KEYS = {"model": "tiny@0123456789ab", "device": "cpu:test", "tensor_parallel_size": "1",
        "pipeline_parallel_size": "1", "dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto",
        "vllm": "0.32.0"}


def _engine() -> SimEngine:
    # steps of 1-3 ms: the sweep takes well under a second
    return SimEngine("decode", load_profile("a100-dsv2-lite"), time_scale=0.05)


async def _measure_twice(store: Path) -> tuple[tuple[object, bool], tuple[object, bool], int]:
    engine = _engine()
    run = asyncio.create_task(engine.run())
    try:
        first = await measured.profile_for(engine, store, KEYS)
        steps = engine.batcher.steps
        second = await measured.profile_for(engine, store, KEYS)
        return first, second, engine.batcher.steps - steps
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


def test_no_stored_profile_measures_stores_then_loads(tmp_path: Path) -> None:
    (prof, was_measured), (again, again_measured), steps_after = asyncio.run(_measure_twice(tmp_path))
    assert was_measured and not again_measured and steps_after == 0  # the second start measures nothing
    path = measured.stored_path(tmp_path, KEYS)
    stored = load_profile(str(path))
    assert stored == prof == again and stored.keys == KEYS
    assert {"all", "decode_only", "prefill_only", "mixed"} <= set(stored.fit_mape)
    # a fit of the sweep's steps (its accuracy on a quiet clock: tests/vllm/test_profile.py's sim sweep)
    assert "engine steps of the short sweep" in stored.derivation and stored.model.step_time(8, 4096, []) > 0
    # another set of keys (another dtype) has no profile yet; a file whose keys differ is not used
    other = {**KEYS, "dtype": "bfloat16"}
    assert measured.stored_path(tmp_path, other) != path and measured.load_stored(tmp_path, other) is None
    measured.stored_path(tmp_path, other).write_bytes(path.read_bytes())
    assert measured.load_stored(tmp_path, other) is None


def test_keys_and_sweep_shape(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    cfg = SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16", quantization=None),
                          parallel_config=SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=2),
                          cache_config=SimpleNamespace(cache_dtype="fp8"))
    keys = measured.keys_of(cfg, model=str(tmp_path), device="cuda:NVIDIA H100 80GB HBM3", vllm_version="0.32.0")
    assert keys["model"].startswith(tmp_path.name + "@") and keys["dtype"] == "bfloat16"
    assert keys["tensor_parallel_size"] == "4" and keys["pipeline_parallel_size"] == "2"
    assert keys["quantization"] == "none" and keys["kv_cache_dtype"] == "fp8" and tuple(keys) == measured.KEY_NAMES
    moved = tmp_path / "elsewhere" / tmp_path.name
    moved.mkdir(parents=True)
    (moved / "config.json").write_text('{"vocab_size": 1000}')
    assert measured.model_key(str(moved)) == keys["model"]  # the same model under another path
    assert measured.model_key("meta-llama/Llama-2-70b-hf") == "meta-llama/Llama-2-70b-hf"
    shape = measured.SweepShape(token_budget=256, max_batch=16, max_model_len=2048)
    assert max(shape.chunks) + max(shape.batches) <= 256 and max(shape.contexts) <= 2048 // 4


def test_vllm_workers_measure_by_default(tmp_path: Path) -> None:
    from kairos.up import ClusterSpec, parse_args

    assert WorkerConfig().vllm_profile == measured.MEASURED
    assert ClusterSpec().vllm_profile == measured.MEASURED
    assert parse_args(["--engine", "vllm", "--model", str(tmp_path)]).vllm_profile == measured.MEASURED
    a = parse_args(["--engine", "vllm", "--model", str(tmp_path), "--vllm-profile", "cpu-tiny-llama"])
    assert a.vllm_profile == "cpu-tiny-llama"
