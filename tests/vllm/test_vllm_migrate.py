"""Mid-stream migration on the real engine: greedy decoding resumed from the prompt plus the
tokens already sent continues exactly where the first worker stopped.

Engine level: the vLLM decode engine, given prompt + the first k output tokens and max_tokens - k,
produces the rest of the uninterrupted greedy run. Cluster level: `kairos up --engine vllm` with two
decode workers; the worker streaming a request is killed (kill -9 of its process group: the worker
and its vLLM engine-core process) after the first tokens; the client's one stream must equal an
uninterrupted greedy run, with the right usage and finish_reason, and the router must have
migrated it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from common.engines.base import EngineRequest
from common.messages import Sampling, StructuredOutputs
from kairos.up import Cluster, ClusterSpec
from tests.vllm.helpers import PD, VLLM_MISSING, request

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")]

PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_resumed_greedy_run_continues_the_uninterrupted_one(pd: PD) -> None:
    assert await pd.decode.reset_prefix_cache()
    full = await pd.run_decode(request("whole", PROMPT, 40))
    assert await pd.decode.reset_prefix_cache()
    sent = full[:13]  # what the first worker had streamed when it died
    rest = await pd.run_decode(EngineRequest(
        request_id="resumed", attempt=1, prompt_token_ids=PROMPT + sent, mode="deflect", resume_tokens=len(sent),
        sampling=Sampling(max_tokens=40 - len(sent), ignore_eos=True)))
    assert await pd.decode.reset_prefix_cache()
    assert sent + rest == full
    assert pd.out.finish["resumed"] == "length"
    assert pd.out.starts["resumed"] == len(sent) and not pd.out.pos_errors  # positions go on from the resume


NAME_SCHEMA = StructuredOutputs(json=msgspec.json.encode({
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}).decode())


@pytest.mark.asyncio(loop_scope="session")
async def test_a_resumed_run_with_a_grammar_continues_inside_it(pd: PD) -> None:
    """With a grammar (a JSON schema), the resumed request's grammar first accepts the output
    already sent (resume_tokens), so the output continues the JSON instead of starting another."""
    def grammar_request(rid: str, prompt: list[int], max_tokens: int, resume: int) -> EngineRequest:
        return EngineRequest(request_id=rid, attempt=1 if resume else 0, prompt_token_ids=prompt, mode="deflect",
                             resume_tokens=resume, sampling=Sampling(max_tokens=max_tokens, structured=NAME_SCHEMA))

    assert await pd.decode.reset_prefix_cache()
    full = await pd.run_decode(grammar_request("json-whole", PROMPT, 30, 0))
    assert len(full) > 8, full
    sent = full[:6]
    assert await pd.decode.reset_prefix_cache()
    rest = await pd.run_decode(grammar_request("json-resumed", PROMPT + sent, 30 - len(sent), len(sent)))
    assert sent + rest == full
    assert pd.out.finish["json-resumed"] == pd.out.finish["json-whole"]
    # without the resume count the grammar starts over: another JSON object, not the same output
    assert await pd.decode.reset_prefix_cache()
    fresh = await pd.run_decode(EngineRequest(request_id="json-restarted", attempt=1, prompt_token_ids=PROMPT + sent,
                                              mode="deflect",
                                              sampling=Sampling(max_tokens=30 - len(sent), structured=NAME_SCHEMA)))
    assert sent + fresh != full
    assert await pd.decode.reset_prefix_cache()


def migrated(api: str) -> int:
    """The router's count of requests resumed on another decode worker."""
    return int(httpx.get(api + "/v1/kairos/stats", timeout=10).json()["counts"].get("migrated", 0))


def stream_killing_its_worker(cluster: Cluster, body: dict[str, Any]) -> tuple[str, str | None, Any]:
    """Stream the completion `body` and, after its first chunk, kill -9 the decode worker
    streaming it (its process group: the worker and its engine-core process). What the client got:
    the text, the last finish_reason and the usage (when the body asks for it). After the first
    chunk, not later: a router starved of CPU joins the tokens one loop turn delivers into one
    chunk, and a 600-token stream of the tiny model once came in two (seen on the shared 2-core host)."""
    chunks: list[str] = []
    finish = None
    usage = None
    killed = ""
    with httpx.stream("POST", cluster.spec.api + "/v1/completions", timeout=300,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        victim = r.headers["x-kairos-decode-worker"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                chunks.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
            if not killed and chunks:
                p = cluster.services[victim].proc
                assert p is not None
                os.killpg(p.pid, signal.SIGKILL)
                killed = victim
    assert killed
    return "".join(chunks), finish, usage


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec.ephemeral(prefill=0, decode=2, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy="deflect-all", monitor=False,
                                 log_dir=str(tmp_path_factory.mktemp("vllm-migrate")),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64",
                                             "KAIROS_LIVENESS": "50"},  # 5 s: the 2 shared CI cores stall workers
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64"})
    c = Cluster(spec)
    c.start(timeout=400)
    yield c
    c.stop(30)


@pytest.mark.timeout(600)  # the fixture's start alone may take up to 400 s on 2 busy cores
def test_killing_the_decode_worker_mid_stream_leaves_one_greedy_stream(cluster: Cluster) -> None:
    api = cluster.spec.api
    max_tokens = 400
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(api + "/v1/completions", json=body, timeout=300)
    assert whole.status_code == 200, whole.text
    want = whole.json()["choices"][0]["text"]
    before = migrated(api)

    text, finish, usage = stream_killing_its_worker(
        cluster, {**body, "stream_options": {"include_usage": True}})
    assert text == want                             # nothing repeated, nothing missing
    assert finish == "length"
    assert usage is not None and usage["completion_tokens"] == max_tokens and usage["prompt_tokens"] == len(PROMPT)
    after = migrated(api)
    # at least one migration: the kill came mid-stream. A second one is the router doing its job
    # when the surviving worker also goes silent past the liveness timeout (seen once in CI: the
    # other decode worker silent 5 s on 2 starved cores, then the stream resumed and was whole)
    assert after > before, "the stream finished before the kill: nothing was migrated"


# the tiny model never closes a string of its own accord: a bounded string makes the grammar end it
STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200, "maxLength": 200}},
                "required": ["story"], "additionalProperties": False}


@pytest.mark.timeout(600)
def test_a_grammar_stream_whose_worker_is_killed_stays_one_valid_json(cluster: Cluster) -> None:
    """The cluster-level twin of the grammar resume test above: a JSON-schema stream is migrated
    when its decode worker is killed mid-stream, and the client still gets exactly the greedy
    output of an uninterrupted run: one JSON object that satisfies the schema, not a second one
    started after the first tokens."""
    dead = [n for n, s in cluster.services.items() if n.startswith("decode") and s.proc is not None
            and s.proc.poll() is not None]
    for name in dead:  # the test above killed one: bring it back, so that a worker is left to resume on
        cluster.restart(name)
    cluster.wait_registered(set(dead), timeout=400)
    api = cluster.spec.api
    body = {"prompt": PROMPT, "max_tokens": 600, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}}
    whole = httpx.post(api + "/v1/completions", json=body, timeout=300)
    assert whole.status_code == 200, whole.text
    want = whole.json()["choices"][0]["text"]
    assert len(json.loads(want)["story"]) == 200
    before = migrated(api)

    got, finish, _ = stream_killing_its_worker(cluster, body)
    assert got == want  # one JSON object, continued where the dead worker stopped
    assert len(json.loads(got)["story"]) == 200
    assert finish == whole.json()["choices"][0]["finish_reason"] == "stop"
    after = migrated(api)
    assert after > before, "the stream finished before the kill: nothing was migrated"
