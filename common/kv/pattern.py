"""The simulated engine's KV content: a deterministic pattern of (request id, token position).

Byte `j` of token `p` of request `r` is byte `k % 8` of the 64-bit word `mix(k // 8) ^ seed(r)`,
with `k = p * bytes_per_token + j`, `mix` the splitmix64 finaliser and `seed` a BLAKE2b hash of
the request id. Every byte thus depends on the request and its position: a block written to the
wrong place, a stale block of another request, a truncated or zero-filled transfer and a single
flipped bit all fail `verify_pattern`. Both sides compute the pattern independently (no pattern
bytes cross the bus). `mix(i)` does not depend on the request, so it is computed once per process
(grown to the longest payload seen) and each fill or check is one XOR pass, in 1 MiB pieces.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from common.kv.errors import KvCorrupt

_CHUNK = 1 << 20  # bytes per numpy pass: bounds temporaries, stays in cache
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

Bytes = npt.NDArray[np.uint8]
BufferLike = bytes | bytearray | memoryview | npt.NDArray[Any]

_base: npt.NDArray[np.uint64] = np.empty(0, np.uint64)


def _seed(request_id: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little"))


def _mix(first: int, count: int) -> npt.NDArray[np.uint64]:
    """splitmix64 of word indices [first, first + count) (array ops wrap and never warn)."""
    x = np.arange(first, first + count, dtype=np.uint64)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _base_words(count: int) -> npt.NDArray[np.uint64]:
    """The first `count` position words, cached (grown by doubling)."""
    global _base
    if _base.size < count:
        size = max(count, 2 * _base.size, 1 << 16)
        grown = np.empty(size, np.uint64)
        grown[:_base.size] = _base
        grown[_base.size:] = _mix(_base.size, size - _base.size)
        _base = grown
    return _base[:count]


def _pieces(seed: np.uint64, n: int) -> Any:
    """Yield (start, stop, pattern bytes [start, stop)) over a payload of n bytes."""
    base = _base_words((n + 7) // 8)
    tmp = np.empty(_CHUNK // 8, np.uint64)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        w0, w1 = start // 8, (stop + 7) // 8
        words = tmp[:w1 - w0]
        np.bitwise_xor(base[w0:w1], seed, out=words)
        yield start, stop, words.view(np.uint8)[:stop - start]


def payload_bytes(tokens: int, bytes_per_token: int) -> int:
    if tokens < 0 or bytes_per_token <= 0:
        raise ValueError(f"need tokens >= 0 and bytes_per_token > 0, got {tokens}, {bytes_per_token}")
    return tokens * bytes_per_token


def fill_pattern(request_id: str, tokens: int, bytes_per_token: int, out: Bytes | None = None) -> Bytes:
    """The KV bytes of `tokens` tokens of `request_id`: a new uint8 array, or written into `out`.

    `out`, if given, must be a writable uint8 array of at least tokens * bytes_per_token bytes;
    the returned array is its prefix of exactly that length.
    """
    n = payload_bytes(tokens, bytes_per_token)
    if out is None:
        dst: Bytes = np.empty(n, np.uint8)
    else:
        if out.dtype != np.uint8 or out.ndim != 1 or out.size < n:
            raise ValueError(f"out must be a 1-D uint8 array of >= {n} bytes")
        dst = out[:n]
    for start, stop, want in _pieces(_seed(request_id), n):
        dst[start:stop] = want
    return dst


def verify_pattern(data: BufferLike, request_id: str, tokens: int, bytes_per_token: int) -> None:
    """Check that `data` (any buffer: bytes, memoryview, numpy array) holds exactly the pattern.

    Raises KvCorrupt naming the first bad byte and its token position, or a length mismatch.
    """
    n = payload_bytes(tokens, bytes_per_token)
    got = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if got.size != n:
        raise KvCorrupt(f"request {request_id}: expected {n} KV bytes ({tokens} tokens x {bytes_per_token}), "
                        f"got {got.size}")
    for start, stop, want in _pieces(_seed(request_id), n):
        piece = got[start:stop]
        if not np.array_equal(piece, want):
            bad = start + int(np.flatnonzero(piece != want)[0])
            raise KvCorrupt(f"request {request_id}: KV byte {bad} (token {bad // bytes_per_token}, "
                            f"offset {bad % bytes_per_token}) is {int(got[bad])}, expected "
                            f"{int(want[bad - start])}")
