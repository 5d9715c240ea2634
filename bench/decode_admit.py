"""A deflection's handling on the decode worker, in process: the first token's path from the
DecodeWork's receipt to the engine's `add` (the "wr -> wa" hop of router-throughput.md's "Added
TTFT hop by hop"), no socket.

    python -m bench.decode_admit                 # 3000 deflections of 128 prompt tokens, 3 runs

One decode worker (the simulated engine, the `fast` profile, its prefix cache on with 16-token
blocks as the worker's defaults have it) handles --requests DecodeWork messages one at a time
(`DecodeWorker.on_message`: the engine's load, the prefix cache's hits for the prompt, the
admission check, the engine's `add`); each is aborted again after it, so every one is admitted
to the same idle engine. Its step-time windows are filled first, as a running engine's are.
Wall microseconds per message (the handling alone), and CPU microseconds per message over the
whole run (the handling and the abort after it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import config
from common import logging as logs
from common import messages as m
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from services.decode_worker.service import DecodeWorker


async def one_run(n: int, prompt_tokens: int) -> tuple[float, float]:
    """(wall µs per DecodeWork handled, CPU µs per DecodeWork with its abort) over `n` of them."""
    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_transport": "modeled"})
    engine = SimEngine("decode", load_profile("fast"), prefix_block_tokens=cfg.prefix_block_tokens)
    w = DecodeWorker(cfg, engine)
    w.core.ports.send = lambda msg: None  # type: ignore[method-assign]  # no bus
    now = time.monotonic()
    for i in range(64):
        engine._step_ms.append(0.5 + i * 0.001)
    for i in range(1000):
        engine.step_errors.observe(0.0005, 0.0005 * (1 + (i % 7) / 100), now)
    works = [m.DecodeWork(request_id=f"r{i}", attempt=0, dispatch=i + 1, mode="deflect",
                          prompt_token_ids=list(range(100 + i, 100 + i + prompt_tokens)),
                          sampling=m.Sampling(max_tokens=16), tbt_slo=0.1, deadline_s=5.0,
                          chunk_schedule=(prompt_tokens,), step_budget_s=0.05) for i in range(n)]
    wall = 0.0
    c0 = time.process_time()  # (once per run: the CPU clock's own call costs tens of µs on some VMs)
    for wk in works:
        t0 = time.perf_counter()
        w.on_message(wk)
        wall += time.perf_counter() - t0
        if wk.request_id not in w.core.active:
            raise SystemExit(f"bench.decode_admit: {wk.request_id} was not admitted; this bench times admissions")
        engine.abort(wk.request_id)
        w.core.active.pop(wk.request_id, None)
        w.core.drop(wk.request_id)
    return wall / n * 1e6, (time.process_time() - c0) / n * 1e6


async def main_async(a: argparse.Namespace) -> None:
    runs = [await one_run(a.requests, a.prompt_tokens) for _ in range(a.repeat)]
    walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
    print(f"DecodeWork handled: {statistics.median(walls):.1f} µs wall (runs {min(walls):.1f}-{max(walls):.1f}), "
          f"{statistics.median(cpus):.1f} µs CPU (runs {min(cpus):.1f}-{max(cpus):.1f}), "
          f"{a.requests} x {a.prompt_tokens}-token deflections x {a.repeat} runs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_admit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="DecodeWork messages per run (default 3000)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("--repeat", type=int, default=3, help="runs (default 3)")
    a = p.parse_args(argv)
    logs.configure("bench", level="info")  # as the worker configures it
    asyncio.run(main_async(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
