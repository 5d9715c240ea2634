"""`kairos profile fit-splitwise`: fit a profile to the measured Splitwise step times.

common/data/splitwise/perf_model.csv (MIT, SplitwiseSim) holds, per model, GPU and tensor-parallel
degree, repeated runs of: a prefill of one prompt (128 to 8192 tokens), a prefill of a batch of
512-token prompts (1 to 64 of them), and the mean decode iteration of the run that follows. Each
configuration becomes one observation per kind, the median over its repeats:

- prefill: one step with the chunk (L, 0): T = L tokens, attention L**2/2;
- batched_prefill: one step with B chunks (512, 0): T = 512*B, attention B*512**2/2;
- decode: one decode step of B sequences with mean context L + O/2 (the context grows from the
  prompt L to L + O over the O output tokens, the iteration time is their mean).

Held out of the fit: within each kind, configurations sorted by size, every k-th (`--holdout-every`)
starting from the second, never the smallest or largest (the check is interpolation, not
extrapolation). The fit is `perf_model.fit` on the rest (least squares on relative error,
non-negative), each kind weighted equally; the report is the MAPE per kind on the held-out
observations, stored in the profile's fit_mape as `heldout_<kind>` (and `train_<kind>`).

    kairos profile fit-splitwise --hardware a100-80gb --tp 4 --out common/profiles/a100-llama2-70b-tp4.json
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from common.perf_model import PerfModel, Profile, StepSample, fit, save_profile

DATA = Path(__file__).resolve().parent.parent / "data" / "splitwise" / "perf_model.csv"
KINDS = ("prefill", "batched_prefill", "decode")
GIB = 1024**3


@dataclass(frozen=True)
class Arch:
    """What the KV size and the memory budget need to know about a model."""

    layers: int
    kv_heads: int
    head_dim: int
    params: float  # weights, parameters
    dtype_bytes: int = 2  # fp16, as measured

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class Gpu:
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s, datasheet


ARCHS = {
    "llama2-70b": Arch(layers=80, kv_heads=8, head_dim=128, params=68.98e9),  # GQA: 8 KV heads of 64
    "bloom-176b": Arch(layers=70, kv_heads=112, head_dim=128, params=176.25e9),  # MHA
}
GPUS = {
    "a100-80gb": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=2.039e12),  # A100 SXM4 80GB, HBM2e
    "h100-80gb": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=3.35e12),  # H100 SXM5 80GB, HBM3
    "h100-80gb-pcap": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=3.35e12),  # power-capped H100
}


@dataclass(frozen=True)
class Obs:
    kind: str
    size: int  # the sort key of the hold-out rule
    label: str
    sample: StepSample
    repeats: int


def observations(model: str, hardware: str, tp: int, path: Path = DATA) -> list[Obs]:
    """The medians per configuration, as step samples, sorted by kind and size."""
    prefill: dict[tuple[int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] != model or r["hardware"] != hardware or int(r["tensor_parallel"]) != tp:
                continue
            L, B, O = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
            prefill[(L, B)].append(float(r["prompt_time"]) / 1e3)  # prefill does not depend on O
            decode[(L, B, O)].append(float(r["token_time"]) / 1e3)
    if not prefill:
        raise ConfigError(f"no rows for model {model}, hardware {hardware}, tensor_parallel {tp} in {path}: "
                          f"see its README for the measured combinations")
    out: list[Obs] = []
    for (L, B), v in prefill.items():
        k = "prefill" if B == 1 else "batched_prefill"
        size = L if B == 1 else L * B
        out.append(Obs(k, size, f"{B}x{L}", StepSample(0, 0, [(L, 0)] * B, statistics.median(v)), len(v)))
    for (L, B, O), v in decode.items():
        out.append(Obs("decode", B * (L + O // 2), f"B{B} L{L} O{O}",
                       StepSample(B, B * (L + O // 2), [], statistics.median(v)), len(v)))
    out.sort(key=lambda o: (KINDS.index(o.kind), o.size, o.label))
    return out


def split(obs: Sequence[Obs], every: int) -> tuple[list[Obs], list[Obs]]:
    """(train, held out): per kind, every `every`-th configuration by size from the second,
    never the first or the last."""
    train: list[Obs] = []
    held: list[Obs] = []
    for k in KINDS:
        group = [o for o in obs if o.kind == k]
        for i, o in enumerate(group):
            out = every > 0 and 0 < i < len(group) - 1 and (i - 1) % every == 0
            (held if out else train).append(o)
    return train, held


def kind_mape(model: PerfModel, obs: Sequence[Obs]) -> dict[str, float]:
    res: dict[str, float] = {}
    for k in KINDS:
        errs = [abs(model.step_time(o.sample.batch, o.sample.kv_tokens, o.sample.chunks) - o.sample.seconds)
                / o.sample.seconds for o in obs if o.kind == k]
        if errs:
            res[k] = sum(errs) / len(errs)
    return res


def kv_read_floor(arch: Arch, gpu: Gpu, tp: int) -> float:
    """Seconds per resident KV token a decode step must at least spend reading it from HBM."""
    return arch.kv_bytes_per_token / (tp * gpu.hbm_bandwidth)


def fit_splitwise(model: str, hardware: str, tp: int, *, every: int = 3, kv_read: str = "fit",
                  use_a5: bool = False, path: Path = DATA) -> tuple[PerfModel, dict[str, float], list[Obs], list[Obs]]:
    """Fit on the training configurations; returns the model, fit_mape, train and held-out obs."""
    if model not in ARCHS or hardware not in GPUS:
        raise ConfigError(f"unknown model {model!r} or hardware {hardware!r}: models {sorted(ARCHS)}, "
                          f"hardware {sorted(GPUS)}")
    arch, gpu = ARCHS[model], GPUS[hardware]
    obs = observations(model, hardware, tp, path)
    train, held = split(obs, every)
    counts = {k: sum(o.kind == k for o in train) for k in KINDS}
    weights = [1.0 / counts[o.kind] for o in train]
    floor = kv_read_floor(arch, gpu, tp)
    fixed = {"a2": floor} if kv_read == "hbm" else {}
    m, _ = fit([o.sample for o in train], use_a5=use_a5, fixed=fixed, weights=weights)
    if kv_read == "fit" and m.a2 < floor:  # the data says less than HBM allows: the HBM floor instead
        m, _ = fit([o.sample for o in train], use_a5=use_a5, fixed={"a2": floor}, weights=weights)
    report = {f"heldout_{k}": round(v, 4) for k, v in kind_mape(m, held).items()}
    report |= {f"train_{k}": round(v, 4) for k, v in kind_mape(m, train).items()}
    return m, report, train, held
