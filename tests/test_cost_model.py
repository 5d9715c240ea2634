"""The measured cost models: held-out error from the CSV, the chunking property, round trips, refits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import messages as m
from common.engines.splitwise_fit import Fit, build_profile, fit_splitwise, observations, slower_than_sequential
from common.errors import ConfigError
from common.perf_model import PerfModel, StepSample, fit, load_profile, save_profile

MEASURED = ("a100-llama2-70b-tp4", "h100-llama2-70b-tp4")
HW = {"a100-llama2-70b-tp4": "a100-80gb", "h100-llama2-70b-tp4": "h100-80gb"}


@pytest.mark.parametrize("name", MEASURED)
def test_shipped_profile_is_what_the_fit_command_writes(name: str) -> None:
    """The profile in the tree is reproducible from the CSV (the derivation text carries a date),
    up to floating-point round-off: the least-squares solve's last digits move with the numpy
    and BLAS build (seen: a fresh install gave a0 differing in the 16th digit)."""
    shipped = load_profile(name)
    again = build_profile("llama2-70b", HW[name], 4, name=name)
    want, got = msgspec.structs.asdict(shipped.model), msgspec.structs.asdict(again.model)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k
    assert again.fit_mape == pytest.approx(shipped.fit_mape, rel=1e-9)
    assert (again.kv_capacity_tokens, again.prefill_token_budget, again.decode_token_budget, again.max_batch) == (
        shipped.kv_capacity_tokens, shipped.prefill_token_budget, shipped.decode_token_budget, shipped.max_batch)
    assert shipped.model.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # Llama-2-70B: 80 layers, 8 KV heads, fp16
    assert "200 Gb/s" in shipped.derivation and "HBM" in shipped.derivation


def test_h100_heldout_error_per_kind_is_at_most_10_percent() -> None:
    f = fit_splitwise("llama2-70b", "h100-80gb", 4)  # computed from the CSV here, not read from the profile
    assert {o.kind for o in f.held} == {"prefill", "batched_prefill", "decode"}
    assert not f.excluded
    for kind in ("prefill", "batched_prefill", "decode"):
        assert f.report[f"heldout_{kind}"] <= 0.10, (kind, f.report)


def test_a100_heldout_error_and_its_inconsistent_batched_rows() -> None:
    """On A100, batches of 4 to 64 prompts of 512 tokens took longer than the same prompts one after
    another (571 ms for 4 against 4 x 127 ms): they cannot be single steps, so the fit leaves them
    out and reports their error apart. What is left fits decode and single prompts within 10 % on
    the held-out rows (the MAPE fit; the held-out 2048-token prompt, 403 ms, below the trend of its
    neighbours, is still the worst row)."""
    obs = observations("llama2-70b", "a100-80gb", 4)
    bad = slower_than_sequential(obs)
    assert sorted(len(o.sample.chunks) for o in bad) == [4, 8, 16, 32, 64]
    assert not slower_than_sequential(observations("llama2-70b", "h100-80gb", 4))
    f = fit_splitwise("llama2-70b", "a100-80gb", 4)
    assert f.excluded == bad
    assert f.report["heldout_decode"] <= 0.10
    assert f.report["heldout_prefill"] <= 0.10
    assert f.report["excluded_batched_prefill"] > 0.10  # not hidden: reported, and large


@pytest.mark.parametrize("hw", ["a100-80gb", "h100-80gb"])
def test_mape_objective_fits_the_training_rows_no_worse_than_squares(hw: str) -> None:
    """The reweighting reaches a lower mean absolute relative error on the rows it fits than the
    least-squares start it begins from (else it would not be minimising MAPE), with the same
    rows held out and the same constraints (a5 = 0, a0 + a6 >= a7*knee)."""
    sq = fit_splitwise("llama2-70b", hw, 4, objective="squares")
    ab = fit_splitwise("llama2-70b", hw, 4)
    assert [o.label for o in ab.held] == [o.label for o in sq.held]

    def train_mape(f: Fit) -> float:
        return sum(abs(f.model.step_time(o.sample.batch, o.sample.kv_tokens, o.sample.chunks) - o.sample.seconds)
                   / o.sample.seconds for o in f.train) / len(f.train)

    assert train_mape(ab) < train_mape(sq)
    assert ab.model.a5 == 0.0 and ab.model.a0 + ab.model.a6 >= ab.model.a7 * ab.model.knee
    with pytest.raises(ConfigError, match="objective"):
        fit_splitwise("llama2-70b", hw, 4, objective="median")


# ------------------------------------------------------------------ chunking never pays


@pytest.mark.parametrize("name", MEASURED)
@settings(max_examples=300, deadline=None)
@given(n1=st.integers(1, 24), extra=st.integers(1, 40), mult=st.integers(1, 64))
def test_more_equal_chunks_are_never_faster(name: str, n1: int, extra: int, mult: int) -> None:
    """A prompt cut into n2 > n1 equal chunks is never prefilled faster on an idle worker."""
    mdl = load_profile(name).model
    n2 = n1 + extra
    tokens = math.lcm(n1, n2) * mult
    c1, c2 = tokens // n1, tokens // n2
    assert mdl.prefill_exec(tokens, c2) >= mdl.prefill_exec(tokens, c1) * (1 - 1e-12)


@pytest.mark.parametrize("name", MEASURED)
@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 65536), c1=st.integers(2, 1 << 15), frac=st.floats(0.0, 1.0))
def test_smaller_chunks_are_never_faster_below_the_knee_or_without_remainder_waste(
        name: str, tokens: int, c1: int, frac: float) -> None:
    """prefill_exec(n, c2) >= prefill_exec(n, c1) for c1 > c2 whenever c1 is at most the roofline
    knee (every step then costs the same fixed share plus a per-token one) or c1 leaves no
    remainder below the knee. (A schedule whose last step carries a few tokens pays a whole step
    for them; see test_a_tiny_last_chunk_wastes_a_step.)"""
    mdl = load_profile(name).model
    c2 = max(1, min(c1 - 1, int(c1 * frac)))
    rem = tokens % c1
    if c1 > mdl.knee and tokens > c1 and 0 < rem < mdl.knee:
        return
    assert mdl.prefill_exec(tokens, c2) >= mdl.prefill_exec(tokens, c1) * (1 - 1e-12)


def test_a_tiny_last_chunk_wastes_a_step_as_in_the_measurements() -> None:
    """The one way smaller chunks win: 1025 tokens as 1024 + 1 pay a nearly empty compute-bound
    step; 513 + 512 stay at the knee. The H100 data says the same: two 512-token prefills
    (2 x 59.6 ms) take less than one of 1024 (105.6 ms) plus one of 128 (49.1 ms)."""
    mdl = load_profile("h100-llama2-70b-tp4").model
    assert mdl.prefill_exec(1025, 513) < mdl.prefill_exec(1025, 1024)
    single = {o.sample.chunks[0][0]: o.sample.seconds for o in observations("llama2-70b", "h100-80gb", 4)
              if o.kind == "prefill"}
    assert 2 * single[512] < single[1024] + single[128]


@pytest.mark.parametrize("name", MEASURED)
def test_a_chunk_is_composed_into_a_decode_step_additively(name: str) -> None:
    mdl = load_profile(name).model
    b, kv, chi, k = 32, 32 * 2048, 512, 1024
    mixed = mdl.step_time(b, kv, [(chi, k)])
    assert mixed == pytest.approx(mdl.decode_time(b, kv) + mdl.chunk_cost(chi, k, b))
    # the GEMM terms see the step's total: the same chunk costs more beside decodes past the knee
    assert mdl.chunk_cost(chi, k, b) >= mdl.chunk_cost(chi, k, 0)
    # several chunks in one step pay one fixed cost, and the same attention as apart
    two = mdl.step_time(0, 0, [(256, 0), (256, 0)])
    assert two == pytest.approx(mdl.a0 + mdl.a6 + mdl._gemm(512) + mdl.a4 * 2 * 256 * 128)


# ------------------------------------------------------------------ round trips and old profiles


@pytest.mark.parametrize("name", [*MEASURED, "a100-dsv2-lite", "cpu-tiny-llama", "fast"])
def test_profile_round_trip(name: str, tmp_path: Path) -> None:
    p = load_profile(name)
    save_profile(p, tmp_path / "p.json")
    assert load_profile(str(tmp_path / "p.json")) == p
    c = msgspec.json.decode(msgspec.json.encode(p.model.to_coeffs()), type=m.Coeffs)
    assert PerfModel.from_coeffs(c) == p.model


def test_form1_profile_is_converted_on_load(tmp_path: Path) -> None:
    """A profile of the first form (no model_form: a1 per decode alone, a3 and a5 per chunk)
    gives the same step times for decode-only steps and for a chunk alone."""
    old = {"a0": 0.014, "a1": 0.00015, "a2": 1e-7, "a3": 4e-5, "a4": 4e-9, "a5": 3e-8}
    doc = {"name": "old", "description": "d", "derivation": "d", "model": old}
    (tmp_path / "old.json").write_text(json.dumps(doc))
    new = load_profile(str(tmp_path / "old.json")).model
    for b, kv in ((1, 100), (32, 80_000)):
        want = old["a0"] + old["a1"] * b + old["a2"] * kv
        assert new.decode_time(b, kv) - new.a5 * b * b == pytest.approx(want)
    for chi, k in ((512, 0), (2048, 4096)):
        want = old["a0"] + old["a3"] * chi + old["a4"] * chi * (k + chi / 2) + old["a5"] * chi * chi
        assert new.step_time(0, 0, [(chi, k)]) == pytest.approx(want)


def test_unknown_model_form_is_refused(tmp_path: Path) -> None:
    from common.errors import ConfigError
    doc = {"name": "x", "description": "d", "derivation": "d", "model": {"a0": 0.01}, "model_form": 9}
    (tmp_path / "x.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="model_form"):
        load_profile(str(tmp_path / "x.json"))


# ------------------------------------------------------------------ the online refit


def test_refit_recovers_a_measured_model_from_its_steps() -> None:
    """A worker refits from its own steps (prefill, decode and mixed) with the profile as base:
    the roofline knee is kept from the base and the other terms come back."""
    true = load_profile("h100-llama2-70b-tp4").model
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(400):
        b = int(rng.integers(0, 96))
        kv = int(b * rng.integers(200, 6000))
        chunks = [(int(c), int(rng.integers(0, 6000))) for c in rng.choice([0, 64, 256, 512, 1024, 2048], 1) if c]
        if b == 0 and not chunks:
            b, kv = 1, 500
        samples.append(StepSample(b, kv, chunks, true.step_time(b, kv, chunks) * float(rng.normal(1.0, 0.01))))
    model, err = fit(samples, base=true)
    assert err < 0.02
    assert model.knee == true.knee and model.kv_bytes_per_token == true.kv_bytes_per_token
    for b, kv, ch in ((0, 0, [(2048, 0)]), (64, 64 * 2048, []), (32, 32 * 1024, [(512, 2048)])):
        assert model.step_time(b, kv, ch) == pytest.approx(true.step_time(b, kv, ch), rel=0.03)
