"""End to end, ``previous_response_id`` affinity of the Responses API through real Envoy (the shared
4-replica simulated stack): Envoy reads each JSON answer's ``id`` (``json_to_metadata``), its completion
log tells the ext_proc which replica produced it, and a follow-up naming that id goes to that replica, the
one whose KV (and, with vLLM, response store) holds the conversation, whatever its own prompt."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from kvgate.dev.up import Stack
from tests.e2e.test_burst import gateway
from tests.e2e.test_gateway import LONG, MODEL

pytestmark = pytest.mark.e2e

FOLLOW_UP = "And then? " + LONG  # the same for every conversation: alone, it would go where it is cached


def post(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    got = httpx.post(
        f"{stack.url}/v1/responses", json={"model": MODEL, "max_output_tokens": 3, **body}, timeout=30
    )
    assert got.status_code == 200, got.text
    return got


def learned(stack: Stack) -> float:
    return gateway(stack, "kvgate_response_affinity_learned_total")


def wait_learned(stack: Stack, at_least: float) -> None:
    deadline = time.monotonic() + 20  # the completion log flushes every 20 ms; generous on a loaded host
    while learned(stack) < at_least:
        assert time.monotonic() < deadline, "the response id was not learned"
        time.sleep(0.02)


def test_a_follow_up_goes_to_the_replica_that_produced_the_response(stack: Stack) -> None:
    hits = gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit")
    producers, followed = [], []
    for i in range(8):
        before = learned(stack)
        first = post(stack, {"input": f"Conversation {i}: {i * 7919} is where we start. " + LONG})
        wait_learned(stack, before + 1)
        producers.append(first.headers["x-kvgate-endpoint"])
        nxt = post(stack, {"input": FOLLOW_UP, "previous_response_id": first.json()["id"]})
        followed.append(nxt.headers["x-kvgate-endpoint"])
    assert followed == producers
    assert len(set(producers)) >= 2, producers  # so the follow-ups' common prompt alone could not do it
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit") == hits + 8


def test_an_unknown_id_is_scored_as_usual(stack: Stack) -> None:
    unknown = gateway(stack, "kvgate_response_affinity_requests_total", outcome="unknown")
    post(stack, {"input": "Hi", "previous_response_id": "resp_never_seen_by_this_gateway"})
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="unknown") == unknown + 1
    assert gateway(stack, "kvgate_response_affinity_entries") >= 1
