"""The performance model: step time of one engine iteration, and KV-transfer time.

    t_step = a0 + a1*B + a2*K + sum_i [ a3*chi_i + a4*chi_i*(k_i + chi_i/2) + a5*chi_i**2 ]
    t_xfer(L) = t0 + L * kv_bytes_per_token / bandwidth

B: decode tokens in the step (one per running decode); K: their resident KV tokens (attention
reads); chi_i: the prefill chunk of request i in the step; k_i: that request's tokens already
prefilled (the chunk attends over them). a5 refines the form of docs/reference/paper.md section 6: the
paper's Figure 1 shows the added step time flat up to 512 tokens and > 200 ms at 2048, a
superlinearity (MoE expert GEMMs turning compute-bound) that a4 alone can only fit by making
attention over long contexts far too expensive. Profiles that do not need it leave a5 = 0.

Everything here is pure: the live engine, the simulator and the router's policy call it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import msgspec
import numpy as np

from common.errors import ConfigError
from common.messages import Coeffs

PROFILE_DIR = Path(__file__).with_name("profiles")


class PerfModel(msgspec.Struct, frozen=True, kw_only=True):
    a0: float
    a1: float = 0.0
    a2: float = 0.0
    a3: float = 0.0
    a4: float = 0.0
    a5: float = 0.0
    xfer_t0: float = 0.0
    xfer_bandwidth: float = 1e10
    kv_bytes_per_token: int = 0

    # -- step times -------------------------------------------------------------------------
    def chunk_cost(self, chi: int, k: int) -> float:
        """Added time of a prefill chunk of `chi` tokens over `k` already-prefilled tokens."""
        return self.a3 * chi + self.a4 * chi * (k + chi / 2.0) + self.a5 * chi * chi

    def decode_time(self, batch: int, kv_tokens: int) -> float:
        """A step with only decodes (the baseline TBT of a decode worker)."""
        return self.a0 + self.a1 * batch + self.a2 * kv_tokens

    def step_time(self, batch: int, kv_tokens: int, chunks: Iterable[tuple[int, int]] = ()) -> float:
        t = self.a0 + self.a1 * batch + self.a2 * kv_tokens
        for chi, k in chunks:
            t += self.a3 * chi + self.a4 * chi * (k + chi / 2.0) + self.a5 * chi * chi
        return t

    def prefill_exec(self, prompt_tokens: int, chunk: int, done: int = 0) -> float:
        """Exec of Equation 1: a prompt prefilled alone in chunks of `chunk` tokens."""
        t = 0.0
        while done < prompt_tokens:
            chi = min(chunk, prompt_tokens - done)
            t += self.a0 + self.chunk_cost(chi, done)
            done += chi
        return t

    def queue_wait(self, queued_tokens: int, chunk: int) -> float:
        """W_q of Equation 1: (sum_l / chi) * T_step(chi, sum_l / 2), fractional step count."""
        if queued_tokens <= 0:
            return 0.0
        return (queued_tokens / chunk) * (self.a0 + self.chunk_cost(chunk, int(queued_tokens / 2)))

    def xfer_time(self, tokens: int) -> float:
        return self.xfer_t0 + tokens * self.kv_bytes_per_token / self.xfer_bandwidth

    # -- wire form ----------------------------------------------------------------------------
    def to_coeffs(self) -> Coeffs:
        return Coeffs(a0=self.a0, a1=self.a1, a2=self.a2, a3=self.a3, a4=self.a4, a5=self.a5,
                      xfer_t0=self.xfer_t0, xfer_bandwidth=self.xfer_bandwidth,
                      kv_bytes_per_token=self.kv_bytes_per_token)

    @classmethod
    def from_coeffs(cls, c: Coeffs) -> PerfModel:
        return cls(a0=c.a0, a1=c.a1, a2=c.a2, a3=c.a3, a4=c.a4, a5=c.a5, xfer_t0=c.xfer_t0,
                   xfer_bandwidth=c.xfer_bandwidth, kv_bytes_per_token=c.kv_bytes_per_token)

    def scaled(self, factor: float) -> PerfModel:
        """Every step-time coefficient times `factor` (a faster or slower device)."""
        return msgspec.structs.replace(
            self, a0=self.a0 * factor, a1=self.a1 * factor, a2=self.a2 * factor,
            a3=self.a3 * factor, a4=self.a4 * factor, a5=self.a5 * factor)


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A named, fitted device+model profile with the engine limits it was measured under."""

    name: str
    description: str
    derivation: str
    model: PerfModel
    prefill_token_budget: int = 2048
    decode_token_budget: int = 2304
    decode_default_chunk: int = 512
    kv_capacity_tokens: int = 1_000_000
    max_batch: int = 256
    fit_mape: dict[str, float] = {}


def profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    cand = PROFILE_DIR / f"{name_or_path}.json"
    if cand.exists():
        return cand
    known = ", ".join(sorted(x.stem for x in PROFILE_DIR.glob("*.json")))
    raise ConfigError(f"unknown profile {name_or_path!r}: give a profile name ({known}) or a .json path")


def load_profile(name_or_path: str) -> Profile:
    path = profile_path(name_or_path)
    try:
        return msgspec.json.decode(path.read_bytes(), type=Profile)
    except msgspec.DecodeError as e:
        raise ConfigError(f"profile {path} is not valid: {e}") from e


def save_profile(profile: Profile, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def list_profiles() -> list[str]:
    _ = resources  # profiles ship as package data next to this module
    return sorted(x.stem for x in PROFILE_DIR.glob("*.json"))


# ------------------------------------------------------------------------------ fitting


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    """One measured engine step: decode batch, their KV tokens, prefill chunks (chi, k), seconds."""

    batch: int
    kv_tokens: int
    chunks: list[tuple[int, int]]
    seconds: float


def features(s: StepSample) -> list[float]:
    chi_sum = float(sum(c for c, _ in s.chunks))
    attn = float(sum(c * (k + c / 2.0) for c, k in s.chunks))
    sq = float(sum(c * c for c, _ in s.chunks))
    return [1.0, float(s.batch), float(s.kv_tokens), chi_sum, attn, sq]


def fit(samples: Sequence[StepSample], *, use_a5: bool = True,
        base: PerfModel | None = None) -> tuple[PerfModel, float]:
    """Least-squares fit on relative error; returns the model and its MAPE over the samples.

    Coefficients are constrained to be non-negative (a negative cost would let the policy
    believe that a larger chunk is cheaper) by refitting without the offending columns.
    """
    if len(samples) < 6:
        raise ValueError(f"need at least 6 step samples to fit, got {len(samples)}")
    X = np.array([features(s) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("step samples must have positive durations")
    cols = [0, 1, 2, 3, 4, 5] if use_a5 else [0, 1, 2, 3, 4]
    # drop columns that are constant zero in the data (e.g. no decodes in a prefill-only sweep)
    cols = [c for c in cols if c == 0 or np.any(X[:, c] != 0)]
    coef = np.zeros(6)
    while True:
        W = X[:, cols] / y[:, None]
        sol, *_ = np.linalg.lstsq(W, np.ones_like(y), rcond=None)
        neg = [c for c, v in zip(cols, sol, strict=True) if v < 0 and c != 0]
        if not neg:
            coef[:] = 0
            coef[cols] = sol
            break
        cols = [c for c in cols if c not in neg]
    pred = X @ coef
    mape = float(np.mean(np.abs(pred - y) / y))
    b = base or PerfModel(a0=0.0)
    model = PerfModel(a0=float(max(coef[0], 0.0)), a1=float(coef[1]), a2=float(coef[2]), a3=float(coef[3]),
                      a4=float(coef[4]), a5=float(coef[5]), xfer_t0=b.xfer_t0,
                      xfer_bandwidth=b.xfer_bandwidth, kv_bytes_per_token=b.kv_bytes_per_token)
    return model, mape


def mape(model: PerfModel, samples: Sequence[StepSample]) -> float:
    if not samples:
        return 0.0
    errs = [abs(model.step_time(s.batch, s.kv_tokens, s.chunks) - s.seconds) / s.seconds for s in samples]
    return float(sum(errs) / len(errs))


def dumps_samples(samples: Sequence[StepSample]) -> str:
    return json.dumps([[s.batch, s.kv_tokens, s.chunks, s.seconds] for s in samples])
