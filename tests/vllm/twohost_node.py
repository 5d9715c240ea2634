"""One "host" of the two-host KV hand-off test: a vLLM CPU engine built from worker settings.

    python -m tests.vllm.twohost_node prefill|decode MODEL_DIR [KAIROS_* settings in the env]

The engine is made exactly as a worker makes it (`make_engine(WorkerConfig)`: the vLLM hook
check, the side-channel host/port/bind settings). It then serves JSON lines from stdin and
answers each on stdout, on lines starting with PREFIX (test_two_hosts.py runs one of these
per network namespace):

    prefill  {"id", "prompt"}                               -> {"id", "kv_params"} | {"id", "error"}
    decode   {"id", "prompt", "kv_params"|null, "max_tokens"} -> {"id", "tokens", "finish"}
    both     {"reset": true}                                -> {"reset": bool}
    both     {"stats": true}                                -> {"kv_fallbacks", "fallback_reasons"}

The first line it prints is {"ready": ..., "side_channel": ...}. EOF on stdin ends it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from typing import Any

PREFIX = "@@twohost "  # marks this protocol's lines among whatever else reaches stdout (logs)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main(role: str, model: str) -> None:
    from common.config import WorkerConfig, load
    from common.engines import make_engine
    from common.engines.base import EngineRequest
    from common.messages import KvHandle, Sampling

    cfg = load(WorkerConfig, overrides={"engine": "vllm", "model": model})
    engine: Any = make_engine(cfg, role)  # type: ignore[arg-type]
    prefilled: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    tokens: dict[str, list[int]] = {}
    done: dict[str, asyncio.Future[str]] = {}
    loop = asyncio.get_running_loop()

    def on_tokens(items: Any, step_s: float) -> None:
        for it in items:
            tokens.setdefault(it.request_id, []).extend(it.token_ids)
            if it.finish_reason is not None:
                fut = done.setdefault(it.request_id, loop.create_future())
                if not fut.done():
                    fut.set_result(it.finish_reason)

    def on_failed(rid: str, attempt: int, why: str, retryable: bool = True) -> None:
        if role == "prefill":
            prefilled.put_nowait({"id": rid, "error": why})

    engine.on_prefilled = lambda pr: prefilled.put_nowait({"id": pr.request_id, "kv_params": pr.kv_params})
    engine.on_tokens = on_tokens
    engine.on_failed = on_failed
    await engine.start()
    runner = asyncio.create_task(engine.run())
    _emit({"ready": role, "side_channel": [engine.side_channel_host, engine.side_channel_port],
           "bind": engine.side_channel_bind})
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            msg = json.loads(line)
            if msg.get("reset"):
                _emit({"reset": await engine.reset_prefix_cache()})
            elif msg.get("stats"):
                _emit({"kv_fallbacks": engine.kv_fallbacks, "fallback_reasons": dict(engine.kv_fallback_reasons)})
            elif role == "prefill":
                engine.add(EngineRequest(request_id=msg["id"], attempt=0, prompt_token_ids=msg["prompt"],
                                         sampling=Sampling(max_tokens=1, ignore_eos=True), mode="prefill"))
                _emit(await asyncio.wait_for(prefilled.get(), 120))
            else:
                params = msg.get("kv_params")
                kv = None if params is None else KvHandle(transport="nixl", source_worker="prefill-host",
                                                          tokens=len(msg["prompt"]), params=params)
                engine.add(EngineRequest(request_id=msg["id"], attempt=0, prompt_token_ids=msg["prompt"],
                                         sampling=Sampling(max_tokens=msg["max_tokens"], ignore_eos=True),
                                         mode="handoff" if kv else "deflect", kv=kv))
                fut = done.setdefault(msg["id"], loop.create_future())
                finish = await asyncio.wait_for(fut, 120)
                _emit({"id": msg["id"], "tokens": tokens.pop(msg["id"], []), "finish": finish})
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await engine.close()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
