"""`kairos profile`: measure an engine's step times, fit the performance model, write a profile.

The sweep drives a decode-role engine through the Engine interface, so the vLLM engine and the
simulated engine are measured the same way. For every (context, batch, chunk) point it starts
`batch` background requests with `context`-token prompts, waits until all of them decode, then
deflects one prompt of `chunks-per-prompt` x `chunk` tokens with the schedule (chunk, chunk, ...)
and lets the background requests run `decode-steps` more tokens. Every engine step of the sweep
becomes a StepSample (decode batch, its KV tokens, the chunks with their contexts, seconds):
prefill-only steps (the background prompts), mixed steps (decodes + one scheduled chunk) and
decode-only steps. `perf_model.fit` fits the step-time model to them, refitted without the
steps that contention from other processes slowed down (`robust_fit`, `--trim`); the MAPE is
reported over the kept steps, per kind of step (which terms of the model are active) and per
scheduled chunk size, and over all steps untrimmed, and stored in the profile's `fit_mape`.

For vLLM it also measures the KV handoff (prefill engine -> NIXL -> decode engine): the time
from a handoff's submission to its first token, less the decode engine's own step for it,
over several prompt lengths, fitted as t0 + L * kv_bytes_per_token / bandwidth.

    .venv-vllm/bin/python -m common.engines.profile --engine vllm --out common/profiles/cpu-tiny-llama.json
    python -m common.engines.profile --engine sim --sim-profile a100-dsv2-lite --out /tmp/sim.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.config import parse_list
from common.engines.sweep import (  # noqa: F401 (kind, lower_envelope: this module's API too)
    _req,
    _Tracker,
    kind,
    kv_bytes_per_token,
    lower_envelope,
    mape_table,
    robust_fit,
    sweep,
)
from common.messages import KvHandle
from common.perf_model import PerfModel, Profile, StepSample, load_profile, mape, save_profile


def fit_xfer(points: Sequence[tuple[int, float]], bytes_per_token: int) -> tuple[float, float]:
    """Least squares of seconds = t0 + tokens * bytes_per_token / bandwidth; returns (t0, bandwidth)."""
    x = np.array([p[0] * bytes_per_token for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    slope, t0 = np.polyfit(x, y, 1)
    if slope <= 0:  # the bytes are too few to show on this machine: time is all fixed cost
        return max(float(np.mean(y)), 0.0), 1e12
    return float(max(t0, 0.0)), float(1.0 / slope)


async def measure_xfer(prefill: Any, decode: Any, *, lengths: Sequence[int], repeats: int,
                       vocab: int) -> list[tuple[int, float]]:
    """Handoff time (submit to first token, less the decode step that computed it) per prompt length."""
    rng = random.Random(1)
    done: dict[str, Any] = {}
    prefill.on_prefilled = lambda p: done.__setitem__(p.request_id, p)
    track = _Tracker()
    decode.on_tokens = track.on_tokens
    points: list[tuple[int, float]] = []
    for i, length in enumerate([lengths[0], *[x for x in lengths for _ in range(repeats)]]):
        rid = f"xfer{i}-{length}"
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        prefill.add(_req(rid, prompt, 1, mode="prefill"))
        while rid not in done:
            await asyncio.sleep(0.002)
        kv = KvHandle(transport="nixl", source_worker="profile", tokens=length, params=done.pop(rid).kv_params)
        t0 = time.monotonic()
        decode.add(_req(rid, prompt, 1, mode="handoff", kv=kv))
        await track.until(lambda: rid in track.finished)  # noqa: B023
        total = track.first[rid] - t0
        step = next((r.seconds for r in reversed(decode.step_records) for key, _, _ in r.chunks
                     if key == f"{rid}:0"), 0.0)
        if decode.kv_fallbacks:
            raise RuntimeError("a KV handoff fell back to in-place prefill while profiling")
        if i > 0:  # the first one pays the NIXL handshake
            points.append((length, max(total - step, 1e-6)))
    return points


async def _profile(args: argparse.Namespace) -> Profile:
    contexts, batches, chunks = parse_list(args.contexts), parse_list(args.batches), parse_list(args.chunks)
    say = print if not args.quiet else (lambda *a, **k: None)
    t_start = time.monotonic()
    xfer_points: list[tuple[int, float]] = []
    base = PerfModel(a0=0.0)
    if args.engine == "sim":
        from common.engines.sim import SimEngine

        src = load_profile(args.sim_profile)
        engine: Any = SimEngine("decode", src, time_scale=args.time_scale)
        base = src.model
        kv_capacity, budget, max_batch, vocab = engine.kv_capacity_tokens, engine.token_budget, engine.max_batch, 1000
        what = f"the simulated engine timed by profile {src.name!r} (time_scale {args.time_scale:g})"
        prefill = None
    else:
        from common.engines.vllm import VllmEngine
        from common.ports import free_port

        model = args.model
        if not model:
            from common.engines.tiny_model import make_tiny_model

            model = tempfile.mkdtemp(prefix="kairos-tiny-")
            make_tiny_model(Path(model))
            say(f"made the tiny model in {model}")
        opts: dict[str, Any] = dict(model=model, max_model_len=args.max_model_len, kv_cache_mib=args.kv_cache_mib,
                                    token_budget=args.token_budget, max_batch=args.max_batch, prefix_caching=False)
        engine = VllmEngine("decode", side_channel_port=free_port(), **opts)
        prefill = VllmEngine("prefill", side_channel_port=free_port(), **opts) if args.xfer else None
        say("starting vLLM engine(s) ...")
        await engine.start()
        if prefill is not None:
            await prefill.start()
        kv_capacity, budget, max_batch = engine.kv_capacity_tokens, engine.token_budget, engine.max_batch
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        base = PerfModel(a0=0.0, kv_bytes_per_token=kv_bytes_per_token(model))
        model_name = "the tiny Llama of common/engines/tiny_model.py" if not args.model else Path(model).name
        what = (f"vLLM {_vllm_version()} ({model_name}, {args.kv_cache_mib} MiB KV, token budget "
                f"{args.token_budget}, max batch {args.max_batch})")
    attr = "samples"
    if args.engine == "vllm" and (args.clock == "cpu" or (args.clock == "auto" and _on_cpu())):
        attr = "cpu_samples"
    setattr(engine, attr, deque())  # unbounded while profiling, so indices into it stay put
    runs = [asyncio.create_task(engine.run())]
    if prefill is not None:
        runs.append(asyncio.create_task(prefill.run()))
    try:
        total = len(contexts) * len(batches) * len(chunks)
        samples: list[StepSample] = []
        for rep in range(args.repeats):
            samples += await sweep(engine, lambda: getattr(engine, attr), contexts=contexts, batches=batches,
                                   chunks=chunks, chunks_per_prompt=args.chunks_per_prompt,
                                   decode_steps=args.decode_steps, vocab=vocab, tag=f"r{rep}",
                                   progress=lambda i, tag: say(f"  [{i}/{total}] {tag}", end="\r"))
        say(f"\nswept {len(samples)} steps in {time.monotonic() - t_start:.1f} s")
        if prefill is not None:
            xfer_points = await measure_xfer(prefill, engine, lengths=parse_list(args.xfer_lengths),
                                             repeats=args.xfer_repeats, vocab=vocab)
    finally:
        for t in runs:
            t.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await engine.close()
        if prefill is not None:
            await prefill.close()

    measured = samples
    if args.repeats > 1:  # the sweep is deterministic in shape: keep the fastest of each step's repeats
        samples = lower_envelope(samples)
    model_fit, kept = robust_fit(samples, trim=args.trim, use_a5=args.a5, base=base)
    if xfer_points:
        t0, bw = fit_xfer(xfer_points, base.kv_bytes_per_token)
        model_fit = PerfModel(**{**_fields(model_fit), "xfer_t0": t0, "xfer_bandwidth": bw})
    table = mape_table(model_fit, kept, chunks)
    table["all_steps_untrimmed"] = round(mape(model_fit, samples), 4)
    if measured is not samples:
        table["all_repeats"] = round(mape(model_fit, measured), 4)
    if xfer_points:
        errs = [abs(model_fit.xfer_time(n) - s) / s for n, s in xfer_points]
        table["xfer"] = round(float(np.mean(errs)), 4)
    if args.samples_out:
        Path(args.samples_out).write_text(json.dumps([[s.batch, s.kv_tokens, s.chunks, s.seconds] for s in measured]))
    cmd = args.cmdline or "kairos profile " + " ".join(_shown_args(sys.argv[1:]))
    clock_text = {"samples": "the engine's real-clock step" if args.engine == "sim" else
                  "the scheduler's wall time from schedule() to update_from_output()",
                  "cpu_samples": "the engine-core thread's CPU time from schedule() to update_from_output() "
                                 "(the model runs in that thread with OMP_NUM_THREADS=1)"}[attr]
    reduced = (f" {args.repeats} repeats of the sweep were reduced to the fastest of each distinct step shape "
               f"({len(samples)} shapes from {len(measured)} steps)." if measured is not samples else "")
    derivation = (
        f"Measured with `{cmd}` on {' '.join(filter(None, (platform.machine(), platform.processor())))} "
        f"({_cpus()} CPUs) against "
        f"{what}: {len(measured)} engine steps over background prompts of {list(contexts)} tokens, decode "
        f"batches {list(batches)} and scheduled chunks {list(chunks)} ({args.chunks_per_prompt} per deflected "
        f"prompt). Step time = {clock_text}.{reduced} Fitted by common.perf_model.fit (least squares on relative "
        f"error, non-negative), refitted without steps more than {args.trim:.0%} slower than the fit "
        f"(contention from other processes; {len(kept)} of {len(samples)} kept; see profile.robust_fit)."
        + (f" KV handoff over NIXL fitted on {len(xfer_points)} handoffs of {parse_list(args.xfer_lengths)} "
           f"tokens (the first handoff, which pays the handshake, excluded)." if xfer_points else "")
        + " MAPE per kind of step in fit_mape.")
    return Profile(name=args.name, description=args.description or f"{args.name}: fitted by kairos profile",
                   derivation=derivation, model=model_fit, prefill_token_budget=budget, decode_token_budget=budget,
                   decode_default_chunk=max(c for c in chunks if c <= budget - 1) if chunks else budget,
                   kv_capacity_tokens=kv_capacity, max_batch=max_batch, fit_mape=table)


def _shown_args(argv: Sequence[str]) -> list[str]:
    """The command line for the derivation text, without the (long) description."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--description":
            skip = True
        elif not a.startswith("--description="):
            out.append(a)
    return out


def _fields(m: PerfModel) -> dict[str, Any]:
    return {f: getattr(m, f) for f in m.__struct_fields__}


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def print_report(profile: Profile) -> None:
    from rich.console import Console
    from rich.table import Table

    m = profile.model
    coeffs = Table(title=f"profile {profile.name}: step-time model")
    coeffs.add_column("term")
    coeffs.add_column("value", justify="right")
    for name, value, unit in (("a0", m.a0 * 1e3, "ms per step"), ("a6", m.a6 * 1e3, "ms per step with prefill"),
                              ("a1", m.a1 * 1e6, "us per decode"), ("a2", m.a2 * 1e9, "ns per KV token"),
                              ("a3", m.a3 * 1e6, "us per token of the step"),
                              ("a7", m.a7 * 1e6, f"us per token of the step above {m.knee:g}"),
                              ("a4", m.a4 * 1e9, "ns per chunk token x context"),
                              ("a5", m.a5 * 1e9, "ns per (step tokens)^2"), ("xfer_t0", m.xfer_t0 * 1e3, "ms"),
                              ("xfer_bandwidth", m.xfer_bandwidth / 1e9, "GB/s")):
        coeffs.add_row(f"{name} ({unit})", f"{value:.4g}")
    errs = Table(title="fit MAPE")
    errs.add_column("steps")
    errs.add_column("MAPE", justify="right")
    for k, v in profile.fit_mape.items():
        errs.add_row(k, f"{100 * v:.1f} %")
    console = Console()
    console.print(coeffs)
    console.print(errs)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["fit-splitwise"]:
        from common.engines import splitwise_fit
        return splitwise_fit.main(args_in[1:])
    about = " (`kairos profile fit-splitwise --help`: fit a profile to the measured Splitwise data)"
    p = argparse.ArgumentParser(prog="kairos profile", description=__doc__.split("\n\n")[0] + about,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    p.add_argument("--model", default="", help="vllm: model directory (default: make the tiny model in a temp dir)")
    p.add_argument("--sim-profile", default="a100-dsv2-lite", help="sim: the profile that times the simulated engine")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim: step-time multiplier")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--name", default="", help="profile name (default: the --out file's stem)")
    p.add_argument("--description", default="")
    p.add_argument("--contexts", default="32,256,1024", help="prompt tokens of each background decode")
    p.add_argument("--batches", default="0,1,4,8,16", help="background decode batch sizes")
    p.add_argument("--chunks", default="16,64,128,256", help="scheduled chunk sizes of the deflected prompt")
    p.add_argument("--chunks-per-prompt", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=12, help="decode-only steps after each deflection")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="vllm: time steps by wall clock or by the engine-core thread's CPU time (auto: CPU time "
                        "on a CPU platform, where the model runs in that one thread and other processes can only "
                        "inflate the wall clock; wall time on GPUs)")
    p.add_argument("--trim", type=float, default=0.25,
                   help="drop steps this much slower than the fit and refit (0: plain fit); see robust_fit")
    p.add_argument("--repeats", type=int, default=1, help="run the whole sweep this many times")
    p.add_argument("--a5", action=argparse.BooleanOptionalAction, default=True,
                   help="fit the (step's total tokens)^2 term")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--xfer", action=argparse.BooleanOptionalAction, default=True,
                   help="vllm: also measure the KV handoff over NIXL (starts a prefill engine)")
    p.add_argument("--xfer-lengths", default="128,512,1024,1536")
    p.add_argument("--xfer-repeats", type=int, default=3)
    p.add_argument("--samples-out", default="", help="also write the raw step samples (JSON)")
    p.add_argument("--cmdline", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(args_in)
    if not args.name:
        args.name = Path(args.out).stem
    profile = asyncio.run(_profile(args))
    save_profile(profile, Path(args.out))
    if not args.quiet:
        print_report(profile)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
