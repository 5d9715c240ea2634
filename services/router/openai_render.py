"""Turning a request's token events into OpenAI response bodies, as vLLM's server writes them.

One `Choice` per (prompt, choice) pair follows its request's events: it detokenizes, applies the
stop strings (the engines run without a tokenizer, so stop strings are found here, as vLLM's
front end finds them: the output ends before the stop string, or after it with
include_stop_str_in_output, and a streamed delta holds back the longest stop string's length
minus one), keeps the logprobs and renders them in the completions or the chat format.
"""

from __future__ import annotations

from typing import Any

from common import messages as m
from common.router_core.requests import Event, Request
from common.tokenizer import Tokenizer
from services.router.openai_schema import Plan

_FLOOR = -9999.0  # vLLM clamps -inf logprobs to this for JSON


class Choice:
    def __init__(self, index: int, prompt_index: int, req: Request, plan: Plan, tok: Tokenizer) -> None:
        self.index, self.prompt_index, self.req, self.plan, self.tok = index, prompt_index, req, plan, tok
        self.ids: list[int] = []
        self.lps: list[m.TokenLogprobs | None] = []
        self.prompt_lps: list[m.TokenLogprobs | None] | None = None
        self.text = ""              # the output text so far (after stop-string truncation)
        self.sent = 0               # characters of it already streamed
        self.lps_sent = 0           # tokens whose logprobs were already streamed
        self.finish: str | None = None
        self.stop_reason: str | int | None = None
        self.error: Event | None = None
        self.hold = max((len(s) for s in plan.stop), default=1) - 1 if not plan.include_stop else 0
        self.stop_early = False     # a stop string ended it here: the router must stop the work
        self.full = ""              # the whole decoded output, before any truncation
        # a tokenizer whose tokens decode independently (the simple one) extends the text token by
        # token; a byte-level one needs the whole sequence (a character may span tokens)
        self.additive = type(tok).__name__ == "SimpleTokenizer"

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None

    def push(self, events: list[Event]) -> None:
        for ev in events:
            if self.done:
                return
            if ev.prompt_logprobs is not None:
                self.prompt_lps = ev.prompt_logprobs
            if ev.token_ids:
                self._tokens(ev.token_ids, ev.logprobs)
            if ev.error is not None and not self.done:
                self.error = ev
            elif ev.finish_reason is not None and not self.done:
                self._finish(ev.finish_reason)

    def _tokens(self, ids: list[int], lps: list[m.TokenLogprobs] | None) -> None:
        for j, t in enumerate(ids):
            self.ids.append(t)
            self.lps.append(lps[j] if lps is not None and j < len(lps) else None)
            if not self.plan.stop:
                continue
            text = self._extend([t])
            start = max(len(self.text) - max(len(s) for s in self.plan.stop) + 1, 0)
            hit = None
            for s in self.plan.stop:
                i = text.find(s, start)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.text = text[:i + len(s)] if self.plan.include_stop else text[:i]
                self.finish, self.stop_reason, self.stop_early = "stop", s, True
                return
            self.text = text
        if not self.plan.stop:
            self.text = self._extend(ids)

    def _finish(self, reason: str) -> None:
        self.finish = reason
        if reason == "stop" and self.ids:
            last = self.ids[-1]
            if last in self.req.sampling.stop_token_ids:
                self.stop_reason = last
            if not self.plan.include_stop:  # vLLM leaves the stop token's text out of the output
                self.text = self._decode(self.ids[:-1])
        # an output ending inside a multi-byte character: vLLM's incremental detokenizer never shows
        # the incomplete character, so neither does Kairos
        self.text = self.text.rstrip("\ufffd")

    def _extend(self, new: list[int]) -> str:
        if self.additive:
            self.full += self._decode(new)
        else:
            self.full = self._decode(self.ids)
        return self.full

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.plan.skip_special)

    # ------------------------------------------------------------------ streaming deltas
    def delta(self) -> tuple[str, list[int], list[m.TokenLogprobs | None]]:
        """The text, token ids and logprobs not streamed yet that may go out now."""
        end = len(self.text)
        if not self.done:
            end = min(end - self.hold, len(self.text.rstrip("\ufffd")))
        out = self.text[self.sent:max(end, self.sent)] if end > self.sent else ""
        self.sent += len(out)
        n_ids = len(self.ids)
        new_ids = self.ids[self.lps_sent:n_ids]
        new_lps = self.lps[self.lps_sent:n_ids]
        self.lps_sent = n_ids
        return out, new_ids, new_lps

    # ------------------------------------------------------------------ logprobs formats
    def _strs(self, lp: m.TokenLogprobs | None, context: list[int]) -> list[str] | None:
        if lp is None:
            return None
        if self.plan.tokens_as_ids:
            return [f"token_id:{t}" for t in lp.token_ids]
        return self.tok.position_strs(lp.token_ids, context[-4:])

    def out_strs(self, start: int, lps: list[m.TokenLogprobs | None]) -> list[list[str] | None]:
        """Token strings of output positions start.. (context: the tokens chosen before each)."""
        return [self._strs(lp, self.ids[max(start + j - 4, 0):start + j]) for j, lp in enumerate(lps)]

    def prompt_strs(self) -> list[list[str] | None]:
        prompt = self.plan.prompts[self.prompt_index]
        lps = self.prompt_lps or []
        return [self._strs(lp, prompt[max(j - 4, 1):j]) for j, lp in enumerate(lps)]

    def _alone(self, t: int) -> str:
        return f"token_id:{t}" if self.plan.tokens_as_ids else self.tok.token_str(t)

    def completion_logprobs(self, ids: list[int], lps: list[m.TokenLogprobs | None],
                            strs: list[list[str] | None], offset: int = 0) -> dict[str, Any]:
        k = self.plan.logprobs or 0
        text_offset: list[int] = []
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        last = 0
        for t, lp, ss in zip(ids, lps, strs, strict=True):
            if lp is None or ss is None:
                s = self._alone(t)
                token_lps.append(None)
                tops.append(None)
            else:
                s = ss[lp.token_ids.index(t)] if t in lp.token_ids else self._alone(t)
                token_lps.append(max(_lp_of(lp, t), _FLOOR))
                top: dict[str, float] = {}
                for i, (name, v) in enumerate(zip(ss, lp.logprobs, strict=True)):
                    if k >= i:  # the chosen token plus the top k, as vLLM (and OpenAI) report
                        top[name] = max(v, _FLOOR)
                tops.append(top)
            tokens.append(s)
            text_offset.append(offset if not text_offset else text_offset[-1] + last)
            last = len(s)
        return {"text_offset": text_offset, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def chat_logprobs(self, ids: list[int], lps: list[m.TokenLogprobs | None],
                      strs: list[list[str] | None]) -> dict[str, Any]:
        k = self.plan.logprobs or 0
        content = []
        for t, lp, ss in zip(ids, lps, strs, strict=True):
            if lp is None or ss is None or t not in lp.token_ids:
                s = self._alone(t)
                content.append({"token": s, "logprob": _FLOOR, "bytes": list(s.encode("utf-8", errors="replace")),
                                "top_logprobs": []})
                continue
            s = ss[lp.token_ids.index(t)]
            top = [{"token": name, "logprob": max(v, _FLOOR), "bytes": list(name.encode("utf-8", errors="replace"))}
                   for i, (name, v) in enumerate(zip(ss, lp.logprobs, strict=True)) if i < k]
            content.append({"token": s, "logprob": max(_lp_of(lp, t), _FLOOR),
                            "bytes": list(s.encode("utf-8", errors="replace")), "top_logprobs": top})
        return {"content": content}

    def prompt_logprobs_json(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """`prompt_logprobs` as vLLM returns them: per position {token_id: {logprob, rank, decoded_token}}
        (None for the first token)."""
        if self.prompt_lps is None:
            return None
        return [None if lp is None or ss is None else
                {str(t): {"logprob": max(v, _FLOOR), "rank": r, "decoded_token": name}
                 for t, v, r, name in zip(lp.token_ids, lp.logprobs, lp.ranks, ss, strict=True)}
                for lp, ss in zip(self.prompt_lps, self.prompt_strs(), strict=True)]

    # ------------------------------------------------------------------ echo (completions)
    def echo_parts(self) -> tuple[str, list[int], list[m.TokenLogprobs | None], list[list[str] | None]]:
        p = self.plan
        prompt = p.prompts[self.prompt_index]
        if self.prompt_lps:
            return p.prompt_texts[self.prompt_index], list(prompt), list(self.prompt_lps), self.prompt_strs()
        return p.prompt_texts[self.prompt_index], list(prompt), [None] * len(prompt), [None] * len(prompt)


def _lp_of(lp: m.TokenLogprobs, t: int) -> float:
    for tid, v in zip(lp.token_ids, lp.logprobs, strict=True):
        if tid == t:
            return v
    return _FLOOR


def usage(plan: Plan, choices: list[Choice], *, details: bool = False, stream: bool = False) -> dict[str, Any]:
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": prompt_tokens_details(plan, choices, stream) if details else None,
            "completion_tokens_details": None}


def prompt_tokens_details(plan: Plan, choices: list[Choice], stream: bool) -> dict[str, Any]:
    """`usage.prompt_tokens_details` as vLLM's server writes it with --enable-prompt-tokens-details:
    the engine's prefix-cache hits of one request (a response reports one request's, as vLLM does:
    the last one's in a whole response, the first to produce output in a stream); chat also says
    how many prompt tokens that request added to the cache. Streams leave out the None fields.
    An engine that reports no hits (the sim engine) counts 0, as vLLM does when nothing hit."""
    if stream:
        req = min((c.req for c in choices), key=lambda r: r.first_token_at or float("inf"))
    else:
        req = choices[-1].req
    cached = req.engine_cached or 0
    out: dict[str, Any] = {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
    if plan.chat:
        out["created_cache_tokens"] = req.engine_created or 0
    return {k: v for k, v in out.items() if v is not None} if stream else out


def unary_choice(c: Choice) -> dict[str, Any]:
    p = c.plan
    ids, lps, text = c.ids, c.lps, c.text
    strs = c.out_strs(0, lps) if p.logprobs is not None else []
    if p.chat:
        text = p.echo_text + text if p.echo else text
        finish = c.finish
        message: dict[str, Any] = {"role": p.role, "content": text, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None, "reasoning": None}
        if p.tool_plan is not None:  # vLLM's tool-call parser (services/router/openai_tools.py)
            content, calls, finish, _ = p.tool_plan.parse(text, list(ids), c.finish)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
        return {"index": c.index, "message": message,
                "logprobs": c.chat_logprobs(ids, lps, strs) if p.logprobs is not None else None,
                "finish_reason": finish, "stop_reason": c.stop_reason,
                "token_ids": list(ids) if p.return_token_ids else None, "routed_experts": None}
    if p.echo and p.logprobs is not None:
        ptext, pids, plps, pstrs = c.echo_parts()
        if p.max_tokens_zero:
            text, ids, lps, strs = ptext, pids, plps, pstrs
        else:
            text, ids, lps, strs = ptext + text, pids + ids, plps + lps, pstrs + strs
    elif p.echo:
        text = p.prompt_texts[c.prompt_index] + ("" if p.max_tokens_zero else text)
    return {"index": c.index, "text": text,
            "logprobs": c.completion_logprobs(ids, lps, strs) if p.logprobs is not None else None,
            "finish_reason": c.finish, "stop_reason": c.stop_reason,
            "token_ids": list(c.ids) if p.return_token_ids else None,
            "prompt_logprobs": c.prompt_logprobs_json() if c.req.sampling.prompt_logprobs is not None else None,
            "prompt_token_ids": p.prompts[c.prompt_index] if p.return_token_ids else None, "routed_experts": None}
