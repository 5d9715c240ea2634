"""Side by side: vLLM's own OpenAI server and Kairos (`kairos up --engine vllm`, 1 prefill + 1 decode
worker) on the same tiny model, the same request shapes, on both of Kairos' routes.

Every shape is sent to both servers; the responses must be equal field by field apart from ids,
timestamps, fingerprints and Kairos' own `kairos` extension. Streams are compared as what a client
assembles from them, and by the fields each kind of chunk carries: per choice the concatenated text
(or content), the concatenated logprobs, the finish and stop reasons, and the usage chunk (how
tokens are grouped into chunks differs: Kairos sends every token of an engine step at once, as does
vLLM, but the router may batch two steps when it is behind). Logprobs are compared to 1e-3: the two
engines batch and chunk the same prompt differently (Kairos runs its chunk schedule), which moves
float32 sums in the last digits. Sampled shapes (temperature > 0) carry a seed: vLLM's per-request
generator makes them reproducible across servers.

Skipped shapes, and why: none of the shapes below is skipped. Streamed tool calls are compared as a
client assembles them too: per tool-call index, the type, the name and the concatenated arguments
(tool-call ids are random on both servers); vLLM's streaming tool parser depends on how tokens are
grouped into chunks, which is timing-dependent on both servers: the arguments of a call cut short by
max_tokens may stream as "" from one and "{}" from the other, so for a truncated call one must be a
prefix of the other (`_truncated_calls_as_prefixes`), and a Kairos chunk may merge delta fields vLLM
sent in separate chunks (`_kind_allowed`). Not compared at all: `/version` (each server reports its own version),
and the fields Kairos refuses (tests/test_api_params.py checks each refusal names its field).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kairos.passthrough import passthrough
from kairos.up import Cluster, ClusterSpec
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]

TOKENS = [5, 6, 7, 8, 9]
TEXT = "the quick brown fox jumps over"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]
SEEDED = {"temperature": 0.9, "seed": 1234}
GREEDY = {"temperature": 0}

# (name, endpoint, body); `model` is added per server. Greedy unless a seed is given.
SHAPES: list[tuple[str, str, dict[str, Any]]] = [
    ("text", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8}),
    ("token_ids", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 8}),
    ("batch_text", "completions", {**GREEDY, "prompt": [TEXT, "lorem ipsum dolor"], "max_tokens": 5}),
    ("batch_token_ids", "completions", {**GREEDY, "prompt": [TOKENS, [11, 12, 13, 14]], "max_tokens": 5}),
    ("n2_greedy_refused", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 5, "n": 2}),
    ("mixed_batch_refused", "completions", {**GREEDY, "prompt": [TEXT, TOKENS], "max_tokens": 5}),
    ("n2_seeded", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 6, "n": 2, **SEEDED}),
    ("logprobs", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 6, "logprobs": 3}),
    ("logprobs0", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 4, "logprobs": 0}),
    ("echo", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, "echo": True}),
    ("echo_logprobs_harness", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 1, "echo": True, "logprobs": 1,
                                              "temperature": 0}),
    ("echo_max_tokens_0", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("prompt_logprobs", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 3, "prompt_logprobs": 2}),
    ("stop_string", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 16, "stop": ["STOP1"]}),
    ("stop_string_included", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 16, "stop": ["STOP1"],
                                             "include_stop_str_in_output": True}),
    ("stop_token_ids", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 16, "stop_token_ids": [550]}),
    ("min_tokens_ignore_eos", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 12, "min_tokens": 12,
                                              "ignore_eos": True, "stop_token_ids": [550]}),
    ("seeded", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8, **SEEDED}),
    ("top_k", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8, "top_k": 5, **SEEDED}),
    ("top_p", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8, "top_p": 0.5, **SEEDED}),
    ("min_p", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8, "min_p": 0.3, **SEEDED}),
    ("penalties", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 10, "presence_penalty": 1.5,
                                  "frequency_penalty": 1.0}),
    ("repetition_penalty", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 10, "repetition_penalty": 1.5}),
    ("logit_bias", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 8, "logit_bias": {"515": -100}}),
    ("allowed_token_ids", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 6,
                                          "allowed_token_ids": [40, 41, 42]}),
    ("return_token_ids", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, "return_token_ids": True}),
    ("tokens_as_ids", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, "logprobs": 2,
                                      "return_tokens_as_token_ids": True}),
    ("truncate", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, "truncate_prompt_tokens": 3}),
    ("no_special_tokens", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, "add_special_tokens": False}),
    ("stream", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 8, "stream": True}),
    ("stream_usage", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 8, "stream": True,
                                     "stream_options": {"include_usage": True}}),
    ("stream_logprobs", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 6, "logprobs": 2, "stream": True}),
    ("stream_stop", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 16, "stop": ["STOP1"], "stream": True}),
    ("stream_n2_batch", "completions", {"prompt": [TEXT, "lorem ipsum dolor"], "max_tokens": 4, "n": 2,
                                        "stream": True, "stream_options": {"include_usage": True}, **SEEDED}),
    ("stream_echo_logprobs", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 3, "echo": True, "logprobs": 1,
                                             "stream": True}),
    ("chat", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 8}),
    ("chat_max_completion_tokens", "chat/completions", {**GREEDY, "messages": MSGS, "max_completion_tokens": 5}),
    ("chat_logprobs", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 5, "logprobs": True,
                                           "top_logprobs": 2}),
    ("chat_n2_seeded", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 5, "n": 2, **SEEDED}),
    ("chat_stop", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 16, "stop": ["STOP2"]}),
    ("chat_echo_continue", "chat/completions", {
        **GREEDY, "messages": [*MSGS, {"role": "assistant", "content": "the quick"}], "max_tokens": 5, "echo": True,
        "add_generation_prompt": False, "continue_final_message": True}),
    ("chat_no_generation_prompt", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 5,
                                                       "add_generation_prompt": False}),
    ("chat_stream", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 8, "stream": True}),
    ("chat_stream_logprobs_usage", "chat/completions", {
        **GREEDY, "messages": MSGS, "max_tokens": 6, "stream": True, "logprobs": True, "top_logprobs": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
]
# structured outputs: the grammar constrains the tiny model's garbage, so equal output is a real check
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}
JSON_OBJECT = {"response_format": {"type": "json_object"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [MSGS[0], {"role": "user", "content": "weather in Oslo?", "name": "ann"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny, 12 C"}]}]
BAD_ARGS = [*HISTORY[:2], {"role": "assistant", "content": "let me look", "tool_calls": [
    {**CALL, "function": {"name": "get_weather", "arguments": "not json"}}]}, HISTORY[3]]
SHAPES += [
    ("json_schema", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 40, **JSON_SCHEMA}),
    ("stream_json_schema", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 40, "stream": True,
                                           **JSON_SCHEMA}),
    ("json_object", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 12, **JSON_OBJECT}),
    ("so_regex", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 12,
                                 "structured_outputs": {"regex": "(fox|dog) [0-9]{2,4}"}}),
    ("so_choice_seeded", "completions", {"prompt": TEXT, "max_tokens": 8, **SEEDED,
                                         "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}),
    ("so_grammar", "completions", {**GREEDY, "prompt": TOKENS, "max_tokens": 10,
                                   "structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "."'}}),
    ("so_json_no_whitespace", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 30, "structured_outputs": {
        "json": SCHEMA, "disable_any_whitespace": True}}),
    ("chat_json_schema", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 40, **JSON_SCHEMA}),
    ("chat_json_schema_logprobs", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 20, "logprobs": True,
                                                       "top_logprobs": 2, **JSON_SCHEMA}),
    ("chat_stream_json_schema", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 40, "stream": True,
                                                     **JSON_SCHEMA}),
    ("chat_json_object", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 12, **JSON_OBJECT}),
    ("chat_stream_so_choice", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 8, "stream": True,
                                                "structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("chat_n2_json_schema_seeded", "chat/completions", {"messages": MSGS, "max_tokens": 30, "n": 2, **SEEDED,
                                                        **JSON_SCHEMA}),
    ("chat_tools_none", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 8, "tools": TOOLS,
                                             "tool_choice": "none"}),
    ("chat_stream_tools_none", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 8, "stream": True,
                                                    "tools": TOOLS, "tool_choice": "none"}),
    # tool calling with vLLM's hermes parser on both servers (vLLM: --enable-auto-tool-choice
    # --tool-call-parser hermes; Kairos: the router's tool_call_parser / enable_auto_tool_choice)
    ("chat_tools_required", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 60, "tools": TOOLS,
                                                 "tool_choice": "required"}),
    ("chat_tools_named", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 40, "tools": TOOLS,
                                              "tool_choice": NAMED}),
    ("chat_tools_required_single_call", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 60,
                                                             "tools": TOOLS, "tool_choice": "required",
                                                             "parallel_tool_calls": False}),
    ("chat_tools_auto", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 12, "tools": TOOLS}),
    ("chat_stream_tools_required", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 60, "stream": True,
                                                        "tools": TOOLS, "tool_choice": "required"}),
    ("chat_stream_tools_named", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 40, "stream": True,
                                                     "tools": TOOLS, "tool_choice": NAMED}),
    ("chat_stream_tools_auto", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 12, "stream": True,
                                                    "tools": TOOLS}),
    ("chat_tools_named_unknown_refused", "chat/completions", {
        **GREEDY, "messages": MSGS, "max_tokens": 4, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("two_constraints_refused", "completions", {**GREEDY, "prompt": TEXT, "max_tokens": 4, **JSON_OBJECT,
                                                "structured_outputs": {"regex": "a+"}}),
    ("json_schema_without_schema_refused", "chat/completions", {
        **GREEDY, "messages": MSGS, "max_tokens": 4, "response_format": {"type": "json_schema"}}),
    ("tools_empty_refused", "chat/completions", {**GREEDY, "messages": MSGS, "max_tokens": 4, "tools": []}),
    # a conversation with a tool turn: the assistant's call (arguments parsed into a mapping for the
    # template) and the tool's result (its call id), rendered by the tiny model's template
    ("chat_tool_history", "chat/completions", {**GREEDY, "messages": HISTORY, "max_tokens": 8}),
    ("chat_stream_tool_history", "chat/completions", {**GREEDY, "messages": HISTORY, "max_tokens": 8,
                                                      "stream": True}),
    ("chat_tool_history_tools_auto", "chat/completions", {**GREEDY, "messages": HISTORY, "max_tokens": 12,
                                                          "tools": TOOLS}),
    ("chat_tool_history_bad_arguments", "chat/completions", {**GREEDY, "messages": BAD_ARGS, "max_tokens": 8}),
]
IGNORED = {"id", "created", "system_fingerprint", "kairos"}


@pytest.fixture(scope="module")
def stops(vllm_server: str, tiny_model: Path) -> dict[str, str]:
    """Stop strings taken from the middle of vLLM's own greedy outputs, so they do occur."""
    out = {}
    r = httpx.post(vllm_server + "/completions", json={"model": tiny_model.name, "prompt": TOKENS,
                                                       "max_tokens": 16}, timeout=60).json()
    text = r["choices"][0]["text"]
    out["STOP1"] = text[len(text) // 2:len(text) // 2 + 3]
    r = httpx.post(vllm_server + "/chat/completions", json={"model": tiny_model.name, "messages": MSGS,
                                                            "max_tokens": 16}, timeout=60).json()
    text = r["choices"][0]["message"]["content"]
    out["STOP2"] = text[len(text) // 2:len(text) // 2 + 2]
    assert all(out.values()), out
    return out


@pytest.fixture(scope="module", params=["disagg-least-loaded", "deflect-all"])
def kairos(request: pytest.FixtureRequest, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy=request.param, monitor=False,
                                 log_dir=str(tmp_path_factory.mktemp("conformance")),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64", "KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50"},  # 5 s: the 2 shared CI cores stall workers
                                 # tool calling and the KV size as an operator turns them on under `kairos up`:
                                 # from its environment (kairos/passthrough.py), not from kairos up's flags
                                 operator_env=passthrough(None, {"KAIROS_TOOL_CALL_PARSER": "hermes",
                                                                 "KAIROS_ENABLE_AUTO_TOOL_CHOICE": "true",
                                                                 "KAIROS_VLLM_KV_CACHE_MIB": "64"})[0])
    c = Cluster(spec)
    c.start(timeout=300)
    route = "deflect" if request.param == "deflect-all" else "disagg"
    CLUSTERS[route] = c
    yield c.spec.api + "/v1", route
    CLUSTERS.pop(route, None)
    c.stop(30)


CLUSTERS: dict[str, Cluster] = {}


def _diagnose(route: str) -> str:
    """What the cluster says when Kairos fails where vLLM's server did not: each service
    running or not, and its last warnings and errors."""
    c = CLUSTERS.get(route)
    if c is None:
        return ""
    out = []
    for name, svc in c.services.items():
        code = c.returncode(name)
        out.append(f"{name}: {'running' if code is None else f'exited {code}'}")
        if svc.log_path is not None and svc.log_path.exists():
            bad = [ln for ln in svc.log_path.read_text(errors="replace").splitlines()
                   if '"level": "warning"' in ln or '"level": "error"' in ln or "Traceback" in ln]
            out += ["  " + ln[:300] for ln in bad[-6:]]
    return "\n".join(out)


def _fill(body: dict[str, Any], stops: dict[str, str], model: str) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    if "stop" in out:
        out["stop"] = [stops.get(s, s) for s in out["stop"]]
    return {"model": model, **out}


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    r = httpx.post(url, json=body, timeout=120)
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, r.json(), dict(r.headers)
    events = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    assert r.text.rstrip().endswith("data: [DONE]")
    return r.status_code, _assemble(events), dict(r.headers)


def _assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client makes of a stream: per choice, everything concatenated."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    # the fields each kind of chunk has. How many chunks there are, and whether a step's text was
    # held back (a delta without content), depends on how tokens fell into chunks: not compared
    shapes = set()
    for ev in events:
        for ch in ev["choices"] or [{}]:
            delta = sorted(set(ch.get("delta") or {}) - {"content"})
            shapes.add(" ".join([*sorted(ev), "|", *sorted(ch), "|", *delta]))
        assert "error" not in ev, ev
        if ev.get("usage") is not None and not ev["choices"]:
            usage = ev["usage"]
        for ch in ev["choices"]:
            c = choices.setdefault(ch["index"], {"text": "", "logprobs": None, "finish_reason": None,
                                                 "stop_reason": None, "usages": []})
            if "delta" in ch:
                c["text"] += ch["delta"].get("content") or ""
                for tc in ch["delta"].get("tool_calls") or []:  # by index; ids are random on both servers
                    t = c.setdefault("tool_calls", {}).setdefault(tc["index"], {"type": None, "name": "",
                                                                                "arguments": ""})
                    t["type"] = tc.get("type") or t["type"]
                    t["name"] += (tc.get("function") or {}).get("name") or ""
                    t["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                if ch["delta"].get("role"):
                    c["role"] = ch["delta"]["role"]
            else:
                c["text"] += ch["text"]
            lp = ch.get("logprobs")
            if lp is not None:
                if c["logprobs"] is None:
                    c["logprobs"] = {k: [] for k in lp}
                for k, v in lp.items():
                    c["logprobs"][k] += v
            if ch.get("finish_reason") is not None:
                c["finish_reason"] = ch["finish_reason"]
                c["stop_reason"] = ch.get("stop_reason")
            if ev.get("usage") is not None:
                c["usages"].append(ev["usage"]["completion_tokens"])
    for c in choices.values():  # continuous usage: the last count is what matters
        c["usages"] = c["usages"][-1:] if c["usages"] else []
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage,
            "object": events[0]["object"], "model": events[0]["model"], "chunk_fields": sorted(shapes)}


def _fields(kind: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """A chunk kind of `_assemble` ("event fields | choice fields | delta fields") as three sets."""
    ev, ch, delta = kind.split("|")
    return frozenset(ev.split()), frozenset(ch.split()), frozenset(delta.split())


FINAL_ONLY = frozenset({"stop_reason", "system_fingerprint"})  # fields vLLM puts on its final chunk only


def _kind_allowed(kind: str, theirs: list[str]) -> bool:
    """Whether Kairos may send this kind of chunk, given the kinds vLLM's server sent for the same
    request. What must be equal is the fields: the event's and the choice's fields must be those of
    a chunk vLLM sends, and the delta may carry only fields vLLM's deltas carry. How the deltas
    are grouped into chunks is timing, on both servers: Kairos puts every token ready in one event
    and the router may send two engine steps at once, and vLLM's output collector merges steps
    when its server falls behind. So a Kairos chunk may be the merge of chunks vLLM sent apart
    (e.g. the last tool-call delta and the finish: the final chunk carrying the unstreamed
    arguments of a truncated call on one server and not on the other), and a chunk vLLM
    sends before its final one has the final chunk's kind without the final-only fields (when vLLM
    put every token in its final chunk, Kairos may still have sent some of them before it)."""
    ev, ch, delta = _fields(kind)
    vllm = [_fields(t) for t in theirs]
    every_delta_field = frozenset().union(*(d for _, _, d in vllm))
    if not delta <= every_delta_field:
        return False
    for v_ev, v_ch, v_delta in vllm:
        if not v_delta <= delta:
            continue
        # the same fields, apart from final-only ones vLLM's chunk has and Kairos's lacks
        if ev - FINAL_ONLY == v_ev - FINAL_ONLY and ev <= v_ev and ch - FINAL_ONLY == v_ch - FINAL_ONLY and ch <= v_ch:
            return True
    return False


def _diff(a: Any, b: Any, path: str = "$") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in IGNORED:
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'vllm' if k in a else 'kairos'}")
            elif k == "chunk_fields":
                extra = [kind for kind in b[k] if not _kind_allowed(kind, a[k])]
                if extra:
                    out.append(f"{path}.{k}: kairos sends chunk kinds vllm does not: {extra} (vllm: {a[k]})")
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}: {str(a)[:300]} vs {str(b)[:300]}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return [] if math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3) else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _truncated_calls_as_prefixes(want: dict[str, Any], got: dict[str, Any]) -> None:
    """Streamed tool calls cut short by max_tokens (finish "length", e.g. `<tool_call>{"name":
    "get_weather", "argu`): what must be equal is what both servers streamed, not what vLLM's
    hermes parser appends at the finish. Its finish step (`_append_unstreamed_tool_args`) adds
    the arguments it parsed but did not stream (e.g. "{}") only when the final chunk itself
    carries a tool-call delta, and whether it does depends on how tokens were grouped into chunks
    (vLLM's output collector merges steps when its server falls behind; the router may send two
    engine steps at once). Seen both ways ("" and "{}"), on both routes. So for a truncated call
    one server's arguments must be a prefix of the other's; names, types, the number of calls and
    every complete call are compared exactly (`_diff`)."""
    for w, g in zip(want["choices"], got["choices"], strict=False):
        if w["finish_reason"] != "length" or g["finish_reason"] != "length":
            continue
        g_calls = g.get("tool_calls") or {}
        for i, t in (w.get("tool_calls") or {}).items():
            a, b = t["arguments"], (g_calls.get(i) or {}).get("arguments")
            if isinstance(b, str) and (a.startswith(b) or b.startswith(a)):
                t["arguments"] = b


@pytest.mark.parametrize("name,endpoint,body", SHAPES, ids=[s[0] for s in SHAPES])
def test_same_response(name: str, endpoint: str, body: dict[str, Any], kairos: tuple[str, str], vllm_server: str,
                       stops: dict[str, str], tiny_model: Path) -> None:
    url, route = kairos
    req = _fill(body, stops, tiny_model.name)
    s1, want, _ = _post(f"{vllm_server}/{endpoint}", req)
    s2, got, headers = _post(f"{url}/{endpoint}", req)
    if name.endswith("_refused"):  # vLLM refuses these bodies; so must Kairos, with vLLM's error body
        assert s1 == 400 and s2 == 400, (want, got)
        assert {k: got["error"][k] for k in ("type", "code")} == {k: want["error"][k] for k in ("type", "code")}, \
            (want, got)
        return
    assert s1 == 200, want
    assert s2 == 200, f"{got}\n{_diagnose(route)}"
    assert headers.get("x-kairos-route") == route
    if body.get("stream") and body.get("tools"):
        _truncated_calls_as_prefixes(want, got)
    diffs = _diff(want, got)
    assert not diffs, f"{name} on the {route} route:\n" + "\n".join(diffs[:20])


def test_tokenize_and_detokenize(kairos: tuple[str, str], vllm_server: str, tiny_model: Path) -> None:
    url, _ = kairos
    base = vllm_server.removesuffix("/v1")
    kbase = url.removesuffix("/v1")
    for body in ({"prompt": TEXT}, {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
                 {"messages": MSGS}, {"messages": MSGS, "add_generation_prompt": False},
                 {"messages": HISTORY}, {"messages": MSGS, "tools": TOOLS}):
        want = httpx.post(base + "/tokenize", json={"model": tiny_model.name, **body}, timeout=30).json()
        got = httpx.post(kbase + "/tokenize", json={"model": tiny_model.name, **body}, timeout=30).json()
        assert not _diff(want, got), (body, want, got)
        want = httpx.post(base + "/detokenize", json={"model": tiny_model.name, "tokens": want["tokens"]}).json()
        got = httpx.post(kbase + "/detokenize", json={"model": tiny_model.name, "tokens": got["tokens"]}).json()
        assert want == got
    oov = {"model": tiny_model.name, "tokens": [5, 6, 10**6, 7]}  # past the vocabulary: decoded to nothing
    want = httpx.post(base + "/detokenize", json=oov, timeout=30)
    got = httpx.post(kbase + "/detokenize", json=oov, timeout=30)
    assert want.status_code == got.status_code == 200 and want.json() == got.json(), (want.text, got.text)
    assert httpx.get(kbase + "/version").json()["version"]


# ---------------------------------------------------------------------------- the Responses API
RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("text", {**GREEDY, "input": "the lazy dog", "max_output_tokens": 8}),
    ("instructions", {**GREEDY, "input": "the lazy dog", "instructions": "be brief", "max_output_tokens": 6}),
    ("items", {**GREEDY, "max_output_tokens": 6, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
        {"role": "user", "content": "the lazy dog"}]}),
    ("function_call_history", {**GREEDY, "max_output_tokens": 6, "input": [
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 12 C"}]}),
    ("seeded", {"input": "the lazy dog", "max_output_tokens": 8, **SEEDED}),
    ("json_schema", {**GREEDY, "input": "the lazy dog", "max_output_tokens": 40, "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": SCHEMA}}}),
    ("tools_auto", {**GREEDY, "input": "weather in Oslo?", "max_output_tokens": 12,
                    "tools": [{"type": "function", **TOOLS[0]["function"]}]}),
    ("stream", {**GREEDY, "input": "the lazy dog", "max_output_tokens": 8, "stream": True}),
    ("stream_items", {**GREEDY, "max_output_tokens": 6, "stream": True, "input": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]}),
    ("previous_response_refused", {"input": "x", "previous_response_id": "resp_0123"}),
    ("background_refused", {"input": "x", "background": True}),
]
RESPONSE_IGNORED = {"id", "created_at", "call_id", "item_id"}


def _post_responses(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A unary answer as it is; a stream as (the event types, the text its deltas add up to, the
    final response)."""
    r = httpx.post(url, json=body, timeout=120)
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, r.json()
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    kinds = [ln[7:] for ln in r.text.splitlines() if ln.startswith("event: ")]
    assert kinds == [e["type"] for e in events] and [e["sequence_number"] for e in events] == list(
        range(len(events))), r.text[:2000]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    # how many deltas there are depends on how tokens fell into chunks (timing, on both servers)
    kinds = [k for i, k in enumerate(kinds) if not (k == "response.output_text.delta" and kinds[i - 1] == k)]
    return 200, {"kinds": kinds, "text": text, "response": events[-1]["response"]}


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in RESPONSE_IGNORED}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


@pytest.mark.parametrize("name,body", RESPONSES, ids=[s[0] for s in RESPONSES])
def test_same_responses_answer(name: str, body: dict[str, Any], kairos: tuple[str, str], vllm_server: str,
                               tiny_model: Path) -> None:
    """/v1/responses, unary and streamed, field by field against vLLM's server (ids and times aside)."""
    url, route = kairos
    req = {"model": tiny_model.name, **body}
    s1, want = _post_responses(f"{vllm_server}/responses", req)
    s2, got = _post_responses(f"{url}/responses", req)
    if name.endswith("_refused"):
        assert s1 == s2 and s1 in (400, 404), (want, got)
        assert {k: got["error"][k] for k in ("type", "code", "param")} == \
            {k: want["error"][k] for k in ("type", "code", "param")}, (want, got)
        return
    assert s1 == 200, want
    assert s2 == 200, f"{got}\n{_diagnose(route)}"
    diffs = _diff(_strip(want), _strip(got))
    assert not diffs, f"{name} on the {route} route:\n" + "\n".join(diffs[:20])
