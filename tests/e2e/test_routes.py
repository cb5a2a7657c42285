"""Every OpenAI route the engines serve, through Envoy (issue 21 part 4): embeddings (with the OpenAI SDK),
responses, score and rerank are routed by model like chat, prefix-aware, with the same errors."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from kvgate.dev.up import Stack
from tests.e2e.test_gateway import LONG, MODEL

pytestmark = pytest.mark.e2e


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=30)


def test_embeddings_with_the_openai_sdk(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=["routes test. " + LONG, "second"])
    got = raw.parse()
    assert [d.index for d in got.data] == [0, 1] and len(got.data[0].embedding) == 64
    assert got.usage.prompt_tokens > 0 and raw.headers["x-kvgate-replica"]


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/embeddings", {"input": "embeddings prefix. " + LONG}, "data"),
        (
            "/v1/responses",
            {"instructions": "responses prefix. " + LONG, "input": "Hi", "max_output_tokens": 3},
            "output",
        ),
        ("/v1/score", {"text_1": "score prefix. " + LONG, "text_2": ["a", "b"]}, "data"),
        ("/score", {"text_1": "score2 prefix. " + LONG, "text_2": "a"}, "data"),
        ("/v1/rerank", {"query": "rerank prefix. " + LONG, "documents": ["a", "b"]}, "results"),
        ("/rerank", {"query": "rerank2 prefix. " + LONG, "documents": ["a"]}, "results"),
    ],
)
def test_routed_by_model_and_prefix(stack: Stack, path: str, body: dict[str, Any], key: str) -> None:
    """A repeated prompt goes back to the replica that computed it (prefix-aware)."""
    replicas = set()
    for _ in range(3):
        resp = post(stack, path, {"model": MODEL, **body})
        assert resp.status_code == 200, resp.text
        assert resp.json()[key]
        replicas.add(resp.headers["x-kvgate-replica"])
    assert len(replicas) == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/embeddings", {"model": MODEL}, 400, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": [1, "x"]}, 400, "input"),
        ("/v1/embeddings", {"model": "no-such-model", "input": "x"}, 404, "model"),
        ("/v1/responses", {"model": MODEL, "input": []}, 400, "input"),
        ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ("/v1/responses", {"input": "x"}, 400, "model"),
        ("/v1/score", {"model": MODEL, "text_1": "q"}, 400, "text_2"),
        ("/score", {"model": "no-such-model", "text_1": "q", "text_2": "a"}, 404, "model"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": []}, 400, "documents"),
        ("/rerank", {"model": MODEL, "query": 3, "documents": ["a"]}, 400, "query"),
    ],
)
def test_bad_requests_get_openai_errors(
    stack: Stack, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    resp = post(stack, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and "type" in error


def test_a_body_that_is_not_json_is_400(stack: Stack) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/embeddings", content=b"{", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["message"]
