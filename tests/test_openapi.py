"""GET /openapi.json: a valid OpenAPI 3.1 document whose request schemas are the router's own
decoding types, so what it documents is what the router accepts and refuses."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openapi_spec_validator import validate

from kairos.up import Cluster


@pytest.fixture(scope="module")
def cluster(fast_cluster: Cluster) -> Iterator[Cluster]:
    yield fast_cluster


def test_openapi_document_is_valid_and_matches_the_decoders(cluster: Cluster) -> None:
    r = httpx.get(cluster.spec.api + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    validate(doc)  # raises on anything that is not OpenAPI 3.1
    comps = doc["components"]["schemas"]
    completion = comps["CompletionBody"]
    assert completion["additionalProperties"] is False  # unknown fields are refused, and say so
    assert {"prompt", "max_tokens", "stream", "ttft_slo"} <= set(completion["properties"])
    assert "messages" in comps["ChatBody"]["properties"]
    assert {"input", "instructions", "max_output_tokens"} <= set(comps["ResponsesBody"]["properties"])
    assert comps["_ErrorDetail"]["properties"]["code"]["type"] == "integer"  # vLLM's: the status
    post = doc["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatBody"}
    assert "text/event-stream" in post["responses"]["200"]["content"]
    # what the document says is refused, the router refuses
    bad = httpx.post(cluster.spec.api + "/v1/completions", json={"prompt": "x", "not_a_field": 1}, timeout=10)
    assert bad.status_code == 400 and "not_a_field" in bad.text
    for path in doc["paths"]:
        if "get" in doc["paths"][path]:
            assert httpx.get(cluster.spec.api + path, timeout=10).status_code in (200, 503), path
