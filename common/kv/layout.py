"""How many bytes a simulated token's KV takes, and how the receiver's pool is cut into blocks.

Real DeepSeek-V2-Lite KV is 31,104 bytes per token (the a100-dsv2-lite profile); a 64 MiB pool
would hold only 2,157 such tokens. The simulated engine therefore scales the bytes per token
down so that `capacity_tokens` tokens of KV fit in the pool at once:

    bytes_per_token = configured value                       if kv_bytes_per_token > 0
                    = min(profile value, pool_bytes // capacity_tokens), rounded down to a
                      multiple of 8 (at least 8)              otherwise
    block_bytes     = block_tokens * bytes_per_token
    num_blocks      = pool_bytes // block_bytes

`capacity_tokens` is the KV a decode worker must hold *in flight* (reserved, not yet verified
and released): the simulated engine does not read KV after verifying it, so the pool only needs
the handoffs in transit, not the engine's whole KV capacity. DEFAULT_INFLIGHT_TOKENS (65,536 =
eight 8k-token prompts) with the default 64 MiB pool gives 1,024 bytes per token, 16 KiB blocks
and 4,096 blocks: a scale of 1/30 of the real transfer volume. The scale is logged by the
worker (`kv_layout` event) and visible in `KvLayout.scale`.
"""

from __future__ import annotations

import msgspec

from common.errors import ConfigError
from common.messages import KvAgentInfo

DEFAULT_INFLIGHT_TOKENS = 65536


class KvLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The byte layout both sides agree on: block_tokens is shared config, the rest follows."""

    bytes_per_token: int
    block_tokens: int
    num_blocks: int
    profile_bytes_per_token: int = 0

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def pool_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.block_tokens * self.num_blocks

    @property
    def scale(self) -> float:
        """Simulated bytes over real bytes per token (1.0: unscaled)."""
        p = self.profile_bytes_per_token
        return self.bytes_per_token / p if p > 0 else 1.0

    def nbytes(self, tokens: int) -> int:
        """KV bytes of `tokens` tokens."""
        return tokens * self.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


def plan_layout(*, pool_bytes: int, block_tokens: int, profile_bytes_per_token: int,
                capacity_tokens: int = DEFAULT_INFLIGHT_TOKENS, bytes_per_token: int = 0) -> KvLayout:
    """The decode worker's pool layout (see the module docstring for the rule)."""
    if pool_bytes <= 0 or block_tokens <= 0 or capacity_tokens <= 0:
        raise ConfigError(f"KV pool needs positive sizes: pool_bytes={pool_bytes}, block_tokens={block_tokens}, "
                          f"capacity_tokens={capacity_tokens}")
    if bytes_per_token < 0:
        raise ConfigError(f"kv_bytes_per_token must be >= 0, got {bytes_per_token}")
    if bytes_per_token == 0:
        fit = pool_bytes // capacity_tokens
        want = profile_bytes_per_token if profile_bytes_per_token > 0 else fit
        bytes_per_token = max(8, min(want, fit) // 8 * 8)
    block_bytes = bytes_per_token * block_tokens
    num_blocks = pool_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigError(f"KV pool of {pool_bytes} bytes cannot hold one block of {block_tokens} tokens x "
                          f"{bytes_per_token} bytes; raise kv_pool_mib or lower kv_bytes_per_token")
    return KvLayout(bytes_per_token=bytes_per_token, block_tokens=block_tokens, num_blocks=num_blocks,
                    profile_bytes_per_token=profile_bytes_per_token)


def layout_from_info(info: KvAgentInfo, block_tokens: int) -> KvLayout:
    """The sender's view of a receiver's layout (block_tokens is shared cluster config)."""
    if block_tokens <= 0 or info.block_bytes <= 0 or info.block_bytes % block_tokens:
        raise ConfigError(f"receiver {info.agent_name}: block of {info.block_bytes} bytes is not a multiple of "
                          f"kv_block_tokens={block_tokens}; both roles must use the same kv_block_tokens")
    return KvLayout(bytes_per_token=info.block_bytes // block_tokens, block_tokens=block_tokens,
                    num_blocks=info.num_blocks)
