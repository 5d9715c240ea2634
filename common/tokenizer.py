"""Tokenizers the router uses to count prompt tokens and to turn output ids into text.

`SimpleTokenizer` (the simulated engine's): a prompt is split into words and punctuation marks
(regex `\\w+|[^\\w\\s]`); each piece is one token. Pieces in the fixed vocabulary below map to
their index; any other piece maps to a stable hash bucket above it, so lengths are exact and ids
are deterministic. Output ids decode to vocabulary words separated by spaces. A prompt given as
a list of token ids (the OpenAI API allows it) is taken as is.

`HFTokenizer` wraps a Hugging Face tokenizer directory (the vLLM engine's model), loaded from
disk only.
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or which have had "
    "not but were they their one all has more been would also its can there who new time year "
    "when first two other into after some only most over such may many these people then what "
    "about out them than up so could three made where between used both each under during while "
    "world state city part system well work because like through life since any how long back "
    "number model token prefill decode cache batch chunk router worker queue latency request "
    "schedule deflect transfer memory kernel tensor layer head block stream serve load burst slack"
).split()

SPECIAL = ("<pad>", "<s>", "</s>")


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_str(self, token_id: int) -> str: ...

    def vocab_pieces(self, ids: list[int]) -> list[str]: ...

    def position_strs(self, ids: list[int], context: list[int]) -> list[str]: ...

    def render_chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, object] | None = None) -> str: ...


class SimpleTokenizer:
    vocab_size = 32000
    eos_token_id: int | None = 2
    fingerprint = "simple"  # the same vocabulary everywhere (TextStream: router and worker agree)
    additive = True  # the decode of a sequence is the decodes of its tokens, joined
    _split = re.compile(r"\w+|[^\w\s]")

    def __init__(self) -> None:
        self._vocab = list(SPECIAL) + _WORDS
        self._index = {w: i for i, w in enumerate(self._vocab)}
        self._n = len(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        index = self._index
        for piece in self._split.findall(text.lower()):
            i = index.get(piece)
            if i is None:
                i = self._n + zlib.crc32(piece.encode()) % (self.vocab_size - self._n)
            out.append(i)
        return out

    def token_text(self, i: int) -> str:
        if 0 <= i < self._n:
            return self._vocab[i] if i >= len(SPECIAL) else ""
        return f"t{i}"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(" " + self.token_text(i) for i in ids)

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        return [self.token_text(i) for i in ids]

    def position_strs(self, ids: list[int], context: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def render_chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, object] | None = None) -> str:
        text = "\n".join(f"{msg['role']}: {msg.get('content') or ''}" for msg in messages)
        return text + "\nassistant:" if add_generation_prompt and not continue_final_message else text

    def output_token(self, i: int) -> int:
        """Map any integer into the decodable word range (the simulated engine's outputs)."""
        return len(SPECIAL) + i % (self._n - len(SPECIAL))


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # only on hosts with the vllm extra

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = int(self._tok.vocab_size)
        self.eos_token_id = self._tok.eos_token_id
        self.additive = False  # byte-level: a character may span tokens, and decoding may join them
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        """What identifies this tokenizer's decoding (TextStream: a decode worker sends text only
        to a router whose tokenizer has the same one): its full serialized definition, hashed."""
        import hashlib

        backend = getattr(self._tok, "backend_tokenizer", None)
        spec = backend.to_str() if backend is not None else repr(sorted(self._tok.get_vocab().items()))
        extra = repr((type(self._tok).__name__, self._tok.all_special_ids,
                      getattr(self._tok, "clean_up_tokenization_spaces", None)))
        return "hf:" + hashlib.sha256((spec + extra).encode()).hexdigest()[:32]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_str(self, token_id: int) -> str:
        """One token as vLLM's server shows it in logprobs: decoded alone, with the leading space a
        SentencePiece marker stands for."""
        text: str = self._tok.decode([token_id])
        raw = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and raw.startswith("\u2581") and not text.startswith(" ") and self._metaspace:
            text = " " + text
        return text

    def position_strs(self, ids: list[int], context: list[int]) -> list[str]:
        """The tokens at one logprobs position (the chosen one and its alternatives) as vLLM's server
        names them: each decoded alone; one that ends inside a multi-byte character is completed
        with the up to 4 tokens chosen before it (`context`), or is "" while still incomplete."""
        out = []
        for t in ids:
            text = self.token_str(t)
            if text.endswith("\ufffd"):
                text = self._complete(t, context[-4:])
            out.append(text)
        return out

    def _complete(self, t: int, context: list[int]) -> str:
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full: str = self._tok.decode([*ctx, t])
            if full.endswith("\ufffd"):
                continue
            clean = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self._tok.decode([ctx[j]]).endswith("\ufffd"):
                    clean = j
                else:
                    break
            prefix: str = self._tok.decode(ctx[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        """The vocabulary entries of these ids, as /tokenize's token_strs shows them."""
        pieces: list[str] = self._tok.convert_ids_to_tokens(ids)
        return pieces

    @property
    def _metaspace(self) -> bool:
        backend = getattr(self._tok, "backend_tokenizer", None)
        return backend is not None and "Metaspace" in type(backend.pre_tokenizer).__name__ if backend else False

    def render_chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, object] | None = None) -> str:
        if getattr(self._tok, "chat_template", None):
            text: str = self._tok.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **(kwargs or {}))
            return text
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")


class TextStream:
    """One output's text deltas as the router streams them (services/router/openai_render.py
    `Choice` without stop strings: the whole decode so far, less a character still incomplete at
    its end, minus what went out before), kept where the tokens are made: a decode worker sends each
    delta with its ids (`TokenItem.text`) and the router writes it without decoding. The same
    arithmetic as the router's, so a delta is the router's own, byte for byte; a tokenizer whose
    tokens decode one by one (`additive`) extends the text, another decodes the whole output again
    at each step, as the router did."""

    __slots__ = ("full", "ids", "sent", "skip", "tok")

    def __init__(self, tok: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.full = ""
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        """The text `ids` add that may go out now ("" while a character is incomplete)."""
        if getattr(self.tok, "additive", False):
            self.full += self.tok.decode(ids, skip_special_tokens=self.skip)
        else:
            self.ids += ids
            self.full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        full = self.full
        end = len(full.rstrip("\ufffd")) if full.endswith("\ufffd") else len(full)
        if end <= self.sent:
            return ""
        out = full[self.sent:end]
        self.sent = end
        return out


def fingerprint(tok: Tokenizer) -> str:
    """The tokenizer's identity for text deltas (Sampling.text); "" for one without (no deltas)."""
    fp = getattr(tok, "fingerprint", "")
    return fp if isinstance(fp, str) else ""


def make_tokenizer(spec: str) -> Tokenizer:
    """The router's tokenizer; a ConfigError (one log line with the fix, common/startup.py) for a
    directory that is not there or a missing `transformers`, before the traceback either gives."""
    if spec in ("", "simple"):
        return SimpleTokenizer()
    import os

    from common.errors import ConfigError

    if not os.path.isdir(spec):
        raise ConfigError(f"tokenizer directory {spec} does not exist", event="model_not_found", key="tokenizer",
                          path=spec, fix="set --tokenizer (KAIROS_TOKENIZER; `kairos up` sets it from --model) to "
                          "the model's directory, or 'simple' for the word tokenizer")
    try:
        return HFTokenizer(spec)
    except ImportError as e:
        raise ConfigError(f"tokenizer {spec} needs the transformers package: {e}", event="engine_unavailable",
                          missing=e.name, fix="install the [vllm] extra (or transformers) in the router's "
                          "environment, or use tokenizer 'simple'") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {spec}: {e}"[:500], event="model_not_found",
                          key="tokenizer", path=spec, fix="point --tokenizer at a model directory that holds "
                          "tokenizer.json / tokenizer_config.json") from e
