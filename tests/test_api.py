"""The OpenAI API end to end: the official client against a real local cluster, down both paths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kairos.up import Cluster
from tests.conftest import start_cluster


@pytest.fixture(scope="module", params=["disagg-least-loaded", "deflect-all"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("api"), prefill=1, decode=1, profile="fast", policy=request.param)
    c.policy = request.param  # type: ignore[attr-defined]
    yield c
    c.stop(15)


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.spec.api + "/v1", api_key="unused", max_retries=0, timeout=30)


def expected_route(c: Cluster) -> str:
    return "deflect" if c.policy == "deflect-all" else "disagg"  # type: ignore[attr-defined]


def test_completion_unary(cluster: Cluster) -> None:
    r = client(cluster).completions.with_raw_response.create(model="kairos-sim", prompt="the quick brown fox",
                                                             max_tokens=7)
    assert r.headers["x-kairos-route"] == expected_route(cluster)
    out = r.parse()
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 7 and out.usage.prompt_tokens == 4
    assert len(out.choices[0].text.split()) == 7


def test_completion_stream_matches_unary_text(cluster: Cluster) -> None:
    c = client(cluster)
    chunks = list(c.completions.create(model="kairos-sim", prompt=[5, 6, 7, 8, 9, 10], max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len(text.split()) == 12


def test_chat_unary_and_stream(cluster: Cluster) -> None:
    c = client(cluster)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rid = {"x-request-id": f"chat-{cluster.policy}"}  # type: ignore[attr-defined]
    out = c.chat.completions.create(model="kairos-sim", messages=msgs, max_tokens=5,  # type: ignore[arg-type]
                                    extra_headers=rid, seed=7)
    assert out.choices[0].message.role == "assistant"
    assert len((out.choices[0].message.content or "").split()) == 5
    stream = c.chat.completions.create(model="kairos-sim", messages=msgs, max_tokens=5,  # type: ignore[arg-type]
                                       stream=True, extra_headers=rid, seed=7)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert content == out.choices[0].message.content  # synthetic tokens: a function of the seed and position
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_health(cluster: Cluster) -> None:
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == ["kairos-sim"]
    assert cluster.get("/health")[0] == 200
    status, body = cluster.get("/ready")
    assert status == 200 and body["decode_workers"] == 1 and body["prefill_workers"] == 1


def test_long_prompt_goes_down_its_path(cluster: Cluster) -> None:
    prompt = " ".join(["token"] * 3000)
    r = httpx.post(cluster.spec.api + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 3000
    assert body["kairos"]["route"] == expected_route(cluster)
    if expected_route(cluster) == "disagg":
        assert body["kairos"]["prefill_worker"] == "prefill-0"
    assert body["kairos"]["decode_worker"] == "decode-0"


def test_vllm_limits_and_utility_routes_answer_as_vllm_does(tmp_path: Path) -> None:
    """Workers with max_model_len 64 (a CPU vLLM's is 2048): a max_tokens the context cannot hold
    beside the prompt is a 400 (vLLM's message), not a reply cut at the context; without
    max_tokens the default is served. /v1/models and /tokenize report the workers' limit, with
    vLLM's root/parent/permission; /ping and /load answer."""
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="kairos",
                      worker_env={"KAIROS_SIM_MAX_MODEL_LEN": "64"})
    try:
        with httpx.Client(base_url=c.spec.api, timeout=20) as client:
            r = client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 100})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "max_tokens" and err["code"] == 400 and err["type"] == "BadRequestError"
            assert r.headers["x-kairos-error"] == "context_length_exceeded"
            assert "maximum context length is 64 tokens" in err["message"], err
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 64})
            assert r.status_code == 400 and "in the messages" in r.json()["error"]["message"]
            assert client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 8}).status_code == 200
            assert client.post("/v1/completions", json={"prompt": "one two three"}).status_code == 200
            model = client.get("/v1/models").json()["data"][0]
            assert model["max_model_len"] == 64 and model["parent"] is None and model["root"]
            assert model["permission"][0]["object"] == "model_permission"
            assert client.post("/tokenize", json={"prompt": "a b"}).json()["max_model_len"] == 64
            assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
            assert client.get("/load").json() == {"server_load": 0}
    finally:
        c.stop(15)


def test_unknown_routes_and_methods_answer_as_vllms_server(cluster: Cluster) -> None:
    r = httpx.get(cluster.spec.api + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = httpx.get(cluster.spec.api + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"} and r.headers["allow"] == "POST"


def test_responses_api_with_the_openai_client(cluster: Cluster) -> None:
    """POST /v1/responses as the official client uses it: a unary answer, a stream of typed events
    the client parses, and vLLM's answers for what it does not keep or support."""
    c = client(cluster)
    r = c.responses.with_raw_response.create(model="kairos-sim", input="the quick brown fox", max_output_tokens=6,
                                             instructions="be brief")
    assert r.headers["x-kairos-route"] == expected_route(cluster)
    out = r.parse()
    assert out.object == "response" and out.status == "incomplete" and out.id.startswith("resp_")
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 6 and out.usage.input_tokens > 4
    assert len(out.output_text.split()) == 6 and out.instructions == "be brief" and out.max_output_tokens == 6
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {"role": "user", "content": "again"}]
    events = list(c.responses.create(model="kairos-sim", input=msgs, max_output_tokens=5, stream=True))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and len(text.split()) == 5
    assert final.output[0].id == events[2].item.id  # type: ignore[union-attr]
    api = cluster.spec.api
    for body, status, param in (
            ({"input": "x", "previous_response_id": "resp_nope"}, 404, "response_id"),
            ({"input": "x", "background": True}, 400, "background"),
            ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning"),
            ({"input": "x", "nonsense": 1}, 400, "nonsense"),
            ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
            ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools")):
        r2 = httpx.post(api + "/v1/responses", json={"model": "kairos-sim", **body}, timeout=10)
        assert r2.status_code == status, (body, r2.text)
        err = r2.json()["error"]
        assert err["code"] == status and err["param"] == param, (body, err)
    assert httpx.get(api + "/v1/responses/resp_nope", timeout=10).status_code == 404
    assert httpx.get(api + "/v1/responses", timeout=10).status_code == 405
