"""Tool calling with vLLM 0.32.0's own tool-call parsers, run in the router.

The router options `tool_call_parser` and `enable_auto_tool_choice` are vLLM's server options
`--tool-call-parser` and `--enable-auto-tool-choice`, with vLLM's meaning: with both set, a chat
request with tools and `tool_choice` "auto", "required" or a named function goes through the
parser vLLM would use (`ParserManager.get_parser`). Per request the router builds vLLM's own
`ChatCompletionRequest`, lets the parser adjust it (`adjust_request`: the JSON schema or
structural tag that forces "required"/named calls, `skip_special_tokens`), and sends the
resulting grammar to the engine that samples (the decode worker on both routes). The output text
is parsed back into `tool_calls` by the same parser (`parse`), and the choice is rendered as vLLM's
server renders it (finish_reason "tool_calls" for auto calls and for "required", `parallel_tool_calls:
false` keeps the first call). Streams go through the parser's `parse_delta` chunk by chunk, as in
vLLM's server, so the tool-call deltas are vLLM's (`ToolStream`).

This module imports vLLM (the router then needs it installed, as the vLLM engine's hosts have it);
without the options it is never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common import messages as m
from common.errors import ConfigError, RequestError

_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
           "structured_outputs", "chat_template_kwargs", "skip_special_tokens")


@dataclass
class ToolPlan:
    """One request's tool calling: vLLM's request (as the parser adjusted it) and the parser class."""

    request: Any
    parser_cls: Any
    tokenizer: Any
    enable_auto: bool

    def parse(self, text: str, token_ids: list[int], finish: str | None) -> tuple[str | None, list[dict[str, Any]],
                                                                                    str | None, bool]:
        """(content, tool_calls, finish_reason, has_tool_calls) as vLLM's server makes them for one choice."""
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self.parser_cls(self.tokenizer, self.request.tools,
                                 chat_template_kwargs=self.request.chat_template_kwargs or {}, model_config=None)
        _, content, calls = parser.parse(text, self.request, enable_auto_tools=self.enable_auto,
                                         model_output_token_ids=token_ids)
        choice = self.request.tool_choice
        named = choice is not None and not isinstance(choice, str)  # vLLM's ChatCompletionNamedToolChoiceParam
        required = choice == "required"
        out: list[dict[str, Any]] = []
        auto_called = False
        for tc in calls or []:
            out.append({"id": tc.id or make_tool_call_id(), "type": "function",
                        "function": {"name": tc.name, "arguments": tc.arguments}})
        if named or required:
            content = content or ""
        else:
            auto_called = bool(out)
        if self.request.parallel_tool_calls is False:
            out = out[:1]
        if auto_called or (required and finish == "stop"):
            finish = "tool_calls"
        return content, out, finish, named or required or auto_called


class ToolStream:
    """One streamed choice's tool-call parsing: vLLM's `parse_delta`, chunk by chunk, as its server."""

    def __init__(self, plan: ToolPlan, prompt_ids: list[int]) -> None:
        self.plan = plan
        self.prompt_ids: list[int] | None = prompt_ids
        self.parser = plan.parser_cls(plan.tokenizer, plan.request.tools,
                                      chat_template_kwargs=plan.request.chat_template_kwargs or {}, model_config=None)
        self.tools_streamed = False

    def delta(self, text: str, ids: list[int], finished: bool) -> dict[str, Any] | None:
        """The chunk's delta (vLLM's DeltaMessage as its server serialises it), or None: nothing to send."""
        dm = self.parser.parse_delta(delta_text=text, delta_token_ids=ids, request=self.plan.request,
                                     prompt_token_ids=self.prompt_ids, finished=finished)
        self.prompt_ids = None  # vLLM passes them with every output, but only the first call reads them
        if dm is None:
            return None
        if dm.tool_calls:
            self.tools_streamed = True
            if self.plan.request.parallel_tool_calls is False:
                dm.tool_calls = [tc for tc in dm.tool_calls if tc.index == 0]
        out: dict[str, Any] = dm.model_dump(exclude_unset=True)
        return out

    def finish(self, finish: str | None) -> str | None:
        choice = self.plan.request.tool_choice
        named = choice is not None and not isinstance(choice, str)
        return "tool_calls" if self.tools_streamed and not named and finish == "stop" else finish


class ToolCalling:
    """The parser class for the served model, from the router's options (vLLM must be installed)."""

    def __init__(self, parser_name: str, enable_auto: bool, tokenizer_dir: str, model_name: str) -> None:
        try:
            from vllm.parser import ParserManager
            from vllm.tokenizers import get_tokenizer
        except ImportError as e:
            raise ConfigError(f"tool_call_parser={parser_name!r} needs vLLM installed on the router host ({e}); "
                              "install the vllm extra or unset KAIROS_TOOL_CALL_PARSER") from e
        if tokenizer_dir in ("", "simple"):
            raise ConfigError("tool_call_parser needs the model's tokenizer: set --tokenizer to the model directory")
        self.enable_auto = enable_auto
        self.tokenizer = get_tokenizer(tokenizer_dir)
        try:
            self.parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=enable_auto,
                                                       model_name=model_name, tokenizer=self.tokenizer)
        except (TypeError, KeyError, ValueError) as e:
            raise ConfigError(f"tool_call_parser={parser_name!r}: {e}") from e

    def plan(self, body: dict[str, Any]) -> tuple[ToolPlan, m.StructuredOutputs | None, bool]:
        """vLLM's request for this body, adjusted by the parser: (plan, grammar, skip_special_tokens)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            req = ChatCompletionRequest.model_validate({k: body[k] for k in _FIELDS if body.get(k) is not None})
        except ValidationError as e:
            err = e.errors()[0]
            loc = str(err["loc"][0]) if err.get("loc") else "tools"
            raise RequestError(f"invalid tools request: {err.get('msg')}", param=loc) from None
        if req.tool_choice == "auto" and not self.enable_auto:
            raise RequestError('"auto" tool choice requires enable_auto_tool_choice and tool_call_parser to be '
                               "set on the router", param="tool_choice", code="unsupported_parameter")
        if self.parser_cls is None:
            raise RequestError("tool_choice other than \"none\" needs the router's tool_call_parser",
                               param="tool_choice", code="unsupported_parameter")
        parser = self.parser_cls(self.tokenizer, req.tools, chat_template_kwargs=req.chat_template_kwargs or {},
                                 model_config=None)
        try:
            req = parser.adjust_request(req)
            so = req.extract_structured_outputs()
        except ValueError as e:
            raise RequestError(str(e), param="tool_choice") from None
        return ToolPlan(req, self.parser_cls, self.tokenizer, self.enable_auto), _wire(so), \
            bool(req.skip_special_tokens)


def _wire(so: Any) -> m.StructuredOutputs | None:
    if so is None:
        return None
    js = so.json
    return m.StructuredOutputs(
        json=js if js is None or isinstance(js, str) else json.dumps(js), regex=so.regex,
        choice=tuple(so.choice) if so.choice is not None else None, grammar=so.grammar, json_object=so.json_object,
        structural_tag=so.structural_tag, disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties, whitespace_pattern=so.whitespace_pattern)
