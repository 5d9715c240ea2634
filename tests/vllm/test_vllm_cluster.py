"""`kairos up --engine vllm` on the tiny model: the official OpenAI client, down both paths.

A real cluster of processes (router, one prefill and one decode worker, each with its own vLLM
engine); the disaggregated path moves the KV over vLLM's NIXL connector. Greedy outputs must be
the reference ids of docs/reference/vllm.md (section 5) on both paths.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kairos.up import Cluster, ClusterSpec
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]

PROMPT = [5, 6, 7, 8, 9]
REFERENCE = [515, 273, 598, 515, 468, 550, 515, 550, 515, 981, 118, 725, 550, 515, 598, 515]


@pytest.fixture(scope="module", params=["disagg-least-loaded", "deflect-all"])
def cluster(request: pytest.FixtureRequest, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy=request.param, monitor=False,
                                 log_dir=str(tmp_path_factory.mktemp("vllm-cluster")),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64"},
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64"})
    c = Cluster(spec)
    c.start(timeout=300)
    c.policy = request.param  # type: ignore[attr-defined]
    yield c
    c.stop(30)


def _reference_text(model_dir: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    text: str = tok.decode(REFERENCE, skip_special_tokens=True)
    return text


def test_openai_client_gets_the_reference_tokens(cluster: Cluster, tiny_model: Path) -> None:
    client = openai.OpenAI(base_url=cluster.spec.api + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                     extra_body={"ignore_eos": True})
    route = "deflect" if cluster.policy == "deflect-all" else "disagg"  # type: ignore[attr-defined]
    assert r.headers["x-kairos-route"] == route
    out = r.parse()
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert out.choices[0].text == _reference_text(tiny_model)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == out.choices[0].text


def test_chat_on_the_real_engine(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.spec.api + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "the quick brown fox"}],
                                         max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"


def test_prompt_over_max_model_len_is_400_at_once(cluster: Cluster) -> None:
    """The workers advertise vLLM's max_model_len (2048 here) at registration; the router answers
    a longer prompt with 400 before dispatch (formerly: three tries on the engine, then 503)."""
    import httpx

    r = httpx.post(cluster.spec.api + "/v1/completions", json={"prompt": [5] * 2100, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and r.headers["x-kairos-error"] == "context_length_exceeded"
    assert "2048" in err["message"]
    assert "retry-after" not in r.headers
    counts = httpx.get(cluster.spec.api + "/v1/kairos/stats", timeout=10).json()["counts"]
    assert "redispatched" not in counts
