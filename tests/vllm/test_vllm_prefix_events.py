"""PrefixTranslator (common/engines/vllm_prefix.py) on hand-made vLLM KV cache events: vLLM's
block hashes renamed into common.prefix_hash names, copies counted, what cannot be named skipped,
the map bounded. The engine-level checks (real events from a real engine) are in
test_vllm_prefix.py."""

from __future__ import annotations

import warnings

import pytest

from common.prefix_hash import block_hashes
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
              pytest.mark.usefixtures("vllm_events")]


@pytest.fixture(scope="module")
def vllm_events() -> None:
    with warnings.catch_warnings():  # importing vllm warns (torch deprecations), once per process
        warnings.simplefilter("ignore")
        import vllm.distributed.kv_events  # noqa: F401

B = 4
IDS = list(range(100, 112))  # three blocks of 4


def stored(hashes: list[int], ids: list[int], parent: int | None = None, block_size: int = B,
           **kw: object) -> object:
    from vllm.distributed.kv_events import BlockStored

    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, **kw}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=ids, block_size=block_size,
                       **fields)


def removed(*hashes: int) -> object:
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def make(limit: int = 100) -> object:
    from common.engines.vllm_prefix import PrefixTranslator

    return PrefixTranslator(B, limit)


def test_stored_blocks_get_prefix_hash_names_across_events() -> None:
    t = make()
    want = block_hashes(IDS, B)
    t.feed([stored([901, 902], IDS[:8])])          # a prompt's first two blocks
    t.feed([stored([903], IDS[8:], parent=902)])   # the third, cached in a later step
    s, r, c = t.take()
    assert s == want and r == [] and not c
    assert t.take() == ([], [], False)             # a take returns only what is new
    t.feed([removed(903)])
    assert t.take() == ([], [want[2]], False)


def test_copies_are_counted_and_the_last_eviction_reports() -> None:
    t = make()
    t.feed([stored([901], IDS[:4]), stored([901], IDS[:4])])  # one content in two physical blocks
    h = block_hashes(IDS[:4], B)
    assert t.take() == (h, [], False)
    t.feed([removed(901)])
    assert t.take() == ([], [], False)  # one copy is still cached
    t.feed([removed(901)])
    assert t.take() == ([], h, False)
    t.feed([removed(901)])               # unknown by now: ignored
    assert t.take() == ([], [], False)


def test_net_change_and_clear() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared

    t = make()
    t.feed([stored([901], IDS[:4]), removed(901)])
    assert t.take() == ([], block_hashes(IDS[:4], B), False)  # stored and evicted within one take
    t.feed([stored([901], IDS[:4]), AllBlocksCleared(), stored([905], IDS[4:8])])
    assert t.take() == (block_hashes(IDS[4:8], B), [], True)  # what came before the clear is gone
    assert len(t) == 1


def test_what_cannot_be_named_is_skipped() -> None:
    t = make()
    t.feed([stored([901], IDS[4:8], parent=999)])                 # parent unknown
    t.feed([stored([902], IDS[:2], block_size=2)])                # another block size (a partial entry)
    t.feed([stored([903], IDS[:4], extra_keys=[("salt",)])])      # cache salt / LoRA / multimodal
    t.feed([stored([904], IDS[:4], medium="CPU")])                # an offloading tier
    assert t.take() == ([], [], False)
    assert t.skipped == 4 and len(t) == 0


def test_map_is_bounded_and_put_back_restores_a_lost_take() -> None:
    t = make(limit=2)
    t.feed([stored([901, 902, 903], IDS)])
    s, r, c = t.take()
    assert len(t) == 2
    h = block_hashes(IDS, B)
    assert s == h[1:] and r == [h[0]]  # the oldest is dropped and said to be gone
    t.feed([removed(903)])
    s, r, c = t.take()
    t.put_back(s, r, c)
    assert t.take() == ([], [h[2]], False)
