"""The performance model: the shipped profile matches the paper's figures; the fit recovers a model."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import ConfigError
from common.perf_model import PerfModel, StepSample, fit, list_profiles, load_profile, mape


def test_a100_profile_matches_the_public_figures() -> None:
    p = load_profile("a100-dsv2-lite")
    mdl = p.model
    assert mdl.kv_bytes_per_token == 31104  # 27 layers x 576 x 2 B
    for chi in (128, 256, 512):
        assert mdl.chunk_cost(chi, 0) <= 0.030  # Figure 1: flat, at most ~30 ms up to 512
    assert mdl.chunk_cost(1024, 0) > mdl.chunk_cost(512, 0) * 2  # rises visibly
    assert mdl.chunk_cost(2048, 0) > 0.200  # over 200 ms at 2048
    assert "Figure 1" in p.derivation


def test_equation_one_pieces() -> None:
    mdl = PerfModel(a0=0.01, a3=1e-4)
    assert mdl.queue_wait(0, 2048) == 0.0
    # (sum_l / chi) * T_step(chi, sum_l/2) with no context cost: 2 steps of 0.01 + 0.2048
    assert mdl.queue_wait(4096, 2048) == pytest.approx(2 * (0.01 + 0.2048))
    assert mdl.prefill_exec(3000, 2048) == pytest.approx(2 * 0.01 + 3000 * 1e-4)
    x = PerfModel(a0=0, xfer_t0=0.01, xfer_bandwidth=1e9, kv_bytes_per_token=1000)
    assert x.xfer_time(1000) == pytest.approx(0.011)


def test_fit_recovers_coefficients_and_reports_mape() -> None:
    true = PerfModel(a0=0.012, a1=2e-4, a2=1e-7, a3=4e-5, a4=5e-9, a5=2e-8)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        b = int(rng.integers(0, 64))
        kv = int(b * rng.integers(100, 4000))
        chunks = [(int(rng.choice([0, 128, 512, 1024, 2048])), int(rng.integers(0, 4000)))]
        chunks = [(c, k) for c, k in chunks if c > 0]
        t = true.step_time(b, kv, chunks) * float(rng.normal(1.0, 0.02))
        samples.append(StepSample(b, kv, chunks, t))
    model, err = fit(samples)
    assert err < 0.05
    assert model.a0 == pytest.approx(true.a0, rel=0.15)
    assert model.a3 == pytest.approx(true.a3, rel=0.2)
    assert mape(model, samples) == pytest.approx(err)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(ValueError):
        fit([StepSample(1, 1, [], 0.01)] * 3)


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="a100-dsv2-lite"):
        load_profile("nope")
    assert "a100-dsv2-lite" in list_profiles()
