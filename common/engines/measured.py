"""A vLLM worker's own step-time profile: measured on its engine at first start, stored by its keys.

A real engine's step times depend on the model, the device, the parallelism, the dtype and the
quantization; a profile named for another set-up (h100-llama2-70b-tp4 on a CPU worker) would
make every decision on wrong times. So a vLLM worker started with `vllm_profile = measured` (the
default) looks in its profile store (`profile_store`, default $XDG_CACHE_HOME/kairos/profiles)
for the profile of its keys (KEY_NAMES, read off the started engine's own vllm_config); when
there is none it measures one: a short sweep of step times on the engine itself, the sweep
`kairos profile` runs (common/engines/sweep.py) with fewer points (SHORT_SWEEP, about 150 steps,
seconds on the vLLM CPU tier's tiny model), fitted the same way (robust_fit), and stores it in
the store with its keys inside the file. The worker reports it to the routers (Hello and
heartbeat `coeffs`), which predict that worker with it, and keeps refitting it online as before.

Two workers of the same keys starting together (a prefill and a decode worker on one host)
measure once: the store's lock file for those keys is held while measuring, and the second
loads what the first stored.

The KV handoff terms (xfer_t0, xfer_bandwidth) need a second engine and are not measured here:
they keep PerfModel's defaults, with kv_bytes_per_token from the model's config.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import platform
import random
import re
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from common.engines.sweep import kv_bytes_per_token, mape_table, robust_fit, sweep
from common.errors import ConfigError
from common.perf_model import PerfModel, Profile, StepSample, load_profile, mape, save_profile

_log = structlog.get_logger()

MEASURED = "measured"  # vllm_profile's value for "this engine's own, measured"
KEY_NAMES = ("model", "device", "tensor_parallel_size", "pipeline_parallel_size", "dtype", "quantization",
             "kv_cache_dtype", "vllm")


def default_store() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kairos" / "profiles"


def model_key(model: str) -> str:
    """A model directory by its name and the hash of its config.json (the same weights found
    under another path are the same model); a model name as vLLM resolves it, as given."""
    cfg = Path(model) / "config.json"
    if cfg.is_file():
        return f"{Path(model).resolve().name}@{hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]}"
    return model


def keys_of(vllm_config: Any, *, model: str, device: str, vllm_version: str) -> dict[str, str]:
    """The keys a measured profile is stored under, from the started engine's vllm_config."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    return {"model": model_key(model), "device": device,
            "tensor_parallel_size": str(pc.tensor_parallel_size),
            "pipeline_parallel_size": str(pc.pipeline_parallel_size),
            "dtype": str(mc.dtype).removeprefix("torch."), "quantization": str(mc.quantization or "none"),
            "kv_cache_dtype": str(cc.cache_dtype), "vllm": vllm_version}


def device_name(platform_device: str) -> str:
    """The accelerator's name (all of this host's of that kind are taken as the same), or the CPU's."""
    if platform_device == "cuda":
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform_device}:{cpu}"


def stored_path(store: Path, keys: Mapping[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(dict(keys), sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", keys.get("model", "model").split("@")[0])[:48]
    return store / f"{slug}-{digest}.json"


def load_stored(store: Path, keys: Mapping[str, str]) -> Profile | None:
    """The stored profile of these keys, or None (none stored, or one whose keys differ)."""
    path = stored_path(store, keys)
    if not path.exists():
        return None
    prof = load_profile(str(path))
    if dict(prof.keys) != dict(keys):  # a hash collision, or a file edited by hand: measure anew
        _log.warning("profile_keys_differ", path=str(path), stored=prof.keys, engine=dict(keys))
        return None
    return prof


class SweepShape:
    """The short sweep's points, scaled to the engine's limits (chunks within its token budget,
    contexts within its context window, batches within its batch size)."""

    def __init__(self, token_budget: int, max_batch: int, max_model_len: int) -> None:
        self.batches = tuple(sorted({0, 2, min(8, max_batch - 1)}))
        room = token_budget - self.batches[-1]
        self.chunks = tuple(sorted({max(8, room // 8), max(16, room // 2)}))
        self.contexts = tuple(sorted({32, max(64, min(512, max_model_len // 4))}))
        self.chunks_per_prompt = 2
        self.decode_steps = 6


async def measure(engine: Any, *, name: str, keys: Mapping[str, str], trim: float = 0.25) -> Profile:
    """Run the short sweep on a started VllmEngine (either role) and fit its profile."""
    shape = SweepShape(engine.token_budget, engine.max_batch, engine.max_model_len or 2048)
    config = Path(getattr(engine, "model_dir", "")) / "config.json"  # the simulated engine has none
    vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else 1000
    t0 = time.monotonic()
    saved_cb, saved_samples = engine.on_tokens, engine.samples
    engine.samples = deque()  # unbounded while measuring (sweep slices it by index)
    engine.measuring = True   # a prefill engine takes the sweep's in-place requests too
    try:
        samples = await sweep(engine, lambda: engine.samples, contexts=shape.contexts, batches=shape.batches,
                              chunks=shape.chunks, chunks_per_prompt=shape.chunks_per_prompt,
                              decode_steps=shape.decode_steps, vocab=vocab,
                              tag=f"m{random.getrandbits(32):x}-")
    finally:
        engine.measuring = False
        engine.on_tokens = saved_cb
        engine.samples = saved_samples
    samples = [s for s in samples if s.seconds > 0]
    dtype_bytes = 2 if keys.get("dtype") in ("float16", "bfloat16") else 1 if "8" in keys.get("kv_cache_dtype", "") \
        else 4
    try:
        per_token = kv_bytes_per_token(str(config.parent), dtype_bytes)
    except (OSError, KeyError, ValueError):
        per_token = PerfModel(a0=0.0).kv_bytes_per_token
    model, kept = robust_fit(samples, trim=trim, use_a5=True, base=PerfModel(a0=0.0, kv_bytes_per_token=per_token))
    table = mape_table(model, kept, shape.chunks)
    table["all_steps_untrimmed"] = round(mape(model, samples), 4)
    seconds = time.monotonic() - t0
    derivation = (
        f"Measured by the {engine.role} worker's engine at its first start (common/engines/measured.py) on "
        f"{keys.get('device')}: {len(samples)} engine steps of the short sweep (background prompts of "
        f"{list(shape.contexts)} tokens, decode batches {list(shape.batches)}, scheduled chunks "
        f"{list(shape.chunks)}, {shape.chunks_per_prompt} per deflected prompt) in {seconds:.1f} s; step time = "
        f"the scheduler's wall time from schedule() to update_from_output(). Fitted by profile.robust_fit "
        f"({len(kept)} of {len(samples)} steps kept). KV handoff terms not measured (PerfModel defaults).")
    return Profile(name=name, description=f"measured on this engine: {', '.join(f'{k}={v}' for k, v in keys.items())}",
                   derivation=derivation, model=model, prefill_token_budget=engine.token_budget,
                   decode_token_budget=engine.token_budget, decode_default_chunk=max(shape.chunks),
                   kv_capacity_tokens=engine.kv_capacity_tokens, max_batch=engine.max_batch, fit_mape=table,
                   keys=dict(keys))


async def profile_for(engine: Any, store: Path, keys: Mapping[str, str]) -> tuple[Profile, bool]:
    """The stored profile of `keys`, else one measured on `engine` now and stored; (profile, measured)."""
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"profile store {store} cannot be made: {e.strerror}", key="profile_store",
                          fix="set KAIROS_PROFILE_STORE to a writable directory, or KAIROS_VLLM_PROFILE to a "
                              "profile name or .json path") from e
    path = stored_path(store, keys)
    found = load_stored(store, keys)
    if found is not None:
        return found, False
    lock = open(path.with_suffix(".lock"), "a+")
    try:
        # another worker of the same keys may be measuring: wait for it (in a thread: the loop runs on)
        await asyncio.to_thread(fcntl.flock, lock.fileno(), fcntl.LOCK_EX)
        found = load_stored(store, keys)
        if found is not None:
            return found, False
        _log.info("profile_measuring", path=str(path), keys=dict(keys),
                  detail="no stored profile for this engine's keys: measuring a short sweep of step times")
        prof = await measure(engine, name=path.stem, keys=keys)
        tmp = path.with_suffix(".tmp")
        save_profile(prof, tmp)
        tmp.replace(path)
        return prof, True
    finally:
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        lock.close()


def step_samples_error(model: PerfModel, samples: list[StepSample]) -> float:
    """Median relative error of `model` over measured steps (|predicted - measured| / measured)."""
    errs = sorted(abs(model.step_time(s.batch, s.kv_tokens, s.chunks) - s.seconds) / s.seconds
                  for s in samples if s.seconds > 0)
    return errs[len(errs) // 2] if errs else float("nan")
