"""The request bodies of the OpenAI API, declared: every field vLLM 0.32.0's OpenAI server reads.

Each field of vLLM's `CompletionRequest` and `ChatCompletionRequest` is declared here, so a body is
decoded in one place: a field nobody declared is refused (400 naming it), and a declared field
Kairos cannot honour is refused when it is set to anything but its default (`REFUSED`, with the
reason). Everything else is honoured as vLLM honours it (docs/api.md has the table). Kairos adds
`ttft_slo` and `tbt_slo` (seconds).

`plan()` turns a decoded body into what the router submits: one prompt (token ids) per prompt in
the batch and one `Sampling` per choice (`n` choices per prompt; with a seed, choice i gets
seed + i, as vLLM's parallel sampling does).
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from common import messages as m
from common.config import RouterConfig
from common.errors import RequestError
from common.tokenizer import Tokenizer
from services.router.openai_structured import calls_tools, structured, template_tools

if TYPE_CHECKING:
    from services.router.openai_tools import ToolCalling

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP = 4       # vLLM: at most 4 stop strings


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both endpoints share, in vLLM's order."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    # Kairos' own
    ttft_slo: float | None = None
    tbt_slo: float | None = None


class CompletionBody(_Body, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True


class ChatBody(_Body, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # vLLM: "auto" when tools are given, else "none"
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None


_BEAM = "beam search is not implemented (it needs every beam on one engine; Kairos splits prefill and decode)"
REFUSED: dict[str, str] = {
    "use_beam_search": _BEAM,
    "length_penalty": "it applies to beam search only, which is not implemented",
    "watermarking": "watermarking is not implemented",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs/top_logprobs",
    "bad_words": "bad words are not implemented (the prefill engines run without a tokenizer); use logit_bias "
                 "with negative values",
    "priority": "request priorities are not implemented: the routing policy orders the work",
    "session_id": "sessions are not implemented",
    "routed_experts_prompt_start": "routed-expert reporting is not implemented",
    "return_token_offsets": "token offsets are not implemented",
    "mm_payload": "multimodal inputs are not supported",
    "return_mm_kwargs": "multimodal inputs are not supported",
    "cache_salt": "prefix-cache salts are not implemented",
    "kv_transfer_params": "Kairos moves the KV cache itself; it takes no client transfer parameters",
    "ec_transfer_params": "encoder-cache transfer is not supported",
    "vllm_xargs": "vLLM's extra arguments are not passed through the router",
    "repetition_detection": "repetition detection is not implemented",
    "thinking_token_budget": "reasoning budgets are not implemented",
    "stream_interval": "stream intervals are not implemented: every step's tokens are sent at once",
    "spaces_between_special_tokens": "only the default (true) is supported",
    "suffix": "suffixes are not supported (vLLM refuses them too)",
    "prompt_embeds": "prompt embeddings are not supported",
    "reasoning_effort": "reasoning controls are not implemented (no reasoning parser)",
    "include_reasoning": "reasoning controls are not implemented (no reasoning parser)",
    "documents": "documents in the chat template are not supported",
    "chat_template": "per-request chat templates are not accepted; the model's own template is used",
    "media_io_kwargs": "multimodal inputs are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "return_prompt_text": "returning the rendered prompt is not implemented; use POST /tokenize",
}
# defaults besides the declared ones that mean "off" (vLLM treats them alike)
_OFF: dict[str, tuple[Any, ...]] = {
    "length_penalty": (1.0,), "watermarking": (False,), "return_token_offsets": (None,),
    "return_mm_kwargs": (False,),
}


_REFUSED_ITEMS = tuple(REFUSED.items())


@functools.cache
def _refusable(typ: type[msgspec.Struct], refused: tuple[tuple[str, str], ...]) \
        -> tuple[tuple[str, str, Any, tuple[Any, ...]], ...]:
    """The refused fields a body type has, each with its default and its 'off' values: read once
    per type. (`msgspec.structs.fields` re-reads the type's annotations on every call: about
    0.8 ms for the 57-field chat body, more than the rest of a request's router work.)"""
    defaults = {f.name: f.default for f in msgspec.structs.fields(typ)}
    return tuple((name, why, defaults[name], _OFF.get(name, ())) for name, why in refused if name in defaults)


def check_refused(body: msgspec.Struct, refused: tuple[tuple[str, str], ...] = _REFUSED_ITEMS) -> None:
    """A 400 naming the first field of `refused` ((name, reason) pairs) set to other than its
    default or an 'off' value."""
    for name, why, default, off in _refusable(type(body), refused):
        v = getattr(body, name)
        if v is None or v == default or v in off:
            continue
        raise RequestError(f"'{name}' is not supported by Kairos: {why}", param=name, code="unsupported_parameter")


TOO_DEEP = "the body's JSON is nested too deeply"


def decode(raw: bytes, *, chat: bool) -> CompletionBody | ChatBody:
    """The body, decoded and checked field by field; RequestError (400) names the field at fault."""
    body: CompletionBody | ChatBody = decode_as_checked(raw, ChatBody if chat else CompletionBody)
    check_refused(body)
    return body


def decode_as_checked(raw: bytes, typ: type[Any]) -> Any:
    """`raw` decoded as `typ`; a field nobody declared, a wrong type or bad JSON is a 400 naming it."""
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as e:
        msg = str(e)
        field = None
        if "unknown field `" in msg:
            field = msg.split("unknown field `", 1)[1].split("`", 1)[0]
            raise RequestError(f"unknown field '{field}': vLLM's OpenAI server does not define it, and Kairos "
                               "refuses what it would ignore", param=field, code="unknown_parameter") from e
        if "at `$." in msg:  # vLLM's schema validation names the place as pydantic does: body.a.0.b
            path = msg.rsplit("at `$.", 1)[1].split("`", 1)[0]
            field = "body." + path.replace("[", ".").replace("]", "")
        raise RequestError(f"invalid request: {msg}", param=field, validation=True) from e
    except msgspec.DecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}", code="invalid_json", validation=True) from e
    except RecursionError as e:  # msgspec's own bound on nesting: a client's doing, not a server error
        raise RequestError(TOO_DEEP, code="invalid_json", validation=True) from e


class TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize: vLLM's TokenizeCompletionRequest or TokenizeChatRequest."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as vLLM's /tokenize does


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


def decode_tokenize(raw: bytes) -> TokenizeBody:
    b: TokenizeBody = decode_as_checked(raw, TokenizeBody)
    return b


def decode_detokenize(raw: bytes) -> DetokenizeBody:
    b: DetokenizeBody = decode_as_checked(raw, DetokenizeBody)
    return b


# ---------------------------------------------------------------------------- the plan


class Plan(msgspec.Struct, kw_only=True):
    """What one HTTP request asks: prompts x choices, and how to render the answer."""

    chat: bool
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
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
            texts.append(tok.decode(x, skip_special_tokens=False))
    return prompts, texts


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
    base = m.Sampling(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, ignore_eos=body.ignore_eos, seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, min_tokens=body.min_tokens, logit_bias=bias,
        allowed_token_ids=tuple(body.allowed_token_ids or ()), logprobs=logprobs, prompt_logprobs=plps,
        structured=grammar)
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
