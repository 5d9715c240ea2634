"""response_format / structured_outputs / tools: what reaches the wire, and what is refused by name."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from common import messages as m
from common.config import RouterConfig
from common.errors import RequestError
from common.tokenizer import SimpleTokenizer
from services.router import openai_schema as schema

MSGS = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _plan(extra: dict[str, Any], chat: bool = True) -> schema.Plan:
    body: dict[str, Any] = {"max_tokens": 4, **({"messages": MSGS} if chat else {"prompt": "x y"}), **extra}
    return schema.plan(schema.decode(json.dumps(body).encode(), chat=chat), RouterConfig(), SimpleTokenizer())


def _refused(extra: dict[str, Any], chat: bool = True) -> RequestError:
    with pytest.raises(RequestError) as e:
        _plan(extra, chat)
    return e.value


@pytest.mark.parametrize("chat", [True, False])
def test_response_format_becomes_the_grammar(chat: bool) -> None:
    so = _plan({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
               chat).samplings[0].structured
    assert so is not None and json.loads(so.json or "") == SCHEMA and so.json_object is None
    assert _plan({"response_format": {"type": "json_object"}}, chat).samplings[0].structured == \
        m.StructuredOutputs(json_object=True)
    assert _plan({"response_format": {"type": "text"}}, chat).samplings[0].structured is None
    assert _plan({}, chat).samplings[0].structured is None


def test_structured_outputs_fields() -> None:
    so = _plan({"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}}).samplings[0]
    assert so.structured == m.StructuredOutputs(choice=("yes", "no"), disable_any_whitespace=True)
    so2 = _plan({"structured_outputs": {"json": json.dumps(SCHEMA)}}).samplings[0].structured
    assert so2 is not None and json.loads(so2.json or "") == SCHEMA
    g = _plan({"structured_outputs": {"grammar": 'root ::= "a"'}}).samplings[0].structured
    assert g == m.StructuredOutputs(grammar='root ::= "a"')
    # response_format overrides the same kind of constraint, as in vLLM
    so3 = _plan({"structured_outputs": {"disable_any_whitespace": True},
                 "response_format": {"type": "json_object"}}).samplings[0].structured
    assert so3 == m.StructuredOutputs(json_object=True, disable_any_whitespace=True)


def test_every_choice_of_n_carries_the_grammar() -> None:
    p = _plan({"n": 2, "temperature": 1.0, "seed": 3, "response_format": {"type": "json_object"}})
    assert [s.structured for s in p.samplings] == [m.StructuredOutputs(json_object=True)] * 2


def test_the_grammar_survives_the_wire() -> None:
    s = m.Sampling(max_tokens=3, structured=m.StructuredOutputs(choice=("a", "b")))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=m.Sampling) == s
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.Sampling(max_tokens=3)), type=m.Sampling).structured is None


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format"),
])
def test_bad_structured_requests_are_refused_by_name(extra: dict[str, Any], param: str) -> None:
    assert _refused(extra).param == param


def test_tools_render_in_the_template_with_tool_choice_none() -> None:
    seen: dict[str, Any] = {}

    class Tok(SimpleTokenizer):
        def render_chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, kwargs: dict[str, object] | None = None) -> str:
            seen.update(kwargs or {})
            return super().render_chat(messages, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, kwargs=kwargs)

    body = {"messages": MSGS, "max_tokens": 2, "tools": [TOOL], "tool_choice": "none",
            "chat_template_kwargs": {"x": 1}}
    schema.plan(schema.decode(json.dumps(body).encode(), chat=True), RouterConfig(), Tok())
    assert seen == {"x": 1, "tools": [{"type": "function", "function": {**TOOL["function"]}}]}


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL]},  # "auto" is the default with tools
    {"tools": [TOOL], "tool_choice": "auto"},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": "sometimes"},
])
def test_tool_choice_needing_a_parser_is_refused_by_name(extra: dict[str, Any]) -> None:
    e = _refused(extra)
    assert e.param == "tool_choice" and "tool_choice" in str(e)


def test_bad_tools_are_refused() -> None:
    assert _refused({"tools": [], "tool_choice": "none"}).param == "tools"
    assert _refused({"tools": [{"type": "function"}], "tool_choice": "none"}).param == "tools"
