"""The request bodies of the OpenAI API, declared: every field vLLM 0.32.0's OpenAI server reads,
and their decoding (services/router/openai_schema.py plans a decoded body).

Each field of vLLM's `CompletionRequest` and `ChatCompletionRequest` is declared here, so a body is
decoded in one place: a field nobody declared is refused (400 naming it), and a declared field
Kairos cannot honour is refused when it is set to anything but its default (`REFUSED`, with the
reason). Everything else is honoured as vLLM honours it (docs/api.md has the table). Kairos adds
`ttft_slo` and `tbt_slo` (seconds). The bodies of POST /tokenize and /detokenize too.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import msgspec

from common.errors import RequestError

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
