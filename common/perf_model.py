"""The performance model: step time of one engine iteration, and KV-transfer time.

One engine step runs every token scheduled in it through the model's weights once. Its time is

    t_step = a0 + a6*[P]                                     fixed cost (+ a step with prefill)
           + a3*T + a7*max(0, T - knee) + a5*T**2            weight GEMMs over the step's total
           + a1*B + a2*K                                     decodes: per sequence, KV reads
           + a4 * sum_i chi_i*(k_i + chi_i/2)                prefill attention, per request
    T = B + sum_i chi_i                                      the step's TOTAL tokens
    t_xfer(L) = xfer_t0 + L * kv_bytes_per_token / xfer_bandwidth

- a0: the fixed cost of every step (launches, the tensor-parallel all-reduce latencies,
  scheduling, and reading the weights once: what a one-token step costs).
- a6: added once when the step holds any prefill chunk ([P] = 1). The measured engines run a
  prefill step about 20 ms slower than a decode step of a few tokens (decode-only steps replay
  captured CUDA graphs; prefill steps launch eagerly).
- a3, a7, knee, a5: the weight GEMMs over the step's TOTAL tokens T, decode tokens and chunk
  tokens alike. A roofline: below `knee` tokens a step is bound by reading the weights and an
  extra token costs a3; above it the GEMMs are compute-bound and a token costs a3 + a7. Any
  superlinearity belongs here, to T (a5*T**2 for the paper-figure profile), never to a request's
  chunk alone.
- a1: per running decode, what a decode sequence costs beyond its token's GEMM share (sampling,
  per-sequence attention-kernel work). a2: per resident KV token the decodes read (K: the KV
  tokens of the step's decodes).
- a4: prefill attention: chunk chi_i of request i attends over its k_i tokens already prefilled
  and, causally, over itself: chi_i*(k_i + chi_i/2) query-key pairs. Summed over the chunks of
  a prompt of L tokens this is L**2/2 however the prompt is chunked.

A mixed step (prefill chunks beside decodes) is composed additively: ONE fixed cost a0 + a6, the
GEMM terms over the sum of all its tokens (B decode tokens + every chunk's tokens), the decodes'
own terms (a1*B, a2*K) and each chunk's attention over its own context. Nothing is charged per
chunk except its attention. On an idle worker a prompt cut into N equal chunks costs
N*(a0 + a6) + a3*L + a7*max(0, L - N*knee)-ish + a4*L**2/2: more chunks add (a0 + a6) each and
save at most a7*knee each, so with a0 + a6 >= a7*knee (which the fitter enforces) and a5 = 0,
splitting into more equal chunks is never faster. (A schedule that ends in a tiny remainder can
be slower than a balanced one with smaller chunks, as on the real GPU: that last step pays the
fixed cost for a few tokens.)

Everything here is pure: the live engine, the simulator and the router's policy call it. The
form, the fitted profiles and their held-out error: docs/cost-model.md.
Profiles written before this form (no "model_form": 2) charged a1 per decode alone and a3, a5
per chunk token; `load_profile` converts them (a1 -> a1 - a3, a5 moves to T; a6 = a7 = 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from common.errors import ConfigError
from common.messages import Coeffs

PROFILE_DIR = Path(__file__).with_name("profiles")
MODEL_FORM = 2  # the step-time form above; profiles without "model_form" are form 1 (converted on load)


class PerfModel(msgspec.Struct, frozen=True, kw_only=True):
    a0: float
    a1: float = 0.0
    a2: float = 0.0
    a3: float = 0.0
    a4: float = 0.0
    a5: float = 0.0
    a6: float = 0.0
    a7: float = 0.0
    knee: float = 0.0
    xfer_t0: float = 0.0
    xfer_bandwidth: float = 1e10
    kv_bytes_per_token: int = 0

    # -- step times -------------------------------------------------------------------------
    def _gemm(self, total: float) -> float:
        """The step-total GEMM terms for `total` tokens."""
        over = total - self.knee
        return self.a3 * total + (self.a7 * over if over > 0 else 0.0) + self.a5 * total * total

    def chunk_cost(self, chi: int, k: int, batch: int = 0) -> float:
        """Added time of a prefill chunk of `chi` tokens over `k` already-prefilled tokens, in a
        step that also runs `batch` other tokens (decodes; the GEMM terms grow with the step's
        total) and no other chunk (it pays the prefill step's a6)."""
        return self.a6 + self._gemm(batch + chi) - self._gemm(batch) + self.a4 * chi * (k + chi / 2.0)

    def decode_time(self, batch: int, kv_tokens: int) -> float:
        """A step with only decodes (the baseline TBT of a decode worker)."""
        return self.a0 + self.a1 * batch + self.a2 * kv_tokens + self._gemm(batch)

    def step_time(self, batch: int, kv_tokens: int, chunks: Iterable[tuple[int, int]] = ()) -> float:
        """One mixed step: `batch` decodes reading `kv_tokens` resident KV tokens, plus prefill
        chunks given as (chi, k) pairs (chunk tokens, that request's tokens already prefilled)."""
        total = batch
        attn = 0.0
        fixed = self.a0
        for chi, k in chunks:
            total += chi
            attn += chi * (k + chi / 2.0)
            fixed = self.a0 + self.a6
        return fixed + self.a1 * batch + self.a2 * kv_tokens + self._gemm(total) + self.a4 * attn

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
        return Coeffs(a0=self.a0, a1=self.a1, a2=self.a2, a3=self.a3, a4=self.a4, a5=self.a5, a6=self.a6,
                      a7=self.a7, knee=self.knee, xfer_t0=self.xfer_t0, xfer_bandwidth=self.xfer_bandwidth,
                      kv_bytes_per_token=self.kv_bytes_per_token)

    @classmethod
    def from_coeffs(cls, c: Coeffs) -> PerfModel:
        return cls(a0=c.a0, a1=c.a1, a2=c.a2, a3=c.a3, a4=c.a4, a5=c.a5, a6=c.a6, a7=c.a7, knee=c.knee,
                   xfer_t0=c.xfer_t0,
                   xfer_bandwidth=c.xfer_bandwidth, kv_bytes_per_token=c.kv_bytes_per_token)

    def scaled(self, factor: float) -> PerfModel:
        """Every step-time coefficient times `factor` (a faster or slower device)."""
        return msgspec.structs.replace(
            self, a0=self.a0 * factor, a1=self.a1 * factor, a2=self.a2 * factor,
            a3=self.a3 * factor, a4=self.a4 * factor, a5=self.a5 * factor, a6=self.a6 * factor,
            a7=self.a7 * factor)

    def slowed(self, factor: float) -> PerfModel:
        """Every modeled time times `factor`: each step (`scaled`) and the KV transfer (its fixed
        cost and its time per byte). The simulated engine's `time_scale` and `kairos sim
        --time-scale`: the same device run `factor` times slower, not a slower GPU on the same link."""
        return msgspec.structs.replace(self.scaled(factor), xfer_t0=self.xfer_t0 * factor,
                                       xfer_bandwidth=self.xfer_bandwidth / factor)


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A named, fitted device+model profile with the engine limits it was measured under."""

    name: str
    description: str
    derivation: str
    model: PerfModel
    model_form: int = MODEL_FORM
    prefill_token_budget: int = 2048
    decode_token_budget: int = 2304
    decode_default_chunk: int = 512
    kv_capacity_tokens: int = 1_000_000
    max_batch: int = 256
    fit_mape: dict[str, float] = {}
    # a profile measured on a worker's engine (common/engines/measured.py): what it was measured on
    keys: dict[str, str] = {}


def profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    cand = PROFILE_DIR / f"{name_or_path}.json"
    if cand.exists():
        return cand
    known = ", ".join(sorted(x.stem for x in PROFILE_DIR.glob("*.json")))
    raise ConfigError(f"unknown profile {name_or_path!r}: give a profile name ({known}) or a .json path")


def convert_form1(model: dict[str, Any]) -> dict[str, Any]:
    """Coefficients of the first form (a1 per decode, a3 and a5 per chunk token) in this one.

    a3 now applies to every token of the step, decodes included, so a decode's own term is
    a1 - a3 (exact; clamped at 0, which adds at most a3 per decode). a5 moves from each chunk's
    chi**2 to the step total's T**2: the same for a step with one chunk and no decodes, and for
    a mixed step larger by a5*2*B*chi (and by the cross terms of several chunks)."""
    out = dict(model)
    out["a1"] = max(0.0, float(model.get("a1", 0.0)) - float(model.get("a3", 0.0)))
    return out


def load_profile(name_or_path: str) -> Profile:
    path = profile_path(name_or_path)
    try:
        raw = json.loads(path.read_bytes())
        if isinstance(raw, dict) and "model_form" not in raw and isinstance(raw.get("model"), dict):
            raw = {**raw, "model": convert_form1(raw["model"]), "model_form": MODEL_FORM}
        prof = msgspec.convert(raw, type=Profile)
    except (ValueError, msgspec.ValidationError) as e:
        raise ConfigError(f"profile {path} is not valid: {e}") from e
    if prof.model_form != MODEL_FORM:
        raise ConfigError(f"profile {path} has model_form {prof.model_form}; this Kairos reads form {MODEL_FORM} "
                          f"(or files without model_form): refit it with `kairos profile`")
    return prof


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


COEFF_NAMES = ("a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7")


def features(s: StepSample, knee: float = 0.0) -> list[float]:
    """The step's value of each term, in COEFF_NAMES order: t = features . (a0..a7)."""
    total = float(s.batch + sum(c for c, _ in s.chunks))
    attn = float(sum(c * (k + c / 2.0) for c, k in s.chunks))
    return [1.0, float(s.batch), float(s.kv_tokens), total, attn, total * total, 1.0 if s.chunks else 0.0,
            max(0.0, total - knee)]


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = A.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    scale = float(np.abs(A).max()) * float(np.abs(b).max()) if A.size and b.size else 1.0
    tol = 1e-10 * max(scale, 1e-300)
    for _ in range(3 * n + 3):
        w = A.T @ (b - A @ x)
        free = ~passive
        if not free.any() or w[free].max() <= tol:
            break
        passive[int(np.argmax(np.where(free, w, -np.inf)))] = True
        for _ in range(3 * n + 3):
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            bad = passive & (s <= 0) & (x > s)
            alpha = float(np.min(x[bad] / (x[bad] - s[bad]))) if bad.any() else 0.0
            x = x + alpha * (s - x)
            passive &= x > 0
        x = s
    return x


def fit(samples: Sequence[StepSample], *, use_a5: bool = True, base: PerfModel | None = None,
        fixed: dict[str, float] | None = None, weights: Sequence[float] | None = None,
        knee: float | None = None) -> tuple[PerfModel, float]:
    """Least-squares fit on relative error; returns the model and its MAPE over the samples.

    Coefficients are constrained to be non-negative (a negative cost would let the policy
    believe that a larger chunk is cheaper). `fixed` pins coefficients by name (e.g. a2 from the
    HBM bandwidth when the data cannot identify it); `weights` weighs each sample's error.
    `knee` (default: the base model's) is where the roofline term a7 starts; 0 leaves a7 out.
    The transfer terms come from `base`.
    """
    if len(samples) < 6:
        raise ValueError(f"need at least 6 step samples to fit, got {len(samples)}")
    b = base or PerfModel(a0=0.0)
    kn = b.knee if knee is None else knee
    X = np.array([features(s, kn) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("step samples must have positive durations")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    pinned = dict(fixed or {})
    if not use_a5:
        pinned.setdefault("a5", 0.0)
    if kn <= 0:
        pinned.setdefault("a7", 0.0)
    coef = np.zeros(len(COEFF_NAMES))
    for name, v in pinned.items():
        coef[COEFF_NAMES.index(name)] = v
    # free columns: not pinned, and not constant zero in the data (e.g. no decodes in a prefill sweep)
    cols = [i for i, nm in enumerate(COEFF_NAMES) if nm not in pinned and (i == 0 or np.any(X[:, i] != 0))]
    rest = y - X @ coef
    # columns scaled to unit norm so that the solver's tolerance is not dominated by T**2
    A = X[:, cols] * (w / y)[:, None]
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    sol = nnls(A / norms, rest * w / y) / norms
    coef[cols] = sol
    pred = X @ coef
    err = float(np.mean(np.abs(pred - y) / y))
    model = PerfModel(**{nm: float(coef[i]) for i, nm in enumerate(COEFF_NAMES)}, knee=kn, xfer_t0=b.xfer_t0,
                      xfer_bandwidth=b.xfer_bandwidth, kv_bytes_per_token=b.kv_bytes_per_token)
    return model, err


def mape(model: PerfModel, samples: Sequence[StepSample]) -> float:
    if not samples:
        return 0.0
    errs = [abs(model.step_time(s.batch, s.kv_tokens, s.chunks) - s.seconds) / s.seconds for s in samples]
    return float(sum(errs) / len(errs))


def dumps_samples(samples: Sequence[StepSample]) -> str:
    return json.dumps([[s.batch, s.kv_tokens, s.chunks, s.seconds] for s in samples])
