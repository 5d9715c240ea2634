"""The engine settings an operator tunes, applied over a performance profile.

A profile carries the engine limits it was measured under; these override them (0 keeps the
profile's). `kairos sim`, `kairos tune` and the workers (`--prefill-token-budget` ... on
`kairos up`, or KAIROS_* in the environment) all read them through `apply`.
"""

from __future__ import annotations

import msgspec

from common.perf_model import Profile


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    prefill_token_budget: int = 0  # prefill workers: tokens per step (vLLM max_num_batched_tokens)
    decode_token_budget: int = 0   # decode workers: tokens per step, decodes plus in-place prefill chunks
    decode_chunk: int = 0          # decode workers: largest chunk of one in-place prefill per step when the
    #                                router sends no chunk schedule (vLLM long_prefill_token_threshold)

    def __post_init__(self) -> None:
        if min(self.prefill_token_budget, self.decode_token_budget, self.decode_chunk) < 0:
            raise ValueError("token budgets and the decode chunk must be >= 0 (0: the profile's)")

    def apply(self, profile: Profile) -> Profile:
        """The profile with these settings in place of its own (where set)."""
        changes: dict[str, int] = {}
        if self.prefill_token_budget:
            changes["prefill_token_budget"] = self.prefill_token_budget
        if self.decode_token_budget:
            changes["decode_token_budget"] = self.decode_token_budget
        if self.decode_chunk:
            changes["decode_default_chunk"] = self.decode_chunk
        return msgspec.structs.replace(profile, **changes) if changes else profile

    def resolved(self, profile: Profile) -> EngineSettings:
        """Every setting spelled out, as `apply` makes them on this profile (for reports)."""
        p = self.apply(profile)
        return EngineSettings(prefill_token_budget=p.prefill_token_budget, decode_token_budget=p.decode_token_budget,
                              decode_chunk=p.decode_default_chunk)
