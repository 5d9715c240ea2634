"""What vLLM's kv_both KV role costs against kv_producer / kv_consumer (docs/operations.md, "Role
changes"): one prefill and one decode engine on a model directory, both in kv_both (`both`) or in
their own roles (`role`); prints each engine's start time and the wall time of N hand-offs, one
after another (a prefill of a 200-token prompt, then the KV read and 16 tokens on the decode
engine), median and P90 without the first three. Needs the vLLM venv:

    .venv-vllm/bin/python -m bench.kv_both_cost MODEL_DIR both|role [N]

Run `both` and `role` alternately, in fresh processes, on the same host; `--start-only` times
the prefill engine's start alone (a fresh process each, the first engine of the process).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import warnings
from typing import Any

from common.engines.base import EngineRequest, Prefilled
from common.messages import KvHandle, Sampling, TokenItem
from common.ports import free_port


def _req(rid: str, prompt: list[int], max_tokens: int, mode: str, kv: dict[str, Any] | None = None) -> EngineRequest:
    handle = None if kv is None else KvHandle(transport="nixl", source_worker="bench", tokens=len(prompt), params=kv)
    return EngineRequest(request_id=rid, attempt=0, prompt_token_ids=prompt, kv=handle, mode=mode,  # type: ignore[arg-type]
                         sampling=Sampling(max_tokens=max_tokens, ignore_eos=True))


async def run(model: str, mode: str, n: int, start_only: bool) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import common.engines.vllm as vllm_engine
    kw: dict[str, Any] = dict(model=model, max_model_len=2048, kv_cache_mib=32, token_budget=256, max_batch=16,
                              kv_timeout=20.0, cache_root=tempfile.mkdtemp(), kv_both=mode == "both")
    p = vllm_engine.VllmEngine("prefill", side_channel_port=free_port(), **kw)
    t0 = time.monotonic()
    await p.start()
    tp = time.monotonic() - t0
    if start_only:
        await p.close()
        return f"{mode}: prefill engine start {tp:.1f} s"
    d = vllm_engine.VllmEngine("decode", side_channel_port=free_port(), **kw)
    t0 = time.monotonic()
    await d.start()
    td = time.monotonic() - t0
    prefilled: dict[str, Prefilled] = {}
    done: dict[str, asyncio.Event] = {}
    p.on_prefilled = lambda pr: prefilled.__setitem__(pr.request_id, pr)

    def on_tokens(items: list[TokenItem], step_s: float) -> None:
        for it in items:
            if it.finish_reason is not None:
                done.setdefault(it.request_id, asyncio.Event()).set()

    d.on_tokens = on_tokens
    runs = [asyncio.create_task(p.run()), asyncio.create_task(d.run())]
    walls: list[float] = []
    try:
        for i in range(n):
            rid, prompt = f"r{i}", [5 + (i * 7 + j) % 300 for j in range(200)]
            t0 = time.monotonic()
            p.add(_req(rid, prompt, 1, "prefill"))
            while rid not in prefilled:
                await asyncio.sleep(0.002)
            d.add(_req(rid, prompt, 16, "handoff", prefilled.pop(rid).kv_params))
            await asyncio.wait_for(done.setdefault(rid, asyncio.Event()).wait(), 60)
            walls.append(time.monotonic() - t0)
    finally:
        for t in runs:
            t.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await d.close()
        await p.close()
    w = sorted(walls[3:])
    return (f"{mode}: start prefill {tp:.1f} s, decode {td:.1f} s; hand-off + 16 tokens, n={len(w)}: median "
            f"{statistics.median(w) * 1000:.1f} ms, p90 {w[int(len(w) * 0.9)] * 1000:.1f} ms, "
            f"kv fallbacks {d.kv_fallbacks}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("model", help="a model directory (`kairos make-tiny-model DIR` makes the tiny one)")
    ap.add_argument("mode", choices=("both", "role"), help="both: kv_both engines; role: kv_producer + kv_consumer")
    ap.add_argument("n", type=int, nargs="?", default=60, help="hand-offs (default 60)")
    ap.add_argument("--start-only", action="store_true", help="time the prefill engine's start only")
    a = ap.parse_args()
    print(asyncio.run(run(a.model, a.mode, a.n, a.start_only)), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the main module must be import-safe
    main()
