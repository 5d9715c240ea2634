"""The router's tool calling with vLLM's own parser (hermes), in process, without an engine: the
grammar that forces required/named calls, the parse of a finished output, and the streamed deltas
assembling to the same call. (Against vLLM's server, end to end: test_openai_conformance.py.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from common.config import RouterConfig
from common.errors import ConfigError, RequestError
from services.router import openai_schema as schema
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def env(tiny_model: Path) -> tuple[Any, Any]:
    from common.tokenizer import make_tokenizer
    from services.router.openai_tools import ToolCalling

    with warnings.catch_warnings():  # importing vllm warns about torch internals
        warnings.simplefilter("ignore")
        tc = ToolCalling("hermes", True, str(tiny_model), tiny_model.name)
        _plan((tc, make_tokenizer(str(tiny_model))), tool_choice="required")  # vllm's protocol modules
    return tc, make_tokenizer(str(tiny_model))


def _plan(env: tuple[Any, Any], **extra: Any) -> schema.Plan:
    tc, tok = env
    body = {"messages": MSGS, "max_tokens": 8, "tools": TOOLS, **extra}
    return schema.plan(schema.decode(json.dumps(body).encode(), chat=True), RouterConfig(), tok, tc)


def test_required_and_named_calls_are_forced_by_the_grammar(env: tuple[Any, Any]) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        p = _plan(env, tool_choice=choice)
        so = p.samplings[0].structured
        assert so is not None and so.structural_tag is not None and "get_weather" in so.structural_tag
        assert p.skip_special is False  # hermes keeps special tokens for its tags, as in vLLM
    assert _plan(env).samplings[0].structured is None  # auto: the model decides, unconstrained


def test_a_finished_output_is_parsed_into_tool_calls(env: tuple[Any, Any]) -> None:
    content, calls, finish, _ = _plan(env, tool_choice="required").tool_plan.parse(CALL, [], "stop")
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert finish == "tool_calls" and content == "" and calls[0]["id"].startswith("chatcmpl-tool-")
    content, calls, finish, _ = _plan(env).tool_plan.parse("just text", [], "length")
    assert (content, calls, finish) == ("just text", [], "length")


def test_streamed_deltas_assemble_to_the_same_call(env: tuple[Any, Any]) -> None:
    from services.router.openai_tools import ToolStream

    _, tok = env
    p = _plan(env, tool_choice="required", stream=True)
    ids = tok.encode(CALL, add_special_tokens=False)
    ts = ToolStream(p.tool_plan, p.prompts[0])
    prev, name, args, finish = "", "", "", None
    for k in range(0, len(ids), 3):
        text = tok.decode(ids[:k + 3], skip_special_tokens=False)
        done = k + 3 >= len(ids)
        d = ts.delta(text[len(prev):], ids[k:k + 3], done)
        prev = text
        for call in (d or {}).get("tool_calls", []):
            name += call.get("function", {}).get("name") or ""
            args += call.get("function", {}).get("arguments") or ""
        finish = ts.finish("stop" if done else None)
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Oslo"}, "tool_calls")


def test_auto_needs_enable_auto_tool_choice(tiny_model: Path) -> None:
    from common.tokenizer import make_tokenizer
    from services.router.openai_tools import ToolCalling

    tc = ToolCalling("hermes", False, str(tiny_model), tiny_model.name)  # vLLM: no parser without the flag
    with pytest.raises(RequestError) as e:
        _plan((tc, make_tokenizer(str(tiny_model))), tool_choice="required")
    assert e.value.param == "tool_choice"
    with pytest.raises(ConfigError):
        ToolCalling("no-such-parser", True, str(tiny_model), tiny_model.name)
