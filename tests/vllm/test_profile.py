"""`kairos profile` (common/engines/profile.py) and the scheduler's chunk arithmetic.

The sim-engine sweep needs no vLLM, so it runs in the main suite too: it measures the
simulated engine on the real clock and must recover the step-time model that times it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from common.engines.profile import fit_xfer, kind, main, mape_table, robust_fit
from common.perf_model import PerfModel, StepSample, load_profile
from tests.vllm.helpers import VLLM_MISSING


def test_sim_sweep_recovers_the_timing_model(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    samples = tmp_path / "samples.json"
    # time_scale 1: steps of 14-50 ms, long enough that timer and scheduling jitter stay small.
    # On an idle machine the fit's error is 2.5-4 %; a CI run once measured 31 %, when another
    # process held the CPU for part of the 4-second sweep: a second sweep is taken then (a broken
    # fit fails both).
    for _attempt in range(2):
        rc = main(["--engine", "sim", "--sim-profile", "a100-dsv2-lite", "--out", str(out),
                   "--contexts", "32,512", "--batches", "0,1,4", "--chunks", "32,128,256", "--chunks-per-prompt", "3",
                   "--decode-steps", "4", "--samples-out", str(samples), "--quiet"])
        assert rc == 0
        prof = load_profile(str(out))
        if prof.fit_mape["all"] < 0.3:
            break
    truth = load_profile("a100-dsv2-lite").model
    assert prof.name == "sim" and "a100-dsv2-lite" in prof.derivation
    assert {"all", "decode_only", "prefill_only", "mixed", "mixed_chunk_32", "mixed_chunk_256",
            "all_steps_untrimmed"} <= set(prof.fit_mape)
    assert prof.fit_mape["all"] < 0.3
    # the fitted model predicts the true step times across the sweep's range
    grid = [(b, k, ch) for b in (0, 4) for k in (0, 2048) for ch in ([], [(64, 0)], [(256, 512)]) if b or ch]
    errs = [abs(prof.model.step_time(b, k if b else 0, ch) - truth.step_time(b, k if b else 0, ch))
            / truth.step_time(b, k if b else 0, ch) for b, k, ch in grid]
    assert sum(errs) / len(errs) < 0.2, errs
    raw = json.loads(samples.read_text())
    assert len(raw) >= 18 * 3 and all(s[3] > 0 for s in raw)


def test_robust_fit_ignores_contention_spikes() -> None:
    true = PerfModel(a0=2e-3, a1=1e-4, a2=2e-7, a3=1e-5, a4=1e-8)
    shapes = [(b, b * kv, [(chi, k)] if chi else []) for b in (0, 1, 4, 8) for kv in (64, 512)
              for chi in (0, 32, 128) for k in (0, 256) if b or chi]
    clean = [StepSample(b, kv, ch, true.step_time(b, kv, ch)) for b, kv, ch in shapes]
    spiky = clean + [StepSample(s.batch, s.kv_tokens, s.chunks, s.seconds * 3) for s in clean[::4]]
    model, kept = robust_fit(spiky, trim=0.25, use_a5=False, base=PerfModel(a0=0.0))
    assert len(kept) == len(clean)
    assert mape_table(model, kept)["all"] < 1e-6
    plain, _ = robust_fit(spiky, trim=0, use_a5=False, base=PerfModel(a0=0.0))
    assert mape_table(plain, clean)["all"] > 0.05  # what the spikes do to a plain fit


def test_step_kinds_and_transfer_fit() -> None:
    assert kind(StepSample(2, 10, [], 1.0)) == "decode_only"
    assert kind(StepSample(0, 0, [(8, 0)], 1.0)) == "prefill_only"
    assert kind(StepSample(2, 10, [(8, 0)], 1.0)) == "mixed"
    t0, bw = fit_xfer([(n, 0.01 + n * 1024 / 2e9) for n in (128, 512, 1024)], 1024)
    assert t0 == pytest.approx(0.01) and bw == pytest.approx(2e9)
    t0, bw = fit_xfer([(128, 0.02), (1024, 0.019)], 1024)  # no visible slope: all fixed cost
    assert t0 == pytest.approx(0.0195) and bw == 1e12


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")
def test_next_scheduled_chunk_boundaries() -> None:
    with warnings.catch_warnings():  # importing vllm warns (torch deprecations); not ours to fix
        warnings.simplefilter("ignore")
        from common.engines.vllm_scheduler import next_scheduled_chunk

    sched = (64, 32, 100)
    assert [next_scheduled_chunk(sched, 0, c, 300) for c in (0, 64, 96, 196)] == [64, 32, 100, None]
    assert next_scheduled_chunk(sched, 0, 50, 300) == 14        # a clamped chunk is finished next step
    assert next_scheduled_chunk(sched, 128, 128, 200) == 64     # base = a prefix-cache hit
    assert next_scheduled_chunk(sched, 128, 192, 200) == 8      # never past the prompt
    assert next_scheduled_chunk((), 0, 0, 10) is None
