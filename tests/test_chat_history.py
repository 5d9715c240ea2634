"""Chat history with tool turns, as vLLM 0.32's chat_utils hands it to the chat template: an
assistant's tool calls (their JSON `arguments` parsed into a mapping; unparsable or not an object
becomes {}), a tool result's `tool_call_id`, a message's `name`; what vLLM would accept and ignore
is refused by name. (Rendered by a real template and compared with vLLM's own server:
tests/vllm/test_openai_conformance.py, shapes chat_tool_history*.)"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from common.errors import RequestError
from common.tokenizer import SimpleTokenizer
from services.router import openai_schema as schema

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


class Recording(SimpleTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, object]] = []

    def render_chat(self, messages: list[dict[str, object]], **kw: Any) -> str:
        self.seen = messages
        return super().render_chat(messages, **kw)


def _render(messages: list[dict[str, Any]]) -> list[dict[str, object]]:
    tok = Recording()
    schema.chat_prompt(msgspec.convert({"messages": messages}, schema.ChatBody), tok)
    return tok.seen


def test_tool_turns_reach_the_template_as_vllm_hands_them() -> None:
    seen = _render([
        {"role": "user", "content": "weather in Oslo?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"},
                                                                {"type": "text", "text": "12 C"}]},
    ])
    assert seen == [
        {"role": "user", "content": "weather in Oslo?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny\n12 C", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize("arguments,want", [("not json", {}), ("[1, 2]", {}), ("", {}), (None, {}),
                                            ({"a": 1}, {"a": 1})])
def test_call_arguments_are_coerced_like_vllm(arguments: Any, want: dict[str, Any]) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    seen = _render([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}])
    assert seen[1]["tool_calls"] == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": want}}]


def test_empty_tool_calls_are_dropped() -> None:
    seen = _render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "hi", "tool_calls": []}])
    assert seen[1] == {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize("msg,needle", [
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "'tool_calls'"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "'tool_call_id'"),
    ({"role": "assistant", "tool_calls": [{"type": "custom", "custom": {"name": "f"}}]}, "type 'function'"),
    ({"role": "assistant", "tool_calls": "call"}, "must be an array"),
    ({"role": "tool", "tool_call_id": 3, "content": "x"}, "tool_call_id must be a string"),
    ({"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "only text parts"),
])
def test_what_vllm_would_ignore_or_reject_is_refused_by_name(msg: dict[str, Any], needle: str) -> None:
    with pytest.raises(RequestError) as e:
        _render([{"role": "user", "content": "x"}, msg])
    assert needle in str(e.value) and e.value.param == "messages"
