"""vLLM's prefix cache on the CPU build with the tiny model: what it reports, and that hits change
only the work, never the answer.

- take_prefix_events: after a request, the blocks vLLM stored are named exactly as
  common.prefix_hash.block_hashes names the full blocks of the request's tokens; a reset reports
  `cleared`.
- A conversation's second turn (first prompt + first output + new text) deflected to the engine
  that served the first prefills only its uncached suffix: vLLM reports the cached tokens (the
  full blocks), KairosScheduler's chunk schedule starts at the hit (chunks exact, none missed),
  and the greedy output equals the same prompt served cold.
- The NIXL handoff with prefix caching on both sides: the prefill engine's hits travel to the
  decode side, which reports them as vLLM's own P/D setup does.
"""

from __future__ import annotations

import asyncio

import pytest

from common.engines.base import PrefixEvents
from common.prefix_hash import block_hashes
from tests.vllm.helpers import PD, VLLM_MISSING, request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
    pytest.mark.asyncio(loop_scope="session"),
]

TURN1 = [(11 * i + 5) % 900 + 3 for i in range(300)]  # two full blocks of 128 and a partial one
NEW_TEXT = [(13 * i + 7) % 900 + 3 for i in range(40)]


async def events_until(engine: object, want: set[int], timeout: float = 10.0,
                       cleared_too: bool = False) -> tuple[set[int], set[int], bool]:
    """Take prefix events until `want` has been stored, and a clear seen if `cleared_too` (step
    records travel on their own socket: they may trail the last token a little)."""
    stored: set[int] = set()
    removed: set[int] = set()
    cleared = False
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ev = engine.take_prefix_events()  # type: ignore[attr-defined]
        assert isinstance(ev, PrefixEvents)
        if ev.cleared:
            stored.clear()
            cleared = True
        stored |= set(ev.stored)
        stored -= set(ev.removed)
        removed |= set(ev.removed)
        if (want <= stored and (cleared or not cleared_too)) or asyncio.get_running_loop().time() > deadline:
            return stored, removed, cleared
        await asyncio.sleep(0.01)


async def test_stored_blocks_are_prefix_hashes_of_the_request(pd: PD) -> None:
    d = pd.decode
    assert d.block_size == 128
    assert await d.reset_prefix_cache()
    out = await pd.run_decode(request("pfx-a", TURN1, max_tokens=16))
    # vLLM caches every full block it computed: the prompt and the outputs fed back (all but the last)
    want = block_hashes(TURN1 + out[:-1], d.block_size)
    assert len(want) == 2
    stored, _, cleared = await events_until(d, set(want), cleared_too=True)
    assert cleared  # the reset above, reported with the first step after it
    assert stored == set(want)
    assert pd.out.cached["pfx-a"][0] == 0  # a cold cache: no hit

    assert await d.reset_prefix_cache()
    d.add(request("pfx-b", [5, 6, 7], max_tokens=2))  # a step after the reset brings its event
    await pd.out.wait("pfx-b")
    stored, _, cleared = await events_until(d, set(), cleared_too=True)
    assert cleared and stored == set()  # three tokens fill no block


async def test_second_turn_prefills_only_its_suffix_and_matches_cold(pd: PD) -> None:
    d = pd.decode
    assert await d.reset_prefix_cache()
    out1 = await pd.run_decode(request("turn1", TURN1, max_tokens=16))
    turn2 = TURN1 + out1 + NEW_TEXT  # 356 tokens: the first two blocks are cached
    hit = len(block_hashes(TURN1 + out1[:-1], d.block_size)) * d.block_size
    assert hit == 256
    misses = d.chunk_misses
    schedule = (40, 40, 40)
    got = await pd.run_decode(request("turn2", turn2, max_tokens=16, schedule=schedule))
    assert pd.out.cached["turn2"][0] == hit
    # the schedule counts from the hit: 100 suffix tokens as 40 + 40 + 20, at positions 256, 296, 336
    steps = [(chi, k) for r in d.step_records for key, chi, k in r.chunks if key == "turn2:0"]
    assert steps == [(40, 256), (40, 296), (20, 336)]
    assert d.chunk_misses == misses

    assert await d.reset_prefix_cache()
    cold = await pd.run_decode(request("turn2-cold", turn2, max_tokens=16, schedule=schedule))
    assert pd.out.cached["turn2-cold"][0] == 0
    assert got == cold
    steps = [(chi, k) for r in d.step_records for key, chi, k in r.chunks if key == "turn2-cold:0"]
    # cold, the schedule counts from 0 (then vLLM's own chunking takes the rest)
    assert steps[:3] == [(40, 0), (40, 40), (40, 80)] and sum(c for c, _ in steps) == len(turn2)
    assert d.chunk_misses == misses
    assert await d.reset_prefix_cache()


async def test_handoff_reports_the_prefill_engines_hits(pd: PD) -> None:
    p, d = pd.prefill, pd.decode
    fallbacks = len(pd.out.fallbacks)  # the session's earlier tests break some handoffs on purpose
    # a prompt the prefill engine has never seen (its cache cannot be reset at will: the blocks of
    # handoffs nobody read stay held until their lease ends)
    prompt = [(17 * i + 11) % 900 + 3 for i in range(300)]
    assert await d.reset_prefix_cache()
    want = await pd.run_decode(request("ho-alone", prompt, max_tokens=8))
    assert await d.reset_prefix_cache()
    pre = await pd.run_prefill("ho1", prompt)
    stored, _, _ = await events_until(p, set(block_hashes(prompt, p.block_size)))
    assert stored >= set(block_hashes(prompt, p.block_size))
    got = await pd.run_decode(request("ho1", prompt, max_tokens=8, kv_params=pre.kv_params, mode="handoff"))
    assert got == want
    assert pd.out.cached["ho1"] == (0, 256)  # the prefill engine computed it all and cached 2 blocks

    # the same prompt again: the prefill engine hits its cache; the decode side holds the blocks too
    pre = await pd.run_prefill("ho2", prompt)
    got = await pd.run_decode(request("ho2", prompt, max_tokens=8, kv_params=pre.kv_params, mode="handoff"))
    assert got == want
    assert pd.out.cached["ho2"] == (256, 0)
    assert len(pd.out.fallbacks) == fallbacks
    assert await d.reset_prefix_cache()
