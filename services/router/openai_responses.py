"""POST /v1/responses: the Responses API, with vLLM 0.32's semantics for a text model.

A Responses request is turned into the chat request vLLM's server would build from it (the
`instructions` as a system message, the `input` items as chat messages: text content parts
joined, `function_call` items as the assistant's tool calls, `function_call_output` items as tool
results) and served like one; the answer is rendered as a `response` object, or as the Responses
streaming events (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed`), each an SSE
`event:` + `data:` pair with its `sequence_number`, as vLLM sends them.

What vLLM's server does by default, so does Kairos: it keeps no responses (vLLM's store is off
unless VLLM_ENABLE_RESPONSES_API_STORE is set), so `previous_response_id` and
GET /v1/responses/{id} answer 404 "not found", `store` is accepted and ignored, and `background`
with `store` is a 400. Refused with a 400 naming the field: reasoning, prompt templates,
logprobs, image/file inputs and built-in tools (the engines serve a text model, and Kairos runs
no tool server); function tools are served where the router's tool-call parser is on, with
`tool_choice` "auto" or "none" (docs/api.md).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from common.errors import RequestError
from services.router.openai_render import Choice
from services.router.openai_schema import ChatBody, Plan, check_refused, decode_as_checked
from services.router.openai_serve import SSE_HEADERS, Send, error_status, feed
from services.router.service import Router

_json = msgspec.json.Encoder()

Metadata = dict[str, str]


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every field of vLLM 0.32's ResponsesRequest."""

    background: bool | None = False
    include: list[str] | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: Metadata | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = 0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt_cache_key: str | None = None
    watermarking: bool | None = None
    request_id: str | None = None
    session_id: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    priority: int = 0
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Kairos' own
    ttft_slo: float | None = None
    tbt_slo: float | None = None


_NO_STORE = ("This vLLM engine does not support `store=True` and therefore does not support the background mode. "
             "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
             "launching the vLLM server.")
# refused unless left at their defaults: (field, reason)
_REFUSED = (
    ("reasoning", "reasoning controls are not implemented (no reasoning parser)"),
    ("include_reasoning", "reasoning controls are not implemented (no reasoning parser)"),
    ("prompt", "stored prompt templates are not supported"),
    ("include", "no include option is implemented (output logprobs are not served on /v1/responses)"),
    ("top_logprobs", "output logprobs are not served on /v1/responses; use /v1/chat/completions"),
    ("enable_response_messages", "raw input and output messages are not returned"),
    ("previous_input_messages", "previous harmony messages are not supported"),
    ("max_tool_calls", "a limit on tool calls is not implemented"),
    ("watermarking", "watermarking is not implemented"),
    ("session_id", "sessions are not implemented"),
    ("priority", "request priorities are not implemented: the routing policy orders the work"),
    ("media_io_kwargs", "multimodal inputs are not supported"),
    ("mm_processor_kwargs", "multimodal inputs are not supported"),
    ("mm_payload", "multimodal inputs are not supported"),
    ("return_mm_kwargs", "multimodal inputs are not supported"),
    ("cache_salt", "prefix-cache salts are not implemented"),
    ("kv_transfer_params", "Kairos moves the KV cache itself; it takes no client transfer parameters"),
    ("ec_transfer_params", "encoder-cache transfer is not supported"),
    ("vllm_xargs", "vLLM's extra arguments are not passed through the router"),
)


def decode(raw: bytes) -> ResponsesBody:
    body: ResponsesBody = decode_as_checked(raw, ResponsesBody)
    check_refused(body, _REFUSED)
    if body.input is None:
        raise RequestError("Field required: 'input'", param="input")
    if body.store and body.background:
        raise RequestError(_NO_STORE, param="background", code="no_response_store")
    return body


def not_found(response_id: str) -> RequestError:
    return RequestError(f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
            and isinstance(part.get("text"), str):
        return str(part["text"])
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise RequestError(f"{where}: content parts of type {kind!r} are not supported (the served model is "
                       "text-only)", param="input")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(p, where) for p in content)
    raise RequestError(f"{where}.content must be a string or an array of text parts", param="input")


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages for text items: calls merge into the assistant message before."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input or []):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        last = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _content(item.get("output", ""), where),
                        "tool_call_id": item.get("call_id")})
        elif kind == "message" and isinstance(item.get("role"), str):
            role = item["role"]
            text = _content(item.get("content"), where)
            if role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = text
            else:
                out.append({"role": role, "content": text})
        else:
            raise RequestError(f"Unsupported input item type: {kind}", param="input")
    if not out:
        raise RequestError("'input' must not be empty", param="input")
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{i}]: only function tools are supported (got {kind!r}); Kairos runs no "
                               "built-in tools", param="tools")
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t.get("parameters")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as vLLM echoes them (its pydantic model's fields, unset ones null)."""
    return [{"name": t.get("name"), "parameters": t.get("parameters"), "strict": t.get("strict"),
             "type": "function", "allowed_callers": t.get("allowed_callers"), "async": t.get("async"),
             "defer_loading": t.get("defer_loading"), "description": t.get("description"),
             "output_schema": t.get("output_schema")} for t in tools or []]


def to_chat(body: ResponsesBody, tools_on: bool) -> ChatBody:
    """The chat request vLLM's server builds from this Responses request."""
    if body.previous_response_id is not None:  # nothing is kept (vLLM's default): it cannot be found
        raise not_found(body.previous_response_id)
    fmt = body.text.format if body.text is not None else None
    response_format: dict[str, Any] | None = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema" and fmt.schema is not None:
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.name or "schema", "schema": fmt.schema}}
    if response_format is not None and body.structured_outputs is not None:
        raise RequestError("Cannot specify both structured_outputs and text.format", param="structured_outputs")
    tools = None
    tool_choice = None
    if body.tools:
        if not tools_on:
            raise RequestError("function tools need the router's tool-call parser: start it with "
                               "KAIROS_TOOL_CALL_PARSER and KAIROS_ENABLE_AUTO_TOOL_CHOICE=true", param="tools")
        if body.tool_choice not in ("auto", "none"):
            raise RequestError("on /v1/responses only tool_choice 'auto' and 'none' are implemented; use "
                               "/v1/chat/completions for required or named tool choices", param="tool_choice")
        tools, tool_choice = _chat_tools(body.tools), body.tool_choice
    msgs = _messages(body)
    last = body.input[-1] if isinstance(body.input, list) and body.input else None
    cont = isinstance(last, dict) and last.get("type", "message") == "message" \
        and last.get("status") in ("in_progress", "incomplete")
    return ChatBody(messages=msgs, stream=body.stream, max_completion_tokens=body.max_output_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop,
                    stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                    repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias,
                    skip_special_tokens=body.skip_special_tokens,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    response_format=response_format, structured_outputs=body.structured_outputs,
                    tools=tools, tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                    add_generation_prompt=not cont, continue_final_message=cont,
                    chat_template_kwargs=body.chat_template_kwargs, user=body.user, ttft_slo=body.ttft_slo,
                    tbt_slo=body.tbt_slo)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


class Answer:
    """One response's envelope: the fields every event's `response` repeats."""

    def __init__(self, body: ResponsesBody, model: str, max_tokens: int, temperature: float, top_p: float,
                 presence: float, frequency: float) -> None:
        self.id = body.request_id or new_id("resp")
        self.created = int(time.time())
        self.body, self.model, self.max_tokens = body, model, max_tokens
        self.temperature, self.top_p, self.presence, self.frequency = temperature, top_p, presence, frequency

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "created_at": self.created,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "metadata": b.metadata, "model": self.model, "object": "response",
                "output": output, "parallel_tool_calls": True if b.parallel_tool_calls is None
                else b.parallel_tool_calls, "temperature": self.temperature,
                "tool_choice": b.tool_choice if b.tools else "none", "tools": echo_tools(b.tools),
                "top_p": self.top_p, "background": bool(b.background), "max_output_tokens": self.max_tokens,
                "max_tool_calls": b.max_tool_calls, "previous_response_id": b.previous_response_id,
                "prompt": b.prompt, "reasoning": b.reasoning, "service_tier": b.service_tier, "status": status,
                "text": msgspec.to_builtins(b.text) if b.text is not None else None, "top_logprobs": None,
                "truncation": b.truncation or "disabled", "usage": usage, "user": b.user,
                "presence_penalty": self.presence, "frequency_penalty": self.frequency, "kv_transfer_params": None,
                "ec_transfer_params": None, "input_messages": None, "output_messages": None}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text and status != "in_progress":
        content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
    return {"id": item_id, "content": content, "role": "assistant",
            "status": status, "type": "message", "phase": None}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"arguments": fn.get("arguments", ""), "call_id": call.get("id"), "name": fn.get("name"),
            "type": "function_call", "id": new_id("fc"), "namespace": None, "status": "completed"}


def usage(prompt_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + output_tokens}


# ---------------------------------------------------------------------------- serving


def _output(p: Plan, c: Choice, parser_on: bool) -> tuple[list[dict[str, Any]], str]:
    """The output items of a finished choice and the response's status, as vLLM builds them: with
    a parser configured (the router's tool-call parser), a message only when there is text and a
    function_call item per parsed call; without one, always the message."""
    text, finish = c.text, c.finish
    calls: list[dict[str, Any]] = []
    if p.tool_plan is not None:
        text, calls, finish, _ = p.tool_plan.parse(text, list(c.ids), c.finish)
        text = text or ""
    items = [message_item(new_id("msg"), text)] if text or not parser_on else []
    items += [call_item(call) for call in calls]
    return items, "incomplete" if finish == "length" else "completed"


def _usage(p: Plan, c: Choice) -> dict[str, Any]:
    return usage(len(p.prompts[0]), len(c.ids), c.req.engine_cached or 0)


async def unary(router: Router, p: Plan, c: Choice, answer: Answer) -> tuple[int, dict[str, Any]]:
    while not c.done:
        feed(router, c, await c.req.events.take())
    if c.error is not None:
        status, retry_after = error_status(c.error.error_code)
        return status, {"message": c.error.error, "code": c.error.error_code, "retry_after": retry_after}
    items, state = _output(p, c, router.tool_calling is not None)
    return 200, answer.response(state, items, _usage(p, c))


class _Events:
    """Responses SSE events, numbered."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        fields.update(sequence_number=self.seq, type=kind)
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(fields) + b"\n\n"


async def stream(router: Router, send: Send, p: Plan, c: Choice, answer: Answer,
                 headers: list[tuple[bytes, bytes]]) -> None:
    """The Responses events of one request. Text streams as it comes; with tool calling on, the
    output is parsed when it ends and its items are sent then (the text of a tool call is not
    streamed as text)."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
    ev = _Events()
    start = answer.response("in_progress", [], None)
    await send({"type": "http.response.body", "more_body": True,
                "body": ev("response.created", response=start) + ev("response.in_progress", response=start)})
    item_id = new_id("msg")
    streamed = ""
    opened = False
    parse_at_end = p.tool_plan is not None
    while not c.done:
        feed(router, c, await c.req.events.take())
        if c.error is not None:
            code, _ = error_status(c.error.error_code)
            err = ev("error", code=str(code), message=c.error.error, param=None)
            await send({"type": "http.response.body", "body": err, "more_body": False})
            return
        text, _, _ = c.delta()
        if parse_at_end or not text:
            continue
        out = b""
        if not opened:
            opened = True
            out += ev("response.output_item.added", item=message_item(item_id, "", "in_progress"), output_index=0)
            out += ev("response.content_part.added", content_index=0, item_id=item_id, output_index=0,
                      part={"annotations": [], "text": "", "type": "output_text", "logprobs": []})
        streamed += text
        out += ev("response.output_text.delta", content_index=0, delta=text, item_id=item_id, logprobs=[],
                  output_index=0)
        await send({"type": "http.response.body", "body": out, "more_body": True})
    items, state = _output(p, c, router.tool_calling is not None)
    out = b""
    if opened:  # the streamed message, closed; its id is the one the final response names
        part: dict[str, Any] = {"annotations": [], "text": streamed, "type": "output_text", "logprobs": None}
        out += ev("response.output_text.done", content_index=0, item_id=item_id, logprobs=[], output_index=0,
                  text=streamed)
        out += ev("response.content_part.done", content_index=0, item_id=item_id, output_index=0, part=part)
        done = message_item(item_id, streamed)
        out += ev("response.output_item.done", item=done, output_index=0)
        items = [done]
    else:
        for i, item in enumerate(items):
            out += _item_events(ev, item, i)
    final = answer.response(state, items, _usage(p, c))
    out += ev("response.completed", response=final)
    await send({"type": "http.response.body", "body": out, "more_body": False})


def _item_events(ev: _Events, item: dict[str, Any], index: int) -> bytes:
    """One whole output item as its added / delta / done events."""
    if item["type"] == "function_call":
        out = ev("response.output_item.added", item={**item, "arguments": "", "status": "in_progress"},
                 output_index=index)
        out += ev("response.function_call_arguments.delta", delta=item["arguments"], item_id=item["id"],
                  output_index=index)
        out += ev("response.function_call_arguments.done", arguments=item["arguments"], item_id=item["id"],
                  name=item["name"], output_index=index)
        return out + ev("response.output_item.done", item=item, output_index=index)
    text = item["content"][0]["text"] if item["content"] else ""
    out = ev("response.output_item.added", item=message_item(item["id"], "", "in_progress"), output_index=index)
    out += ev("response.content_part.added", content_index=0, item_id=item["id"], output_index=index,
              part={"annotations": [], "text": "", "type": "output_text", "logprobs": []})
    out += ev("response.output_text.delta", content_index=0, delta=text, item_id=item["id"], logprobs=[],
              output_index=index)
    out += ev("response.output_text.done", content_index=0, item_id=item["id"], logprobs=[], output_index=index,
              text=text)
    out += ev("response.content_part.done", content_index=0, item_id=item["id"], output_index=index,
              part={"annotations": [], "text": text, "type": "output_text", "logprobs": None})
    return out + ev("response.output_item.done", item=item, output_index=index)
