"""`--enable-prompt-tokens-details` side by side: vLLM's own server and Kairos (1 prefill + 1
decode worker, vLLM engine), both with the flag, on both of Kairos' routes; and a conversation's
second turn served from the prefix cache (issue 16's vLLM-tier check).

Each shape is sent twice to each server: the first send computes the prompt (cached_tokens 0;
chat also reports the prompt tokens it added to the cache), the second finds the prompt's full
blocks cached. Prompts differ per shape and per route, so vLLM's server (shared by both routes)
starts every shape cold, as each fresh Kairos cluster does. On the disaggregated route the
decode engine reports the prefill engine's hits, as in vLLM's own P/D setup.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kairos.up import Cluster, ClusterSpec
from tests.vllm.conftest import run_vllm_server
from tests.vllm.helpers import VLLM_MISSING
from tests.vllm.test_openai_conformance import _diff, _post

# setup starts a vLLM server and a Kairos cluster of two vLLM engines: minutes on shared CI cores.
# The server is requested first, so it starts before the cluster's engines compete for the cores
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or ""),
              pytest.mark.timeout(600)]

BLOCK = 128  # vLLM's KV block on the CPU platform
ROUTES = {"disagg-least-loaded": "disagg", "deflect-all": "deflect"}


def ids(seed: int, n: int = 300) -> list[int]:
    """Token ids of whole ASCII pieces: the tiny tokenizer's merges (259 and up), not its byte
    alphabet, whose partial UTF-8 sequences vLLM's detokenizer renders with the prompt's tail."""
    return [(seed * 7919 + 31 * i) % 760 + 260 for i in range(n)]


def words(seed: int) -> str:
    pool = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
    return " ".join(pool[(seed * 5 + 3 * i) % len(pool)] + str(i) for i in range(120))


def shapes(seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    g = {"temperature": 0, "max_tokens": 4}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    return [
        ("completion", "completions", {**g, "prompt": ids(seed)}),
        ("completion_stream", "completions", {**g, "prompt": ids(seed + 1), **usage}),
        ("chat", "chat/completions", {**g, "messages": [{"role": "user", "content": words(seed + 2)}]}),
        ("chat_stream", "chat/completions", {**g, "messages": [{"role": "user", "content": words(seed + 3)}],
                                             **usage}),
    ]


@pytest.fixture(scope="module")
def vllm_details(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from run_vllm_server(tiny_model, tmp_path_factory.mktemp("vllm-details"), "--enable-prompt-tokens-details")


@pytest.fixture(scope="module", params=list(ROUTES))
def kairos_details(request: pytest.FixtureRequest, tiny_model: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy=request.param, monitor=False,
                                 log_dir=str(tmp_path_factory.mktemp("details")),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64", "KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50", "KAIROS_ENABLE_PROMPT_TOKENS_DETAILS": "true"},
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64"})
    c = Cluster(spec)
    c.start(timeout=300)
    yield c.spec.api + "/v1", ROUTES[request.param], list(ROUTES).index(request.param) * 100
    c.stop(30)


def test_same_details_cold_then_cached(vllm_details: str, kairos_details: tuple[str, str, int],
                                       tiny_model: Path) -> None:
    url, route, seed = kairos_details
    for name, endpoint, body in shapes(seed):
        req = {"model": tiny_model.name, **body}
        for send in ("cold", "cached"):
            s1, want, _ = _post(f"{vllm_details}/{endpoint}", req)
            s2, got, headers = _post(f"{url}/{endpoint}", req)
            assert s1 == 200 and s2 == 200, (want, got)
            assert headers.get("x-kairos-route") == route
            cached = want["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached == 0) if send == "cold" else (cached >= BLOCK), (name, send, want["usage"])
            diffs = _diff(want, got)
            assert not diffs, f"{name} ({send}) on the {route} route:\n" + "\n".join(diffs[:20])


def test_second_turn_hits_the_cache_and_matches_cold(vllm_details: str, kairos_details: tuple[str, str, int],
                                                     tiny_model: Path) -> None:
    """Turn 2 = turn 1's prompt + its output + new text, at the token level. Kairos has served turn 1
    (on the one decode worker, or through the one prefill worker), so turn 2 prefills only what is
    not in full cached blocks; vLLM's server never saw turn 1 and serves turn 2 cold."""
    url, route, seed = kairos_details
    model = tiny_model.name
    turn1 = ids(seed + 50)
    r = httpx.post(f"{url}/completions", json={"model": model, "prompt": turn1, "max_tokens": 16, "temperature": 0,
                                              "ignore_eos": True, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    out1 = r.json()["choices"][0]["token_ids"]
    turn2 = turn1 + out1 + ids(seed + 60, 40)
    body = {"model": model, "prompt": turn2, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    warm = httpx.post(f"{url}/completions", json=body, timeout=120)
    assert warm.status_code == 200 and warm.headers["x-kairos-route"] == route
    cold = httpx.post(f"{vllm_details}/completions", json=body, timeout=120).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    w = warm.json()
    # every full block of turn 1's computed tokens (its prompt and all outputs but the last)
    assert w["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(turn1) + len(out1) - 1) // BLOCK * BLOCK
    # the vLLM workers' cache reports reach the router's prefix index (these baseline policies do
    # not price by it, so x-kairos-cached-tokens stays 0 here)
    prefix = httpx.get(url.removesuffix("/v1") + "/v1/kairos/stats", timeout=10).json()["prefix"]
    assert prefix["summaries"] > 0 and prefix["blocks"] > 0 and prefix["workers"], prefix
    assert w["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert w["choices"][0]["text"] == cold["choices"][0]["text"]
