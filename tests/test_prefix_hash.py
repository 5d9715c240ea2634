"""Block hashes: only full blocks, chained (equal hash means equal prefix), stable across
processes, and the cached-prefix count stops at the first miss."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.prefix_hash import block_hashes, cached_prefix_blocks, chain_ids


def test_full_blocks_only_and_chained() -> None:
    ids = list(range(100))
    hs = block_hashes(ids, 16)
    assert len(hs) == 6                       # 96 of 100 tokens: the partial block has no hash
    assert block_hashes(ids[:96], 16) == hs
    assert all(0 <= h < 1 << 63 for h in hs)
    # same second block after a different first block: a different hash (it names the prefix)
    other = [7] * 16 + ids[16:32]
    assert block_hashes(other, 16)[1] != hs[1]
    assert block_hashes(other, 16)[0] != hs[0]
    # a shared prefix shares its hashes, then they part
    fork = ids[:48] + [999] * 48
    assert block_hashes(fork, 16)[:3] == hs[:3] and block_hashes(fork, 16)[3] != hs[3]


def test_stable_across_processes() -> None:
    code = "from common.prefix_hash import block_hashes; print(block_hashes(list(range(64)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout
    assert out.strip() == str(block_hashes(list(range(64)), 16))


def test_chain_ids_is_prefix_semantic() -> None:
    a = chain_ids([1, 2, 3])
    assert chain_ids([1, 2, 4])[:2] == a[:2] and chain_ids([1, 2, 4])[2] != a[2]
    assert chain_ids([9, 2, 3])[1] != a[1]


def test_cached_prefix_stops_at_first_miss() -> None:
    hs = block_hashes(list(range(64)), 16)
    assert cached_prefix_blocks(hs, set(hs)) == 4
    assert cached_prefix_blocks(hs, {hs[0], hs[1], hs[3]}) == 2
    assert cached_prefix_blocks(hs, {hs[1]}) == 0
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def test_the_names_are_pinned() -> None:
    """XXH3-64 seeded by the parent, 63 bits: every process and host, and the next version, must
    name a prefix alike (a change here means routers and workers of two versions share no hits)."""
    assert block_hashes(list(range(64)), 16) == [7457343487171506586, 6537589335131001229,
                                                 1728977786130880931, 8529065062271386352]
    assert chain_ids([1, 2, 3]) == [3439722301264460078, 4995176245941517448, 2696305910825636934]
