"""Synthetic traces with prefix structure: multi-turn chat sessions and agentic loops, written
as JSON-lines traces with `hash_ids` (common/traces.py reads them back).

Each session is one growing token stream: a system prompt shared by every session of its kind
(one of a few), then turn after turn of new input (a user message, or a tool's output) and the
model's answer. Turn k's prompt is the whole stream so far plus its new input, so it re-sends
every earlier turn. Block j of a prompt (`block_tokens` tokens) gets a content id: the shared
system prompt's id where the block lies wholly inside it, the session's id for block j once the
stream has passed it (it never changes after: the stream only grows), and a fresh id for a
prompt's partial last block (its content is that prompt's alone).

    chat   sessions arrive as a Poisson process; 2 to 12 turns (geometric, mean 5); user messages
           lognormal (median 200 tokens), answers lognormal (median 250, as the conv trace's
           outputs); the next turn comes after the answer (at an assumed 30 tokens/s) plus a
           think time (exponential, mean 20 s); 4 system prompts of 600 to 2000 tokens.
    agent  loops arrive as a Poisson process; 5 to 40 steps (geometric, mean 15); each step
           appends a tool output (lognormal, median 400 tokens) to a long transcript and gets a
           short answer (a tool call; lognormal, median 60); the next step comes after the answer
           plus the tool's latency (exponential, mean 2 s); 2 agent prompts (system prompt and
           tool schemas) of 3000 to 6000 tokens.

Deterministic given the seed; nothing is downloaded. `kairos sessions` writes one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.traces import TraceRequest


@dataclass(frozen=True)
class Shape:
    system_prompts: int
    system_min: int
    system_max: int
    turns_mean: float
    turns_min: int
    turns_max: int
    input_median: float
    input_sigma: float
    output_median: float
    output_sigma: float
    think_mean_s: float
    decode_tokens_per_s: float = 30.0
    max_prompt: int = 32768


KINDS = {
    "chat": Shape(system_prompts=4, system_min=600, system_max=2000, turns_mean=5.0, turns_min=2, turns_max=12,
                  input_median=200.0, input_sigma=0.9, output_median=250.0, output_sigma=0.8, think_mean_s=20.0),
    "agent": Shape(system_prompts=2, system_min=3000, system_max=6000, turns_mean=15.0, turns_min=5,
                   turns_max=40, input_median=400.0, input_sigma=0.8, output_median=60.0, output_sigma=0.6,
                   think_mean_s=2.0),
}


class _Ids:
    """Small consecutive integers for content keys, in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[object, ...], int] = {}

    def get(self, key: tuple[object, ...]) -> int:
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _lengths(rng: np.random.Generator, median: float, sigma: float, n: int, cap: int) -> list[int]:
    return [int(x) for x in np.clip(np.rint(rng.lognormal(math.log(median), sigma, size=n)), 1, cap)]


def sessions(kind: str, *, rate: float, duration: float, seed: int = 0, block_tokens: int = 512
             ) -> list[TraceRequest]:
    """A trace of `kind` ("chat" or "agent") sessions starting at `rate` per second over
    `duration` seconds (their later turns may run past it), sorted by arrival."""
    if kind not in KINDS:
        raise ConfigError(f"unknown session kind {kind!r}: choose {' or '.join(KINDS)}")
    if rate <= 0 or duration <= 0 or block_tokens <= 0:
        raise ConfigError(f"rate, duration and block_tokens must be positive (got {rate}, {duration}, {block_tokens})")
    sh = KINDS[kind]
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [int(x) for x in rng.integers(sh.system_min, sh.system_max + 1, size=sh.system_prompts)]
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    t = 0.0
    sid = 0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            break
        sys_i = int(rng.integers(len(systems)))
        sys_len = systems[sys_i]
        turns = int(np.clip(rng.geometric(1.0 / sh.turns_mean), sh.turns_min, sh.turns_max))
        ins = _lengths(rng, sh.input_median, sh.input_sigma, turns, sh.max_prompt)
        outs = _lengths(rng, sh.output_median, sh.output_sigma, turns, 4096)
        thinks = rng.exponential(sh.think_mean_s, size=turns)
        stream = sys_len  # tokens of the session's stream before this turn's input
        at = t
        for k in range(turns):
            prompt = stream + ins[k]
            if prompt > sh.max_prompt:
                break  # the context is full: the session ends
            full = prompt // block_tokens
            hid: list[int] = []
            for j in range(full):
                inside_system = (j + 1) * block_tokens <= sys_len
                hid.append(ids.get(("sys", kind, sys_i, j) if inside_system else ("s", sid, j)))
            if prompt % block_tokens:
                hid.append(ids.get(("tail", sid, k)))
            out.append((at, prompt, outs[k], tuple(hid)))
            stream = prompt + outs[k]
            at += outs[k] / sh.decode_tokens_per_s + float(thinks[k])
        sid += 1
    out.sort(key=lambda r: r[0])
    return [TraceRequest(t=a, input_length=i, output_length=o, hash_ids=h) for a, i, o, h in out]


def write_jsonl(reqs: list[TraceRequest], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.t * 1000.0, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos sessions", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=tuple(KINDS), default="chat", help="chat sessions or agentic loops (default chat)")
    p.add_argument("--rate", type=float, default=0.5, help="new sessions per second (default 0.5)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds over which sessions start (default 600)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--hash-block-tokens", type=int, default=512,
                   help="prompt tokens per hash_ids entry (default 512; give kairos sim the same)")
    p.add_argument("--out", required=True, help="the JSON-lines trace to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        reqs = sessions(args.kind, rate=args.rate, duration=args.duration, seed=args.seed,
                        block_tokens=args.hash_block_tokens)
    except ConfigError as e:
        print(f"kairos sessions: {e}", file=sys.stderr)
        return 2
    write_jsonl(reqs, args.out)
    print(f"{len(reqs)} requests over {reqs[-1].t if reqs else 0.0:.0f} s written to {args.out}")
    return 0
