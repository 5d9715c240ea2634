"""The request bodies of the OpenAI API, planned: `plan()` turns a decoded body into what the
router submits: one prompt (token ids) per prompt in the batch and one `Sampling` per choice
(`n` choices per prompt; with a seed, choice i gets seed + i, as vLLM's parallel sampling does).

The bodies themselves (every field vLLM 0.32.0's OpenAI server reads, what Kairos refuses, the
decoding) are declared in services/router/openai_bodies.py; this module exports them too, so
`openai_schema` stays the one name the rest of the router and the tests import them by.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from common import messages as m
from common.config import RouterConfig
from common.errors import RequestError
from common.tokenizer import Tokenizer, fingerprint
from services.router.openai_bodies import (
    MAX_LOGPROBS,
    MAX_STOP,
    REFUSED,
    TOO_DEEP,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    StreamOptions,
    TokenizeBody,
    check_refused,
    decode,
    decode_as_checked,
    decode_detokenize,
    decode_tokenize,
)
from services.router.openai_structured import calls_tools, structured, template_tools

if TYPE_CHECKING:
    from services.router.openai_tools import ToolCalling

__all__ = ["MAX_LOGPROBS", "MAX_STOP", "REFUSED", "TOO_DEEP", "ChatBody", "CompletionBody", "DetokenizeBody", "Plan",
           "StreamOptions", "TokenizeBody", "chat_prompt", "check_refused", "decode", "decode_as_checked",
           "decode_detokenize", "decode_tokenize", "plan", "response_role"]


# ---------------------------------------------------------------------------- the plan


class Plan(msgspec.Struct, kw_only=True):
    """What one HTTP request asks: prompts x choices, and how to render the answer."""

    chat: bool
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]       # completions: each prompt's text ("" for token ids unless echo shows them)
    samplings: list[m.Sampling]   # one per choice (n of them); the same for every prompt
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: list[str]
    include_stop: bool
    skip_special: bool
    echo: bool
    echo_text: str                # chat: the last message's content, when echo and it is the assistant's
    logprobs: int | None          # completions: logprobs; chat: top_logprobs when logprobs is true
    role: str                     # chat: the answer's role
    max_tokens_zero: bool         # completions with echo and max_tokens 0: the prompt only
    max_tokens_given: bool        # the client set max_tokens (else the router's default)
    return_token_ids: bool
    tokens_as_ids: bool
    ttft_slo: float | None
    tbt_slo: float | None
    request_id: str | None
    tool_plan: Any = None         # chat with tool calls: services.router.openai_tools.ToolPlan

    @property
    def n(self) -> int:
        return len(self.samplings)


def _num(v: float | int | None, name: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if v is None:
        return
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", param=name)


def _text_content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported (no images, audio or "
                                   "files: the served model is text-only)", param="messages")
            parts.append(p["text"])
        return "\n".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or an array of text parts", param="messages")


_MESSAGE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def _history_message(msg: dict[str, Any], role: str, i: int) -> dict[str, object]:
    """One message as vLLM 0.32's chat_utils hands it to the chat template: text content (parts
    joined by newlines), `name` when given, an assistant's `tool_calls` with each call's JSON
    `arguments` string parsed into the mapping templates expect (unparsable or not an object: {},
    as vLLM coerces it; an empty list dropped), a tool result's `tool_call_id`."""
    if "function_call" in msg:
        raise RequestError(f"messages[{i}].function_call: the deprecated function_call is not supported; send "
                           "the call as tool_calls", param="messages")
    extra = set(msg) - {"role", "content", "name"} - _MESSAGE_FIELDS.get(role, set())
    if extra:
        raise RequestError(f"messages[{i}]: field '{sorted(extra)[0]}' is not supported for the {role!r} role",
                           param="messages")
    out: dict[str, object] = {"role": role, "content": _text_content(msg.get("content"), i)}
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if role == "tool" and msg.get("tool_call_id") is not None:
        if not isinstance(msg["tool_call_id"], str):
            raise RequestError(f"messages[{i}].tool_call_id must be a string", param="messages")
        out["tool_call_id"] = msg["tool_call_id"]
    calls = msg.get("tool_calls")
    if role == "assistant" and calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"messages[{i}].tool_calls must be an array", param="messages")
        if calls:
            out["tool_calls"] = [_history_call(c, i) for c in calls]
    return out


def _history_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls: each call must be an object of type 'function' with a "
                           "function name", param="messages")
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        args = {}
    out = {k: v for k, v in call.items() if k != "function"}
    out["function"] = {**fn, "arguments": args}
    return out


def chat_prompt(body: ChatBody, tok: Tokenizer, parser: bool = False) -> tuple[list[int], str, str]:
    msgs = body.messages
    if not msgs:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    flat: list[dict[str, object]] = []
    for i, msg in enumerate(msgs):
        role = msg.get("role")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
        flat.append(_history_message(msg, role, i))
    if body.continue_final_message and body.add_generation_prompt:
        raise RequestError("'continue_final_message' needs 'add_generation_prompt': false",
                           param="continue_final_message")
    tools = template_tools(body.tools, body.tool_choice, parser)
    kwargs = body.chat_template_kwargs if tools is None else {**(body.chat_template_kwargs or {}), "tools": tools}
    try:
        text = tok.render_chat(flat, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message, kwargs=kwargs)
    except Exception as e:  # a template error is the request's fault (its messages or kwargs)
        raise RequestError(f"the chat template could not render these messages: {e}", param="messages") from e
    echo = ""
    if body.echo and flat[-1]["role"] == response_role(body):
        echo = str(flat[-1]["content"])
    return tok.encode(text, add_special_tokens=body.add_special_tokens), text, echo


def response_role(body: ChatBody) -> str:
    """The answer's role: the assistant's, or without a generation prompt the last message's (vLLM)."""
    if body.add_generation_prompt or not body.messages:
        return "assistant"
    return str(body.messages[-1].get("role", "assistant"))


def _completion_prompts(body: CompletionBody, tok: Tokenizer) -> tuple[list[list[int]], list[str]]:
    p = body.prompt
    if p is None:
        raise RequestError("'prompt' is required", param="prompt")
    items: list[str | list[int]]
    if isinstance(p, str):
        items = [p]
    elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        items = [list(p)]
    elif p and all(isinstance(x, str) for x in p):
        items = list(p)
    elif p and all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                   for x in p):
        items = [list(x) for x in p]
    else:
        raise RequestError("'prompt' must be a string, an array of strings, an array of token ids, or an array "
                           "of arrays of token ids", param="prompt",
                           validation=True)
    prompts, texts = [], []
    for x in items:
        if isinstance(x, str):
            prompts.append(tok.encode(x, add_special_tokens=body.add_special_tokens))
            texts.append(x)
        else:
            if any(t < 0 or t >= tok.vocab_size for t in x):
                raise RequestError(f"token ids in 'prompt' must be in [0, {tok.vocab_size})", param="prompt")
            prompts.append(x)
            # the prompt's text is shown only by echo: decoding it for every request was a third of
            # the plan's CPU (py-spy, bench/request_path.py)
            texts.append(tok.decode(x, skip_special_tokens=False) if body.echo else "")
    return prompts, texts


def batch_limit(cfg: RouterConfig) -> int:
    """The most sub-requests (prompts x n) one HTTP request may make: `max_batch`, and never more
    than one client's share of `max_in_flight` (a batch past it could never be admitted whole)."""
    limit = cfg.max_batch
    if 0 < cfg.client_share < 1:
        limit = min(limit, max(1, int(cfg.client_share * cfg.max_in_flight)))
    return min(limit, cfg.max_in_flight)


def _check_batch(body: CompletionBody, cfg: RouterConfig) -> None:
    """A batched `prompt` (a list of prompts) times `n` over `batch_limit`: HTTP 400, before any work."""
    p = body.prompt
    count = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
    n = body.n if isinstance(body.n, int) and body.n > 0 else 1
    limit = batch_limit(cfg)
    if count * n > limit:
        raise RequestError(f"this request makes {count * n} sub-requests ({count} prompts x n={n}); the limit is "
                           f"{limit} (max_batch, and the client's share of max_in_flight): send the prompts in "
                           "several requests", param="prompt", code="batch_too_large")


def plan(body: CompletionBody | ChatBody, cfg: RouterConfig, tok: Tokenizer, tools: ToolCalling | None = None) -> Plan:
    chat = isinstance(body, ChatBody)
    echo_text = ""
    grammar = structured(body.structured_outputs, body.response_format)
    tool_plan = None
    skip_special = body.skip_special_tokens
    if isinstance(body, ChatBody):
        ids, text, echo_text = chat_prompt(body, tok, tools is not None)
        # vLLM's parser sets the grammar (it keeps response_format's)
        if tools is not None and calls_tools(body.tools, body.tool_choice):
            tool_plan, grammar, skip_special = tools.plan(msgspec.to_builtins(body))
        prompts, texts = [ids], [text]
        if body.top_logprobs and not body.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        _num(body.top_logprobs, "top_logprobs", 0, MAX_LOGPROBS)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        echo = body.echo
    else:
        _check_batch(body, cfg)  # before any prompt is tokenized
        prompts, texts = _completion_prompts(body, tok)
        logprobs = body.logprobs
        _num(body.logprobs, "logprobs", 0, MAX_LOGPROBS)
        max_tokens = body.max_tokens
        echo = bool(body.echo)
    param = "messages" if chat else "prompt"
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens != -1:
        k = body.truncate_prompt_tokens
        if k < 1:
            raise RequestError("'truncate_prompt_tokens' must be -1 or at least 1", param="truncate_prompt_tokens")
        prompts = [p[:k] if body.truncation_side == "right" else p[-k:] for p in prompts]
    for p in prompts:
        if not p:
            raise RequestError("the prompt is empty", param=param)
        if len(p) > cfg.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(p)} tokens; the maximum is {cfg.max_prompt_tokens}",
                               param=param, code="context_length_exceeded")
    zero = False
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    elif max_tokens == 0 and echo and not chat:
        zero, max_tokens = True, 1  # the prompt only (vLLM's echo with max_tokens 0): one token, not shown
    _num(max_tokens, "max_tokens", 1, cfg.max_output_tokens)
    n = body.n if body.n is not None else 1
    _num(n, "n", 1, 128)
    _num(body.temperature, "temperature", 0, 1e6)
    _num(body.top_p, "top_p", 0, 1, lo_open=True)
    _num(body.min_p, "min_p", 0, 1)
    _num(body.presence_penalty, "presence_penalty", -2, 2)
    _num(body.frequency_penalty, "frequency_penalty", -2, 2)
    _num(body.repetition_penalty, "repetition_penalty", 0, 1e6, lo_open=True)
    _num(body.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
    if body.prompt_logprobs and body.stream:
        raise RequestError("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    if body.top_k is not None and body.top_k < -1:
        raise RequestError(f"'top_k' must be -1 (off), 0 (off) or at least 1, got {body.top_k}", param="top_k")
    _num(body.min_tokens, "min_tokens", 0, max_tokens)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise RequestError(f"'stop' takes at most {MAX_STOP} non-empty strings", param="stop")
    vocab = tok.vocab_size
    lists: tuple[tuple[str, list[int] | None], ...] = (("stop_token_ids", body.stop_token_ids),
                                                       ("allowed_token_ids", body.allowed_token_ids))
    for name, tids in lists:
        if tids and any(t < 0 or t >= vocab for t in tids):
            raise RequestError(f"'{name}' must hold token ids in [0, {vocab})", param=name)
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise RequestError("'allowed_token_ids' must not be empty", param="allowed_token_ids")
    bias: dict[int, float] = {}
    for k_, v in (body.logit_bias or {}).items():
        try:
            t = int(k_)
        except ValueError:
            raise RequestError(f"'logit_bias' keys must be token ids, got {k_!r}", param="logit_bias") from None
        if not 0 <= t < vocab:
            raise RequestError(f"'logit_bias' token id {t} is not in [0, {vocab})", param="logit_bias")
        bias[t] = max(-100.0, min(100.0, v))
    plps = body.prompt_logprobs
    if plps is None and echo:
        # vLLM: echo scores the prompt too (completions: with logprobs; chat: with top_logprobs)
        plps = body.top_logprobs if isinstance(body, ChatBody) else logprobs
    so = body.stream_options
    if so is not None and not body.stream and (so.include_usage or so.continuous_usage_stats):
        raise RequestError("'stream_options' needs 'stream': true", param="stream_options")
    # a plain stream (services/router/openai_serve.py `plain`): the decode worker sends each token's
    # text with it (common/tokenizer.py TextStream), so the router writes it without decoding
    text_fp = fingerprint(tok) if body.stream and not stop and logprobs is None and tool_plan is None and not echo \
        and not (so and so.continuous_usage_stats) and not body.return_token_ids else ""
    base = m.Sampling(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, ignore_eos=body.ignore_eos, seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, min_tokens=body.min_tokens, logit_bias=bias,
        allowed_token_ids=tuple(body.allowed_token_ids or ()), logprobs=logprobs, prompt_logprobs=plps,
        structured=grammar, text=text_fp, text_keep_special=bool(text_fp) and not skip_special)
    if n > 1 and base.temperature < 1e-5:
        raise RequestError(f"n must be 1 when using greedy sampling, got {n}.", param="n")
    samplings = [base if body.seed is None else msgspec.structs.replace(base, seed=body.seed + i) for i in range(n)]
    if n == 1:
        samplings = [base]
    _num(body.ttft_slo, "ttft_slo", 0.001, 3600)
    _num(body.tbt_slo, "tbt_slo", 0.001, 60)
    return Plan(chat=chat, model=cfg.served_model_name, prompts=prompts, prompt_texts=texts, samplings=samplings,
                stream=bool(body.stream), include_usage=bool(so and so.include_usage),
                continuous_usage=bool(so and so.continuous_usage_stats), stop=stop,
                include_stop=body.include_stop_str_in_output, skip_special=skip_special, echo=echo,
                echo_text=echo_text, logprobs=logprobs,
                role=response_role(body) if isinstance(body, ChatBody) else "assistant",
                max_tokens_zero=zero, max_tokens_given=given, return_token_ids=bool(body.return_token_ids),
                tokens_as_ids=bool(body.return_tokens_as_token_ids), ttft_slo=body.ttft_slo, tbt_slo=body.tbt_slo,
                request_id=body.request_id, tool_plan=tool_plan)
