"""The router's prefix index, kept live: fed by the workers' heartbeat summaries
(messages.PrefixSummary) and by the router's own dispatches, and asked, per request, how many
prompt tokens each worker holds (RequestSpec.cached).

Hashes are computed from the prompt's token ids with each worker's block size, as its engine
computes them (common/prefix_hash.py). A worker is known to the index from its first summary
(its block size); it is forgotten when it is lost or departs, and starts empty when it comes back
as a new incarnation. Heartbeats are not delivered reliably (a worker drops one its socket cannot
take at once): a gap in a worker's heartbeat sequence may have lost evictions, so its entries are
forgotten then too (the next dispatches and summaries rebuild them; a stale entry would only cost a
mispriced request).
"""

from __future__ import annotations

from common import messages as m
from common.policy.prefix_index import PrefixIndex
from common.prefix_hash import block_hashes


class Seen:
    """A prompt's last answer from `RouterPrefix.lookup`, and the index version it was for."""

    __slots__ = ("cached", "hashes", "version")

    def __init__(self) -> None:
        self.version = -1
        self.cached: tuple[tuple[str, int], ...] = ()
        self.hashes: dict[int, list[int]] = {}


class RouterPrefix:
    def __init__(self, *, enabled: bool = True, max_blocks: int = 1 << 20) -> None:
        self.enabled = enabled
        self.index = PrefixIndex(max_blocks)
        self._seq: dict[str, int] = {}
        self.summaries = 0
        self.gaps = 0
        self.dispatches = 0
        self.hits = 0             # dispatches whose prefilling worker held part of the prompt
        self.prompt_tokens = 0
        self.cached_tokens = 0    # of those prompt tokens, held where they were prefilled (as the index knew)

    def on_heartbeat(self, hb: m.PrefillHeartbeat | m.DecodeHeartbeat) -> None:
        if not self.enabled:
            return
        wid = hb.worker_id
        last = self._seq.get(wid)
        self._seq[wid] = hb.seq
        gap = last is not None and hb.seq != last + 1 and hb.seq > last
        s = hb.prefix
        if s is None:
            if gap and wid in self.index.block_tokens:
                self.gaps += 1
                self.index.clear(wid)
            return
        self.summaries += 1
        self.index.join(wid, s.block_tokens, hb.incarnation)
        if s.cleared or gap:
            self.gaps += gap
            self.index.clear(wid)
        if s.removed:
            self.index.removed(wid, s.removed)
        if s.stored:
            self.index.stored(wid, s.stored)

    def forget(self, worker_id: str) -> None:
        self._seq.pop(worker_id, None)
        self.index.forget(worker_id)

    def lookup(self, prompt: list[int], memo: dict[int, list[int]] | None = None, seen: Seen | None = None
               ) -> tuple[tuple[tuple[str, int], ...], dict[int, list[int]]]:
        """(per worker: prompt tokens it holds, the prompt's hashes per block size) for a prompt;
        `memo`: the prompt's hashes per block size the caller already has (the simulator's trace,
        an earlier lookup), used as they are; those it lacks are computed and filled in. `seen`:
        this prompt's previous answer, kept by the caller: returned as it is while the index has
        not changed since (`PrefixIndex.version`), else replaced. A waiting request is decided
        again at every heartbeat; walking its blocks each time (375 for a 6,000-token prompt, for
        each of up to 64 waiting requests) held the router's loop for tens of seconds in a burst of
        long prompts (docs/benchmarks/stranded.md, "A second burst of long prompts")."""
        if not self.enabled or not self.index.block_tokens:
            return (), {}
        if seen is not None and seen.version == self.index.version:
            return seen.cached, seen.hashes
        by_bt: dict[int, list[str]] = {}
        for w, bt in self.index.block_tokens.items():
            by_bt.setdefault(bt, []).append(w)
        hashes: dict[int, list[int]] = {}
        cached: list[tuple[str, int]] = []
        for bt, workers in by_bt.items():
            if memo is not None and bt in memo:
                hs = memo[bt]
            else:
                hs = block_hashes(prompt, bt)
                if memo is not None:
                    memo[bt] = hs
            hashes[bt] = hs
            if hs:
                cached.extend((w, n * bt) for w, n in self.index.hits(hs, among=workers).items())
        out = tuple(cached)
        if seen is not None:  # (`hits` changes no answer: the version is the one it answered at)
            seen.version, seen.cached, seen.hashes = self.index.version, out, hashes
        return out, hashes

    def dispatched(self, worker_ids: list[str], hashes: dict[int, list[int]], prompt_tokens: int,
                   cached_tokens: int) -> dict[str, tuple[int, list[int]]]:
        """The prompt goes to these workers (their caches will hold it); `cached_tokens` of it
        were held where it is prefilled. Returns, per worker, its last heartbeat's sequence number
        and the blocks the index did not know it held (`undo` takes them back if the worker turns
        the work away)."""
        new: dict[str, tuple[int, list[int]]] = {}
        self.dispatches += 1
        self.hits += cached_tokens > 0
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        for w in worker_ids:
            bt = self.index.block_tokens.get(w)
            hs = hashes.get(bt) if bt is not None else None
            if hs:
                new[w] = (self._seq.get(w, -1), self.index.stored(w, hs))
        return new

    def undo(self, worker_id: str, added: tuple[int, list[int]]) -> None:
        """The worker turned a dispatch away (its admission said no): the blocks only that
        dispatch put in the index (`dispatched`) are not in its cache, unless a heartbeat of its
        came in between (it may have reported them stored, by another request: then they stay)."""
        seq, blocks = added
        if blocks and self._seq.get(worker_id, -1) == seq:
            self.index.removed(worker_id, blocks)

    def stats(self) -> dict[str, object]:
        return {"enabled": self.enabled, "blocks": len(self.index), "workers": self.index.workers(),
                "summaries": self.summaries, "sequence_gaps": self.gaps, "dispatches": self.dispatches,
                "hits": self.hits, "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None}
