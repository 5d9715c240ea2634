"""Trace loading (Azure CSV, JSON lines), slicing and scaling, synthetic generators, bursts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from common.errors import ConfigError
from common.traces import LENGTHS, TraceRequest, find_bursty_window, load_trace, synthetic, trace_path

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.03196,3180,8
2023-11-16 18:17:05,110,27
2023-11-16 18:17:06.5000001,7433,14
2023-11-16 18:17:13.9799600,20,1
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_mixed_precision_timestamps(tmp_path: Path) -> None:
    reqs = load_trace(write(tmp_path, "t.csv", CSV))
    assert [r.t for r in reqs] == pytest.approx([0.0, 0.05200, 1.02004, 2.5200401, 10.0], abs=1e-9)
    assert reqs[0] == TraceRequest(t=0.0, input_length=4808, output_length=10)
    assert [(r.input_length, r.output_length) for r in reqs] == [(4808, 10), (3180, 8), (110, 27), (7433, 14), (20, 1)]


def test_csv_keeps_100ns_resolution(tmp_path: Path) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.9999999,1,1\n2023-11-17 00:00:00.0000001,1,1\n"
    reqs = load_trace(write(tmp_path, "t.csv", text))
    assert reqs[1].t == pytest.approx(2e-7, abs=1e-12)  # across midnight, at 100 ns


@pytest.mark.parametrize(("kw", "times"), [
    ({"start": 1.0}, [0.02004, 1.5200401, 9.0]),
    ({"start": 1.0, "duration": 2.0}, [0.02004, 1.5200401]),
    ({"duration": 1.0}, [0.0, 0.052]),
    ({"rate_scale": 2.0}, [0.0, 0.026, 0.51002, 1.26002005, 5.0]),
    ({"start": 1.0, "duration": 2.0, "rate_scale": 4.0}, [0.00501, 0.380010025]),
    ({"start": 50.0}, []),
])
def test_slice_and_scale(tmp_path: Path, kw: dict[str, float], times: list[float]) -> None:
    reqs = load_trace(write(tmp_path, "t.csv", CSV), **kw)  # type: ignore[arg-type]
    assert [r.t for r in reqs] == pytest.approx(times, abs=1e-9)


def test_jsonl(tmp_path: Path) -> None:
    rows = [{"timestamp": 1500, "input_length": 100, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 0, "input_length": 7, "output_length": 3},
            {"timestamp": 250.5, "input_length": 42, "output_length": 9, "extra": "x"}]
    p = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_trace(p)
    assert reqs == [TraceRequest(0.0, 7, 3), TraceRequest(0.2505, 42, 9), TraceRequest(1.5, 100, 5, (1, 2))]
    assert [r.t for r in load_trace(p, start=0.2, rate_scale=0.5)] == pytest.approx([0.101, 2.6])


@pytest.mark.parametrize(("name", "text", "match"), [
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\n2023-11-16 18:17:04.0,-5,1\n",
     r"bad.csv:3: ContextTokens must be a positive integer"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\nyesterday,10,1\n",
     r"bad.csv:3: "),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10\n",
     r"bad.csv:2: expected 3 columns"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,0\n",
     r"bad.csv:2: GeneratedTokens must be >= 1"),
    ("bad.csv", "time,prompt,output\n1,2,3\n", r"bad.csv:1: CSV header .* lacks TIMESTAMP"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:17:03.9,10,1\n", r"bad.csv:2: "),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n',
     r"bad.jsonl:2: missing field 'output_length'"),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n',
     r"bad.jsonl:2: not valid JSON"),
    ("bad.jsonl", '{"timestamp": -3, "input_length": 5, "output_length": 1}\n', r"bad.jsonl:1: timestamp"),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 2.5, "output_length": 1}\n', r"bad.jsonl:1: input_length"),
    ("empty.csv", "\n\n", r"empty"),
])
def test_bad_rows_name_the_line(tmp_path: Path, name: str, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_trace(write(tmp_path, name, text))


def test_bad_arguments(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", CSV)
    with pytest.raises(ConfigError, match="not found"):
        load_trace(tmp_path / "missing.csv")
    for kw in ({"rate_scale": 0.0}, {"duration": -1.0}, {"start": -1.0}):
        with pytest.raises(ConfigError):
            load_trace(p, **kw)  # type: ignore[arg-type]


def test_trace_path(tmp_path: Path) -> None:
    (tmp_path / "AzureLLMInferenceTrace_code.csv").write_text(CSV)
    assert trace_path("code", data_dir=tmp_path) == tmp_path / "AzureLLMInferenceTrace_code.csv"
    with pytest.raises(ConfigError, match="not found"):
        trace_path("conv", data_dir=tmp_path)
    # the shipped traces are found from the package itself, wherever the repository is
    shipped = trace_path("code")
    assert shipped.is_file() and shipped.parent.name == "traces" and shipped.parent.parent.name == "data"
    assert len(load_trace(shipped)) == 8819
    explicit = write(tmp_path, "mine.csv", CSV)
    assert trace_path(str(explicit)) == explicit
    with pytest.raises(ConfigError, match="not found"):
        trace_path("no-such-trace")


@pytest.mark.parametrize(("name", "rows", "span", "mean_prompt"), [
    ("code", 8819, 3435.9, 2047.8), ("conv", 19366, 3501.7, 1154.7)])
def test_azure_traces(name: str, rows: int, span: float, mean_prompt: float) -> None:
    reqs = load_trace(trace_path(name))
    assert len(reqs) == rows
    assert reqs[0].t == 0.0 and reqs[-1].t == pytest.approx(span, abs=0.1)
    assert np.mean([r.input_length for r in reqs]) == pytest.approx(mean_prompt, abs=0.1)
    assert all(b.t >= a.t for a, b in itertools.pairwise(reqs))


@pytest.mark.parametrize(("arrival", "cv", "want_cv"),
                         [("poisson", 1.0, 1.0), ("gamma", 2.0, 2.0), ("gamma", 0.5, 0.5)])
def test_synthetic_renewal(arrival: str, cv: float, want_cv: float) -> None:
    reqs = synthetic(rate=20.0, duration=500.0, arrival=arrival, cv=cv, seed=3)
    t = np.array([r.t for r in reqs])
    gaps = np.diff(t)
    assert len(reqs) / 500.0 == pytest.approx(20.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(want_cv, rel=0.1)
    assert t.min() >= 0 and t.max() < 500.0 and np.all(gaps >= 0)


def test_synthetic_onoff_is_bursty() -> None:
    reqs = synthetic(rate=2.57, duration=20_000.0, arrival="onoff", cv=2.2, seed=1)
    t = np.array([r.t for r in reqs])
    per_s = np.bincount(t.astype(int))
    assert len(reqs) / 20_000.0 == pytest.approx(2.57, rel=0.15)
    assert per_s.var() / per_s.mean() > 5          # the code trace: 13; Poisson: 1
    assert np.mean(per_s == 0) > 0.5                # mostly idle seconds (code trace: 73 %)
    poisson = synthetic(rate=2.57, duration=20_000.0, arrival="poisson", seed=1)
    pp = np.bincount(np.array([r.t for r in poisson]).astype(int))
    assert pp.var() / pp.mean() == pytest.approx(1.0, abs=0.2)


def test_synthetic_lengths_and_determinism() -> None:
    a = synthetic(rate=50.0, duration=200.0, seed=7, prompt_mu=6.633, prompt_sigma=0.985, output_mu=5.019,
                  output_sigma=0.859, max_prompt=4000, max_output=500)
    b = synthetic(rate=50.0, duration=200.0, seed=7, prompt_mu=6.633, prompt_sigma=0.985, output_mu=5.019,
                  output_sigma=0.859, max_prompt=4000, max_output=500)
    c = synthetic(rate=50.0, duration=200.0, seed=8)
    assert a == b and a != c
    p = np.array([r.input_length for r in a])
    o = np.array([r.output_length for r in a])
    assert p.min() >= 1 and p.max() == 4000 and o.max() == 500
    assert np.median(np.log(p)) == pytest.approx(6.633, abs=0.1)
    assert np.median(np.log(o)) == pytest.approx(5.019, abs=0.1)


def test_synthetic_long_context_lengths() -> None:
    reqs = synthetic(rate=2.0, duration=300.0, arrival="poisson", seed=3, **LENGTHS["long"])  # type: ignore[arg-type]
    p = np.array([r.input_length for r in reqs])
    assert p.min() == 4096 and p.max() == 32768  # clipped at both ends
    assert 7000 < np.median(p) < 11000


@pytest.mark.parametrize("kw", [{"rate": 0.0}, {"duration": 0.0}, {"arrival": "zipf"}, {"cv": 0.0},
                                {"min_prompt": 0}, {"min_prompt": 9000, "max_prompt": 8000}])
def test_synthetic_rejects(kw: dict[str, object]) -> None:
    args: dict[str, object] = {"rate": 1.0, "duration": 10.0, "seed": 0, **kw}
    with pytest.raises(ConfigError):
        synthetic(**args)  # type: ignore[arg-type]


def test_find_bursty_window() -> None:
    reqs = [TraceRequest(0.0, 100, 1), TraceRequest(5.0, 10, 1), TraceRequest(10.0, 500, 1),
            TraceRequest(11.0, 600, 1), TraceRequest(19.9, 50, 1), TraceRequest(20.0, 2000, 1),
            TraceRequest(40.0, 3000, 1)]
    assert find_bursty_window(reqs, 10.0) == 40.0         # 3000 alone beats 2000 + 50
    assert find_bursty_window(reqs, 10.5) == 10.0         # [10, 20.5): 500 + 600 + 50 + 2000
    assert find_bursty_window(reqs, 100.0) == 0.0         # everything
    assert find_bursty_window([], 5.0) == 0.0
    with pytest.raises(ConfigError):
        find_bursty_window(reqs, 0.0)
