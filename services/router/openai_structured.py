"""Structured outputs and tools of an OpenAI request body, as vLLM 0.32.0's server reads them.

- `structured(structured_outputs, response_format)`: `response_format` (`json_object`, `json_schema`) and vLLM's
  `structured_outputs` (json, regex, choice, grammar, json_object, and the whitespace /
  additional-properties options) become the wire's `StructuredOutputs`, which the engine that
  samples applies (the decode worker on both routes: it samples every output token, the first
  included, so the grammar covers the whole output). `response_format` overrides the matching
  constraint of `structured_outputs`, as in vLLM; more than one constraint, or none, is a 400.
  Structural tags are refused by name.
- `template_tools(tools, tool_choice)`: the chat template's `tools`, in the shape vLLM's server passes them
  (each tool as its pydantic model dumps it). Kairos has no tool-call parser, so, exactly as vLLM's
  server started without `--tool-call-parser`, `tool_choice` "auto" (the default when tools are
  given), "required" and a named function are refused with a 400; "none" renders the tools and
  returns plain content.

It reads only the fields it is given, not the request bodies of openai_bodies.py (openai_schema.py calls it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from common import messages as m
from common.errors import RequestError

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_RF_TYPES = ("text", "json_object", "json_schema", "structural_tag")
_json = msgspec.json.Encoder()


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, param=param)


def _from_structured_outputs(so: dict[str, Any]) -> dict[str, Any]:
    """The fields of vLLM's StructuredOutputsParams the client set, checked by type."""
    out: dict[str, Any] = {}
    for k, v in so.items():
        if k not in _CONSTRAINTS and k not in _OPTIONS:
            raise _bad(f"'structured_outputs' has no field '{k}' (fields: {', '.join(_CONSTRAINTS + _OPTIONS)})",
                       "structured_outputs")
        if v is None:
            continue
        if k == "structural_tag":
            raise RequestError("'structured_outputs.structural_tag' is not supported by Kairos: use json, regex, "
                               "choice or grammar", param="structured_outputs", code="unsupported_parameter")
        if k == "json":
            if isinstance(v, str):
                try:
                    msgspec.json.decode(v)
                except (msgspec.DecodeError, RecursionError):
                    raise _bad("'structured_outputs.json' must be a JSON schema (an object, or its JSON text)",
                               "structured_outputs") from None
                out[k] = v
            elif isinstance(v, dict):
                out[k] = _json.encode(v).decode()
            else:
                raise _bad("'structured_outputs.json' must be a JSON schema (an object, or its JSON text)",
                           "structured_outputs")
        elif k == "choice":
            if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
                raise _bad("'structured_outputs.choice' must be an array of strings", "structured_outputs")
            out[k] = tuple(v)
        elif k in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(v, bool):
                raise _bad(f"'structured_outputs.{k}' must be true or false", "structured_outputs")
            out[k] = v
        else:  # regex, grammar, whitespace_pattern
            if not isinstance(v, str):
                raise _bad(f"'structured_outputs.{k}' must be a string", "structured_outputs")
            out[k] = v
    return out


def _from_response_format(rf: dict[str, Any]) -> dict[str, Any]:
    t = rf.get("type")
    if t not in _RF_TYPES:
        raise _bad(f"'response_format.type' must be one of {', '.join(_RF_TYPES)}, got {t!r}", "response_format")
    if t == "structural_tag":
        raise RequestError("'response_format' of type structural_tag is not supported by Kairos: use json_schema "
                           "or json_object", param="response_format", code="unsupported_parameter")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise _bad(f"'response_format' has no field '{sorted(extra)[0]}'", "response_format")
    if t == "text":
        return {}
    if t == "json_object":
        return {"json_object": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                   "response_format")
    if not isinstance(js.get("name"), str):
        raise _bad("'response_format.json_schema.name' must be a string", "response_format")
    extra = set(js) - {"name", "description", "schema", "strict"}
    if extra:
        raise _bad(f"'response_format.json_schema' has no field '{sorted(extra)[0]}'", "response_format")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return {"json": _json.encode(schema).decode()}


def structured(structured_outputs: dict[str, Any] | None,
               response_format: dict[str, Any] | None) -> m.StructuredOutputs | None:
    """The grammar a request's output must follow (its body's `structured_outputs` and
    `response_format`), or None. RequestError (400) names the field."""
    fields: dict[str, Any] = {}
    if structured_outputs is not None:
        fields = _from_structured_outputs(structured_outputs)
    if response_format is not None:
        override = _from_response_format(response_format)
        if override:
            fields.update(override)
    elif structured_outputs is None:
        return None
    if structured_outputs is None and not fields:
        return None  # response_format text
    count = sum(fields.get(k) is not None for k in _CONSTRAINTS)
    param = "structured_outputs" if structured_outputs is not None else "response_format"
    if count > 1:
        raise _bad("You can only use one kind of structured outputs constraint but several are set "
                   f"({', '.join(k for k in _CONSTRAINTS if fields.get(k) is not None)})", param)
    if count < 1:
        raise _bad(f"You must use one kind of structured outputs constraint ({', '.join(_CONSTRAINTS[:5])})", param)
    return m.StructuredOutputs(**fields)


_TOOL_PARSER = ("Kairos has no tool-call parser (as vLLM's server without --tool-call-parser); "
                "send tool_choice \"none\" to render the tools and get plain content")


def calls_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Whether a chat request's `tools` and `tool_choice` let the model call its tools (tool_choice
    auto, required or named)."""
    choice = tool_choice if tool_choice is not None or not tools else "auto"
    return choice is not None and choice != "none"


def template_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
                   parser: bool = False) -> list[dict[str, Any]] | None:
    """The tools for the chat template (vLLM's shapes), after vLLM's checks of a chat request's
    `tools` and `tool_choice`. `parser`: the router has a tool-call parser (else tool_choice must be
    "none")."""
    choice = tool_choice
    if tools is not None and not tools:
        raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                   "entirely.", "tools")
    if choice is None and tools:
        choice = "auto"  # vLLM's default when tools are given
    if choice is not None and choice != "none":
        if tools is None:
            raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise _bad(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                       "\"required\" are supported.", "tool_choice")
        what = f'function "{(choice.get("function") or {}).get("name")}"' if isinstance(choice, dict) \
            else f'"{choice}"'
        if isinstance(choice, dict) and not any(isinstance(t, dict) and isinstance(t.get("function"), dict) and
                                                t["function"].get("name") == (choice.get("function") or {}).get("name")
                                                for t in tools):
            raise _bad("The tool specified in `tool_choice` does not match any of the specified `tools`",
                       "tool_choice")
        if not parser:
            raise RequestError(f"tool_choice={what} is not supported: {_TOOL_PARSER}", param="tool_choice",
                               code="unsupported_parameter")
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        extra = set(fn) - {"name", "description", "parameters", "strict", "defer_loading"}
        if extra or set(t) - {"type", "function", "defer_loading"}:
            raise _bad(f"tools[{i}] has a field vLLM does not define", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        dumped: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                                  "parameters": fn.get("parameters")}
        defer = fn.get("defer_loading", t.get("defer_loading"))
        for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)):
            if v is not None:
                dumped[k] = v
        out.append({"type": "function", "function": dumped})
    return out
