"""The step sweep that measures an engine, and the fit made robust to a shared machine.

What `kairos profile` (common/engines/profile.py) and a worker's first-start measurement
(common/engines/measured.py) share; see profile.py's docstring for what the sweep does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.engines.base import Engine, EngineRequest
from common.messages import KvHandle, Sampling, TokenItem
from common.perf_model import PerfModel, StepSample, fit, mape


class _Tracker:
    """Which requests finished, and when each produced its first token."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.finished: set[str] = set()
        self.failed: list[str] = []
        self.event = asyncio.Event()

    def on_tokens(self, items: list[TokenItem], step_s: float) -> None:
        now = time.monotonic()
        for it in items:
            if it.token_ids:
                self.first.setdefault(it.request_id, now)
            if it.finish_reason is not None:
                self.finished.add(it.request_id)
                if it.finish_reason == "error":
                    self.failed.append(it.request_id)
        self.event.set()

    async def until(self, cond: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.failed:
                raise RuntimeError(f"profile requests failed in the engine: {self.failed}")
            self.event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("profile sweep: the engine stopped making progress")
            try:
                await asyncio.wait_for(self.event.wait(), min(left, 1.0))
            except TimeoutError:
                pass


def _req(rid: str, prompt: list[int], max_tokens: int, *, schedule: tuple[int, ...] = (),
         mode: str = "deflect", kv: KvHandle | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, attempt=0, prompt_token_ids=prompt, mode=mode,  # type: ignore[arg-type]
                         sampling=Sampling(max_tokens=max_tokens, ignore_eos=True), chunk_schedule=schedule, kv=kv)


async def sweep(engine: Engine, samples_of: Any, *, contexts: Sequence[int], batches: Sequence[int],
                chunks: Sequence[int], chunks_per_prompt: int, decode_steps: int, vocab: int,
                tag: str = "", progress: Any = None) -> list[StepSample]:
    """Run the sweep on a started decode-role engine whose step loop runs; returns the samples."""
    rng = random.Random(tag)
    track = _Tracker()
    engine.on_tokens = track.on_tokens
    start = len(samples_of())
    n = 0
    for ctx in contexts:
        for batch in batches:
            for chi in chunks:
                n += 1
                point = f"{tag}c{ctx}-b{batch}-x{chi}"
                bg = [f"{point}-bg{i}" for i in range(batch)]
                for rid in bg:
                    engine.add(_req(rid, [rng.randrange(3, vocab) for _ in range(ctx)],
                                    chunks_per_prompt + decode_steps + 2))
                await track.until(lambda: all(r in track.first for r in bg))  # noqa: B023
                rid = f"{point}-deflect"
                engine.add(_req(rid, [rng.randrange(3, vocab) for _ in range(chi * chunks_per_prompt)], 1,
                                schedule=(chi,) * chunks_per_prompt))
                await track.until(lambda: rid in track.finished and all(r in track.finished for r in bg))  # noqa: B023
                if progress is not None:
                    progress(n, point)
    return list(samples_of())[start:]


def kind(s: StepSample) -> str:
    if s.batch and s.chunks:
        return "mixed"
    return "decode_only" if s.batch else "prefill_only"


def mape_table(model: PerfModel, samples: Sequence[StepSample], chunk_sizes: Sequence[int] = ()) -> dict[str, float]:
    """MAPE over all steps, per kind of step (which model terms are active) and per scheduled chunk size."""
    out = {"all": mape(model, samples)}
    for k in ("decode_only", "prefill_only", "mixed"):
        sub = [s for s in samples if kind(s) == k]
        if sub:
            out[k] = mape(model, sub)
    for c in chunk_sizes:
        sub = [s for s in samples if kind(s) == "mixed" and any(chi == c for chi, _ in s.chunks)]
        if sub:
            out[f"mixed_chunk_{c}"] = mape(model, sub)
    return {k: round(v, 4) for k, v in out.items()}


def robust_fit(samples: Sequence[StepSample], *, trim: float, use_a5: bool, base: PerfModel,
               rounds: int = 8, floor: float = 0.05) -> tuple[PerfModel, list[StepSample]]:
    """`perf_model.fit` made robust to the two kinds of step that are not the engine's.

    1. Steps shorter than `floor` x the median step: the simulated engine sleeps to absolute
       deadlines, so a step after an overslept one returns almost at once (microseconds);
       relative-error least squares would weight such a step a thousand times over.
    2. Steps more than `trim` slower than the current fit: on a shared machine another process
       can only make a step slower, never faster. They are dropped and the model refitted until
       the kept set stops changing; a round that would leave less than two thirds of the steps
       is not taken (the fit is then too poor to judge by). The result models the engine on a
       quiet machine.
    trim <= 0 skips 2.
    """
    median = float(np.median([s.seconds for s in samples]))
    kept = [s for s in samples if s.seconds >= floor * median]
    total = len(kept)
    model, _ = fit(kept, use_a5=use_a5, base=base)
    if trim <= 0:
        return model, kept
    for _ in range(rounds):
        new = [s for s in kept if s.seconds <= (1 + trim) * model.step_time(s.batch, s.kv_tokens, s.chunks)]
        if len(new) == len(kept) or len(new) < max(6, (2 * total) // 3):
            break
        kept = new
        model, _ = fit(kept, use_a5=use_a5, base=base)
    return model, kept


def lower_envelope(samples: Sequence[StepSample]) -> list[StepSample]:
    """One sample per distinct step shape (batch, KV tokens, chunks), the fastest of its repeats:
    contention only adds time, so the minimum over repeated identical steps is the engine's."""
    best: dict[tuple[int, int, tuple[tuple[int, int], ...]], StepSample] = {}
    for s in samples:
        key = (s.batch, s.kv_tokens, tuple((c, k) for c, k in s.chunks))
        if key not in best or s.seconds < best[key].seconds:
            best[key] = s
    return list(best.values())



def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 4) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return int(cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes)
