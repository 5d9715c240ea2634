"""Every request-body field of vLLM's OpenAI server, sent to Kairos: honoured, or refused with a 400
naming it. None may be accepted and ignored.

The field list is the declared schemas of services/router/openai_bodies.py;
tests/vllm/test_openai_fields.py checks those equal vLLM 0.32's own pydantic request models.
Each case sends one field with a non-default value to a simulated cluster and checks the effect in
the response (sampling parameters, whose effect the simulated engine's synthetic tokens do not
show, are checked in the Sampling the router sends to the engine, and for real, against vLLM's
own server, in tests/vllm/test_openai_conformance.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest

from common import messages as m
from common.config import RouterConfig
from common.router_core.requests import Event, Request
from common.tokenizer import SimpleTokenizer
from kairos.up import Cluster
from services.router import openai_schema as schema
from services.router.openai_render import Choice
from tests.conftest import start_cluster

MSGS = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TOOLS_RENDERED = [{"type": "function",
                   "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}]
Check = Callable[[dict[str, Any]], bool]
REFUSE = "refused"


def _choice(r: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = r["choices"][0]
    return c


def _sampling(attr: str, want: Any) -> tuple[str, Any]:
    return ("sampling", (attr, want))


# field -> (value, expectation); expectation: REFUSE, ("sampling", (Sampling attribute, expected)),
# ("plan", (Plan attribute, expected)), ("tok", the tokenizer argument that must carry the value)
# or a check of the response body
COMMON: dict[str, tuple[Any, Any]] = {
    "model": ("kairos-sim", lambda r: r["model"] == "kairos-sim"),
    "frequency_penalty": (0.5, _sampling("frequency_penalty", 0.5)),
    "logit_bias": ({"7": -50}, _sampling("logit_bias", {7: -50.0})),
    "max_tokens": (3, lambda r: r["usage"]["completion_tokens"] == 3),
    "n": (2, lambda r: len(r["choices"]) == 2),
    "presence_penalty": (0.5, _sampling("presence_penalty", 0.5)),
    "response_format": ({"type": "json_object"}, _sampling("structured", m.StructuredOutputs(json_object=True))),
    "seed": (7, _sampling("seed", 7)),
    "stop": (["zzz"], ("plan", ("stop", ["zzz"]))),
    "stream": (True, lambda r: r["stream"]),
    "stream_options": ({"include_usage": True}, lambda r: r["usage_chunk"]),
    "temperature": (0.5, _sampling("temperature", 0.5)),
    "top_p": (0.5, _sampling("top_p", 0.5)),
    "user": ("someone", lambda r: True),  # an end-user id for the operator's logs: no effect in vLLM either
    "use_beam_search": (True, REFUSE),
    "top_k": (5, _sampling("top_k", 5)),
    "min_p": (0.1, _sampling("min_p", 0.1)),
    "repetition_penalty": (1.2, _sampling("repetition_penalty", 1.2)),
    "watermarking": (True, REFUSE),
    "length_penalty": (0.5, REFUSE),
    "stop_token_ids": ([9], _sampling("stop_token_ids", (9,))),
    "include_stop_str_in_output": (True, ("plan", ("include_stop", True))),
    "ignore_eos": (True, _sampling("ignore_eos", True)),
    "min_tokens": (2, _sampling("min_tokens", 2)),
    "skip_special_tokens": (False, ("plan", ("skip_special", False))),
    "spaces_between_special_tokens": (False, REFUSE),
    "truncate_prompt_tokens": (1, lambda r: r["usage"]["prompt_tokens"] == 1),
    "truncation_side": ("right", ("plan", ("prompts", None))),
    "allowed_token_ids": ([3, 4], _sampling("allowed_token_ids", (3, 4))),
    "prompt_logprobs": (1, lambda r: (r.get("prompt_logprobs") or _choice(r).get("prompt_logprobs")) is not None),
    "logprob_token_ids": ([3], REFUSE),
    "bad_words": (["the"], REFUSE),
    "structured_outputs": ({"regex": "[ab]+"}, _sampling("structured", m.StructuredOutputs(regex="[ab]+"))),
    "priority": (1, REFUSE),
    "request_id": ("my-id-1", lambda r: r["id"].endswith("my-id-1")),
    "session_id": ("s", REFUSE),
    "return_tokens_as_token_ids": (True, ("plan", ("tokens_as_ids", True))),
    "return_token_ids": (True, lambda r: _choice(r)["token_ids"] is not None),
    "routed_experts_prompt_start": (1, REFUSE),
    "return_token_offsets": (True, REFUSE),
    "mm_payload": ("none", REFUSE),
    "return_mm_kwargs": (True, REFUSE),
    "cache_salt": ("salt", REFUSE),
    "kv_transfer_params": ({"do_remote_decode": True}, REFUSE),
    "ec_transfer_params": ({"x": 1}, REFUSE),
    "vllm_xargs": ({"x": 1}, REFUSE),
    "repetition_detection": ({"x": 1}, REFUSE),
    "thinking_token_budget": (10, REFUSE),
    "stream_interval": (2, REFUSE),
    "ttft_slo": (2.0, lambda r: True),  # Kairos' own: the routing policy's target (tests/test_router*)
    "tbt_slo": (0.2, lambda r: True),
}
COMPLETIONS: dict[str, tuple[Any, Any]] = {
    **COMMON,
    "prompt": (["the cat", "a dog"], lambda r: len(r["choices"]) == 2),
    "echo": (True, lambda r: _choice(r)["text"].startswith("the quick brown fox")),
    "logprobs": (2, lambda r: len(_choice(r)["logprobs"]["top_logprobs"][0]) == 3),
    "suffix": ("!", REFUSE),
    "prompt_embeds": ("AAAA", REFUSE),
    "add_special_tokens": (False, ("tok", "add_special_tokens")),
}
CHAT: dict[str, tuple[Any, Any]] = {
    **COMMON,
    "messages": ([{"role": "user", "content": "hi"}], lambda r: _choice(r)["message"]["role"] == "assistant"),
    "logprobs": (True, lambda r: _choice(r)["logprobs"]["content"]),
    "top_logprobs": (2, lambda r: len(_choice(r)["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "max_completion_tokens": (2, lambda r: r["usage"]["completion_tokens"] == 2),
    "tools": (TOOLS, ("tok", "kwargs", {"tools": TOOLS_RENDERED})),
    "tool_choice": ("none", ("tok", "kwargs", {"tools": TOOLS_RENDERED})),
    "reasoning_effort": ("low", REFUSE),
    "include_reasoning": (False, REFUSE),
    "parallel_tool_calls": (False, lambda r: "tool_calls" not in _choice(r)["message"]),
    "echo": (True, lambda r: _choice(r)["message"]["content"].startswith("I say")),
    "add_generation_prompt": (False, ("tok", "add_generation_prompt")),
    "continue_final_message": (True, ("tok", "continue_final_message")),
    "add_special_tokens": (True, ("tok", "add_special_tokens")),
    "documents": ([{"title": "t"}], REFUSE),
    "chat_template": ("{{ messages }}", REFUSE),
    "chat_template_kwargs": ({"x": 1}, ("tok", "kwargs")),
    "media_io_kwargs": ({"x": {}}, REFUSE),
    "mm_processor_kwargs": ({"x": 1}, REFUSE),
    "return_prompt_text": (True, REFUSE),
}


class _Recording(SimpleTokenizer):
    """The simple tokenizer, remembering the arguments it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.seen["add_special_tokens"] = add_special_tokens
        return super().encode(text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, object] | None = None) -> str:
        self.seen.update(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                         kwargs=kwargs)
        return super().render_chat(messages, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, kwargs=kwargs)


def _fields(cls: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


def test_every_declared_field_has_a_case() -> None:
    assert set(COMPLETIONS) == _fields(schema.CompletionBody)
    assert set(CHAT) == _fields(schema.ChatBody)
    assert {k for k, (_, e) in {**COMPLETIONS, **CHAT}.items() if e == REFUSE} == set(schema.REFUSED)


@pytest.fixture(scope="module", params=["disagg-least-loaded", "deflect-all"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("params"), prefill=1, decode=1, profile="fast", policy=request.param)
    yield c
    c.stop(15)


def _body(chat: bool, field: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 4}
    if chat:
        body["messages"] = MSGS
        if field == "echo" or field == "continue_final_message":
            body["messages"] = [*MSGS, {"role": "assistant", "content": "I say"}]
            body["add_generation_prompt"] = False
        if field == "top_logprobs":
            body["logprobs"] = True
    else:
        body["prompt"] = "the quick brown fox"
    if field == "tools":
        body["tool_choice"] = "none"  # "auto" (the default with tools) needs a tool-call parser
    if field == "tool_choice":
        body["tools"] = TOOLS
    if field == "truncation_side":
        body["truncate_prompt_tokens"] = 2
    if field in ("n", "stream_options"):
        body["temperature"] = 1.0
    if field == "stream_options":
        body["stream"] = True
    if field in ("max_tokens", "max_completion_tokens"):
        body.pop("max_tokens")
    body[field] = value
    return body


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(url, json=body, timeout=30)
    if r.status_code != 200 or not body.get("stream"):
        return r.status_code, r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return 200, {"stream": True, "usage_chunk": any(e.get("usage") and not e["choices"] for e in events)}


CASES = [("completions", f, v, e) for f, (v, e) in COMPLETIONS.items()] + \
        [("chat/completions", f, v, e) for f, (v, e) in CHAT.items()]


@pytest.mark.parametrize("endpoint,field,value,expect", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_field_is_honoured_or_refused(cluster: Cluster, endpoint: str, field: str, value: Any, expect: Any) -> None:
    chat = endpoint.startswith("chat")
    body = _body(chat, field, value)
    status, out = _post(f"{cluster.spec.api}/v1/{endpoint}", body)
    if expect == REFUSE:
        assert status == 400, out
        assert out["error"]["param"] == field and field in out["error"]["message"], out
        return
    assert status == 200, out
    raw = json.dumps(body).encode()
    tok = _Recording()
    p = schema.plan(schema.decode(raw, chat=chat), RouterConfig(), tok)
    if isinstance(expect, tuple) and expect[0] == "tok":
        assert tok.seen[expect[1]] == (expect[2] if len(expect) > 2 else value)
    elif isinstance(expect, tuple) and expect[0] == "sampling":
        attr, want = expect[1]
        assert getattr(p.samplings[0], attr) == want
    elif isinstance(expect, tuple) and expect[0] == "plan":
        attr, want = expect[1]
        if want is None:  # it changes the prompt: compare with the body without the field
            del body[field]
            q = schema.plan(schema.decode(json.dumps(body).encode(), chat=chat), RouterConfig(), SimpleTokenizer())
            assert getattr(p, attr) != getattr(q, attr)
        else:
            assert getattr(p, attr) == want
    else:
        assert expect(out), out


def test_unknown_field_is_refused_by_name(cluster: Cluster) -> None:
    status, out = _post(cluster.spec.api + "/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": 1})
    assert status == 400 and out["error"]["param"] == "frobnicate"


def test_sampling_reaches_the_engine_on_both_routes(cluster: Cluster) -> None:
    """The simulated engine's synthetic logprobs and stop_token_ids show the parameters arrived at
    whichever worker sampled (the decode worker on both routes) and prefilled (prompt logprobs)."""
    url = cluster.spec.api + "/v1/completions"
    status, out = _post(url, {"prompt": "the quick brown fox", "max_tokens": 3, "logprobs": 1, "echo": True})
    assert status == 200
    lp = _choice(out)["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:4] == [-1.0, -1.0, -1.0]  # prompt
    assert lp["token_logprobs"][4:] == [-0.25, -0.25, -0.25]  # output
    first = _post(url, {"prompt": "a b c", "max_tokens": 8, "return_token_ids": True, "seed": 7})[1]
    ids = _choice(first)["token_ids"]
    again = _post(url, {"prompt": "a b c", "max_tokens": 8, "return_token_ids": True, "seed": 7,
                        "stop_token_ids": [ids[3]]})[1]
    c = _choice(again)
    assert c["finish_reason"] == "stop" and c["stop_reason"] == ids[3] and c["token_ids"] == ids[:ids.index(ids[3]) + 1]


class _Req:
    def __init__(self) -> None:
        self.sampling = schema.m.Sampling(max_tokens=8)


def _stop_choice(stop: list[str], include: bool = False) -> Choice:
    body = {"prompt": "x", "max_tokens": 8, "stop": stop, "include_stop_str_in_output": include}
    p = schema.plan(schema.decode(json.dumps(body).encode(), chat=False), RouterConfig(), SimpleTokenizer())
    req: Request = _Req()  # type: ignore[assignment]
    return Choice(0, 0, req, p, SimpleTokenizer())


def test_stop_string_truncates_and_holds_back_what_may_become_one() -> None:
    tok = SimpleTokenizer()
    ids = tok.encode("the model and the cache")
    c = _stop_choice(["and the"])
    c.push([Event(token_ids=ids[:2])])
    text, _, _ = c.delta()
    assert text == " the"  # " model" holds back len("and the") - 1 characters: they may start the stop string
    c.push([Event(token_ids=ids[2:4])])
    assert c.finish == "stop" and c.stop_reason == "and the" and c.stop_early
    assert c.text == " the model "
    assert c.delta()[0] == " model "
    c2 = _stop_choice(["and the"], include=True)
    c2.push([Event(token_ids=ids)])
    assert c2.text == " the model and the" and len(c2.ids) == 4
