"""Step times of a Llama-shaped model in plain PyTorch, fitted to Kairos's step-time model.

    python -m bench.gpu_check --out DIR              (scripts/gpu-check.sh runs this on a GPU host)
    python -m bench.gpu_check --tiny --out DIR       (CPU, tiny shapes: what the test suite runs)

Needs PyTorch only (no vLLM, no network). The model has Llama-3-8B's shape (32 layers, hidden
4096, 32 query and 8 KV heads of 128, MLP 14336, vocabulary 128256) with random bf16 weights;
a step is what a vLLM engine step computes: every layer's RMSNorm, fused QKV projection,
rotary-sized elementwise work, attention (SDPA: causal over the chunk's own tokens and its
context for a prefill chunk, one query over its context for each decode), output projection,
SwiGLU MLP, and the LM head on the last position of every sequence. The new tokens' K/V are
written into the cache. One layer's weights and one KV buffer are shared by all layers: each
is far larger than the GPU's L2 cache, so the time per layer is that of distinct weights and
caches, at a fraction of the memory.

Three sweeps, interleaved, each step timed `--repeats` times (the fastest kept: contention only
adds time); the sweep stops at 60 % of --budget-s and fits what it has:
- prefill: chunks of 128..8192 tokens over contexts of 0..32k (chunk + context <= 32k);
- decode: batches of 1..256 at contexts of 512..8192 (batch x context <= 512k tokens);
- mixed: one chunk beside a decode batch, the step a deflection adds to a decode worker.
The samples are fitted with common.perf_model.fit (the fitter of `kairos profile`). Writes
DIR/gpu-check.json (device, shapes, every sample, the fit, its error per kind of step) and
DIR/gpu-check-profile.json (a profile `--profile` accepts). With NIXL importable it also runs
`kairos kv-bench` in host memory and, on CUDA, in GPU memory (`--memory vram`), and with vLLM
0.32.0 installed the vLLM stage (bench/gpu_vllm.py: Kairos's vLLM path on this platform, baseline
against Kairos), each bounded by what is left of --budget-s; prints a summary; exit 1 when a
stage that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 128256


TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=256)


@dataclass(frozen=True)
class Sweep:
    chunks: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    contexts: tuple[int, ...] = (0, 2048, 8192, 16384, 24576)
    max_context: int = 32768
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (512, 2048, 8192)
    max_decode_tokens: int = 512 * 1024
    mixed_chunks: tuple[int, ...] = (256, 512, 1024, 2048)
    mixed_batches: tuple[int, ...] = (8, 32, 128)
    mixed_context: int = 2048


TINY_SWEEP = Sweep(chunks=(8, 16, 32), contexts=(0, 32), max_context=96, batches=(1, 2, 4), decode_contexts=(16, 48),
                   max_decode_tokens=1024, mixed_chunks=(8, 16), mixed_batches=(2,), mixed_context=16)


class Model:
    """One Llama layer's weights, run `layers` times per step, and one shared KV buffer."""

    def __init__(self, shape: Shape, device: str, dtype: Any, kv_tokens: int) -> None:
        import torch

        self.torch = torch
        self.s = shape
        self.device = device
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*dims: int) -> Any:
            return (torch.randn(*dims, generator=g) / dims[-1] ** 0.5).to(device=device, dtype=dtype)

        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.qkv = w(q + 2 * kv, shape.hidden)
        self.o = w(shape.hidden, q)
        self.gate_up = w(2 * shape.mlp, shape.hidden)
        self.down = w(shape.hidden, shape.mlp)
        self.norm = torch.ones(shape.hidden, device=device, dtype=dtype)
        self.lm_head = w(shape.vocab, shape.hidden)
        self.embed = w(shape.vocab, shape.hidden)
        # K and V for kv_tokens positions: [2, kv_heads, tokens, head_dim]
        self.cache = torch.zeros(2, shape.kv_heads, kv_tokens, shape.head_dim, device=device, dtype=dtype)

    def _rms(self, x: Any) -> Any:
        return x * self.torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.norm

    def step(self, chunk: int, context: int, batch: int, decode_context: int) -> Any:
        """One engine step: a prefill chunk of `chunk` tokens over `context` cached ones (0: none)
        beside `batch` decodes over `decode_context` cached tokens each. Returns the sampled ids."""
        torch, s = self.torch, self.s
        from torch.nn.attention.bias import causal_lower_right
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        n = chunk + batch
        ids = torch.arange(n, device=self.device) % s.vocab
        x = self.embed[ids]
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for _ in range(s.layers):
            h = self._rms(x) @ self.qkv.T
            q, k, v = h.split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q * 1.0001 + 0.0001  # rotary-sized elementwise work on q and k
            k = k * 1.0001 + 0.0001
            outs = []
            if chunk:
                kc = self.cache[0, :, context:context + chunk]
                kc.copy_(k[:chunk].view(chunk, s.kv_heads, s.head_dim).transpose(0, 1))
                self.cache[1, :, context:context + chunk].copy_(
                    v[:chunk].view(chunk, s.kv_heads, s.head_dim).transpose(0, 1))
                keys = self.cache[0, :, : context + chunk].unsqueeze(0)
                vals = self.cache[1, :, : context + chunk].unsqueeze(0)
                qc = q[:chunk].view(chunk, s.heads, s.head_dim).transpose(0, 1).unsqueeze(0)
                mask = causal_lower_right(chunk, context + chunk)
                a = sdpa(qc, keys, vals, attn_mask=mask, enable_gqa=True)
                outs.append(a[0].transpose(0, 1).reshape(chunk, q_dim))
            if batch:
                span = decode_context + 1
                cache = self.cache[:, :, : batch * span].view(2, s.kv_heads, batch, span, s.head_dim)
                cache[0, :, :, -1].copy_(k[chunk:].view(batch, s.kv_heads, s.head_dim).transpose(0, 1))
                cache[1, :, :, -1].copy_(v[chunk:].view(batch, s.kv_heads, s.head_dim).transpose(0, 1))
                keys = cache[0].transpose(0, 1)  # [batch, kv_heads, span, dim]
                vals = cache[1].transpose(0, 1)
                qd = q[chunk:].view(batch, s.heads, 1, s.head_dim)
                outs.append(sdpa(qd, keys, vals, enable_gqa=True).reshape(batch, q_dim))
            x = x + torch.cat(outs) @ self.o.T
            gu = self._rms(x) @ self.gate_up.T
            gate, up = gu.chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ self.down.T
        last = ([chunk - 1] if chunk else []) + list(range(chunk, n))
        return (self._rms(x[last]) @ self.lm_head.T).argmax(-1)


def timed(model: Model, reps: int, **kw: int) -> float:
    """Fastest of `reps` runs of one step, in seconds (after one untimed warm-up)."""
    torch = model.torch
    cuda = model.device.startswith("cuda")
    model.step(**kw)
    best = float("inf")
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.step(**kw)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            model.step(**kw)
            best = min(best, time.perf_counter() - t0)
    return best


def plan(sw: Sweep) -> list[tuple[str, dict[str, int]]]:
    """Every step shape, the three kinds interleaved: a run cut short by its time budget still has
    samples of each kind (prefill, decode and mixed)."""
    kinds: dict[str, list[tuple[str, dict[str, int]]]] = {"prefill": [], "decode": [], "mixed": []}
    for ctx in sw.contexts:
        for c in sw.chunks:
            if ctx + c <= sw.max_context:
                kinds["prefill"].append(("prefill", dict(chunk=c, context=ctx, batch=0, decode_context=0)))
    for dctx in sw.decode_contexts:
        for b in sw.batches:
            if b * (dctx + 1) <= sw.max_decode_tokens:
                kinds["decode"].append(("decode", dict(chunk=0, context=0, batch=b, decode_context=dctx)))
    for b in sw.mixed_batches:
        for c in sw.mixed_chunks:
            kinds["mixed"].append(("mixed", dict(chunk=c, context=sw.mixed_context, batch=b,
                                                 decode_context=sw.mixed_context)))
    steps: list[tuple[str, dict[str, int]]] = []
    for i in range(max(len(v) for v in kinds.values())):
        steps += [v[i] for v in kinds.values() if i < len(v)]
    return steps


def kv_bench(out: Path, tiny: bool, memory: str, timeout: float) -> dict[str, Any]:
    """`kairos kv-bench` in host memory (dram) or GPU memory (vram); its report, or why not."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return {"skipped": f"NIXL is not importable ({e})"}
    report = out / f"kv-bench-{memory}.json"
    size = str(1 << 20 if tiny else 256 << 20)
    cmd = [sys.executable, "-m", "common.kv.bench", "--memory", memory, "--size", size, "--iters",
           "3" if tiny else "20", "--out", str(report)]
    # UCX prints the protocol and transports it picked for each transfer (in GPU memory: cuda_ipc,
    # or staging through host memory): kept beside the report
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 10.0), env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"{' '.join(cmd[1:])} did not finish within {timeout:.0f} s"}
    (out / f"kv-bench-{memory}.stderr.log").write_text(r.stderr)
    if r.returncode != 0:
        return {"failed": f"{' '.join(cmd[1:])} exited {r.returncode}: {r.stderr[-500:]}"}
    return {"command": " ".join(cmd[1:]), "report": json.loads(report.read_text())}


def vllm_stage(out: Path, tiny: bool, budget_s: float) -> dict[str, Any]:
    """bench.gpu_vllm (vLLM on this platform, baseline vs Kairos) when vLLM is installed."""
    from bench import gpu_vllm

    if why := gpu_vllm.unavailable():
        return {"skipped": why}
    if budget_s < 60:
        return {"skipped": f"the time budget is spent ({budget_s:.0f} s left)"}
    cmd = [sys.executable, "-m", "bench.gpu_vllm", "--out", str(out), "--requests", "8" if tiny else "48",
           "--budget-s", str(int(budget_s - 20))]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"failed": f"bench.gpu_vllm did not finish within {budget_s:.0f} s"}
    res = out / "gpu-vllm.json"
    if not res.exists():
        return {"failed": f"bench.gpu_vllm exited {r.returncode}: {r.stderr[-800:]}"}
    return {"command": " ".join(cmd[1:]), "summary": r.stdout.strip().splitlines()[-1:], **json.loads(res.read_text())}


def summarize_stage(name: str, res: dict[str, Any]) -> str:
    if "skipped" in res or "failed" in res:
        return f"{name}: {'SKIPPED' if 'skipped' in res else 'FAILED'}: {res.get('skipped') or res.get('failed')}"
    if "report" in res:
        r = res["report"]
        return (f"{name}: {r['single']['gbps_median']:.2f} GB/s one block, {r['blocks']['gbps_median']:.2f} GB/s "
                f"{r['blocks']['blocks']} scattered blocks ({r['size_bytes'] >> 20} MiB; copy "
                f"{r['memcpy_gbps_median']:.2f} GB/s)")
    return f"{name}: {'ok' if res.get('ok') else 'FAILED'}: {'; '.join(res.get('summary', []))}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu-check.json and gpu-check-profile.json")
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes (CPU smoke run, seconds)")
    ap.add_argument("--device", default="", help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per step shape (the fastest is kept)")
    ap.add_argument("--no-kv-bench", action="store_true", help="skip `kairos kv-bench`")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM stage (bench.gpu_vllm)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="time for the whole check; the sweep stops at 60 %% of it and fits what it has")
    args = ap.parse_args(argv)
    import torch

    from common.perf_model import PerfModel, Profile, StepSample, fit, mape, save_profile

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device == "cpu":
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); use --tiny for the CPU smoke run",
              file=sys.stderr)
        return 2
    shape, sweep = (TINY, TINY_SWEEP) if args.tiny else (Shape(), Sweep())
    if device == "cpu":
        torch.set_num_threads(1)  # steadier timings on a shared machine; the CPU run is a smoke test
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    decode_kv = max(b * (c + 1) for b in sweep.batches for c in sweep.decode_contexts
                    if b * (c + 1) <= sweep.max_decode_tokens)
    mixed_kv = max(sweep.mixed_batches) * (sweep.mixed_context + 1) + sweep.mixed_context + max(sweep.mixed_chunks)
    kv_tokens = max(sweep.max_context, decode_kv, mixed_kv)
    t_start = time.monotonic()
    with torch.inference_mode():
        model = Model(shape, device, dtype, kv_tokens)
        rows: list[dict[str, Any]] = []
        samples: list[StepSample] = []
        steps = plan(sweep)
        for kind, kw in steps:
            if time.monotonic() - t_start > 0.6 * args.budget_s:
                print(f"sweep: time budget reached after {len(rows)} of {len(steps)} step shapes", flush=True)
                break
            sec = timed(model, args.repeats, **kw)
            b, dctx = kw["batch"], kw["decode_context"]
            chunks = [(kw["chunk"], kw["context"])] if kw["chunk"] else []
            # the perf_model convention: a decode's KV tokens = its context plus the token it adds
            samples.append(StepSample(b, b * (dctx + 1), chunks, sec))
            rows.append({"kind": kind, **kw, "seconds": sec})
            print(f"{kind:8s} chunk={kw['chunk']:<5d} context={kw['context']:<6d} batch={b:<4d} "
                  f"decode_context={dctx:<5d} {sec * 1000:9.3f} ms", flush=True)
    model_fit, err = fit(samples)
    per_kind = {k: round(mape(model_fit, [s for s, r in zip(samples, rows, strict=True) if r["kind"] == k]), 4)
                for k in ("prefill", "decode", "mixed")}
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or platform.machine()
    name = "gpu-check-tiny" if args.tiny else "gpu-check-" + "".join(c if c.isalnum() else "-" for c in gpu.lower())
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cmd = "python -m bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    kv: dict[str, Any] = {}
    for memory in ("dram", "vram"):
        left = args.budget_s - (time.monotonic() - t_start)
        if args.no_kv_bench:
            kv[memory] = {"skipped": "--no-kv-bench"}
        elif memory == "vram" and not device.startswith("cuda"):
            kv[memory] = {"skipped": "no CUDA device"}
        else:
            kv[memory] = kv_bench(out, args.tiny, memory, min(120.0, left / 2))
    left = args.budget_s - (time.monotonic() - t_start)
    vllm = {"skipped": "--no-vllm"} if args.no_vllm else vllm_stage(out, args.tiny, left)
    result = {
        "when": when, "command": cmd, "device": device, "device_name": gpu, "torch": torch.__version__,
        "cuda": torch.version.cuda, "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape),
        "sweep": asdict(sweep), "repeats": args.repeats, "seconds_total": round(time.monotonic() - t_start, 1),
        "fit": {f: getattr(model_fit, f) for f in PerfModel.__struct_fields__}, "fit_mape": round(err, 4),
        "fit_mape_per_kind": per_kind, "steps_planned": len(steps), "samples": rows, "kv_bench": kv["dram"],
        "kv_bench_vram": kv["vram"], "vllm": vllm,
    }
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    save_profile(Profile(
        name=name, description=f"{name}: Llama-3-8B-shaped model, random weights, plain PyTorch ({gpu})",
        derivation=(f"Measured with `{cmd}` on {gpu} ({when}, torch {torch.__version__}): {len(samples)} step "
                    f"shapes, the fastest of {args.repeats} runs each; fitted by common.perf_model.fit."),
        model=model_fit, fit_mape={"all": round(err, 4), **per_kind}), out / "gpu-check-profile.json")
    print(f"\n== gpu-check summary ({gpu}, {time.monotonic() - t_start:.0f} s)")
    print(f"sweep: {len(rows)} of {len(steps)} step shapes; fit MAPE {err:.1%} ({per_kind})")
    print(summarize_stage("kv-bench host memory", kv["dram"]))
    print(summarize_stage("kv-bench GPU memory", kv["vram"]))
    print(summarize_stage("vLLM stage", vllm))
    print(f"wrote {out / 'gpu-check.json'} and {out / 'gpu-check-profile.json'}")
    failed = [n for n, r in (("kv-bench dram", kv["dram"]), ("kv-bench vram", kv["vram"]), ("vllm", vllm))
              if "failed" in r or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
