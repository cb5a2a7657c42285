"""End to end, ``previous_response_id`` affinity of the Responses API through real Envoy (the shared
4-replica simulated stack): Envoy reads each JSON answer's ``id`` (``json_to_metadata``), its completion
log tells the ext_proc which replica produced it, and a follow-up naming that id goes to that replica, the
one whose KV (and, with vLLM, response store) holds the conversation, whatever its own prompt."""

from __future__ import annotations

import json
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


def answered(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    """:func:`post`, once the gateway has learned the answer's id.

    Every 2xx answer here is learned once, from Envoy's completion log, some ms after the client has it
    (flushed every 20 ms): a count read right after the previous answer may not hold that one yet, and
    "one more than then" is then met by its late entry, not this answer's; the follow-up sent next finds
    no producer (outcome ``unknown``, scored as usual). Every answer of these tests goes through here, so
    the count read before each post holds every earlier answer."""
    before = learned(stack)
    got = post(stack, body)
    wait_learned(stack, before + 1)
    return got


def test_a_follow_up_goes_to_the_replica_that_produced_the_response(stack: Stack) -> None:
    hits = gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit")
    producers, followed = [], []
    for i in range(8):
        first = answered(stack, {"input": f"Conversation {i}: {i * 7919} is where we start. " + LONG})
        producers.append(first.headers["x-kvgate-endpoint"])
        nxt = answered(stack, {"input": FOLLOW_UP, "previous_response_id": first.json()["id"]})
        followed.append(nxt.headers["x-kvgate-endpoint"])
    assert followed == producers
    assert len(set(producers)) >= 2, producers  # so the follow-ups' common prompt alone could not do it
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="hit") == hits + 8


def test_an_unknown_id_is_scored_as_usual(stack: Stack) -> None:
    unknown = gateway(stack, "kvgate_response_affinity_requests_total", outcome="unknown")
    answered(stack, {"input": "Hi", "previous_response_id": "resp_never_seen_by_this_gateway"})
    assert gateway(stack, "kvgate_response_affinity_requests_total", outcome="unknown") == unknown + 1
    assert gateway(stack, "kvgate_response_affinity_entries") >= 1


def events(answer: httpx.Response) -> list[dict[str, Any]]:
    """The Responses stream's events (OpenAI's SSE: ``event:`` then ``data:`` lines), checked in order."""
    assert answer.headers["content-type"].startswith("text/event-stream"), answer.text
    blocks = [b for b in answer.text.split("\n\n") if b.strip()]
    out = []
    for i, block in enumerate(blocks):
        kind, data = block.split("\n")
        got = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {got['type']}" and got["sequence_number"] == i
        out.append(got)
    return out


def test_a_streamed_answer_is_learned_too(stack: Stack) -> None:
    """Envoy's Lua filter reads the id from the stream's first event (``response.created``) and lets the
    rest pass; the follow-up goes to the replica that streamed it."""
    producers, followed = [], []
    for i in range(6):
        first = answered(stack, {"input": f"Streamed {i}: {i * 104729} first. " + LONG, "stream": True})
        stream = events(first)
        assert stream[0]["type"] == "response.created"
        assert stream[-1]["type"] == "response.completed"  # the whole stream passed the filter
        assert stream[-1]["response"]["output"][0]["content"][0]["text"]
        producers.append(first.headers["x-kvgate-endpoint"])
        nxt = answered(stack, {"input": FOLLOW_UP, "previous_response_id": stream[0]["response"]["id"]})
        followed.append(nxt.headers["x-kvgate-endpoint"])
    assert followed == producers and len(set(producers)) >= 2, producers
