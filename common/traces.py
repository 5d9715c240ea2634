"""Request traces: the Azure LLM inference CSVs, JSON lines, and synthetic generators.

A trace is a list of `TraceRequest` sorted by arrival time `t` (seconds from the start of the
trace or of the selected slice). The simulator replays one; the load generator sends one.

Formats read by `load_trace`:
    Azure CSV    `TIMESTAMP,ContextTokens,GeneratedTokens`, absolute timestamps such as
                 `2023-11-16 18:17:03.9799600` (up to 7 fractional digits, some rows fewer),
                 or plain seconds. Times are re-based on the first row.
    JSON lines   one object per line with `timestamp` (milliseconds from start),
                 `input_length` and `output_length`, and optionally `hash_ids`: one integer per
                 block of the prompt (`--hash-block-tokens` tokens, 512 by default; the last may
                 be partial), equal ids meaning equal content, as public production traces
                 publish them (common/sessions.py writes such traces). Other fields are ignored.

`synthetic` draws lognormal prompt and output lengths (clipped to [1, max]) and arrivals from
a Gamma renewal process (DistServe's shape = 1/cv^2), a Poisson process, or the on/off MMPP
that reproduces the code trace's bursts (docs/reference/workloads.md, section 3).
Everything is deterministic given the seed.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from datetime import date
from pathlib import Path

import msgspec
import numpy as np

from common.errors import ConfigError

TRACE_FILES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}

# Lognormal fits of ln(length) to the Azure 2023 traces (docs/reference/workloads.md, section 1),
# with the traces' maxima as clip limits.
LENGTHS = {
    "code": {"prompt_mu": 6.999, "prompt_sigma": 1.360, "output_mu": 2.788, "output_sigma": 0.847,
             "max_prompt": 7437, "max_output": 1899},
    "conv": {"prompt_mu": 6.633, "prompt_sigma": 0.985, "output_mu": 5.019, "output_sigma": 0.859,
             "max_prompt": 14050, "max_output": 1000},
    # Long context (not fitted to a trace): prompts of 4k to 32k tokens, median 9k (lognormal,
    # sigma 0.6, clipped), conv-like outputs; document QA and code-repository prompts.
    "long": {"prompt_mu": 9.105, "prompt_sigma": 0.6, "output_mu": 5.019, "output_sigma": 0.859,
             "min_prompt": 4096, "max_prompt": 32768, "max_output": 1000},
}

# The code trace's on/off structure (gaps > 5 s count as OFF): OFF lognormal with median 25.1 s
# and mean 43.2 s, capped at 220 s; ON lognormal with median 15.5 s and mean 16.7 s.
_OFF_MEDIAN, _OFF_MEAN, _OFF_CAP = 25.1, 43.2, 220.0
_ON_MEDIAN, _ON_MEAN = 15.5, 16.7


class TraceRequest(msgspec.Struct, frozen=True):
    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()  # per prompt block content ids (empty: no shared prefix known)


# ------------------------------------------------------------------------------ locating


DATA_DIR = Path(__file__).with_name("data") / "traces"


def trace_path(name: str, *, data_dir: str | Path | None = None) -> Path:
    """Resolve "code" / "conv" to the Azure CSV shipped with the package (common/data/traces,
    or `data_dir`); any other name must be an existing file path."""
    if name in TRACE_FILES:
        base = Path(data_dir) if data_dir is not None else DATA_DIR
        path = base / TRACE_FILES[name]
        if not path.is_file():
            raise ConfigError(f"trace {name!r} not found at {path}: this installation lacks the trace data "
                              f"(reinstall the package, or give the CSV's path with --trace)")
        return path
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"trace file {name!r} not found (give a path, or one of: {', '.join(TRACE_FILES)})")
    return path


# ------------------------------------------------------------------------------ loading


_day_cache: dict[str, int] = {}


def _parse_timestamp(text: str) -> tuple[int, float]:
    """(whole seconds, fraction) of an Azure timestamp or of plain seconds; split so that the
    100 ns resolution survives the subtraction of the first row."""
    text = text.strip()
    if " " not in text and "T" not in text:
        v = float(text)
        if not math.isfinite(v):
            raise ValueError(f"timestamp {text!r} is not finite")
        whole = math.floor(v)
        return whole, v - whole
    day, _, clock = text.replace("T", " ").partition(" ")
    days = _day_cache.get(day)
    if days is None:
        days = date.fromisoformat(day).toordinal()
        _day_cache[day] = days
    clock = clock.rstrip("Z")
    hh, mm, ss = clock.split(":")
    sec, _, frac = ss.partition(".")
    if not (hh.isdigit() and mm.isdigit() and sec.isdigit()) or (frac and not frac.isdigit()):
        raise ValueError(f"bad timestamp {text!r}")
    h, m, s = int(hh), int(mm), int(sec)
    if h > 23 or m > 59 or s > 60:
        raise ValueError(f"bad timestamp {text!r}")
    return days * 86400 + h * 3600 + m * 60 + s, float("0." + frac) if frac else 0.0


def _length(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, str):
        value = value.strip()
        if not value.isdigit():
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
        n = int(value)
    elif isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    else:
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n


Row = tuple[float, int, int, tuple[int, ...]]


def _read_csv(path: Path, lines: list[str]) -> list[Row]:
    header = [h.strip() for h in lines[0].split(",")]
    need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    missing = [h for h in need if h not in header]
    if missing:
        raise ConfigError(f"{path}:1: CSV header {lines[0].strip()!r} lacks {', '.join(missing)} "
                          f"(expected {','.join(need)})")
    it, ii, io = (header.index(h) for h in need)
    width = len(header)
    rows: list[tuple[int, float, int, int]] = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cols = line.split(",")
        if len(cols) != width:
            raise ConfigError(f"{path}:{n}: expected {width} columns, got {len(cols)}: {line.strip()!r}")
        try:
            whole, frac = _parse_timestamp(cols[it])
            rows.append((whole, frac, _length(cols[ii], "ContextTokens"), _length(cols[io], "GeneratedTokens")))
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: {e}") from None
    if not rows:
        return []
    w0, f0 = min((w, f) for w, f, _, _ in rows)
    return [((w - w0) + (f - f0), i, o, ()) for w, f, i, o in rows]


def _hash_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
        raise ValueError(f"hash_ids must be a list of integers, got {str(value)[:60]!r}")
    return tuple(value)


def _read_jsonl(path: Path, lines: list[str]) -> list[Row]:
    rows: list[Row] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{n}: expected a JSON object")
        try:
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise ValueError(f"missing field {key!r}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
                raise ValueError(f"timestamp must be a non-negative number of milliseconds, got {ts!r}")
            rows.append((ts / 1000.0, _length(obj["input_length"], "input_length"),
                         _length(obj["output_length"], "output_length"),
                         _hash_ids(obj["hash_ids"]) if obj.get("hash_ids") is not None else ()))
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: {e}") from None
    return rows


def load_trace(path: str | Path, *, start: float = 0.0, duration: float | None = None,
               rate_scale: float = 1.0) -> list[TraceRequest]:
    """Read a trace file (Azure CSV or JSON lines, told apart by content), keep the requests with
    start <= t < start + duration (trace time, before scaling), re-base on `start` and divide the
    times by `rate_scale` (2 = twice the request rate)."""
    if rate_scale <= 0 or not math.isfinite(rate_scale):
        raise ConfigError(f"rate_scale must be a positive number, got {rate_scale}")
    if start < 0:
        raise ConfigError(f"start must be >= 0, got {start}")
    if duration is not None and duration <= 0:
        raise ConfigError(f"duration must be positive, got {duration}")
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"trace file {p} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read trace file {p}: {e}") from None
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if not first:
        raise ConfigError(f"trace file {p} is empty")
    rows = _read_jsonl(p, lines) if first.lstrip().startswith("{") else _read_csv(p, lines)
    rows.sort(key=lambda r: r[0])
    end = math.inf if duration is None else start + duration
    return [TraceRequest(t=(t - start) / rate_scale, input_length=i, output_length=o, hash_ids=h)
            for t, i, o, h in rows if start <= t < end]


# ------------------------------------------------------------------------------ synthetic


def _lognormal_sigma(median: float, mean: float) -> float:
    return math.sqrt(2.0 * math.log(mean / median))


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ lognormal(mu, sigma)."""
    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2.0) * phi(z - sigma) + cap * (1.0 - phi(z))


def _gamma_gaps(rng: np.random.Generator, rate: float, cv: float, n: int) -> np.ndarray:
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def _renewal(rng: np.random.Generator, rate: float, cv: float, horizon: float, *, poisson: bool) -> np.ndarray:
    """Arrival times in [0, horizon) of a Gamma (or Poisson) renewal process."""
    out: list[np.ndarray] = []
    t0 = 0.0
    batch = max(16, int(rate * horizon * 1.2) + 16)
    while True:
        gaps = rng.exponential(1.0 / rate, size=batch) if poisson else _gamma_gaps(rng, rate, cv, batch)
        times = t0 + np.cumsum(gaps)
        out.append(times[times < horizon])
        if times[-1] >= horizon:
            break
        t0 = float(times[-1])
    return np.concatenate(out)


def _onoff(rng: np.random.Generator, rate: float, cv: float, duration: float) -> np.ndarray:
    """Code-like bursts: alternate ON (lognormal, median 15.5 s, mean 16.7 s) and OFF (lognormal,
    median 25.1 s, mean 43.2 s, capped at 220 s) periods, starting ON; inside ON periods a Gamma
    renewal process with the given CV, at the rate that makes the long-run mean `rate`. The
    renewal runs on the concatenated ON time, so bursts do not lose arrivals at their edges."""
    on_mu, on_sigma = math.log(_ON_MEDIAN), _lognormal_sigma(_ON_MEDIAN, _ON_MEAN)
    off_mu, off_sigma = math.log(_OFF_MEDIAN), _lognormal_sigma(_OFF_MEDIAN, _OFF_MEAN)
    mean_on = _ON_MEAN
    mean_off = _capped_lognormal_mean(off_mu, off_sigma, _OFF_CAP)
    rate_on = rate * (mean_on + mean_off) / mean_on
    # wall-clock ON intervals covering [0, duration)
    on_starts: list[float] = []
    on_lens: list[float] = []
    t = 0.0
    while t < duration:
        on = float(rng.lognormal(on_mu, on_sigma))
        on_starts.append(t)
        on_lens.append(min(on, duration - t))
        t += on + min(float(rng.lognormal(off_mu, off_sigma)), _OFF_CAP)
    cum = np.concatenate([[0.0], np.cumsum(on_lens)])
    on_times = _renewal(rng, rate_on, cv, float(cum[-1]), poisson=False)
    idx = np.searchsorted(cum, on_times, side="right") - 1
    times: np.ndarray = np.asarray(on_starts)[idx] + (on_times - cum[idx])
    return times


def synthetic(*, rate: float, duration: float, arrival: str = "gamma", cv: float = 2.0,
              prompt_mu: float = LENGTHS["code"]["prompt_mu"], prompt_sigma: float = LENGTHS["code"]["prompt_sigma"],
              output_mu: float = LENGTHS["code"]["output_mu"], output_sigma: float = LENGTHS["code"]["output_sigma"],
              max_prompt: int = int(LENGTHS["code"]["max_prompt"]),
              max_output: int = int(LENGTHS["code"]["max_output"]), min_prompt: int = 1,
              seed: int = 0) -> list[TraceRequest]:
    """A synthetic trace of `duration` seconds at a mean of `rate` requests/s.

    arrival: "gamma" (renewal with coefficient of variation `cv`), "poisson", or "onoff" (the
    code trace's bursts; `cv` is the CV inside a burst, 2.2 in the real trace). Lengths are
    lognormal(mu, sigma) rounded and clipped to [min_prompt or 1, max]; the defaults fit the code trace.
    """
    if rate <= 0 or duration <= 0:
        raise ConfigError(f"rate and duration must be positive (got rate={rate}, duration={duration})")
    if cv <= 0:
        raise ConfigError(f"cv must be positive, got {cv}")
    if max_prompt < 1 or max_output < 1 or not 1 <= min_prompt <= max_prompt:
        raise ConfigError("max_prompt and max_output must be >= 1, and 1 <= min_prompt <= max_prompt")
    rng = np.random.default_rng(seed)
    if arrival == "gamma":
        times = _renewal(rng, rate, cv, duration, poisson=False)
    elif arrival == "poisson":
        times = _renewal(rng, rate, 1.0, duration, poisson=True)
    elif arrival == "onoff":
        times = _onoff(rng, rate, cv, duration)
    else:
        raise ConfigError(f"unknown arrival process {arrival!r}: choose gamma, poisson or onoff")
    n = len(times)
    prompts = np.clip(np.rint(rng.lognormal(prompt_mu, prompt_sigma, size=n)), min_prompt, max_prompt).astype(np.int64)
    outputs = np.clip(np.rint(rng.lognormal(output_mu, output_sigma, size=n)), 1, max_output).astype(np.int64)
    return [TraceRequest(t=float(t), input_length=int(i), output_length=int(o))
            for t, i, o in zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True)]


# ------------------------------------------------------------------------------ analysis


def find_bursty_window(reqs: Sequence[TraceRequest], window_s: float) -> float:
    """Start time of the `window_s`-long window holding the most prompt tokens. Windows start at
    request arrivals (the optimum always does); ties go to the earliest. 0.0 for an empty trace."""
    if window_s <= 0:
        raise ConfigError(f"window_s must be positive, got {window_s}")
    if not reqs:
        return 0.0
    times = [r.t for r in reqs]
    cum = [0]
    for r in reqs:
        cum.append(cum[-1] + r.input_length)
    best_t, best = times[0], -1
    for i, t in enumerate(times):
        j = bisect.bisect_left(times, t + window_s, lo=i)
        tokens = cum[j] - cum[i]
        if tokens > best:
            best_t, best = t, tokens
    return best_t
