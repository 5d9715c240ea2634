"""The Responses API's request mapping (services/router/openai_responses.py): the chat request
vLLM's server builds from a Responses body, and what is refused. The answers themselves are
checked end to end in tests/test_api.py (sim engine) and against vLLM's server in
tests/vllm/test_openai_conformance.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import RequestError
from services.router import openai_responses as r


def chat(body: dict[str, Any], tools_on: bool = True) -> Any:
    return r.to_chat(r.decode(json.dumps(body).encode()), tools_on)


def test_string_input_and_instructions_become_system_and_user_messages() -> None:
    c = chat({"input": "hi", "instructions": "be brief", "max_output_tokens": 7, "temperature": 0.5, "seed": 3})
    assert c.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (c.max_completion_tokens, c.temperature, c.seed, c.add_generation_prompt) == (7, 0.5, 3, True)


def test_items_as_vllm_builds_them() -> None:
    c = chat({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "so"}]}]})
    assert c.messages[0] == {"role": "user", "content": "a\nb"}
    calls = c.messages[1]["tool_calls"]  # both calls merged into one assistant message
    assert c.messages[1]["role"] == "assistant" and [x["id"] for x in calls] == ["c1", "c2"]
    assert c.messages[2] == {"role": "tool", "content": "done", "tool_call_id": "c1"}
    assert c.messages[3] == {"role": "assistant", "content": "so"} and len(c.messages) == 4


def test_a_partial_assistant_message_is_continued() -> None:
    c = chat({"input": [{"role": "user", "content": "x"},
                        {"type": "message", "role": "assistant", "status": "incomplete", "content": "the qu"}]})
    assert c.continue_final_message and not c.add_generation_prompt


def test_text_format_is_the_chat_response_format() -> None:
    schema = {"type": "object"}
    c = chat({"input": "x", "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}})
    assert c.response_format == {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    assert chat({"input": "x", "text": {"format": {"type": "json_object"}}}).response_format == {"type": "json_object"}
    assert chat({"input": "x", "text": {"format": {"type": "text"}}}).response_format is None


def test_function_tools_map_to_chat_tools() -> None:
    c = chat({"input": "x", "tools": [{"type": "function", "name": "f", "description": "d",
                                       "parameters": {"type": "object"}}]})
    assert c.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                         "parameters": {"type": "object"}}}]
    assert c.tool_choice == "auto"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "response_id", "not_found"),
    ({"input": "x", "background": True}, "background", "no_response_store"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"input": "x", "bogus": 1}, "bogus", "unknown_parameter"),
    ({"input": [{"type": "reasoning", "content": []}]}, "input", "invalid_request"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input",
     "invalid_request"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools", "invalid_request"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}, "tool_choice",
     "invalid_request"),
    ({}, "input", "invalid_request"),
])
def test_refused_with_the_field_named(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(RequestError) as e:
        chat(body)
    assert (e.value.param, e.value.code) == (param, code)


def test_tools_need_the_routers_parser() -> None:
    with pytest.raises(RequestError) as e:
        chat({"input": "x", "tools": [{"type": "function", "name": "f"}]}, tools_on=False)
    assert e.value.param == "tools" and "KAIROS_TOOL_CALL_PARSER" in str(e.value)
