"""`--enable-prompt-tokens-details` (vLLM's server flag of the same name, off by default there and
here): usage gains `prompt_tokens_details` in vLLM's shapes. The sim engine keeps no prefix cache
and reports no hits, so `cached_tokens` is 0 here; the vLLM tier checks real hits side by side
with vLLM's own server (tests/vllm/test_openai_conformance.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kairos.up import Cluster
from tests.conftest import start_cluster

MSGS = [{"role": "user", "content": "the lazy dog"}]


@pytest.fixture(scope="module", params=[True, False], ids=["on", "off"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("ptd"), prefill=1, decode=1, profile="fast", policy="deflect-all",
                      router_env={"KAIROS_ENABLE_PROMPT_TOKENS_DETAILS": str(request.param).lower()})
    c.on = request.param  # type: ignore[attr-defined]
    yield c
    c.stop(15)


def _stream_usage(url: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=30)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    usage: dict[str, object] = events[-1]["usage"]
    return usage


def test_usage_shapes(cluster: Cluster) -> None:
    on = cluster.on  # type: ignore[attr-defined]
    api = cluster.spec.api + "/v1"
    comp = {"prompt": "the quick brown fox", "max_tokens": 3}
    chat = {"messages": MSGS, "max_tokens": 3}
    u = httpx.post(api + "/completions", json=comp, timeout=30).json()["usage"]
    assert u["prompt_tokens_details"] == ({"cached_tokens": 0, "created_cache_tokens": None,
                                           "multimodal_tokens": None} if on else None)
    u = httpx.post(api + "/chat/completions", json=chat, timeout=30).json()["usage"]
    assert u["prompt_tokens_details"] == ({"cached_tokens": 0, "created_cache_tokens": 0,
                                           "multimodal_tokens": None} if on else None)
    # streams leave out the None fields, as vLLM's stream chunks do
    u = _stream_usage(api + "/completions", comp)
    assert u.get("prompt_tokens_details") == ({"cached_tokens": 0} if on else None)
    u = _stream_usage(api + "/chat/completions", chat)
    assert u.get("prompt_tokens_details") == ({"cached_tokens": 0, "created_cache_tokens": 0} if on else None)
