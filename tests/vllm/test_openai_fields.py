"""Kairos' declared request schemas hold exactly the fields of vLLM's own OpenAI request models.

tests/test_api_params.py sends each declared field and checks it is honoured or refused by name;
this test closes the loop against the vLLM version we pin, so a field vLLM adds is noticed here.
"""

from __future__ import annotations

import warnings

import msgspec
import pytest

from services.router import openai_schema as schema
from tests.vllm.helpers import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]

KAIROS_ONLY = {"ttft_slo", "tbt_slo"}


def _declared(cls: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)} - KAIROS_ONLY


def test_schemas_match_vllms_request_models() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert _declared(schema.CompletionBody) == set(CompletionRequest.model_fields)
    assert _declared(schema.ChatBody) == set(ChatCompletionRequest.model_fields)
